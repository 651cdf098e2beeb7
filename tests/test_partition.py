"""Pure ZeRO partition arithmetic, checked with case tables."""

from __future__ import annotations

import pytest

from zeroio._formats.partition import (
    Piece,
    Zero3Pieces,
    locate,
    split_pieces,
    zero3_offsets,
    zero3_partition_numel,
    zero3_plan,
    zero12_offsets,
    zero12_plan,
)


@pytest.mark.parametrize(
    "numel, world_size, expected",
    [
        pytest.param(91, 1, 91, id="ws1"),
        pytest.param(91, 2, 46, id="ws2-padded"),
        pytest.param(91, 3, 31, id="ws3-padded"),
        pytest.param(92, 4, 23, id="ws4-divisible"),
        pytest.param(5, 8, 1, id="fewer-elements-than-ranks"),
        pytest.param(0, 8, 0, id="empty"),
    ],
)
def test_zero3_partition_numel(numel, world_size, expected):
    """Each rank holds ceil(numel / world_size) elements of a ZeRO-3 parameter."""
    assert zero3_partition_numel(numel, world_size) == expected


def _rebuild(plan, numel, world_size, offsets_per_rank):
    """Execute a plan against synthetic per-rank vectors that hold (param, element) labels."""
    out = [None] * numel
    for piece in plan:
        for i in range(piece.length):
            out[piece.dest + i] = offsets_per_rank[piece.rank][piece.group][piece.start + i]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize(
    "numels, group_counts",
    [
        pytest.param([91, 35, 35, 5, 7, 7], [3, 3], id="two-groups"),
        pytest.param([10], [1], id="one-param"),
        pytest.param([3, 0, 17], [2, 1], id="empty-param"),
        pytest.param([1, 1, 1], [1, 1, 1], id="tiny-params"),
    ],
)
def test_zero3_plans_rebuild_every_parameter(world_size, numels, group_counts):
    """Rebuilding each parameter from per-rank flat groups gives its elements in order and skips padding."""
    offsets, per_rank_total = zero3_offsets(numels, world_size)
    # Lay out each rank's concatenated vector exactly as DeepSpeed does, then split it into the groups.
    rank_vectors = []
    for rank in range(world_size):
        vector = []
        for p, numel in enumerate(numels):
            part = zero3_partition_numel(numel, world_size)
            for i in range(part):
                element = rank * part + i
                vector.append((p, element) if element < numel else "pad")
        assert len(vector) == per_rank_total
        rank_vectors.append(vector)
    sizes, start = [], 0
    params_so_far = 0
    for count in group_counts:
        end = offsets[params_so_far + count] if params_so_far + count < len(numels) else per_rank_total
        sizes.append(end - start)
        start = end
        params_so_far += count
    groups = [[v[sum(sizes[:g]) : sum(sizes[: g + 1])] for g in range(len(sizes))] for v in rank_vectors]
    for p, numel in enumerate(numels):
        plan = zero3_plan(numel, offsets[p], world_size, sizes)
        assert _rebuild(plan, numel, world_size, groups) == [(p, i) for i in range(numel)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("sizes", [[400], [13, 0, 387], [1, 1, 1, 397]])
def test_zero3_pieces_made_on_demand_equal_the_plan(world_size, sizes):
    """Zero3Pieces iterates, counts, indexes and picks overlapping pieces exactly as zero3_plan's list."""
    for numel in (0, 1, 5, 63, 64, 65, 130):
        for offset in (0, 1, 12):
            part = zero3_partition_numel(numel, world_size)
            if offset + part > sum(sizes):
                continue
            plan, lazy = zero3_plan(numel, offset, world_size, sizes), Zero3Pieces(numel, offset, world_size, sizes)
            assert list(lazy) == plan and len(lazy) == len(plan) and lazy == plan
            assert lazy.runs() == [(p.rank, p.group, p.start, p.length) for p in plan]  # dest: back to back
            assert [p.dest for p in plan] == [sum(p.length for p in plan[:i]) for i in range(len(plan))]
            assert [lazy[i] for i in range(-len(plan), len(plan))] == plan + plan and list(lazy[1:3]) == plan[1:3]
            for start in range(0, numel + 1, 7):
                for end in (start, start + 1, start + 9, numel):
                    touched = [p for p in plan if p.dest < end and p.dest + p.length > start and start < end]
                    assert list(lazy.overlapping(start, end)) == touched, (numel, offset, start, end)
            with pytest.raises(IndexError):
                lazy[len(plan)]


def test_locate_crosses_group_boundaries_and_skips_empty_groups():
    """A range spanning groups maps to one run per group, skipping empty groups."""
    assert locate([4, 0, 3], 2, 4) == [(0, 2, 2), (2, 0, 2)]
    with pytest.raises(ValueError):
        locate([4], 2, 3)


@pytest.mark.parametrize(
    "numels, paddings, expected",
    [
        pytest.param([91, 35, 35], None, ([0, 91, 126], 161), id="no-padding-record"),
        pytest.param([91, 35, 35], [0, 0, 0], ([0, 91, 126], 161), id="zero-padding"),
        pytest.param([5, 7], [3, 1], ([0, 8], 16), id="alignment-padding"),
    ],
)
def test_zero12_offsets(numels, paddings, expected):
    """ZeRO-1/2 parameters sit back to back in their group, plus recorded alignment padding."""
    assert zero12_offsets(numels, paddings) == expected


def test_zero12_plan_spans_uneven_rank_partitions():
    """A parameter crossing the rank boundary reads from both ranks (DeepSpeed's last partition may be shorter)."""
    # Fixture z2_ws2_fp32, group 0: 161 elements split 82 + 79; emb.weight (91) crosses the boundary.
    assert zero12_plan(91, 0, 0, [82, 79]) == [Piece(0, 0, 0, 82, 0), Piece(1, 0, 0, 9, 82)]
    assert zero12_plan(35, 126, 0, [82, 79]) == [Piece(1, 0, 44, 35, 0)]


def test_split_pieces_bounds_every_read():
    """Splitting keeps the data and caps each read at max_elements."""
    pieces = [Piece(0, 0, 10, 7, 0), Piece(1, 0, 0, 3, 7)]
    split = split_pieces(pieces, 3)
    assert [p.length for p in split] == [3, 3, 1, 3]
    assert [(p.start, p.dest) for p in split] == [(10, 0), (13, 3), (16, 6), (0, 7)]
