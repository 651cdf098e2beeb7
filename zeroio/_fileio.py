"""Output-file primitives every writer uses: new files only, full positional writes, preallocation, fsync."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = [
    "ChunkBuffers",
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
            buf = self.by_dtype[dtype] = torch.empty(numel, dtype=dtype)
        return buf
