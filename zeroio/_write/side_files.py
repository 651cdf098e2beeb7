"""Config and tokenizer files saved beside a checkpoint (the HF Trainer's ``checkpoint-N/``): find and copy them."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._messages import get_logger

if TYPE_CHECKING:
    import torch

    from .._dtypes import DType

__all__ = [
    "CONFIG_DTYPE_KEYS",
    "SIDE_FILES",
    "config_dequantized",
    "config_with_dtype",
    "copy_side_files",
    "find_side_files",
    "write_derived_config",
]

logger = get_logger(__name__)

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

CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")
"""Keys of ``config.json`` that say the weights' dtype: ``dtype`` (transformers 5.x), ``torch_dtype`` (older)."""

_DTYPE_ENTRY = re.compile(r'("(?:' + "|".join(CONFIG_DTYPE_KEYS) + r')"\s*:\s*)"[^"\\]*"')


def find_side_files(src: Path, read: Path | None = None) -> list[Path]:
    """The :data:`SIDE_FILES` next to a checkpoint: in ``src`` and, for a tag folder or a file, in its parent.

    A plain DeepSpeed checkpoint has none of them, so nothing is found. For a tag folder
    (``checkpoint-N/global_stepN``) or a single file, the parent folder is searched too, as the Trainer keeps
    ``config.json`` in ``checkpoint-N/`` beside ``global_stepN/``. ``read`` is the folder the reader chose under
    ``src`` (verl's ``global_step_N/actor/`` when ``src`` is the root): its ``huggingface/`` is searched too.
    """
    folders = [src] if src.is_dir() else []
    is_tag_folder = src.is_dir() and any(p.name.endswith(_ZERO_RANK_SUFFIXES) for p in src.iterdir())
    if is_tag_folder or src.is_file():
        folders.append(src.parent)
    # verl keeps the model's config and tokenizer in huggingface/ beside its rank files (global_step_N/actor/).
    # The folder itself must stay inside the checkpoint: a link to elsewhere would copy files from there.
    inner = [read] if read is not None and read.is_dir() and read != src else []
    hf = [f / "huggingface" for f in folders[:1] + [src / "actor"] + inner]
    folders += [h for h in hf if h.is_dir() and _stays_inside(h, h.parent)]
    found: dict[str, Path] = {}
    for folder in folders:
        for name in SIDE_FILES:
            if name not in found and (folder / name).is_file() and _stays_inside(folder / name, folder):
                found[name] = folder / name
    return list(found.values())


def _stays_inside(path: Path, folder: Path) -> bool:
    """False (with a warning) for a link resolving outside ``folder``: it could expose any file (a token,
    ``/etc/shadow``) in the output and on the Hub. Links within the checkpoint folder are followed."""
    if path.resolve().is_relative_to(folder.resolve()):
        return True
    logger.warning(
        "not copying '%s': it is a link to a file outside '%s'; copy the file into the checkpoint folder to include it",
        path,
        folder,
    )
    return False


def copy_side_files(
    src: Path,
    dst: Path,
    *,
    dtype: torch.dtype | DType | None = None,
    dequantized: bool = False,
    read: Path | None = None,
) -> tuple[str, ...]:
    """Copy the side files found for ``src`` into the folder ``dst`` (new files, fsynced); return their names.

    Used while ``dst`` is still the temporary folder of an atomic output, so the copies appear with the weights.
    ``dtype`` is the dtype the weights were cast to: ``config.json`` then says it (``dtype`` / ``torch_dtype``,
    whichever it has), so ``from_pretrained(dtype="auto")`` loads them as written; every other byte is kept.
    ``dequantized``: the weights were quantized and are written dequantized, so ``config.json`` loses its
    ``quantization_config`` (transformers would otherwise quantize-load plain weights) (:func:`config_dequantized`).
    ``read``: the folder the checkpoint was read from (:func:`find_side_files`).
    """
    copied: list[str] = []
    for path in find_side_files(src, read):
        with path.open("rb") as fin, open(dst / path.name, "xb") as fout:
            if path.name == "config.json" and dequantized and dtype is not None:
                fout.write(config_with_dtype(config_dequantized(fin.read(), dtype), dtype))
            elif path.name == "config.json" and dtype is not None:
                fout.write(config_with_dtype(fin.read(), dtype))
            else:
                shutil.copyfileobj(fin, fout)
            fout.flush()
            os.fsync(fout.fileno())
        copied.append(path.name)
    if copied:
        logger.debug("copied %s from beside %s", ", ".join(copied), src)
    return tuple(copied)


def write_derived_config(config: Any, dst: Path, *, dtype: torch.dtype | DType | None = None) -> tuple[str, ...]:
    """Write ``config.json`` a reader derived from the checkpoint (a Megatron GPT read with ``names="hf"``) into
    ``dst``, unless one was copied from beside the source; return the names written."""
    if not isinstance(config, dict) or (dst / "config.json").exists():
        return ()
    from .._io.fileio import write_new_file

    raw = (json.dumps(config, indent=2) + "\n").encode("utf-8")
    write_new_file(dst / "config.json", config_with_dtype(raw, dtype) if dtype is not None else raw)
    return ("config.json",)


def config_with_dtype(raw: bytes, dtype: torch.dtype | DType) -> bytes:
    """``config.json`` bytes with every :data:`CONFIG_DTYPE_KEYS` entry (sub-configs too) set to ``dtype``.

    Only the values change, in place, so the rest of the file stays byte-identical; a config without such a key,
    or that is not JSON, is returned unchanged.
    """
    name = str(dtype).removeprefix("torch.")
    try:
        text = raw.decode("utf-8")
        before = json.loads(text)
    except (UnicodeDecodeError, ValueError):
        logger.warning("config.json is not JSON; copied unchanged (its dtype may not say %s)", name)
        return raw
    after = _DTYPE_ENTRY.sub(lambda m: f'{m.group(1)}"{name}"', text)
    if json.loads(after) != _set_dtype(before, name):  # a key the pattern cannot see safely: rewrite the JSON
        after = json.dumps(_set_dtype(before, name), indent=2, ensure_ascii=False) + "\n"
    return after.encode("utf-8")


def config_dequantized(raw: bytes, dtype: torch.dtype | DType) -> bytes:
    """``config.json`` without ``quantization_config``, naming ``dtype`` (``torch_dtype`` added if it has no key).

    As DeepSeek's model card says to do by hand after ``fp8_cast_bf16.py``. A config that is not a JSON object is
    returned unchanged (with a warning)."""
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        config = None
    if not isinstance(config, dict):
        logger.warning("config.json is not a JSON object; copied unchanged (it may still declare quantization)")
        return raw
    config.pop("quantization_config", None)
    if not any(key in config for key in CONFIG_DTYPE_KEYS):
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _set_dtype(value: Any, name: str) -> Any:
    if isinstance(value, dict):
        return {
            k: name if k in CONFIG_DTYPE_KEYS and isinstance(v, str) else _set_dtype(v, name) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_set_dtype(v, name) for v in value]
    return value
