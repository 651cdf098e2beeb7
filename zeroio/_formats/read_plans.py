"""Read plans: where a stored tensor's elements lie in the rank files, executed by reading only those bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from .._dtypes import FLOAT32, DType, as_dtype, to_torch
from .._io.sources import ByteRange, writable_bytes
from .._pickles import RankFile, TensorRef
from .metadata import CheckpointMetadata, TensorInfo, require
from .partition import Piece, Zero3Pieces
from .stored_bits import ref_bytes, rounds_to
from .validate import tensor_ref

if TYPE_CHECKING:
    import torch

    from .._io.read_ahead import ReadAhead

__all__ = [
    "FlatPlan",
    "GroupPlaces",
    "ReadPlan",
    "TensorPlans",
    "WholePlan",
    "ZeroContents",
    "buffer_plans",
    "casts_to",
    "plan_byte_ranges",
    "read_plan_into",
    "same_bits",
    "sample_ranges",
]


class GroupPlaces:
    """Where each rank's flat groups lie in their files, looked up once for all the parameters that share them
    (``groups[rank][group]``): a ZeRO-3 conversion's byte ranges at 1,024 ranks, a million, cost an addition each."""

    __slots__ = ("_found", "groups")

    def __init__(self, groups: tuple[tuple[TensorRef, ...], ...]) -> None:
        self.groups = groups
        self._found: dict[tuple[int, int], tuple[ByteRange, int] | None] = {}

    def byte_range(self, rank: int, group: int, start: int, length: int) -> ByteRange | None:
        """``groups[rank][group].byte_range(start, length)``."""
        key = (rank, group)
        if key not in self._found:
            ref = self.groups[rank][group]
            whole = ref.byte_range(0, ref.numel)
            self._found[key] = None if whole is None else (whole, ref.dtype_spec.itemsize)
        place = self._found[key]
        if place is None:
            return None
        (source, offset, nbytes), each = place
        if start < 0 or (start + length) * each > nbytes:
            return None
        return source, offset + start * each, length * each


@dataclass(frozen=True, slots=True)
class FlatPlan:
    """Elements gathered from the ranks' flat groups (trainable params, ZeRO-3 frozen fragments)."""

    pieces: Sequence[Piece]
    """A tuple, or a :class:`~.partition.Zero3Pieces` (ZeRO-3 trainable parameters: made when iterated)."""
    groups: tuple[tuple[TensorRef, ...], ...]  # groups[rank][group]
    places: GroupPlaces | None = None
    """The groups' places in their files, shared by the parameters of one checkpoint (ZeRO-3 trainable ones)."""


@dataclass(frozen=True, slots=True)
class WholePlan:
    """A tensor stored whole in one file (buffers, ZeRO-1/2 frozen params)."""

    ref: TensorRef


ReadPlan: TypeAlias = FlatPlan | WholePlan
"""How to read one stored tensor."""


def read_plan_into(source: FlatPlan | WholePlan, start: int, out: torch.Tensor, ahead: ReadAhead | None = None) -> None:
    """Fill ``out`` with a tensor's flattened elements ``[start, start + out.numel())``; reads only those bytes, or,
    with ``ahead``, serves the pieces of a contiguous ``out`` from its windows (a pass over many tensors)."""
    end = start + out.numel()
    if isinstance(source, WholePlan):
        source.ref.read(start, out.numel(), out)
        return
    pieces, places = source.pieces, source.places
    view = writable_bytes(out) if ahead is not None and out.is_contiguous() else None
    if view is not None and ahead is not None and start == 0 and _read_whole(source, view, ahead):
        return
    each = out.element_size()
    for piece in pieces.overlapping(start, end) if isinstance(pieces, Zero3Pieces) else pieces:
        lo = max(start, piece.dest)
        hi = min(end, piece.dest + piece.length)
        if lo >= hi:
            continue
        ref = source.groups[piece.rank][piece.group]
        at, found = piece.start + (lo - piece.dest), None
        if view is not None:  # where the piece lies in its file: an addition once the group's place is known
            found = (
                places.byte_range(piece.rank, piece.group, at, hi - lo)
                if places is not None
                else ref.byte_range(at, hi - lo)
            )
        if found is not None and view is not None and ahead is not None:
            ahead.read_into(found[0], found[1], view[(lo - start) * each : (hi - start) * each])
        else:
            ref.read(at, hi - lo, out[lo - start : hi - start])


def _read_whole(source: FlatPlan, view: memoryview, ahead: ReadAhead) -> bool:
    """All of a tensor through ``ahead``: its byte ranges back to back, as a conversion reads them (no
    :class:`Piece` made); False when they are not plain bytes or hold more than ``view`` (the first chunk)."""
    ranges = plan_byte_ranges(source)
    if ranges is None or sum(n for _, _, n in ranges) != len(view):
        return False
    at = 0
    for file, offset, nbytes in ranges:
        ahead.read_into(file, offset, view[at : at + nbytes])
        at += nbytes
    return True


def plan_byte_ranges(source: FlatPlan | WholePlan) -> list[ByteRange] | None:
    """File byte ranges whose concatenation is the planned tensor's bytes, or None when a piece is not plain bytes."""
    if isinstance(source, WholePlan):
        whole = source.ref.byte_range(0, source.ref.numel)
        return None if whole is None else [whole]
    if isinstance(source.pieces, Zero3Pieces) and source.places is not None:  # a piece per rank, back to back
        ranges = []
        for rank, group, start, length in source.pieces.runs():
            found = source.places.byte_range(rank, group, start, length)
            if found is None:
                return None
            ranges.append(found)
        return ranges
    ranges = []
    expected_dest = 0
    for piece in sorted(source.pieces, key=lambda p: p.dest):
        if piece.dest != expected_dest:
            return None
        found = source.groups[piece.rank][piece.group].byte_range(piece.start, piece.length)
        if found is None:
            return None
        ranges.append(found)
        expected_dest += piece.length
    return ranges


@dataclass(slots=True)
class TensorPlans:
    """Tensors found by one planning step: their infos and read plans, in the order found."""

    infos: dict[str, TensorInfo] = field(default_factory=dict)
    plans: dict[str, ReadPlan] = field(default_factory=dict)

    def add(self, info: TensorInfo, plan: ReadPlan) -> None:
        """Record one stored tensor."""
        self.infos[info.name] = info
        self.plans[info.name] = plan

    def update(self, other: TensorPlans) -> None:
        """Take every tensor of ``other`` (a name already here keeps its position, takes the new value)."""
        self.infos.update(other.infos)
        self.plans.update(other.plans)


@dataclass(frozen=True, slots=True)
class ZeroContents:
    """What planning a DeepSpeed checkpoint found: everything a ZeroCheckpoint serves, no tensor bytes read."""

    metadata: CheckpointMetadata
    infos: dict[str, TensorInfo]
    """Every key, in key order (tied aliases included)."""
    tied: dict[str, str]
    plans: dict[str, ReadPlan]
    """Read plans of the stored names."""
    optimizer_states: tuple[Any, ...] = ()
    """Each rank's base optimizer state (moments as TensorRefs), partitioned like the fp32 flat groups."""
    swap_files: tuple[RankFile, ...] = ()
    """Raw NVMe swap files some of the plans read (``nvme.py``), closed with the checkpoint."""


def buffer_plans(module: dict[Any, Any], buffer_names: list[str], path: Path) -> TensorPlans:
    """Buffers: whole tensors in rank 0's module. DeepSpeed's consolidation returns floating buffers as fp32."""
    found = TensorPlans()
    for name in buffer_names:
        ref = tensor_ref(require(module, name, path, "model state with this buffer"), f"buffer '{name}'", path)
        dtype = FLOAT32 if ref.dtype_spec.is_floating_point else ref.dtype_spec
        found.add(
            TensorInfo(name, ref.shape, dtype, "buffer", (path,), ref.dtype_spec if ref.dtype_spec != dtype else None),
            WholePlan(ref),
        )
    return found


# --------------------------------------------------------------------------- value matching

_SAMPLE = 2048  # elements compared at each end of a tensor; tensors up to 2 * _SAMPLE are compared whole


def sample_ranges(numel: int) -> list[tuple[int, int]]:
    """``(start, count)`` element ranges compared when matching two tensors' values."""
    if numel <= 2 * _SAMPLE:
        return [(0, numel)]
    return [(0, _SAMPLE), (numel - _SAMPLE, _SAMPLE)]


def plan_bytes(source: FlatPlan | WholePlan, start: int, count: int) -> bytes | None:
    """The stored bytes of a planned tensor's elements ``[start, start + count)`` without torch (None: use torch)."""
    if isinstance(source, WholePlan):
        return ref_bytes(source.ref, start, count)
    end, parts, covered = start + count, [], 0
    for piece in sorted(source.pieces, key=lambda p: p.dest):
        lo, hi = max(start, piece.dest), min(end, piece.dest + piece.length)
        if lo >= hi:
            continue
        if lo != start + covered:
            return None
        part = ref_bytes(source.groups[piece.rank][piece.group], piece.start + (lo - piece.dest), hi - lo)
        if part is None:
            return None
        parts.append(part)
        covered += hi - lo
    return b"".join(parts) if covered == count else None


def _casts_to_bits(master: FlatPlan | WholePlan, low: TensorRef, start: int, count: int) -> bool | None:
    high = plan_bytes(master, start, count)
    stored = ref_bytes(low, start, count)
    return None if high is None or stored is None else rounds_to(high, stored, low.dtype_spec)


def casts_to(master: FlatPlan | WholePlan, low: TensorRef, numel: int, master_dtype: DType | torch.dtype) -> bool:
    """True when the fp32 ``master`` rounds to ``low``'s stored bits (compared at both ends).

    DeepSpeed 0.19.8's 16-bit wrappers copy the fp32 master into the 16-bit parameter after every step
    (``fp16_param.data.copy_(fp32_param.data)``), so a parameter's stored value is exactly its master cast.
    Answered from raw bytes without torch when it can be (``bits.py``), with torch otherwise.
    """
    if as_dtype(master_dtype) == FLOAT32:
        answers = [_casts_to_bits(master, low, start, count) for start, count in sample_ranges(numel)]
        if all(a is not None for a in answers):
            return all(answers)
    import torch

    for start, count in sample_ranges(numel):
        hp = torch.empty(count, dtype=to_torch(master_dtype))
        read_plan_into(master, start, hp)
        lp = low.read(start, count)
        if not torch.equal(hp.to(lp.dtype).view(torch.uint8), lp.view(torch.uint8)):
            return False
    return True


def same_bits(a: TensorRef, b: TensorRef) -> bool:
    """True when two tensors of one shape and dtype hold the same bits (compared at both ends)."""
    if a.dtype_spec != b.dtype_spec or a.shape != b.shape:
        return False
    pairs = [(ref_bytes(a, start, count), ref_bytes(b, start, count)) for start, count in sample_ranges(a.numel)]
    if all(x is not None and y is not None for x, y in pairs):
        return all(x == y for x, y in pairs)
    import torch

    return all(
        torch.equal(a.read(start, count).view(torch.uint8), b.read(start, count).view(torch.uint8))
        for start, count in sample_ranges(a.numel)
    )
