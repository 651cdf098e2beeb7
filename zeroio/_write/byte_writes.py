"""Write a tensor into its safetensors slot from its stored bytes, without torch (issue 17).

Most tensors of a conversion are runs of stored bytes written unchanged (fp32 master partitions, frozen
parameters and buffers, concatenations along dim 0), or fp32 masters rounded to bf16/fp16. Both need no tensor
arithmetic, so ``zeroio convert`` need not import torch (seconds) for them:

1. :func:`copy_in_kernel`: no cast, local files: ``copy_file_range``, the bytes never enter user space;
2. :func:`copy_through_memory`: otherwise, each run read into a reused buffer (``pread``), cast with numpy where
   the output dtype differs (:mod:`zeroio._io.casts`), and ``pwrite``\\ n.

Each returns False before writing anything when it cannot do the tensor (no byte runs, a dtype pair not cast
here): the caller then streams it with torch. Zip records are CRC-checked as
their bytes pass, exactly as on the torch path (the sources are :class:`~zeroio._io.integrity.CheckedFile`\\ s).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from .._dtypes import DType
from .._formats import TensorReader, output_spec
from .._io.casts import can_cast, cast_into
from .._io.fileio import ByteBuffers, pwrite_all
from .._io.read_ahead import ReadAhead
from .._io.sources import ByteRange, ByteSource, kernel_copy_enabled, kernel_copy_forced
from .safetensors_writer import TensorSlot

__all__ = ["KERNEL_RUN", "copy_in_kernel", "copy_through_memory", "stored_runs"]

KERNEL_RUN = 256 * 1024
"""Runs shorter than this on average are copied through memory, packed into one write: a ZeRO-3 parameter on 1,024
ranks is 1,024 runs of a few bytes each, and a ``copy_file_range`` per run (after reading it to check its CRC) cost
two syscalls a run where packing costs one read a run and one write a chunk. ``ZEROIO_NO_COPY_FILE_RANGE=0`` copies
every run in the kernel (tests of that path on small fixtures)."""


def stored_runs(ckpt: TensorReader, name: str) -> list[ByteRange] | None:
    """The stored byte runs of ``name``, or None unless they are whole elements and hold exactly the tensor: what
    :func:`copy_in_kernel` and :func:`copy_through_memory` are given (made once: 1,024 runs at 1,024 ranks)."""
    ckpt.ensure_open(name)
    stored = ckpt.stored_spec(name)
    ranges = ckpt.byte_ranges(ckpt.source_name(name))
    if ranges is None or any(n % stored.itemsize for _, _, n in ranges):
        return None
    if sum(n for _, _, n in ranges) != ckpt.info(name).numel * stored.itemsize:
        return None
    return ranges


def copy_in_kernel(
    ckpt: TensorReader,
    name: str,
    ranges: list[ByteRange] | None,
    target: DType | None,
    fd: int,
    slot: TensorSlot,
    chunk_bytes: int,
    on_bytes: Callable[[int], None],
    stop: threading.Event,
) -> bool:
    """Copy a tensor that needs no cast file to file with ``copy_file_range``; False to fall back.

    The bytes never enter user space: measured 1.8 s instead of 5.8 s for the 468M benchmark checkpoint's
    fp32 pieces (docs/benchmarks.md). Falling back after a partial copy is safe: the fallback rewrites the slot.
    """
    stored = ckpt.stored_spec(name)
    if not kernel_copy_enabled() or output_spec(ckpt.info(name), target) != stored:
        return False
    if ranges is None or sum(n for _, _, n in ranges) != slot.nbytes:
        return False
    if slot.nbytes < KERNEL_RUN * len(ranges) and not kernel_copy_forced():
        return False
    offset = slot.begin
    for source, src_offset, nbytes in ranges:
        done = 0
        while done < nbytes:
            if stop.is_set():
                return True
            got = source.copy_to(fd, src_offset + done, min(chunk_bytes, nbytes - done), offset + done)
            if got is None:  # no fast path between this source and the destination
                return False
            if got <= 0:  # the source ended early: let the streaming reader raise its precise error
                return False
            done += got
            on_bytes(got)
        offset += nbytes
    return True


def copy_through_memory(
    ckpt: TensorReader,
    name: str,
    ranges: list[ByteRange] | None,
    target: DType | None,
    fd: int,
    slot: TensorSlot,
    chunk_bytes: int,
    on_bytes: Callable[[int], None],
    stop: threading.Event,
    buffers: ByteBuffers,
    read_ahead: ReadAhead | None = None,
) -> bool:
    """Read a tensor's byte runs chunk by chunk, cast them with numpy if asked, ``pwrite`` them; False to fall back.

    Memory is one read buffer and one cast buffer per IO thread (``buffers``), as on the torch path. Short runs
    (a ZeRO-3 parameter's piece on each of 1,024 ranks) are served by ``read_ahead``'s window of their file.
    """
    info = ckpt.info(name)
    stored, wanted = ckpt.stored_spec(name), output_spec(info, target)
    if sys.byteorder != "little" or (stored != wanted and not can_cast(stored, wanted)):
        return False
    if ranges is None or info.numel * wanted.itemsize != slot.nbytes:
        return False
    step = max(1, chunk_bytes // max(stored.itemsize, wanted.itemsize)) * stored.itemsize
    packed = buffers.get("read", min(step, sum(n for _, _, n in ranges)))
    offset, fill = slot.begin, 0

    def flush() -> None:
        nonlocal offset, fill
        raw = data = packed[:fill]
        if stored != wanted:
            data = buffers.get("cast", fill // stored.itemsize * wanted.itemsize)
            if not cast_into(raw, stored, wanted, data):
                _cast_with_torch(raw, stored, wanted, data)
        pwrite_all(fd, data, offset)
        offset += len(data)
        on_bytes(len(data))
        fill = 0

    # Runs packed back to back into one buffer, written when it is full. A CheckedFile folds the bytes read into
    # their CRC (a read-ahead window: the whole window, once).
    read = read_ahead.read_into if read_ahead is not None else _read_into
    for source, at, nbytes in ranges:
        start = 0
        while start < nbytes:
            if stop.is_set():
                return True
            n = min(step, nbytes - start)
            if fill + n > len(packed):
                flush()
            read(source, at + start, packed[fill : fill + n])
            fill, start = fill + n, start + n
    if fill:
        flush()
    return True


def _read_into(source: ByteSource, offset: int, out: memoryview) -> None:
    source.read_into(offset, out)


def _cast_with_torch(raw: memoryview, stored: DType, wanted: DType, out: memoryview) -> None:
    """A chunk holding a NaN: torch's own cast of the 1-D chunk, as the torch path does (``zeroio._io.casts``)."""
    import torch

    from .._io.sources import tensor_bytes

    cast = torch.frombuffer(raw, dtype=stored.torch).to(wanted.torch)
    out[:] = tensor_bytes(cast)
