"""Format readers and their registry: ``open`` asks each registered format, in order, whether it reads a path.

Adding a checkpoint layout takes one module (detect + open) and one line in ``FORMATS``; no verb changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._checkpoint import Checkpoint
from .._layout import is_zero_checkpoint
from .._pickles import require_regular_file
from .._remote import RemotePath, as_path
from .._types import StrPath
from ..errors import CheckpointFormatError, CheckpointNotFoundError, ZeroIOError
from .consolidated import is_consolidated, open_consolidated
from .universal import is_universal, open_universal
from .zero import open_zero

__all__ = ["FORMATS", "Format", "open", "open_checkpoint"]


@dataclass(frozen=True, slots=True)
class Format:
    """One checkpoint layout zeroio reads."""

    name: str
    detect: Callable[[Path], bool]
    """True when the path (checked by names only, nothing parsed) holds this layout."""
    open: Callable[[Path, str | None, frozenset[str]], Checkpoint]
    """``open(path, tag, trusted_globals)``: the lazy checkpoint view."""


def _consolidated_not_zero(path: Path) -> bool:
    return is_consolidated(path) and not is_zero_checkpoint(path)


def _open_consolidated(path: Path, tag: str | None, trusted_globals: frozenset[str]) -> Checkpoint:
    return open_consolidated(path, trusted_globals=trusted_globals)


def _open_zero(path: Path, tag: str | None, trusted_globals: frozenset[str]) -> Checkpoint:
    return open_zero(path, tag, trusted_globals=trusted_globals)


def _anything(path: Path) -> bool:
    return True


FORMATS: list[Format] = [
    Format("consolidated", _consolidated_not_zero, _open_consolidated),
    Format("universal", is_universal, open_universal),
    # Last, and takes any path: its errors say what a DeepSpeed checkpoint folder should hold.
    Format("zero", _anything, _open_zero),
]
"""Registered formats, tried in order; the first whose ``detect`` is true opens the path."""


def open_checkpoint(path: Path, tag: str | None, trusted_globals: frozenset[str]) -> Checkpoint:
    """Open ``path`` with the first registered format that detects it."""
    for fmt in FORMATS:
        if fmt.detect(path):
            return fmt.open(path, tag, trusted_globals)
    raise CheckpointFormatError(f"'{path}' is not a checkpoint layout zeroio reads.", path=path)


def open(
    path: StrPath | RemotePath,
    tag: str | None = None,
    *,
    trusted_globals: Iterable[str] = (),
    verify_crc: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Checkpoint:
    """Open a checkpoint lazily: read metadata now, tensor bytes only when asked.

    Args:
        path: a DeepSpeed checkpoint root (with ``latest``), a tag folder, a rank file, or a consolidated
            checkpoint (``model.safetensors``, a sharded safetensors folder, a torch ``.bin``/``.pt`` state dict).
        tag: the tag folder to read (default: the one named in ``latest``).
        trusted_globals: extra pickle globals to accept, rebuilt as inert data (never called).
        verify_crc: check every zip record read (torch ``.pt``/``.bin`` files) against its stored CRC-32 and raise
            CheckpointFormatError on a mismatch (see :attr:`Checkpoint.verify_crc`). False reads corrupted bytes
            silently, as torch.load does. Safetensors files have no checksum to check.
        storage_options: for a URL path (``s3://``, ``gs://``, ``hf://``, ``https://``), options of its fsspec
            filesystem (credentials, ``endpoint_url``, ...); the standard environment variables apply otherwise
            (docs/remote.md).

    Returns:
        A read-only ``Mapping[str, torch.Tensor]`` with ``metadata``, ``info()``, ``tied`` and ``state_dict()``.

    Raises:
        CheckpointNotFoundError: the path, tag or a rank file is missing.
        CheckpointFormatError: a file is not what a checkpoint holds (subclasses say how).

    Example:
        >>> import zeroio
        >>> with zeroio.open("fixtures/z3_ws2_fp32") as ckpt:
        ...     print(ckpt.metadata.zero_stage, ckpt.metadata.world_size, ckpt["emb.weight"].shape)
        3 2 torch.Size([13, 7])
    """
    p = as_path(path, storage_options)
    if not p.exists():
        raise CheckpointNotFoundError(f"Checkpoint path '{p}' does not exist.", path=p)
    if not p.is_dir():
        require_regular_file(p)  # a FIFO, /dev/zero or a link to one: reading would block or never end
    try:
        ckpt = open_checkpoint(p, tag, frozenset(trusted_globals))
    except ZeroIOError:
        raise
    except (
        TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError, MemoryError,
        NotADirectoryError, IsADirectoryError,
    ) as exc:  # fmt: skip
        # Last line of defence, for every format: content of an unexpected shape (RecursionError is a RuntimeError)
        # must never surface as a bare Python error.
        raise CheckpointFormatError(
            f"'{p}' holds metadata zeroio cannot interpret ({type(exc).__name__}: {str(exc)[:200]}). The checkpoint "
            "is corrupted or was written by an unsupported version; please report it with `zeroio inspect --json`.",
            path=p,
        ) from exc
    ckpt.verify_crc = verify_crc
    return ckpt
