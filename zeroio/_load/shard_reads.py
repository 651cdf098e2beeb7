"""How a rank reads the elements of its part of one checkpoint tensor (the flat ranges ``sharded.plan_shard``
gives), through the reader contract (``read_into``, ``byte_map``): straight into the local shard, through host or
pinned staging buffers, column blocks in blocks of rows; or, with ``broadcast_from_rank0``, rank 0 reads and
broadcasts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from .._env import env_bytes
from .._io.byte_map import ByteMap, read_strided
from .._io.sources import tensor_bytes
from .rank_agreement import broadcast_checked
from .shard_slices import Strided

if TYPE_CHECKING:
    from .._formats import TensorReader

__all__ = [
    "CHUNK_BYTES",
    "MAX_ROWS",
    "Fill",
    "broadcast_segments",
    "fill_whole",
    "read_segments",
    "staging_bytes",
]

CHUNK_BYTES = 16 * 1024 * 1024
"""Largest block of elements read at once, and staging buffer (when the local shard's dtype or device differs from
the stored dtype)."""
MAX_ROWS = 8192
"""Most rows of a column block read in one block, so a block's list of byte ranges stays small."""


class _Landing:
    """Where :func:`read_segments` reads a local part's elements before ``dest`` holds them, and how they get there.

    Straight into ``dest`` (a CPU tensor of the stored dtype); through one host buffer, cast by ``copy_`` (a CPU
    tensor of another dtype); or, for a CUDA tensor, through pinned host buffers copied with ``non_blocking=True``
    and cast on the device, so the next read overlaps the copy (a pageable ``copy_`` casts on the CPU and blocks the
    reading thread for the transfer). Pinned buffers come from torch's caching host allocator, which reuses one only
    once the copy recorded on it has completed.
    """

    def __init__(self, flat: torch.Tensor, stored: torch.dtype, step: int) -> None:
        self.flat = flat
        self.out = 0
        self.cap = min(step, max(1, flat.numel()))
        self.cuda = flat.is_cuda
        self.direct = flat.device.type == "cpu" and flat.dtype == stored
        self.stored = stored
        self.host: torch.Tensor | None = None
        if not (self.direct or self.cuda):
            self.host = torch.empty(self.cap, dtype=stored)

    def buffer(self, n: int) -> torch.Tensor:
        """Where the next ``n`` (at most one step of) elements are read."""
        if self.direct:
            return self.flat[self.out : self.out + n]
        if self.cuda:  # a fresh block per chunk: the last one may still be on its way to the device
            self.host = torch.empty(self.cap, dtype=self.stored, pin_memory=True)
        assert self.host is not None
        return self.host[:n]

    def place(self, n: int) -> None:
        """Move the ``n`` elements just read into ``dest``."""
        target = self.flat[self.out : self.out + n]
        if self.host is not None:
            read = self.host[:n]
            if not self.cuda:
                target.copy_(read)
            elif target.dtype == self.stored:
                target.copy_(read, non_blocking=True)
            else:  # copied in the stored dtype, cast by the device
                target.copy_(read.to(target.device, non_blocking=True))
            if self.cuda:
                self.host = None  # back to the allocator, reused once this copy has completed
        self.out += n

    def finish(self) -> None:
        """Wait for the copies in flight: ``dest`` is whole when :func:`read_segments` returns."""
        if self.cuda:
            torch.cuda.current_stream(self.flat.device).synchronize()


def staging_bytes(default: int = CHUNK_BYTES) -> int:
    """``default``, or ``ZEROIO_STAGING_BYTES`` (tests cross chunk boundaries with small fixtures), for every
    staging buffer of a load (here, and ``DeviceFiller``'s pinned ring)."""
    return max(8, env_bytes("ZEROIO_STAGING_BYTES", default))


def read_segments(
    ckpt: TensorReader, name: str, parts: Iterable[Strided], dest: torch.Tensor, chunk_bytes: int | None = None
) -> None:
    """Fill the contiguous ``dest`` (flattened) with the elements of checkpoint tensor ``name`` at ``parts``.

    Reads straight into ``dest`` when it is a CPU tensor of the stored dtype; otherwise through staging buffers of
    at most ``chunk_bytes`` (:class:`_Landing`; cast by ``copy_``, rounding as ``load_state_dict`` does). A run of
    rows (a ``Shard(1)`` column block) is read in blocks of up to ``chunk_bytes`` and :data:`MAX_ROWS` rows through
    the reader's :meth:`~zeroio._formats.checkpoint.Checkpoint.byte_map`, straight from the files: one read per block where
    the rows' ranges touch in storage (a column-sharded DCP chunk), else one call per block reading each row's
    own bytes (nothing between them).
    """
    source = ckpt.source_name(name)
    stored = ckpt.stored_dtype(name)
    step = max(1, (chunk_bytes or staging_bytes()) // stored.itemsize)
    landing = _Landing(dest.view(-1), stored, step)
    where: ByteMap | None = None  # the byte map, asked for by the first run of several rows
    asked = False
    for start, length, stride, count in parts:
        rows = min(MAX_ROWS, step // length) if length else 0
        if count == 1 or rows < 2:  # one row at a time, each cut into reads of at most `step` elements
            for k in range(count):
                for at in range(0, length, step):
                    n = min(step, length - at)
                    ckpt.read_into(source, start + k * stride + at, landing.buffer(n))
                    landing.place(n)
            continue
        if not asked:
            where, asked = ckpt.byte_map(source), True
        for k in range(0, count, rows):
            m = min(rows, count - k)
            block = landing.buffer(m * length)
            if where is not None:
                read_strided(where, start + k * stride, length, stride, m, tensor_bytes(block))
            else:
                for j in range(m):
                    ckpt.read_into(source, start + (k + j) * stride, block[j * length : (j + 1) * length])
            landing.place(m * length)
    landing.finish()


def _segments(parts: Iterable[Strided]) -> Iterator[tuple[int, int]]:
    for start, length, stride, count in parts:
        for k in range(count):
            yield start + k * stride, length


def broadcast_segments(
    ckpt: TensorReader, name: str, parts: Iterable[Strided], dest: torch.Tensor, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """:func:`read_segments` for ``broadcast_from_rank0``: rank 0 alone reads the whole tensor, chunk by chunk, and
    broadcasts each chunk; every rank keeps the elements of its ``parts``. All ranks call it for the same tensors
    in the same order (the plan is built from checkpoint keys, in checkpoint order, after the ranks agreed)."""
    import torch.distributed as dist

    info = ckpt.info(name)
    source = ckpt.source_name(name)
    stored = ckpt.stored_dtype(name)
    # NCCL broadcasts device memory only; gloo host memory.
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    step = max(1, chunk_bytes // stored.itemsize)
    buffer = torch.empty(min(step, max(1, info.numel)), dtype=stored, device=on)
    host = buffer if on.type == "cpu" else torch.empty(buffer.numel(), dtype=stored)
    flat = dest.view(-1)
    placed: list[tuple[int, int, int]] = []  # (global start, length, local start), in global order
    local = 0
    for start, length in _segments(parts):
        placed.append((start, length, local))
        local += length
    placed.sort()
    first = 0  # the first placed range that may still overlap the next chunk
    for lo in range(0, info.numel, step):
        n = min(step, info.numel - lo)

        def read(lo: int = lo, n: int = n) -> None:
            ckpt.read_into(source, lo, host[:n])
            if host is not buffer:
                buffer[:n].copy_(host[:n])

        broadcast_checked(read, buffer[:n], str(ckpt.metadata.path), name)  # a read error on 0 reaches every rank
        hi = lo + n
        while first < len(placed) and placed[first][0] + placed[first][1] <= lo:
            first += 1
        for start, length, at in placed[first:]:
            if start >= hi:
                break
            a, b = max(start, lo), min(start + length, hi)
            flat[at + a - start : at + b - start].copy_(buffer[a - lo : b - lo])


Fill = Callable[["TensorReader", str, Sequence[Strided], torch.Tensor], None]
"""How a local part is filled: :func:`read_segments` (each rank reads) or :func:`broadcast_segments`."""


def fill_whole(ckpt: TensorReader, name: str, dest: torch.Tensor, fill: Fill) -> None:
    """Fill an unsharded ``dest`` with all of checkpoint tensor ``name`` (``broadcast_from_rank0`` loads)."""
    numel = ckpt.info(name).numel
    whole = [(0, numel, numel, 1)] if dest.numel() else []
    if dest.is_contiguous():
        fill(ckpt, name, whole, dest)
    else:
        staged = torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
        fill(ckpt, name, whole, staged)
        dest.copy_(staged)
