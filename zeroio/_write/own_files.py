"""Which files zeroio's writers produce, so ``overwrite`` replaces only a folder of zeroio's own outputs.

``zeroio convert ckpt ~/work --overwrite`` must never delete ``~/work``'s other files. A folder is taken as
zeroio's output by its names alone (no marker file), so outputs of earlier zeroio versions qualify too:

- ``convert``: ``model.safetensors`` / ``model-0000K-of-0000N.safetensors`` / ``model.safetensors.index.json``,
  ``pytorch_model.bin`` / ``pytorch_model-0000K-of-0000N.bin`` / ``pytorch_model.bin.index.json``,
  ``optimizer.safetensors`` / ``optimizer-0000K-of-0000N.safetensors`` / ``optimizer.safetensors.index.json`` /
  ``optimizer.json``, and the config and tokenizer files it copies (:data:`~zeroio._write.side_files.SIDE_FILES`);
- ``reshard``: ``latest`` and tag folders holding only DeepSpeed rank files
  (``zero_pp_rank_R_mp_rank_00_model_states.pt``, ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``);
- ``convert(fmt="universal")``: ``latest_universal`` and tag folders holding only model states files and a ``zero/``
  folder of ``optimizer_state.pt`` and ``<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``;
- ``convert(fmt="peft")``: ``adapter_model.safetensors`` and ``adapter_config.json``, at the top and in one
  folder per named adapter holding only those two files;
- ``convert(fmt="dcp")``: ``.metadata`` and ``__0_N.distcp`` (torchtitan layout, at the top), or the folders
  ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` holding only those (accelerate layout). A single-process
  ``dcp.save`` writes the same names, so ``overwrite`` replaces such a folder too;
- the lock file of a write that was killed while committing (:data:`LOCK_NAME`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from .. import _constants as C
from .side_files import SIDE_FILES

__all__ = ["LATEST_UNIVERSAL", "LOCK_NAME", "foreign_entries", "foreign_names", "is_output_name"]

LOCK_NAME = ".zeroio-lock"
"""The file in a temporary output folder that its writer holds an ``flock`` on (see :mod:`zeroio._write.atomic`)."""

_OUTPUT_FILE = re.compile(
    r"^(?:model(?:-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(?:-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json"
    r"|optimizer(?:-\d{5}-of-\d{5})?\.safetensors|optimizer\.safetensors\.index\.json|optimizer\.json"
    r"|adapter_model\.safetensors|adapter_config\.json)$"
)
_ADAPTER_FILES = frozenset({"adapter_model.safetensors", "adapter_config.json"})
"""``convert(fmt="peft")``: an adapter's files, at the top (``default``) or in ``<name>/`` (a named adapter)."""
LATEST_UNIVERSAL = "latest_universal"
_DCP_FILE = re.compile(r"^(?:\.metadata|__0_\d+\.distcp)$")
_DCP_FOLDERS = frozenset({"pytorch_model_fsdp_0", "optimizer_0"})
_UNIVERSAL_PARAM_FILES = frozenset({"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"})
_TOP_FILES = frozenset({*SIDE_FILES, C.LATEST_FILE, LATEST_UNIVERSAL, LOCK_NAME})


def _is_file(path: Path) -> bool:
    """A file or a link (removing a link never touches what it points to); not a folder."""
    return path.is_symlink() or path.is_file()


def _is_rank_file(path: Path) -> bool:
    name = path.name
    return _is_file(path) and bool(C.ZERO3_MODEL_FILE.match(name) or C.ZERO_OPTIM_FILE.match(name))


def _universal_foreign(tag_dir: Path, name: str) -> list[str]:
    """What a universal tag folder holds beyond model states and ``zero/`` (``optimizer_state.pt``, param folders)."""
    foreign: list[str] = []
    for entry in sorted(os.listdir(tag_dir)):
        path = tag_dir / entry
        if entry == "zero" and path.is_dir() and not path.is_symlink():
            for inner in sorted(os.listdir(path)):
                where = path / inner
                if inner == "optimizer_state.pt" and _is_file(where):
                    continue
                if where.is_dir() and not where.is_symlink():
                    foreign += [
                        f"{name}/zero/{inner}/{n}" for n in sorted(os.listdir(where))
                        if n not in _UNIVERSAL_PARAM_FILES or not _is_file(where / n)
                    ]  # fmt: skip
                else:
                    foreign.append(f"{name}/zero/{inner}")
        elif not (_is_file(path) and (C.ZERO3_MODEL_FILE.match(entry) or C.MODEL_FILE.match(entry))):
            foreign.append(f"{name}/{entry}" + ("/" if path.is_dir() else ""))
    return foreign


def _is_adapter_folder(path: Path) -> bool:
    """A named adapter's folder written by ``fmt="peft"``: its two files and nothing else."""
    names = set(os.listdir(path))
    return bool(names) and names <= _ADAPTER_FILES and all(_is_file(path / n) for n in names)


def foreign_entries(folder: Path) -> list[str]:
    """Entries of ``folder`` (relative paths, sorted; a folder ends with ``/``) that no zeroio writer produces.

    Empty for an empty folder or a folder of zeroio's outputs, which ``overwrite`` may replace.
    """
    entries = sorted(os.listdir(folder))
    has_latest = C.LATEST_FILE in entries and _is_file(folder / C.LATEST_FILE)
    has_universal = LATEST_UNIVERSAL in entries and _is_file(folder / LATEST_UNIVERSAL)
    foreign: list[str] = []
    for name in entries:
        path = folder / name
        if _is_file(path):
            if not (_OUTPUT_FILE.match(name) or name in _TOP_FILES or _DCP_FILE.match(name)):
                foreign.append(name)
        elif name in _DCP_FOLDERS and not path.is_symlink() and path.is_dir():  # convert(fmt="dcp", accelerate)
            inner = sorted(os.listdir(path))
            foreign += [f"{name}/{n}" for n in inner if not (_DCP_FILE.match(n) and _is_file(path / n))]
        elif path.is_dir() and has_universal and (path / "zero").is_dir():  # convert(fmt="universal")'s tag folder
            foreign += _universal_foreign(path, name)
        elif path.is_dir() and "adapter_model.safetensors" in entries and _is_adapter_folder(path):
            continue  # convert(fmt="peft")'s folder of a named adapter
        elif path.is_dir() and has_latest:  # reshard's tag folder: DeepSpeed rank files only
            inner = sorted(os.listdir(path))
            foreign += [
                f"{name}/{n}" + ("/" if (path / n).is_dir() else "") for n in inner if not _is_rank_file(path / n)
            ]
        else:
            foreign.append(name + "/" if path.is_dir() else name)
    return foreign


def is_output_name(name: str) -> bool:
    """True for a top-level file name some zeroio writer produces (weights, indexes, side files, ``latest``)."""
    return bool(_OUTPUT_FILE.match(name)) or name in _TOP_FILES


def foreign_names(names: Sequence[str]) -> list[str]:
    """Which of an object-store prefix's object names (relative, ``/``-separated) no zeroio writer produces.

    The same rules as :func:`foreign_entries`, on names alone: a store has objects, not folders or links.
    """
    top = {n for n in names if "/" not in n}
    foreign: list[str] = []
    for name in sorted(names):
        parts = name.split("/")
        if len(parts) == 1:
            ok = bool(_OUTPUT_FILE.match(name) or _DCP_FILE.match(name)) or name in _TOP_FILES
        elif len(parts) == 2 and parts[0] in _DCP_FOLDERS and _DCP_FILE.match(parts[1]):
            ok = True
        elif LATEST_UNIVERSAL in top and parts[1] == "zero":  # convert(fmt="universal")'s tag folder
            ok = (len(parts) == 3 and parts[2] == "optimizer_state.pt") or (
                len(parts) == 4 and parts[3] in _UNIVERSAL_PARAM_FILES
            )
        elif len(parts) == 2 and LATEST_UNIVERSAL in top:
            ok = bool(C.ZERO3_MODEL_FILE.match(parts[1]) or C.MODEL_FILE.match(parts[1]))
        elif len(parts) == 2 and C.LATEST_FILE in top:  # reshard's tag folder: DeepSpeed rank files only
            ok = bool(C.ZERO3_MODEL_FILE.match(parts[1]) or C.ZERO_OPTIM_FILE.match(parts[1]))
        else:
            ok = False
        if not ok:
            foreign.append(name)
    return foreign
