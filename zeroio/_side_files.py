"""Config and tokenizer files saved beside a checkpoint (the HF Trainer's ``checkpoint-N/``): find and copy them."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

__all__ = ["SIDE_FILES", "copy_side_files", "find_side_files"]

logger = logging.getLogger(__name__)

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files the HF Trainer saves in ``checkpoint-N/`` beside ``global_stepN/`` (transformers 5.24 ``_save``)."""

_ZERO_RANK_SUFFIXES = ("_model_states.pt", "_optim_states.pt")


def find_side_files(src: Path) -> list[Path]:
    """The :data:`SIDE_FILES` next to a checkpoint: in ``src`` and, for a tag folder or a file, in its parent.

    A plain DeepSpeed checkpoint has none of them, so nothing is found. For a tag folder
    (``checkpoint-N/global_stepN``) or a single file, the parent folder is searched too, as the Trainer keeps
    ``config.json`` in ``checkpoint-N/`` beside ``global_stepN/``.
    """
    folders = [src] if src.is_dir() else []
    is_tag_folder = src.is_dir() and any(p.name.endswith(_ZERO_RANK_SUFFIXES) for p in src.iterdir())
    if is_tag_folder or src.is_file():
        folders.append(src.parent)
    found: dict[str, Path] = {}
    for folder in folders:
        for name in SIDE_FILES:
            if name not in found and (folder / name).is_file():
                found[name] = folder / name
    return list(found.values())


def copy_side_files(src: Path, dst: Path) -> tuple[str, ...]:
    """Copy the side files found for ``src`` into the folder ``dst`` (new files, fsynced); return their names.

    Used while ``dst`` is still the temporary folder of an atomic output, so the copies appear with the weights.
    """
    copied: list[str] = []
    for path in find_side_files(src):
        with open(path, "rb") as fin, open(dst / path.name, "xb") as fout:
            shutil.copyfileobj(fin, fout)
            fout.flush()
            os.fsync(fout.fileno())
        copied.append(path.name)
    if copied:
        logger.debug("copied %s from beside %s", ", ".join(copied), src)
    return tuple(copied)
