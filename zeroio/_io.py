"""Positional reads straight into tensor memory: the one loop every reader uses."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from .errors import CheckpointFormatError

__all__ = ["pread_into"]


def pread_into(fd: int, offset: int, out: torch.Tensor, path: Path, what: str = "a tensor's data") -> None:
    """Fill the contiguous CPU tensor ``out`` with the file's bytes at ``offset``, with no intermediate copy.

    ``preadv`` does not move a shared file position, so threads may read one descriptor at once.
    A short file raises :class:`CheckpointFormatError` naming ``path`` and ``what`` was being read.
    """
    nbytes = out.numel() * out.element_size()
    if nbytes == 0:
        return
    # A writable view of the tensor's memory without numpy (bf16 has no numpy dtype).
    view = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CheckpointFormatError(
                f"'{path}' ends after {offset + done} bytes, inside {what}: the file is truncated. "
                "Copy it again from where it was saved.",
                path=path,
            )
        done += got
