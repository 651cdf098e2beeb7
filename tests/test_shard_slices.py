"""The pure slice arithmetic behind sharded loading (zeroio._load.shard_slices), checked against torch's own
placement splitting (``Shard._split_tensor`` / ``_StridedShard._split_tensor``) applied to index tensors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from zeroio._load.shard_slices import local_indices, segments, strided_runs


def _torch_local(
    shape: tuple[int, ...], mesh: tuple[int, ...], coord: tuple[int, ...], placements: list
) -> torch.Tensor:
    """The local shard torch's placements cut from ``arange(numel).view(shape)`` at mesh coordinate ``coord``."""
    t = torch.arange(int(torch.Size(shape).numel())).view(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(t, mesh[mesh_dim], with_padding=False)
        t = shards[coord[mesh_dim]]
    return t


def _ours(p: object) -> tuple[str, int, int]:
    if isinstance(p, _StridedShard):
        return ("strided", p.dim, p.split_factor)
    if isinstance(p, Shard):
        return ("shard", p.dim, 1)
    return ("replicate", 0, 1)


CASES = [
    pytest.param((13, 7), (2,), [Shard(0)], id="fsdp2-uneven"),
    pytest.param((1, 3), (2,), [Shard(0)], id="empty-last-shard"),
    pytest.param((5, 3), (4,), [Shard(0)], id="torch-chunk-leaves-a-rank-empty"),
    pytest.param((13, 7), (2,), [Shard(1)], id="colwise-block"),
    pytest.param((13, 7), (2,), [Replicate()], id="replicate"),
    pytest.param((31, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], id="fsdp2-over-tp-31-rows"),
    pytest.param((5, 7), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], id="fsdp2-over-tp-5-rows"),
    pytest.param((13, 7), (2, 2), [Shard(0), Shard(1)], id="2d-rows-and-columns"),
    pytest.param((9, 4, 3), (3, 2), [Shard(1), _StridedShard(0, split_factor=2)], id="3-d-tensor"),
    pytest.param((11, 5), (2, 3), [Shard(1), Shard(1)], id="one-dim-twice"),
]


@pytest.mark.parametrize("shape, mesh, placements", CASES)
def test_segments_read_exactly_torchs_local_shard(shape, mesh, placements) -> None:
    """For every mesh coordinate, the flat ranges concatenated are torch's local shard, element for element."""
    ours = [_ours(p) for p in placements]
    flat = torch.arange(int(torch.Size(shape).numel()))
    for coord in itertools.product(*(range(n) for n in mesh)):
        want = _torch_local(shape, mesh, coord, placements)
        held = local_indices(shape, mesh, coord, ours)
        assert tuple(len(h) for h in held) == tuple(want.shape), coord
        parts = list(segments(shape, held))
        got = torch.cat([flat[s : s + n] for s, n in parts]) if parts else flat[:0]
        assert torch.equal(got, want.reshape(-1)), (coord, parts)


def test_segments_merge_whole_rows() -> None:
    """A Shard(0) block of a 2-D tensor is one contiguous range; a Shard(1) block one range per row."""
    assert list(segments((13, 7), [range(7, 13), range(7)])) == [(49, 42)]
    assert list(segments((3, 4), [range(3), range(2, 4)])) == [(2, 2), (6, 2), (10, 2)]
    assert list(segments((), [])) == [(0, 1)]


@pytest.mark.parametrize("shape, mesh, placements", CASES)
def test_strided_runs_are_the_segments_grouped(shape, mesh, placements) -> None:
    """Expanded, the grouped runs are exactly the flat ranges (so the same local shard), rows of a column block
    grouped into one run."""
    ours = [_ours(p) for p in placements]
    for coord in itertools.product(*(range(n) for n in mesh)):
        held = local_indices(shape, mesh, coord, ours)
        grouped = list(strided_runs(shape, held))
        expanded = [(s + k * stride, n) for s, n, stride, count in grouped for k in range(count)]
        assert expanded == list(segments(shape, held)), (coord, grouped)


def test_strided_runs_group_a_column_block() -> None:
    """A Shard(1) block of a tall tensor is one run, whatever the number of rows."""
    assert list(strided_runs((100_000, 8), [range(100_000), range(4, 8)])) == [(4, 4, 8, 100_000)]
    assert list(strided_runs((3, 5, 4), [range(3), range(1, 3), range(4)])) == [(4, 8, 20, 3)]
    assert list(strided_runs((2, 3, 4), [range(2), range(3), range(1, 3)])) == [(1, 2, 4, 3), (13, 2, 4, 3)]
