"""Pure ZeRO partition arithmetic: where each parameter's elements lie in the ranks' flat groups.

No IO and no torch here: plans are plain integers, executed by ``_formats.plans.read_plan_into``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import NamedTuple, overload

__all__ = [
    "Piece",
    "Zero3Pieces",
    "locate",
    "round_robin_original",
    "split_pieces",
    "zero3_offsets",
    "zero3_partition_numel",
    "zero3_plan",
    "zero3_sub_groups",
    "zero12_offsets",
    "zero12_plan",
]


class Piece(NamedTuple):
    """Read ``length`` elements of ``rank``'s flat group ``group`` from ``start``; they are the
    parameter's flattened elements ``[dest, dest + length)``.

    A named tuple, not a dataclass: a 1,024-rank ZeRO-3 checkpoint of 2,000 tensors plans 2 million of them, and a
    tuple is made in a quarter of the time."""

    rank: int
    group: int
    start: int
    length: int
    dest: int


def zero3_partition_numel(numel: int, world_size: int) -> int:
    """Elements each rank holds of a ZeRO-3 parameter: ``ceil(numel / world_size)``; the last rank is padded."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return math.ceil(numel / world_size)


def zero3_offsets(numels: Sequence[int], world_size: int) -> tuple[list[int], int]:
    """Offsets of each parameter's partition in every rank's concatenated flat groups, and their total.

    ZeRO-3 stores, on every rank, the rank's partition of each parameter back to back, in
    ``param_shapes`` order across all param groups (DeepSpeed's ``fp32_flat_groups``).
    """
    offsets = []
    offset = 0
    for numel in numels:
        offsets.append(offset)
        offset += zero3_partition_numel(numel, world_size)
    return offsets, offset


def locate(group_sizes: Sequence[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """Map ``[start, start+length)`` of the concatenation of groups onto ``(group, start_in_group, length)`` runs."""
    bounds = [0]
    for size in group_sizes:
        bounds.append(bounds[-1] + size)
    if start < 0 or start + length > bounds[-1]:
        raise ValueError(f"range [{start}, {start + length}) outside groups totalling {bounds[-1]} elements")
    runs = []
    group = bisect.bisect_right(bounds, start) - 1
    remaining = length
    position = start
    while remaining > 0:
        while bounds[group + 1] <= position:  # skip empty groups
            group += 1
        take = min(remaining, bounds[group + 1] - position)
        runs.append((group, position - bounds[group], take))
        position += take
        remaining -= take
    return runs


def zero3_plan(numel: int, offset: int, world_size: int, group_sizes: Sequence[int]) -> list[Piece]:
    """Pieces that rebuild one ZeRO-3 parameter of ``numel`` elements whose partitions sit at ``offset``.

    Rank ``r`` holds elements ``[r*p, (r+1)*p)`` with ``p = ceil(numel/world_size)``; what lies beyond
    ``numel`` on the last ranks is padding and is never read.
    """
    part = zero3_partition_numel(numel, world_size)
    pieces: list[Piece] = []
    if part == 0:
        return pieces
    full = locate(group_sizes, offset, part)  # every rank's flat vector has the same layout: one lookup for all
    for rank in range(world_size):
        first = rank * part
        length = min(part, numel - first)
        if length <= 0:
            break
        for group, start, run in full if length == part else locate(group_sizes, offset, length):
            pieces.append(Piece(rank, group, start, run, first))
            first += run
    return pieces


class Zero3Pieces(Sequence[Piece]):
    """:func:`zero3_plan`'s pieces, made when asked for, not held.

    A ZeRO-3 parameter has a piece (or a few) on every rank, all at the same place in each rank's flat groups:
    2,000 parameters on 1,024 ranks would be 2 million objects made at open and kept for the checkpoint's life.
    This holds the parameter's one layout and makes the pieces when iterated; :meth:`overlapping` makes only those of
    the ranks a read touches.
    """

    __slots__ = ("_full", "_numel", "_part", "_ranks", "_tail")

    def __init__(self, numel: int, offset: int, world_size: int, group_sizes: Sequence[int]) -> None:
        part = zero3_partition_numel(numel, world_size)
        self._numel, self._part = numel, part
        self._ranks = -(-numel // part) if part else 0  # ranks holding elements; the last may hold fewer
        last = numel - (self._ranks - 1) * part if part else 0
        self._full = tuple(locate(group_sizes, offset, part)) if part else ()
        self._tail = self._full if last == part else tuple(locate(group_sizes, offset, last))

    def __len__(self) -> int:
        return (self._ranks - 1) * len(self._full) + len(self._tail) if self._ranks else 0

    def _rank(self, rank: int) -> Iterator[Piece]:
        first = rank * self._part
        for group, start, run in self._full if rank < self._ranks - 1 else self._tail:
            yield Piece(rank, group, start, run, first)
            first += run

    def __iter__(self) -> Iterator[Piece]:
        for rank in range(self._ranks):
            yield from self._rank(rank)

    def runs(self) -> list[tuple[int, int, int, int]]:
        """``(rank, group, start, length)`` of every piece, in order (``dest`` follows: the pieces are back to
        back), made without a :class:`Piece` each: a conversion's byte ranges at 1,024 ranks."""
        if not self._ranks:
            return []
        if len(self._full) == 1:  # the usual case: the parameter lies in one flat group
            group, start, length = self._full[0]
            found = [(rank, group, start, length) for rank in range(self._ranks - 1)]
        else:
            found = [(rank, g, s, n) for rank in range(self._ranks - 1) for g, s, n in self._full]
        found.extend((self._ranks - 1, g, s, n) for g, s, n in self._tail)
        return found

    def overlapping(self, start: int, end: int) -> Iterator[Piece]:
        """The pieces holding any of the parameter's elements ``[start, end)``, in order."""
        end = min(end, self._numel)
        if end <= start or not self._part:
            return
        for rank in range(max(0, start // self._part), min(self._ranks, -(-end // self._part))):
            for piece in self._rank(rank):
                if piece.dest < end and piece.dest + piece.length > start:
                    yield piece

    @overload
    def __getitem__(self, index: int) -> Piece: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Piece]: ...

    def __getitem__(self, index: int | slice) -> Piece | Sequence[Piece]:
        if isinstance(index, slice):
            return tuple(self)[index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("piece index out of range")
        rank = min(index // len(self._full), self._ranks - 1)
        return next(islice(self._rank(rank), index - rank * len(self._full), None))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Zero3Pieces({list(self)!r})"


def zero12_offsets(numels: Sequence[int], alignment_paddings: Sequence[int] | None = None) -> tuple[list[int], int]:
    """Offsets of each parameter inside its ZeRO-1/2 param group's merged flat vector, and elements consumed.

    ZeRO-1/2 flattens a param group's parameters back to back (plus per-parameter alignment padding in
    DeepSpeed versions that record ``param_alignment_paddings``) and splits the vector evenly over ranks.
    """
    if alignment_paddings is not None and len(alignment_paddings) != len(numels):
        raise ValueError(f"expected {len(numels)} alignment paddings, got {len(alignment_paddings)}")
    offsets = []
    offset = 0
    for i, numel in enumerate(numels):
        offsets.append(offset)
        offset += numel + (alignment_paddings[i] if alignment_paddings is not None else 0)
    return offsets, offset


def round_robin_original(count: int, ranks: int) -> list[int]:
    """ZeRO-1/2 with ``round_robin_gradients``: the original index of each position of DeepSpeed's round-robin order of ``count`` parameters.

    ``stage_1_and_2._round_robin_reorder`` deals parameter i to rank ``i % ranks`` and concatenates the ranks'
    lists: with 5 parameters over 2 ranks the flat order is 0, 2, 4, 1, 3.
    """
    return [i for first in range(min(count, ranks)) for i in range(first, count, ranks)]


def zero12_plan(numel: int, offset: int, group: int, partition_sizes: Sequence[int]) -> list[Piece]:
    """Pieces that rebuild one ZeRO-1/2 parameter at ``offset`` of param group ``group``'s merged vector,
    given each rank's partition size of that group."""
    pieces = []
    dest = 0
    for rank, start, length in locate(partition_sizes, offset, numel):
        pieces.append(Piece(rank, group, start, length, dest))
        dest += length
    return pieces


def split_pieces(pieces: Sequence[Piece], max_elements: int) -> list[Piece]:
    """Cut pieces so none is longer than ``max_elements`` (bounded reads for streaming)."""
    if max_elements < 1:
        raise ValueError(f"max_elements must be >= 1, got {max_elements}")
    out = []
    for piece in pieces:
        done = 0
        while done < piece.length:
            take = min(max_elements, piece.length - done)
            out.append(Piece(piece.rank, piece.group, piece.start + done, take, piece.dest + done))
            done += take
    return out


def zero3_sub_groups(numels: Sequence[int], world_size: int, sub_group_size: int) -> list[list[int]]:
    """Split one param group into ZeRO-3 sub-groups as DeepSpeed 0.19.8 does (``_create_fp16_sub_groups``).

    Each sub-group gets one fp32 flat tensor and one base-optimizer state entry. Parameters are taken in order
    and a sub-group is closed once its partition sizes (``ceil(numel / world_size)`` each) reach
    ``sub_group_size``; a group whose partitions fit is one sub-group (an empty group too).

    Example:
        >>> zero3_sub_groups([91, 35, 35], 2, 50)
        [[0, 1], [2]]
    """
    parts = [zero3_partition_numel(n, world_size) for n in numels]
    if sub_group_size >= sum(parts):
        return [list(range(len(numels)))]
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, part in enumerate(parts):
        current.append(i)
        size += part
        if size >= sub_group_size or i == len(parts) - 1:
            groups.append(current)
            current, size = [], 0
    return groups
