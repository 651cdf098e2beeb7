"""Where a stored tensor's flattened elements lie as file bytes, so a reader of many small pieces (a column block:
one piece per row) can read them straight from the byte sources, pieces that touch in storage read as one."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Protocol

from .sources import ByteRange

__all__ = ["ByteMap", "ConcatMap", "read_ranges", "read_strided"]


class ByteMap(Protocol):
    """Flattened elements of one stored tensor -> the byte ranges holding them."""

    def locate(self, start: int, count: int) -> list[ByteRange]:
        """``(source, offset, nbytes)`` ranges whose concatenation is elements ``[start, start + count)``."""
        ...


class ConcatMap:
    """A tensor whose bytes are its ranges concatenated (a safetensors entry, a record, ZeRO partitions)."""

    def __init__(self, ranges: list[ByteRange], itemsize: int) -> None:
        self._ranges = [r for r in ranges if r[2]]
        self.itemsize = itemsize
        self.whole = self._ranges[0] if len(self._ranges) == 1 else None
        """The one range holding the whole tensor, if it is one (safetensors, a torch record)."""
        self._starts: list[int] = []  # first element of each range
        at = 0
        for _, _, nbytes in self._ranges:
            self._starts.append(at)
            at += nbytes // itemsize

    def locate(self, start: int, count: int) -> list[ByteRange]:
        each = self.itemsize
        if len(self._ranges) == 1:  # one file range (safetensors, a torch record): no search
            source, offset, _ = self._ranges[0]
            return [(source, offset + start * each, count * each)]
        found: list[ByteRange] = []
        i = bisect.bisect_right(self._starts, start) - 1
        end = start + count
        while start < end:
            source, offset, nbytes = self._ranges[i]
            first = self._starts[i]
            stop = min(end, first + nbytes // each)
            found.append((source, offset + (start - first) * each, (stop - start) * each))
            start = stop
            i += 1
        return found


def read_ranges(ranges: Iterable[ByteRange], view: memoryview, what: str = "a tensor's data") -> None:
    """Fill ``view`` with the concatenation of ``ranges``: ranges that touch in one source are read as one, and each
    source's consecutive ranges go to it in one call (``read_many``, where the source has it: one file lease)."""
    merged: list[ByteRange] = []
    for piece in ranges:
        if merged and piece[0] is merged[-1][0] and merged[-1][1] + merged[-1][2] == piece[1]:
            merged[-1] = (piece[0], merged[-1][1], merged[-1][2] + piece[2])
        elif piece[2]:
            merged.append(piece)
    pos = i = 0
    while i < len(merged):
        source = merged[i][0]
        pieces: list[tuple[int, memoryview]] = []
        while i < len(merged) and merged[i][0] is source:
            pieces.append((merged[i][1], view[pos : pos + merged[i][2]]))
            pos += merged[i][2]
            i += 1
        read_many = getattr(source, "read_many", None)
        if read_many is not None:
            read_many(pieces, what)
        else:
            for offset, piece_view in pieces:
                source.read_into(offset, piece_view, what)
    if pos != len(view):
        raise ValueError(f"ranges hold {pos} bytes, the buffer {len(view)}")


def read_strided(
    where: ByteMap, start: int, length: int, stride: int, count: int, view: memoryview, what: str = "a tensor's data"
) -> None:
    """Fill ``view`` with ``count`` runs of ``length`` elements, the k-th at element ``start + k * stride`` (rows of
    a column block): from a tensor stored as one range, one ``read_many`` of the rows' byte ranges; otherwise each
    row located and read through :func:`read_ranges` (rows that touch in storage read as one)."""
    if isinstance(where, ConcatMap) and where.whole is not None:
        source, offset, _ = where.whole
        read_many = getattr(source, "read_many", None)
        if read_many is not None:
            base, row, nbytes = offset + start * where.itemsize, stride * where.itemsize, length * where.itemsize
            read_many([(base + k * row, view[k * nbytes : (k + 1) * nbytes]) for k in range(count)], what)
            return
    rows = getattr(where, "locate_rows", None)  # a map that finds a block of rows at once (DCP chunk boxes)
    found = rows(start, length, stride, count) if rows is not None else None
    if found is None:
        found = (r for k in range(count) for r in where.locate(start + k * stride, length))
    read_ranges(found, view, what)
