"""Output-file primitives every writer uses: new files only, full positional writes, preallocation, fsync."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


__all__ = [
    "WRITEBACK_BYTES",
    "ByteBuffers",
    "ChunkBuffers",
    "WriteBack",
    "create_new",
    "naming",
    "preallocate",
    "pwrite_all",
    "tensor_bytes",
    "write_new_file",
]


def create_new(path: Path) -> int:
    """Open a file that must not exist yet, for writing (``O_EXCL``: never truncates what is there)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def write_new_file(path: Path, data: str | bytes) -> None:
    """Create ``path`` (which must not exist), write ``data`` (text as UTF-8) and fsync it."""
    fd = create_new(path)
    try:
        pwrite_all(fd, data.encode("utf-8") if isinstance(data, str) else data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """Make an OSError name the output file it concerns (its final path, not the temporary one)."""
    try:
        yield
    except OSError as exc:
        exc.filename = str(path)
        raise


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (bf16 has no numpy dtype, so not via numpy)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


_libc_fallocate: Callable[..., int] | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc_fallocate = _libc.fallocate
    _libc_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _libc_fallocate.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux/glibc
    _libc_fallocate = None


def preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes for the file now, so a full disk fails before any tensor is read.

    Uses Linux ``fallocate(2)`` directly: glibc's ``posix_fallocate`` would emulate it on file systems without
    support by writing zeros (the whole file twice). Where unsupported, this does nothing.

    Raises:
        OSError: ``ENOSPC``/``EDQUOT`` (disk or quota full) or ``EFBIG`` (file size limit).
    """
    if size <= 0 or _libc_fallocate is None:
        return
    if _libc_fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV):
            return
        raise OSError(err, os.strerror(err))


class ChunkBuffers(threading.local):
    """One reusable chunk buffer per dtype and IO thread.

    A fresh tensor per chunk (what ``Checkpoint.iter_chunks`` allocates) makes glibc keep freed chunks in
    per-thread malloc arenas: ~170 MiB more resident memory with 16 MiB chunks and 2 threads, measured in
    ``tests/test_memory_cap.py``. Reusing one buffer per thread keeps memory at ``workers x chunk``.
    """

    def __init__(self) -> None:
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self.by_dtype.get(dtype)
        if buf is None or buf.numel() < numel:
            self.by_dtype.pop(dtype, None)
            del buf
            import torch

            buf = self.by_dtype[dtype] = torch.empty(numel, dtype=dtype)
        return buf


class ByteBuffers(threading.local):
    """One reusable byte buffer per use and IO thread: :class:`ChunkBuffers` for byte-level writers (no torch)."""

    def __init__(self) -> None:
        self.by_use: dict[str, bytearray] = {}

    def get(self, use: str, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` bytes, valid until the next ``get`` of the same use on this thread."""
        buf = self.by_use.get(use)
        if buf is None or len(buf) < nbytes:
            self.by_use.pop(use, None)
            del buf
            buf = self.by_use[use] = bytearray(nbytes)
        return memoryview(buf)[:nbytes]


WRITEBACK_BYTES = 256 * 2**20
"""Dirty bytes of one output file after which its data is flushed in the background."""


class WriteBack:
    """Makes output durable while it is written, not all at the end.

    Every ``every`` bytes written to a file, and as soon as its last byte is, one background thread runs
    ``fdatasync`` on it: the disk writes back while later chunks are still being read, and the final ``fsync``
    (which the caller still makes, for metadata and certainty) finds little left. Errors are re-raised by
    :meth:`close`; call it before closing the descriptors.
    """

    def __init__(self, every: int = WRITEBACK_BYTES) -> None:
        self.every = every
        self._dirty: dict[int, int] = {}
        self._lock = threading.Lock()
        self._wanted: list[int] = []
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="zeroio-writeback", daemon=True)
        self._thread.start()

    def wrote(self, fd: int, nbytes: int) -> None:
        """Count ``nbytes`` written to ``fd``; past ``every`` dirty bytes, ask for a background flush."""
        with self._lock:
            dirty = self._dirty.get(fd, 0) + nbytes
            if dirty >= self.every:
                dirty = 0
                self._ask(fd)
            self._dirty[fd] = dirty

    def finished(self, fd: int) -> None:
        """``fd`` has all its bytes: flush it now, in the background."""
        with self._lock:
            self._dirty[fd] = 0
            self._ask(fd)

    def _ask(self, fd: int) -> None:
        if fd not in self._wanted:
            self._wanted.append(fd)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._wanted and not self._closing:
                    self._wake.wait()
                if not self._wanted:
                    return
                fd = self._wanted.pop(0)
            try:
                os.fdatasync(fd)
            except OSError as exc:  # the caller's final fsync fails the same way, naming the file
                with self._lock:
                    self._error = self._error or exc

    def close(self) -> None:
        """Finish the flushes asked for, stop the thread, raise the first flush error."""
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
