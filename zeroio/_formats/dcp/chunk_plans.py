"""Where a DCP tensor's flattened elements lie in its chunks: each chunk, a box of the full tensor, is a series of
contiguous runs of the flattened tensor, read by byte range and reassembled by offset."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._io.sources import ByteRange, ByteSource
from .metadata import Chunk, TensorEntry

if TYPE_CHECKING:
    import torch

__all__ = [
    "ChunkRuns",
    "EntryMap",
    "chunk_runs",
    "concat_ranges",
    "entry_pieces",
    "read_entry_into",
    "whole_chunk_order",
]


@dataclass(frozen=True, slots=True)
class ChunkRuns:
    """A chunk as ``count`` runs of ``length`` elements; run ``r`` holds the chunk's elements ``[r * length, ...)``."""

    first: int
    """Flat index in the full tensor of the chunk's first element."""
    length: int
    count: int
    outer_sizes: tuple[int, ...]
    """The chunk's sizes in the dimensions that split it into runs (row-major)."""
    outer_strides: tuple[int, ...]
    """The full tensor's strides in those dimensions."""

    def start(self, r: int) -> int:
        """Flat index in the full tensor of run ``r``'s first element."""
        flat = self.first
        for size, stride in zip(reversed(self.outer_sizes), reversed(self.outer_strides)):
            r, i = divmod(r, size)
            flat += i * stride
        return flat


def chunk_runs(chunk: Chunk, shape: tuple[int, ...]) -> ChunkRuns:
    """The runs of ``chunk`` in a tensor of ``shape``: the trailing dimensions it spans whole, and one more, are
    contiguous in the full tensor."""
    if not shape:
        return ChunkRuns(0, 1, 1, (), ())
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    k = len(shape) - 1
    while k > 0 and chunk.sizes[k] == shape[k]:
        k -= 1
    first = sum(o * s for o, s in zip(chunk.offsets, strides))
    count = 1
    for s in chunk.sizes[:k]:
        count *= s
    return ChunkRuns(first, chunk.sizes[k] * strides[k], count, tuple(chunk.sizes[:k]), tuple(strides[:k]))


ReadChunk = Callable[[int, int, "torch.Tensor"], None]
"""``read(chunk index, first chunk element, out)``: fill ``out`` with that chunk's elements."""


def entry_pieces(entry: TensorEntry, start: int, count: int) -> Iterator[tuple[int, int, int, int]]:
    """``(chunk index, first chunk element, first element of the range, length)`` of the runs holding the
    tensor's flattened elements ``[start, start + count)``, chunk by chunk; only runs that meet the range are
    visited (found by bisection: run starts grow with the run index)."""
    end = start + count
    for i, chunk in enumerate(entry.chunks):
        if not chunk.numel:
            continue
        runs = chunk_runs(chunk, entry.shape)
        lo, hi = 0, runs.count
        while lo < hi:  # first run ending after `start`
            mid = (lo + hi) // 2
            if runs.start(mid) + runs.length <= start:
                lo = mid + 1
            else:
                hi = mid
        for r in range(lo, runs.count):
            flat = runs.start(r)
            if flat >= end:
                break
            a, b = max(start, flat), min(end, flat + runs.length)
            if a < b:
                yield i, r * runs.length + (a - flat), a - start, b - a


def read_entry_into(entry: TensorEntry, start: int, out: torch.Tensor, read: ReadChunk) -> None:
    """Fill ``out`` with the tensor's flattened elements ``[start, start + out.numel())`` from the chunks holding
    them, reading only those runs."""
    for i, first, at, n in entry_pieces(entry, start, out.numel()):
        read(i, first, out[at : at + n])


class EntryMap:
    """A DCP tensor's elements as byte ranges inside its chunks' archives (a chunk located on first use): a column
    block stored as column chunks is then read in one range per block of rows."""

    def __init__(self, entry: TensorEntry, place: Callable[[int], tuple[ByteSource, int]]) -> None:
        self._entry = entry
        self._place = place  # chunk index -> (its data file, offset of its data)

    def locate(self, start: int, count: int) -> list[ByteRange]:
        each = self._entry.dtype.itemsize
        found = []
        for i, first, at, n in entry_pieces(self._entry, start, count):
            source, offset = self._place(i)
            found.append((at, (source, offset + first * each, n * each)))
        found.sort(key=lambda f: f[0])
        return [r for _, r in found]

    def locate_rows(self, start: int, length: int, stride: int, count: int) -> list[ByteRange] | None:
        """:meth:`locate` of ``count`` rows of a 2-D tensor (``length`` columns each, from flat ``start``, ``stride``
        = its row length), found by box arithmetic: each chunk's rows of the block are one range when the block's
        columns are the chunk's own columns. None when the tensor is not 2-D."""
        shape = self._entry.shape
        if len(shape) != 2 or stride != shape[1] or start % stride + length > stride:
            return None
        each = self._entry.dtype.itemsize
        row0, col0 = divmod(start, stride)
        col1 = col0 + length
        per_chunk = []  # (first column, chunk index, first row, rows, first col, cols) of each chunk that overlaps
        for i, chunk in enumerate(self._entry.chunks):
            (r0, c0), (nr, nc) = chunk.offsets, chunk.sizes
            lo, hi = max(row0, r0), min(row0 + count, r0 + nr)
            a, b = max(col0, c0), min(col1, c0 + nc)
            if lo < hi and a < b:
                per_chunk.append((lo, a, i, hi, b))
        found: list[tuple[int, int, ByteRange]] = []  # (row, column, range): sorted, the block's element order
        for lo, a, i, hi, b in per_chunk:
            (r0, c0), (_, nc) = self._entry.chunks[i].offsets, self._entry.chunks[i].sizes
            source, offset = self._place(i)
            first = offset + ((lo - r0) * nc + (a - c0)) * each
            if a == col0 and b == col1 and b - a == nc:  # whole chunk rows, back to back in its archive
                found.append((lo, a, (source, first, (hi - lo) * nc * each)))
            else:
                found.extend((r, a, (source, first + (r - lo) * nc * each, (b - a) * each)) for r in range(lo, hi))
        found.sort(key=lambda f: (f[0], f[1]))
        return [r for _, _, r in found]


def whole_chunk_order(entry: TensorEntry) -> list[int] | None:
    """Chunk indices in flat order when each non-empty chunk is one run and together they run back to back (row
    sharding, what FSDP writes): the tensor's bytes are then the chunks' bytes concatenated. None otherwise."""
    order = []
    for i, chunk in enumerate(entry.chunks):
        if chunk.numel:
            runs = chunk_runs(chunk, entry.shape)
            if runs.count != 1:
                return None
            order.append((runs.first, i))
    order.sort()
    expected = 0
    for first, i in order:
        if first != expected:
            return None
        expected += entry.chunks[i].numel
    return [i for _, i in order]


def concat_ranges(entry: TensorEntry, place: Callable[[int], tuple[ByteSource, int]]) -> list[ByteRange] | None:
    """The tensor's bytes as its chunks' data concatenated (:func:`whole_chunk_order`), or None. ``place(i)``:
    chunk ``i``'s data file and where its data starts (a located chunk holds ``chunk.numel`` elements)."""
    order = whole_chunk_order(entry)
    if order is None:
        return None
    return [(*place(i), entry.chunks[i].numel * entry.dtype.itemsize) for i in order]
