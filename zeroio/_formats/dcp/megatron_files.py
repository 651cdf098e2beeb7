"""Which folder of a Megatron checkpoint holds the tensors, and which ``dist_checkpointing`` backend wrote it.

Megatron-Core's ``dist_checkpointing.save`` writes ``metadata.json`` (``sharded_backend``, versions) and
``common.pt`` beside the backend's files; Megatron-LM roots add ``latest_checkpointed_iteration.txt`` naming an
``iter_%07d`` folder (or ``release``). Names only, plus two small text files; nothing is unpickled here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._io.confine import require_regular_file
from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError

__all__ = ["COMMON", "METADATA_JSON", "TRACKER", "MegatronFolder", "is_megatron", "megatron_folder"]

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7,})$")
MAX_JSON_BYTES = 1 << 20
"""Largest ``metadata.json`` read (1 MiB; Megatron writes about 120 bytes)."""
MAX_TRACKER_BYTES = 64


@dataclass(frozen=True, slots=True)
class MegatronFolder:
    """One checkpoint of a Megatron root: the folder the backend wrote and what ``metadata.json`` says."""

    root: Path
    """What the user named (a Megatron-LM root or the checkpoint folder itself)."""
    folder: Path
    """The folder holding ``metadata.json``, ``common.pt`` and the backend's files."""
    tag: str | None
    """``iter_0000003`` (or ``release``) for a Megatron-LM root; None when the folder was named directly."""
    info: dict[str, Any]
    """``metadata.json`` as written (``sharded_backend``, ``sharded_backend_version``, ...)."""


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / METADATA_JSON).is_file() and (path / COMMON).is_file()


def is_megatron(path: Path) -> bool:
    """True for a Megatron ``dist_checkpointing`` folder (``metadata.json`` + ``common.pt``), one of those two
    files, or a Megatron-LM root (``latest_checkpointed_iteration.txt`` beside such an ``iter_%07d``/``release``
    folder, or a legacy ``mp_rank_*`` one, refused by name); names only. verl's roots, which hold the same tracker
    file beside ``global_step_N/``, and Megatron-FSDP's plain DCP folders are left to their readers."""
    if path.name in (METADATA_JSON, COMMON) and path.is_file():
        return _is_checkpoint_dir(path.parent)
    if not path.is_dir():
        return False
    if _is_checkpoint_dir(path):
        return True
    if not (path / TRACKER).is_file():
        return False
    return any(
        (_ITER.match(child.name) or child.name == "release")
        and (_is_checkpoint_dir(child) or (child / "mp_rank_00").is_dir())
        for child in path.iterdir()
    )


def _tracked_tag(root: Path) -> str:
    """The folder ``latest_checkpointed_iteration.txt`` names: ``iter_%07d`` or ``release``."""
    tracker = root / TRACKER
    require_regular_file(tracker)
    text = tracker.read_bytes()[: MAX_TRACKER_BYTES + 1].decode("utf-8", "replace").strip()
    if text == "release":
        return text
    if not text.isdigit() or len(text) > 12:
        raise CheckpointFormatError(
            f"'{tracker}' holds {text[:40]!r}, not an iteration number or 'release' (what Megatron-LM writes). "
            "Pass tag='iter_0000100' to choose a folder.",
            path=tracker,
        )
    return f"iter_{int(text):07d}"


def _read_info(folder: Path) -> dict[str, Any]:
    path = folder / METADATA_JSON
    require_regular_file(path)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise CheckpointFormatError(
            f"'{path}' is {path.stat().st_size} bytes; Megatron writes about 120. The file is corrupted or hostile.",
            path=path,
        )
    try:
        info = json.loads(path.read_bytes())
    except ValueError as exc:
        raise CheckpointFormatError(
            f"'{path}' is not valid JSON ({exc}). Megatron's dist_checkpointing writes it with the backend name; "
            "copy the checkpoint again.",
            path=path,
        ) from exc
    if not isinstance(info, dict) or not isinstance(info.get("sharded_backend"), str):
        raise CheckpointFormatError(
            f"'{path}' has no 'sharded_backend' string (found {str(info)[:80]!r}). Megatron's dist_checkpointing "
            'writes {"sharded_backend": "torch_dist", ...}; copy the checkpoint again.',
            path=path,
        )
    return info


def megatron_folder(path: Path, tag: str | None) -> MegatronFolder:
    """Find the checkpoint folder and check its backend is ``torch_dist`` (the one zeroio reads)."""
    if path.name in (METADATA_JSON, COMMON):
        path = path.parent
    folder, found_tag = path, None
    if not _is_checkpoint_dir(path) and (path / TRACKER).is_file():
        found_tag = tag or _tracked_tag(path)
        folder = path / found_tag
        if not _is_checkpoint_dir(folder):
            present = sorted(p.name for p in path.iterdir() if _ITER.match(p.name) or p.name == "release")[:8]
            legacy = (folder / "mp_rank_00").is_dir()
            why = (
                " It holds mp_rank_* folders: Megatron-LM's legacy torch format, which zeroio does not read. Convert "
                "it with Megatron-LM's --ckpt-convert-format torch_dist."
                if legacy
                else ""
            )
            raise CheckpointNotFoundError(
                f"'{folder}' is not a Megatron dist checkpoint folder (no {METADATA_JSON} + {COMMON}); folders "
                f"found: {', '.join(present) or 'none'}.{why} Pass tag='iter_...' to choose another.",
                path=folder,
            )
    info = _read_info(folder)
    backend = info["sharded_backend"]
    if backend != "torch_dist":
        raise UnsupportedCheckpointError(
            f"'{folder / METADATA_JSON}' says the tensors were saved with Megatron's {backend[:40]!r} backend; "
            "zeroio reads 'torch_dist' (the default since Megatron-Core 0.7). Re-save it as torch_dist, e.g. "
            "Megatron-LM's --ckpt-convert-format torch_dist --ckpt-convert-save DIR.",
            path=folder / METADATA_JSON,
            name=backend,
        )
    return MegatronFolder(path, folder, found_tag, info)
