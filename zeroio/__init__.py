"""zeroio: read, load, convert and publish DeepSpeed ZeRO checkpoints without DeepSpeed."""

from __future__ import annotations

from ._checkpoint import Checkpoint
from ._convert import ConvertResult, convert
from ._deploy import LoadReport, load
from ._formats import open
from ._hub import PushResult, push_to_hub
from ._metadata import CheckpointMetadata, TensorInfo
from ._reshard import ReshardResult, reshard
from ._verify import Mismatch, VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointMetadata",
    "ConvertResult",
    "LoadReport",
    "Mismatch",
    "PushResult",
    "ReshardResult",
    "TensorInfo",
    "VerifyReport",
    "__version__",
    "convert",
    "load",
    "open",
    "push_to_hub",
    "reshard",
    "verify",
]
