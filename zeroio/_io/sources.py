"""Byte sources: the storage layer every format reader reads through (local files; remote objects in _remote)."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from ..errors import CheckpointFormatError

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer  # 4.6+, for type checking only

__all__ = [
    "ByteRange",
    "ByteSource",
    "Fenced",
    "LocalFile",
    "can_copy_in_kernel",
    "kernel_copy_enabled",
    "open_source",
    "tensor_bytes",
    "writable_bytes",
]


@runtime_checkable
class ByteSource(Protocol):
    """A read-only blob of bytes addressed by offset: what a format module reads its tensors from.

    Implementations must allow concurrent :meth:`read_into` calls from several threads.
    """

    @property
    def name(self) -> str:
        """What to call the source in an error message (a path or URL)."""
        ...

    @property
    def size(self) -> int:
        """Total bytes."""
        ...

    def read_into(self, offset: int, out: torch.Tensor | Buffer, what: str = "a tensor's data") -> None:
        """Fill ``out`` with the bytes at ``offset``; a short source raises.

        ``out`` is a contiguous CPU tensor or any writable buffer (:func:`writable_bytes`): the byte-level writers
        of a torch-free conversion read into bytearrays."""
        ...

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes at ``offset`` (fewer only at the end of the source)."""
        ...

    def copy_to(self, fd: int, offset: int, nbytes: int, dst_offset: int) -> int | None:
        """Copy bytes into the local file ``fd`` without passing through user space, if the source can.

        Returns the bytes copied (possibly fewer than asked, 0 at the end of the source), or None when this
        source and destination have no such fast path: the caller then streams through :meth:`read_into`.
        """
        ...

    def close(self) -> None:
        """Release handles; idempotent. A later read reopens."""
        ...


@runtime_checkable
class Fenced(Protocol):
    """A source that reads ahead (a remote object): told where reading ahead must stop (a zip record's end)."""

    def fence(self, offset: int) -> None:
        """Never read ahead across ``offset``."""
        ...

    def read_ahead(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` at ``offset``, fetched with the bytes after them up to the next fence (a record's header,
        read just before its data: one request for both)."""
        ...


ByteRange = tuple[ByteSource, int, int]
"""``(source, offset, nbytes)``: a run of stored bytes; a tensor's bytes are the concatenation of its ranges."""


# copy_file_range (Linux, Python >= 3.8); ZEROIO_NO_COPY_FILE_RANGE=1 forces the streaming path (tests use it).
_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF})


def kernel_copy_enabled() -> bool:
    """True when file-to-file copies may use ``copy_file_range`` (read at call time so tests can switch it)."""
    return (
        hasattr(os, "copy_file_range")
        and sys.byteorder == "little"
        and os.environ.get("ZEROIO_NO_COPY_FILE_RANGE") != "1"
    )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, without numpy (bf16 has no numpy dtype)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def writable_bytes(out: torch.Tensor | Buffer) -> memoryview:
    """The bytes of a read target: a contiguous CPU tensor, or any writable buffer (a bytearray, a numpy array's
    memory), so the write engine can read without torch where it needs no tensor."""
    if hasattr(out, "data_ptr"):
        return tensor_bytes(cast("torch.Tensor", out))
    return memoryview(out).cast("B")


class LocalFile:
    """A local file read with positional reads (``preadv``) on one lazily opened descriptor.

    ``preadv`` does not move a shared file position, so threads may read one descriptor at once.
    """

    def __init__(self, path: Path, size: int | None = None) -> None:
        self.path = Path(path)
        self._size = size
        self._fd: int | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalFile('{self.path}')"

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = os.fstat(self.fileno()).st_size
        return self._size

    def fileno(self) -> int:
        """The open descriptor (opened on first use)."""
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return self._fd

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self.fileno(), nbytes, offset)

    def read_into(self, offset: int, out: torch.Tensor | Buffer, what: str = "a tensor's data") -> None:
        view = writable_bytes(out)  # read straight into the tensor (or buffer): no intermediate copy
        nbytes = len(view)
        if nbytes == 0:
            return
        fd = self.fileno()
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointFormatError(
                    f"'{self.path}' ends after {offset + done} bytes, inside {what}: the file is truncated. "
                    "Copy it again from where it was saved.",
                    path=self.path,
                )
            done += got

    def copy_to(self, fd: int, offset: int, nbytes: int, dst_offset: int) -> int | None:
        if not kernel_copy_enabled():
            return None
        try:
            return os.copy_file_range(self.fileno(), fd, nbytes, offset, dst_offset)
        except OSError as exc:
            if exc.errno in _NO_KERNEL_COPY:
                return None
            raise


def can_copy_in_kernel(source: ByteSource) -> bool:
    """True when ``source.copy_to`` may copy without user space (a local file, kernel copies enabled)."""
    return isinstance(source, LocalFile) and kernel_copy_enabled()


def open_source(path: Path, size: int | None = None) -> ByteSource:
    """The byte source of a file: a :class:`LocalFile`, or a remote path's own (``zeroio._io.remote_path.RemotePath``).

    Format modules open every file through this (never ``LocalFile(path)``), so they read remote roots unchanged.
    """
    byte_source = getattr(path, "byte_source", None)
    if byte_source is not None:
        source: ByteSource = byte_source(size)
        return source
    return LocalFile(path, size)
