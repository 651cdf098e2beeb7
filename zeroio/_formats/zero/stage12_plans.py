"""ZeRO-1/2 read plans: trainable parameters from each param group's fp32 partitions, frozen ones stored whole."""

from __future__ import annotations

import math
from pathlib import Path

from ... import _constants as C
from ..._pickles import TensorRef
from ...errors import PartitionMismatchError, UnsupportedCheckpointError
from ..metadata import TensorInfo, require_dict
from ..partition import Piece, round_robin_original, zero12_offsets, zero12_plan
from ..read_plans import FlatPlan, TensorPlans, WholePlan
from ..validate import ModelStates, ParamShapes, numel_of, tensor_ref
from .flat_partitions import OptimizerPartitions
from .moe import Experts, Placement, PlannedParam, expert_group_layouts, is_expert_param, plan_matches_experts
from .provenance import check_slice_mappings

__all__ = ["plan_zero12_group", "zero12_frozen", "zero12_trainable"]


def zero12_frozen(states: ModelStates, shapes: ParamShapes, experts: Experts | None) -> TensorPlans:
    """Frozen parameters, in their training dtype: stored whole in rank 0's model states."""
    model0_path, module = states.path, states.module
    fragments = require_dict(states.tree.get(C.FROZEN_PARAM_FRAGMENTS) or {}, C.FROZEN_PARAM_FRAGMENTS, model0_path)
    frozen_names = list(shapes.frozen)
    if not frozen_names:
        # Older DeepSpeed (or ZeRO-1) may not record frozen shapes: frozen = module params not optimized.
        skip = set(states.buffer_names) | set(shapes.trainable) | set(shapes.shared)
        frozen_names = [n for n in module if n not in skip]
    if experts is not None:
        # MoE: rank 0 records its own experts under local ids; every expert is in the expert files.
        frozen_names = [n for n in frozen_names if not is_expert_param(n)]
    found = TensorPlans()
    for name in frozen_names:
        value = fragments.get(name, module.get(name))
        ref = tensor_ref(value, f"frozen parameter '{name}'", model0_path)
        shape = shapes.frozen.get(name, ref.shape)
        if numel_of(shape) != ref.numel:
            raise PartitionMismatchError(
                f"'{model0_path}': frozen parameter '{name}' should have shape {shape}, the stored tensor has "
                f"{ref.numel} elements.",
                path=model0_path,
                name=name,
                expected=shape,
                found=ref.shape,
            )
        found.add(TensorInfo(name, tuple(shape), ref.dtype_spec, "frozen", (model0_path,)), WholePlan(ref))
    return found


def zero12_trainable(
    groups: list[list[tuple[str, tuple[int, ...]]]],
    optim: OptimizerPartitions,
    experts: Experts | None,
    model0_path: Path,
    tag_dir: Path,
    *,
    round_robin: bool = False,
) -> TensorPlans:
    """Trainable parameters: fp32 master weights, each param group partitioned over the ranks on its own.

    ``round_robin``: the run set ``zero_optimization.round_robin_gradients`` (see :func:`_check_rank_slices`).
    """
    flat_groups, world_size, optim_files = optim.flat_groups, optim.world_size, optim.files
    paddings = optim.first_state.get(C.PARAM_ALIGNMENT_PADDINGS)
    if len(flat_groups[0]) != len(groups):
        raise PartitionMismatchError(
            f"'{optim_files[0]}' holds {len(flat_groups[0])} fp32 groups, '{model0_path.name}' records "
            f"{len(groups)} param groups.",
            path=optim_files[0],
            expected=len(groups),
            found=len(flat_groups[0]),
        )
    counts = optim.first_state.get(C.PARTITION_COUNT)
    for rank, rank_groups in enumerate(flat_groups):
        if len(rank_groups) != len(groups):
            raise PartitionMismatchError(
                f"'{optim_files[rank]}' holds {len(rank_groups)} fp32 groups, rank 0 holds {len(groups)}.",
                path=optim_files[rank],
                rank=rank,
            )
    found = TensorPlans()
    for g, group in enumerate(groups):
        numels = [numel_of(s) for _, s in group]
        group_padding = None if paddings is None else [int(p) for p in paddings[g]]
        try:
            offsets, consumed = zero12_offsets(numels, group_padding)
        except ValueError as exc:
            raise PartitionMismatchError(f"'{optim_files[0]}': {exc}.", path=optim_files[0]) from None
        count = counts[g] if isinstance(counts, (list, tuple)) and g < len(counts) else world_size
        count = count if isinstance(count, int) else world_size
        if count == world_size:
            # Without alignment padding, DeepSpeed records round-robin groups' slices in the original order.
            # BF16_Optimizer (no zero_stage recorded) ignores round_robin_gradients: its groups keep their order.
            reordered = round_robin and C.ZERO_STAGE in optim.first_state
            unpadded_round_robin = reordered and not any(group_padding or ())
            _check_rank_slices(g, group, numels, offsets, optim, unpadded_round_robin)
            layouts = [[(list(range(world_size)), [name for name, _ in group])]]
        else:
            # MoE expert group: partitioned over an expert-data-parallel group of `count` ranks, one copy
            # per expert-parallel rank; rank 0's param_shapes name its own experts by local id.
            layouts = expert_group_layouts(g, group, count, world_size, experts, tag_dir)
        placed = _place_group(g, group, numels, offsets, consumed, layouts, flat_groups, experts, tag_dir)
        for name, shape, plan in placed:
            files_used = tuple(sorted({optim_files[p.rank] for p in plan})) or (optim_files[0],)
            found.add(
                TensorInfo(name, shape, flat_groups[0][g].dtype_spec, "trainable", files_used),
                FlatPlan(tuple(plan), tuple(flat_groups)),
            )
    return found


def _check_rank_slices(
    g: int,
    group: list[tuple[str, tuple[int, ...]]],
    numels: list[int],
    offsets: list[int],
    optim: OptimizerPartitions,
    round_robin: bool = False,
) -> None:
    """Each rank's recorded slice of param group ``g`` must be its own (files swapped or duplicated show here).

    ``round_robin``: the group was flattened in DeepSpeed's round-robin order (``round_robin_gradients``: what
    ``param_shapes`` lists and the flat partitions hold) with no alignment padding. DeepSpeed 0.19.8 then records
    ``param_slice_mappings`` (and its own ``safe_get_full_fp32_param``) as if the group were flattened in its
    original order, so the check compares the record with those slices.
    """
    if optim.world_size < 2:
        return
    partition_size = max(groups[g].numel for groups in optim.flat_groups)
    names = [name for name, _ in group]
    if round_robin:
        position = {index: pos for pos, index in enumerate(round_robin_original(len(names), optim.world_size))}
        names = [names[position[i]] for i in range(len(names))]
        numels = [numels[position[i]] for i in range(len(numels))]
        offsets, _ = zero12_offsets(numels)
    for rank, mappings in enumerate(optim.slice_mappings):
        if isinstance(mappings, (list, tuple)) and g < len(mappings):
            check_slice_mappings(optim.files[rank], rank, g, names, offsets, numels, partition_size, mappings[g])


def _place_group(
    g: int,
    group: list[tuple[str, tuple[int, ...]]],
    numels: list[int],
    offsets: list[int],
    consumed: int,
    layouts: list[Placement],
    flat_groups: list[tuple[TensorRef, ...]],
    experts: Experts | None,
    tag_dir: Path,
) -> list[PlannedParam]:
    """The plans of one param group under the one candidate placement, or the one whose values match the experts."""
    placed = None
    if len(layouts) == 1:
        placed = plan_zero12_group(g, group, numels, offsets, consumed, layouts[0], flat_groups, tag_dir)
    for candidate in layouts if placed is None else []:
        try:
            planned = plan_zero12_group(g, group, numels, offsets, consumed, candidate, flat_groups, tag_dir)
        except PartitionMismatchError:  # this rank order does not even fit the partition sizes
            continue
        if plan_matches_experts(planned, flat_groups, experts):
            placed = planned
            break
    if placed is None:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}': the fp32 partitions of MoE param group {g} match the expert files under neither "
            "of DeepSpeed's expert/data-parallel rank orders; zeroio cannot place them. Use DeepSpeed's "
            "ds_to_universal.py for this one.",
            path=tag_dir,
        )
    return placed


def plan_zero12_group(
    g: int,
    group: list[tuple[str, tuple[int, ...]]],
    numels: list[int],
    offsets: list[int],
    consumed: int,
    placement: Placement,
    flat_groups: list[tuple[TensorRef, ...]],
    tag_dir: Path,
) -> list[PlannedParam]:
    """Read plans of one ZeRO-1/2 param group's parameters, for each copy of the group in ``placement``."""
    planned = []
    for ranks, names in placement:
        partition_sizes = [flat_groups[r][g].numel for r in ranks]
        available = sum(partition_sizes)
        # DeepSpeed pads each group to a multiple of 2*world_size; consumed and available may differ by that.
        align = 2 * len(ranks)
        if consumed > available or math.ceil(consumed / align) != math.ceil(available / align):
            raise PartitionMismatchError(
                f"Param group {g}: its {len(numels)} parameters need {consumed} elements, the {len(ranks)} "
                f"ranks' fp32 partitions hold {available} in '{tag_dir}'. The rank files come from different "
                "runs or world sizes.",
                path=tag_dir,
                expected=consumed,
                found=available,
            )
        for name, (_, shape), numel, offset in zip(names, group, numels, offsets):
            pieces = [
                Piece(ranks[p.rank], p.group, p.start, p.length, p.dest)
                for p in zero12_plan(numel, offset, g, partition_sizes)
            ]
            planned.append((name, shape, pieces))
    return planned
