"""Consolidated checkpoints: pick the safetensors or torch reader for a file, an index or a model folder."""

from __future__ import annotations

from pathlib import Path

from ... import _constants as C
from ..._io.remote_path import as_path
from ...errors import CheckpointFormatError, CheckpointNotFoundError
from ..checkpoint import Checkpoint
from .safetensors_reader import open_safetensors
from .shard_index import read_index
from .torch_reader import open_torch

__all__ = ["is_consolidated", "open_consolidated"]


def is_consolidated(path: Path) -> bool:
    """True when ``path`` names a consolidated checkpoint file, index or model folder (by names only)."""
    if path.is_file():
        return (
            path.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
            and not path.name.endswith(C.STATES_SUFFIX)
            or path.name.endswith(".index.json")
        )
    return path.is_dir() and any(
        (path / name).is_file() for name in (C.SAFETENSORS_SINGLE, C.SAFETENSORS_INDEX, C.TORCH_SINGLE, C.TORCH_INDEX)
    )


def open_consolidated(path: Path, *, trusted_globals: frozenset[str] = frozenset()) -> Checkpoint:
    """Open a consolidated checkpoint lazily: read headers/pickles now, tensor bytes only when asked.

    Args:
        path: a ``.safetensors`` file, a torch ``.bin``/``.pt``/``.pth``/``.ckpt`` file, an index file
            (``*.index.json``), or a folder holding ``model.safetensors``, ``model.safetensors.index.json``,
            ``pytorch_model.bin`` or ``pytorch_model.bin.index.json`` (safetensors first, as transformers does).
        trusted_globals: extra pickle globals to accept in torch files, rebuilt as inert data (never called).

    Returns:
        A :class:`~zeroio.Checkpoint` with ``metadata.format`` ``"safetensors"`` or ``"torch"``.

    Raises:
        CheckpointNotFoundError: the path or a shard is missing.
        CheckpointFormatError: the file is not a checkpoint zeroio can read (subclasses say how).

    Example:
        >>> with zeroio.open("out/model.safetensors") as ckpt:  # doctest: +SKIP
        ...     ckpt.metadata.format, ckpt.tied
        ('safetensors', {'head.weight': 'emb.weight'})
    """
    path = as_path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"Checkpoint path '{path}' does not exist.", path=path)
    if path.is_dir():
        for name in (C.SAFETENSORS_SINGLE, C.SAFETENSORS_INDEX, C.TORCH_SINGLE, C.TORCH_INDEX):
            if (path / name).is_file():
                return open_consolidated(path / name, trusted_globals=trusted_globals)
        raise CheckpointNotFoundError(
            f"'{path}' holds none of {C.SAFETENSORS_SINGLE}, {C.SAFETENSORS_INDEX}, {C.TORCH_SINGLE}, "
            f"{C.TORCH_INDEX}. Pass the checkpoint file itself.",
            path=path,
        )
    if path.name.endswith(".index.json"):
        weight_map, _ = read_index(path)
        shards = list(dict.fromkeys(weight_map.values()))
        if shards and all(s.endswith(".safetensors") for s in shards):
            return open_safetensors(path, path)
        return open_torch(path, path, trusted_globals)
    if path.suffix == ".safetensors":
        return open_safetensors(path, None)
    with path.open("rb") as fh:
        magic = fh.read(2)
    if magic != b"PK" and magic[:1] != b"\x80":
        # Not a torch zip (nor a legacy pickle): maybe a safetensors file under another name.
        try:
            return open_safetensors(path, None)
        except CheckpointFormatError:
            pass  # load_pickle's message says what the file is not
    return open_torch(path, None, trusted_globals)
