"""verl's FSDP checkpoints (``global_step_N/actor``: per-rank DTensor shards, ``fsdp_config.json``)."""

from __future__ import annotations

from .files import is_verl
from .reader import VerlCheckpoint, open_verl

__all__ = ["VerlCheckpoint", "is_verl", "open_verl"]
