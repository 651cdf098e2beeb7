"""DeepSpeed's Muon at ZeRO-1/2: each rank's ``momentum_buffer`` over the whole matrices its partition touches.

DeepSpeed 0.19.8 (``stage_1_and_2.py``, ``_muon_momentum_buffer`` / ``get_flat_partition``) gives the Muon half
of every param group (``use_muon: True``) one momentum tensor per rank, sized ``sum(p.numel() for p in
params_in_partition)``: the *whole* matrix of every parameter whose elements lie (even partly) in that rank's
fp32 partition, concatenated in flat-group order, in the gradient dtype (bf16 under bf16 training), without
padding (ZeRO-3 partitions it like the fp32 sub-groups). A matrix that straddles two partitions is held whole by both ranks (DeepSpeed all-gathers its full
gradient to both; the copies are equal). With CPU offload (``_apply_muon_updates_cpu_offload``) the buffer is
instead partitioned like the fp32 master, which the ordinary piece plan reads.

So a parameter's momentum is one run of ``numel`` elements in the buffer of the first rank holding a piece of
it, at the summed size of the parameters before it there; the partition pieces say which parameters each rank
touches and in what order (ascending start in the partition is flat-group order).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..partition import Piece
from ..read_plans import FlatPlan

__all__ = ["WholeMatrices", "uses_whole_matrices", "whole_matrices", "whole_matrix_source"]


@dataclass(frozen=True, slots=True)
class WholeMatrices:
    """Where each parameter's whole matrix sits in the per-rank whole-matrix buffers (metadata only)."""

    offsets: dict[tuple[int, int, int], int]
    """``(rank, flat group, piece start) -> element offset`` of the piece's parameter in that rank's buffer."""
    totals: dict[tuple[int, int], int]
    """``(rank, flat group) -> elements`` of the whole matrices that rank's partition touches."""


def uses_whole_matrices(param_group: object, zero_stage: int | None, offloaded: bool) -> bool:
    """True for the Muon half of a ZeRO-1/2 param group trained without offload: its buffer covers whole matrices.

    (ZeRO-3's Muon, ``stage3.py`` ``_create_momentum_buffer``, sizes it like the fp32 sub-group partition.)
    """
    muon = isinstance(param_group, dict) and param_group.get("use_muon") is True
    return muon and zero_stage in (1, 2) and not offloaded


def whole_matrices(sources: Iterable[FlatPlan]) -> WholeMatrices:
    """Lay out the whole-matrix buffers from the trainable parameters' partition pieces."""
    touching: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for source in sources:
        numel = sum(p.length for p in source.pieces)
        for piece in source.pieces:
            if piece.length:
                touching.setdefault((piece.rank, piece.group), []).append((piece.start, numel))
    offsets: dict[tuple[int, int, int], int] = {}
    totals: dict[tuple[int, int], int] = {}
    for (rank, group), params in touching.items():
        at = 0
        for start, numel in sorted(params):
            offsets[(rank, group, start)] = at
            at += numel
        totals[(rank, group)] = at
    return WholeMatrices(offsets, totals)


def whole_matrix_source(whole: WholeMatrices, source: FlatPlan, buffers: tuple[tuple[object, ...], ...]) -> FlatPlan:
    """The read plan of a parameter's whole-matrix state: one run in the first holding rank's buffer."""
    numel = sum(p.length for p in source.pieces)
    first = next((p for p in source.pieces if p.length), None)
    if first is None:
        return FlatPlan((), buffers)  # type: ignore[arg-type]  # an empty parameter reads nothing
    at = whole.offsets[(first.rank, first.group, first.start)]
    return FlatPlan((Piece(first.rank, first.group, at, numel, 0),), buffers)  # type: ignore[arg-type]
