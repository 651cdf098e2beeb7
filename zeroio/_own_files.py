"""Which files zeroio's writers produce, so ``overwrite`` replaces only a folder of zeroio's own outputs.

``zeroio convert ckpt ~/work --overwrite`` must never delete ``~/work``'s other files. A folder is taken as
zeroio's output by its names alone (no marker file), so outputs of earlier zeroio versions qualify too:

- ``convert``: ``model.safetensors`` / ``model-0000K-of-0000N.safetensors`` / ``model.safetensors.index.json``,
  ``pytorch_model.bin`` / ``pytorch_model-0000K-of-0000N.bin`` / ``pytorch_model.bin.index.json``,
  ``optimizer.safetensors`` / ``optimizer-0000K-of-0000N.safetensors`` / ``optimizer.safetensors.index.json`` /
  ``optimizer.json``, and the config and tokenizer files it copies (:data:`~zeroio._side_files.SIDE_FILES`);
- ``reshard``: ``latest`` and tag folders holding only DeepSpeed rank files
  (``zero_pp_rank_R_mp_rank_00_model_states.pt``, ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``);
- the lock file of a write that was killed while committing (:data:`LOCK_NAME`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import _constants as C
from ._side_files import SIDE_FILES

__all__ = ["LOCK_NAME", "foreign_entries"]

LOCK_NAME = ".zeroio-lock"
"""The file in a temporary output folder that its writer holds an ``flock`` on (see :mod:`zeroio._atomic`)."""

_OUTPUT_FILE = re.compile(
    r"^(?:model(?:-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(?:-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json"
    r"|optimizer(?:-\d{5}-of-\d{5})?\.safetensors|optimizer\.safetensors\.index\.json|optimizer\.json)$"
)
_TOP_FILES = frozenset({*SIDE_FILES, C.LATEST_FILE, LOCK_NAME})


def _is_file(path: Path) -> bool:
    """A file or a link (removing a link never touches what it points to); not a folder."""
    return path.is_symlink() or path.is_file()


def _is_rank_file(path: Path) -> bool:
    name = path.name
    return _is_file(path) and bool(C.ZERO3_MODEL_FILE.match(name) or C.ZERO_OPTIM_FILE.match(name))


def foreign_entries(folder: Path) -> list[str]:
    """Entries of ``folder`` (relative paths, sorted; a folder ends with ``/``) that no zeroio writer produces.

    Empty for an empty folder or a folder of zeroio's outputs, which ``overwrite`` may replace.
    """
    entries = sorted(os.listdir(folder))
    has_latest = C.LATEST_FILE in entries and _is_file(folder / C.LATEST_FILE)
    foreign: list[str] = []
    for name in entries:
        path = folder / name
        if _is_file(path):
            if not (_OUTPUT_FILE.match(name) or name in _TOP_FILES):
                foreign.append(name)
        elif path.is_dir() and has_latest:  # reshard's tag folder: DeepSpeed rank files only
            inner = sorted(os.listdir(path))
            foreign += [
                f"{name}/{n}" + ("/" if (path / n).is_dir() else "") for n in inner if not _is_rank_file(path / n)
            ]
        else:
            foreign.append(name + "/" if path.is_dir() else name)
    return foreign
