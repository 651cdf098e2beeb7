"""zeroio: read, load, convert and publish DeepSpeed ZeRO checkpoints without DeepSpeed."""

from __future__ import annotations

from ._checkpoint import Checkpoint
from ._loader import open
from ._metadata import CheckpointMetadata, TensorInfo

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointMetadata",
    "TensorInfo",
    "__version__",
    "open",
]
