"""Hugging Face index files (``*.index.json``): which shard file holds each tensor name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..._io.confine import confined_path, hub_cache_blobs
from ...errors import CheckpointFormatError, CheckpointNotFoundError

__all__ = ["read_index", "shard_paths"]


def read_index(index_path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """``weight_map`` and ``metadata`` of a Hugging Face index file, validated."""
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"'{index_path}' does not exist.", path=index_path) from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(
            f"Cannot read the index '{index_path}' ({exc}). Write it again (it is JSON with a 'weight_map').",
            path=index_path,
        ) from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointFormatError(
            f"The index '{index_path}' has no 'weight_map' of tensor names to shard files. "
            'Write it as Hugging Face does: {"metadata": {...}, "weight_map": {name: file}}.',
            path=index_path,
        )
    meta = index.get("metadata") or {}
    return dict(weight_map), meta if isinstance(meta, dict) else {}


def shard_paths(index_path: Path, weight_map: dict[str, str]) -> dict[str, Path]:
    """``{shard file name: path}`` of every shard the index names, checked to exist inside its folder.

    Links may lead out of the folder only into a Hugging Face cache's ``blobs/`` (:func:`hub_cache_blobs`)."""
    root = index_path.parent
    blobs = hub_cache_blobs(root)
    shards: dict[str, Path] = {}
    for shard in dict.fromkeys(weight_map.values()):
        shard_path = confined_path(root, shard, source=index_path, what="shard", links_into=blobs)
        if not shard_path.is_file():
            raise CheckpointNotFoundError(
                f"Shard '{shard}' listed in '{index_path}' does not exist. Copy every shard next to the index.",
                path=root / shard,
            )
        shards[shard] = shard_path
    return shards
