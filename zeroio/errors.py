"""Every exception zeroio raises on purpose.

::

    ZeroIOError(Exception)
    ├── CheckpointNotFoundError(ZeroIOError, FileNotFoundError)   tag folder, `latest`, a rank file
    ├── CheckpointFormatError(ZeroIOError, ValueError)            content zeroio cannot interpret
    │   ├── UnsupportedCheckpointError                            layouts not handled (yet): MoE, TP/PP, unknown stage
    │   ├── WorldSizeMismatchError                                rank files != partition_count
    │   ├── PartitionMismatchError                                element accounting does not add up
    │   └── UnsafePickleError                                     a pickle global outside the allowlist
    ├── TensorNotFoundError(ZeroIOError, KeyError)                no tensor of that name
    ├── OutputError(ZeroIOError, OSError)                         destination exists, unwritable, disk full
    ├── RemoteStorageError(ZeroIOError, OSError)                  a URL: missing extra, refused credentials, outage
    ├── HubError(ZeroIOError, RuntimeError)                       a push failed; the huggingface_hub error is __cause__
    ├── StateDictMismatchError(ZeroIOError, RuntimeError)         strict load: missing/unexpected/shape mismatch
    ├── InitHookError(ZeroIOError, RuntimeError)                  the model's sharded-init hook raised; __cause__ has it
    ├── ShardedModelError(ZeroIOError, RuntimeError)              a sharded model zeroio cannot fill, or another rank failed
    └── CheckpointClosedError(ZeroIOError, RuntimeError)          use after close

Each exception carries the facts of the failure as attributes (``path``, ``name``,
``rank``, ``expected``, ``found`` where they apply) so callers need not parse text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

# Re-exported (not in __all__) for the CLI, which imports only zeroio and zeroio.errors.
from ._messages import redact as redact  # noqa: PLC0414
from ._messages import redact_exception as redact_exception  # noqa: PLC0414

__all__ = [
    "CheckpointClosedError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "HubError",
    "InitHookError",
    "OutputError",
    "PartitionMismatchError",
    "RemoteStorageError",
    "ShardedModelError",
    "StateDictMismatchError",
    "TensorNotFoundError",
    "UnsafePickleError",
    "UnsupportedCheckpointError",
    "WorldSizeMismatchError",
    "ZeroIODeprecationWarning",
    "ZeroIOError",
]


class ZeroIOError(Exception):
    """Base class of every error zeroio raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        name: str | None = None,
        rank: int | None = None,
        expected: Any = None,
        found: Any = None,
    ) -> None:
        message = redact(message)  # a URL's credentials never reach a message (docs/security.md)
        super().__init__(message)
        self.message = message
        self.path = _error_path(path)
        """The file or folder at fault; for a remote source, its URL (text or zeroio's remote path object)."""
        self.name = name
        self.rank = rank
        self.expected = expected
        self.found = found

    def __str__(self) -> str:
        return self.message


def _error_path(path: object) -> Path | None:
    if path is None:
        return None
    if isinstance(path, str) and "://" in path or not isinstance(path, (str, os.PathLike)):
        text = str(path)
        return cast(
            Path, path if redact(text) == text else redact(text)
        )  # a URL stays as the user wrote it (Path() would fold its '//')
    return Path(path)


class CheckpointNotFoundError(ZeroIOError, FileNotFoundError):
    """The checkpoint folder, its `latest` file, a tag or a rank file does not exist."""

    def __str__(self) -> str:  # OSError would otherwise format "[Errno ...]"
        return self.message


class CheckpointFormatError(ZeroIOError, ValueError):
    """A file exists but its content is not what a DeepSpeed checkpoint holds."""


class UnsupportedCheckpointError(CheckpointFormatError):
    """A real layout zeroio does not handle yet (tensor/pipeline parallel, MoE, unknown stage)."""


class WorldSizeMismatchError(CheckpointFormatError):
    """The number of rank files disagrees with the world size recorded inside them."""


class PartitionMismatchError(CheckpointFormatError):
    """The partitions' element counts do not add up to the recorded parameter shapes."""


class UnsafePickleError(CheckpointFormatError):
    """A pickle asks for a global that is not on zeroio's allowlist; nothing was executed."""


class TensorNotFoundError(ZeroIOError, KeyError):
    """No tensor of the requested name exists in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr-quote the message
        return self.message


class OutputError(ZeroIOError, OSError):
    """The destination cannot be written: it exists, is unwritable, or the disk is full."""

    def __str__(self) -> str:
        return self.message


class RemoteStorageError(ZeroIOError, OSError):
    """A checkpoint URL cannot be read: its fsspec backend is not installed, access was refused, or the storage
    kept failing after retries; the message names the URL and the fix."""

    def __str__(self) -> str:
        return self.message


class HubError(ZeroIOError, RuntimeError):
    """A push to the Hugging Face Hub failed; the huggingface_hub error is ``__cause__``."""


class StateDictMismatchError(ZeroIOError, RuntimeError):
    """Strict loading found missing keys, unexpected keys or shape mismatches."""

    def __init__(
        self,
        message: str,
        *,
        missing_keys: list[str] | None = None,
        unexpected_keys: list[str] | None = None,
        mismatched_shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None,
        path: str | Path | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.missing_keys = list(missing_keys or [])
        self.unexpected_keys = list(unexpected_keys or [])
        self.mismatched_shapes = list(mismatched_shapes or [])


class InitHookError(ZeroIOError, RuntimeError):
    """The sharded-init hook (``configure_model`` or ``init_hook``) raised; nothing was loaded."""


class ShardedModelError(ZeroIOError, RuntimeError):
    """A sharded model zeroio cannot fill (FSDP1, Partial placements), or another rank failed: nothing was loaded."""


class CheckpointClosedError(ZeroIOError, RuntimeError):
    """A checkpoint was used after it was closed."""


class ZeroIODeprecationWarning(DeprecationWarning):
    """A zeroio API that will be removed in a later minor release."""
