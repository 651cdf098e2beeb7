"""Byte sources: the storage layer every format reader reads through (local files; remote objects in _remote)."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from ..errors import CheckpointFormatError
from .confine import FileIdentity, open_regular
from .direct_read import aligned_read, cached_read, on_local_file_system, supports_direct
from .fd_pool import pool

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer  # 4.6+, for type checking only

__all__ = [
    "ByteRange",
    "ByteSource",
    "Fenced",
    "LocalFile",
    "can_copy_in_kernel",
    "kernel_copy_after_read",
    "kernel_copy_enabled",
    "kernel_copy_forced",
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


def kernel_copy_forced() -> bool:
    """``ZEROIO_NO_COPY_FILE_RANGE=0``: ``copy_file_range`` even for runs short enough to pack (tests use it on
    small fixtures); unset, short runs are packed through memory (``zeroio._write.byte_writes.KERNEL_RUN``)."""
    return kernel_copy_enabled() and os.environ.get("ZEROIO_NO_COPY_FILE_RANGE") == "0"


def kernel_copy_after_read(source: LocalFile) -> bool:
    """Whether bytes of ``source`` read into user space (for their CRC-32) should still be copied with
    ``copy_file_range``, not written from the bytes read: only on a file system that is not local (NFS 4.2, CIFS,
    Lustre...: the copy may run on the server, saving the write traffic), or when ``ZEROIO_NO_COPY_FILE_RANGE=0``
    asks for kernel copies everywhere. On a local one the copy reads them a second time from the page cache: with
    ``pread`` + ``pwrite`` instead the H100 host's fp32 conversion took 1.4 s (17 %) less CPU and 6.69 against 7.02 s
    (docs/benchmarks.md, "Lease D")."""
    return kernel_copy_forced() or not source.on_local_file_system()


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
    """A local file read with positional reads (``preadv``) on a descriptor leased from the process's bounded pool
    (``fd_pool.py``): opened on first use, perhaps closed and reopened between reads when many files are open.

    ``preadv`` does not move a shared file position, so threads may read one descriptor at once. A reopened file
    must be the one first opened (same device, inode, size, modification time), else the read raises.
    """

    def __init__(self, path: Path, size: int | None = None, identity: FileIdentity | None = None) -> None:
        self.path = Path(path)
        self._size = size if size is not None or identity is None else identity[2]
        self._identity: FileIdentity | None = identity  # from the stat at open: the first open must find that file
        self._lock = threading.Lock()
        self._direct: int | None = None  # an O_DIRECT descriptor (read_congruent), outside the pool
        self._direct_refused = False
        self._local: bool | None = None

    def __repr__(self) -> str:
        return f"LocalFile('{self.path}')"

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def identity(self) -> FileIdentity | None:
        """The file's identity from its first open (or as given), None before: what every later open must find."""
        return self._identity

    @property
    def size(self) -> int:
        if self._size is None:
            self._lease()  # the first open records the size
            pool.end_lease(self)
        return cast(int, self._size)

    def _lease(self) -> int:
        """A descriptor from the pool for one read or copy; the caller ends the lease (``pool.end_lease``)."""
        fd, identity = pool.acquire(self, self.path, self._identity)
        if self._identity is None:
            with self._lock:
                if self._identity is None:
                    self._identity = identity
                    if self._size is None:
                        self._size = identity[2]
        return fd

    def close(self) -> None:
        pool.release(self)
        with self._lock:
            if self._direct is not None:
                os.close(self._direct)
                self._direct = None

    def on_local_file_system(self) -> bool:
        """Whether this file lies on a local file system (``direct_read.on_local_file_system``; looked up once)."""
        if self._local is None:
            self._local = on_local_file_system(self.path)
        return self._local

    def _direct_fd(self) -> int | None:
        """This file's ``O_DIRECT`` descriptor (opened once, outside the pool), or None where direct reads are off
        or not possible here. It is opened as the pool opens (:func:`~.confine.open_regular`): the file must be
        the regular file first opened, so one swapped since for a link or a FIFO is refused, never blocking."""
        with self._lock:
            if self._direct is None and not self._direct_refused:
                self._direct_refused = True
                if supports_direct(self.path):
                    try:
                        fd, _ = open_regular(self.path, self._identity, os.O_DIRECT)
                    except OSError:  # refused O_DIRECT (EINVAL: this file system, or a FIFO swapped in) or EMFILE
                        self._check_unchanged()
                        return None  # the very file, only not directly: read it buffered
                    self._direct, self._direct_refused = fd, False
            return self._direct

    def _check_unchanged(self) -> None:
        """Raise :class:`~zeroio.errors.CheckpointFormatError` if the path no longer opens the file first opened."""
        try:
            fd, _ = open_regular(self.path, self._identity)
        except OSError:  # no descriptor to check with: the pool checks its own reopens
            return
        os.close(fd)

    def read_congruent(self, offset: int, nbytes: int, window: memoryview, at: int) -> None:
        """Fill ``window[at : at + nbytes]`` with the bytes at ``offset``, where the window's address at ``at`` is
        congruent to ``offset`` modulo a page and the window has room for the aligned blocks around them (one part
        of a :class:`~zeroio._load.device_copy.DeviceFiller` slot). From the page cache where it holds them, else
        with ``O_DIRECT`` where the cache has none of them, else buffered."""
        fd = self._lease()
        try:
            got = cached_read(fd, offset, window[at : at + nbytes])
        finally:
            pool.end_lease(self)
        if got == 0:
            direct = self._direct_fd()
            if direct is not None and aligned_read(direct, offset, nbytes, window, at):
                return
        got = max(got, 0)
        if got < nbytes:
            self.read_many([(offset + got, window[at + got : at + nbytes])])

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        fd = self._lease()
        try:
            return os.pread(fd, nbytes, offset)
        finally:
            pool.end_lease(self)

    def read_into(self, offset: int, out: torch.Tensor | Buffer, what: str = "a tensor's data") -> None:
        self.read_many([(offset, writable_bytes(out))], what)  # straight into the tensor: no intermediate copy

    def read_many(self, pieces: Sequence[tuple[int, memoryview]], what: str = "a tensor's data") -> None:
        """:meth:`read_into` of each ``(offset, bytes view)`` under one descriptor lease (a column block's rows)."""
        fd = self._lease()
        try:
            for offset, view in pieces:
                done, nbytes = 0, len(view)
                while done < nbytes:
                    got = os.preadv(fd, [view[done:]], offset + done)
                    if got <= 0:
                        raise CheckpointFormatError(
                            f"'{self.path}' ends after {offset + done} bytes, inside {what}: the file is truncated. "
                            "Copy it again from where it was saved.",
                            path=self.path,
                        )
                    done += got
        finally:
            pool.end_lease(self)

    def will_need(self, offset: int, nbytes: int) -> None:
        """Ask the kernel to start reading these bytes into the page cache (``posix_fadvise(WILLNEED)``: queued,
        nothing copied; a later read of them waits only for what is still on its way). No-op where unsupported."""
        if not hasattr(os, "posix_fadvise"):
            return
        fd = self._lease()
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:  # advice only: a file system that refuses it reads on demand, as without it
            pass
        finally:
            pool.end_lease(self)

    def copy_to(self, fd: int, offset: int, nbytes: int, dst_offset: int) -> int | None:
        if not kernel_copy_enabled():
            return None
        src = self._lease()  # held for the whole copy: the pool never closes a leased descriptor
        try:
            return os.copy_file_range(src, fd, nbytes, offset, dst_offset)
        except OSError as exc:
            if exc.errno in _NO_KERNEL_COPY:
                return None
            raise
        finally:
            pool.end_lease(self)


def can_copy_in_kernel(source: ByteSource) -> bool:
    """True when ``source.copy_to`` may copy without user space (a local file, kernel copies enabled)."""
    return isinstance(source, LocalFile) and kernel_copy_enabled()


def open_source(path: Path, size: int | None = None, identity: FileIdentity | None = None) -> ByteSource:
    """The byte source of a file: a :class:`LocalFile`, or a remote path's own (``zeroio._io.remote_path.RemotePath``).

    Format modules open every file through this (never ``LocalFile(path)``), so they read remote roots unchanged.
    ``identity`` (:func:`~zeroio._io.fd_pool.file_identity` of a local file's ``stat`` when it was checked) makes
    the first read refuse a file swapped since (for a link or a FIFO); remote objects are pinned by ETag instead.
    """
    byte_source = getattr(path, "byte_source", None)
    if byte_source is not None:
        source: ByteSource = byte_source(size)
        return source
    return LocalFile(path, size, identity)
