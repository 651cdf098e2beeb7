"""Pure index arithmetic for sharded tensors: which global elements a rank's local shard holds (no torch IO).

A placement is described here by plain values so the arithmetic needs no ``torch.distributed``: ``("shard", dim,
1)`` for DTensor ``Shard(dim)``, ``("strided", dim, split_factor)`` for ``_StridedShard`` (what FSDP2 over tensor
parallel creates) and ``("replicate", 0, 1)``. Semantics follow torch 2.13's ``Shard._split_tensor`` and
``_StridedShard._split_tensor``: ``torch.chunk`` sizes (ceil division, trailing shards smaller or empty), applied
left to right over the mesh dimensions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import prod

__all__ = ["Placement", "Segment", "Strided", "local_indices", "runs", "segments", "strided_runs"]

Placement = tuple[str, int, int]
"""``(kind, tensor dim, split factor)``, kind one of ``"shard"``, ``"strided"``, ``"replicate"``."""

Segment = tuple[int, int]
"""``(start, length)``: a contiguous range of a tensor's flattened (row-major) elements."""

Strided = tuple[int, int, int, int]
"""``(start, length, stride, count)``: ``count`` ranges of ``length`` elements, the k-th at ``start + k * stride``
(a column block: one range per row, rows ``stride`` apart)."""


def _chunk(indices: list[int], pieces: int, which: int) -> list[int]:
    """``torch.chunk(x, pieces)[which]`` for a 1-D ``x`` (an empty list where chunk returns fewer pieces)."""
    size = -(-len(indices) // pieces) if indices else 0
    start = min(which * size, len(indices))
    return indices[start : start + size]


def local_indices(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement]
) -> list[list[int]]:
    """For each tensor dim, the global indices (in local order) that the rank at ``coordinate`` holds."""
    held = [list(range(n)) for n in shape]
    for mesh_dim, (kind, dim, split) in enumerate(placements):
        n, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if kind == "shard":
            held[dim] = _chunk(held[dim], n, c)
        elif kind == "strided":
            # First split into split_factor pieces (the virtual inner sharding), then take chunk c of each piece.
            held[dim] = [i for j in range(split) for i in _chunk(_chunk(held[dim], split, j), n, c)]
        elif kind != "replicate":
            raise ValueError(f"unknown placement kind {kind!r}")
    return held


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first, stop), ...]``: ``indices`` cut into runs of consecutive integers, in their order."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _last_partial(shape: tuple[int, ...], held: Sequence[Sequence[int]]) -> int:
    """The last dim whose selection is not the whole dim (every dim after it is read whole); -1 if none."""
    last = -1
    for d, (n, h) in enumerate(zip(shape, held, strict=True)):
        if list(h) != list(range(n)):
            last = d
    return last


def segments(shape: Sequence[int], held: Sequence[Sequence[int]]) -> Iterator[Segment]:
    """The flat ranges of a row-major tensor of ``shape`` holding the selection ``held`` (per-dim indices), in the
    row-major order of the selection: concatenated, they are the local shard's flattened elements."""
    shape = tuple(shape)
    if not shape:
        yield (0, 1)
        return
    if any(len(h) == 0 for h in held):
        return
    last = _last_partial(shape, held)
    if last < 0:
        yield (0, prod(shape))
        return
    inner = prod(shape[last + 1 :])
    strides = [prod(shape[d + 1 :]) for d in range(len(shape))]
    outer = [list(held[d]) for d in range(last)]
    last_runs = runs(held[last])

    def walk(d: int, base: int) -> Iterator[Segment]:
        if d == last:
            for first, stop in last_runs:
                yield (base + first * inner, (stop - first) * inner)
            return
        for i in outer[d]:
            yield from walk(d + 1, base + i * strides[d])

    pending: Segment | None = None
    for seg in walk(0, 0):  # merge touching ranges (e.g. whole rows of a Shard(0) block)
        if pending is not None and pending[0] + pending[1] == seg[0]:
            pending = (pending[0], pending[1] + seg[1])
            continue
        if pending is not None:
            yield pending
        pending = seg
    if pending is not None:
        yield pending


def strided_runs(shape: Sequence[int], held: Sequence[Sequence[int]]) -> Iterator[Strided]:
    """:func:`segments` with the one range per row of a column block grouped (consecutive rows, one range each):
    expanded in order they are the same ranges, but a tall column block is a handful of values, not one per row."""
    shape = tuple(shape)
    last = _last_partial(shape, held) if shape and all(held) else -1
    last_runs = runs(held[last]) if last > 0 else []
    if len(last_runs) != 1:  # rows (or several ranges per row) that do not group: the plain ranges
        for start, length in segments(shape, held):
            yield (start, length, length, 1)
        return
    inner = prod(shape[last + 1 :])
    strides = [prod(shape[d + 1 :]) for d in range(len(shape))]
    first, stop = last_runs[0]
    row = last - 1

    def walk(d: int, base: int) -> Iterator[Strided]:
        if d == row:
            for a, b in runs(held[row]):
                yield (base + a * strides[row] + first * inner, (stop - first) * inner, strides[row], b - a)
            return
        for i in held[d]:
            yield from walk(d + 1, base + i * strides[d])

    yield from walk(0, 0)
