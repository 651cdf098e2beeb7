"""The target layout of a reshard: what the source holds and how its parameters fall into the new ranks' groups.

Metadata only: nothing here reads tensor bytes or writes files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import _constants as C
from .._formats import PartitionedCheckpoint, require, require_dict, zero3_partition_numel, zero3_sub_groups
from ..errors import PartitionMismatchError, UnsupportedCheckpointError

if TYPE_CHECKING:
    from .._formats import FlatPlan, OptimizerLayout, WholePlan

__all__ = ["DEFAULT_SUB_GROUP_SIZE", "RankRead", "ReshardPlan", "SubGroup", "plan_reshard", "rank_reads"]

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed 0.19.8's ``zero_optimization.sub_group_size`` default."""

RankRead = tuple[Any, int, int, int]
"""``(read plan, start, count, padding)``: ``count`` elements of a consolidated tensor from ``start``, then zeros."""


@dataclass(frozen=True, slots=True)
class SubGroup:
    """One fp32 flat group of the target: a run of one param group's parameters."""

    param_group: int
    """The param group it belongs to."""
    names: tuple[str, ...]
    """Its parameters, in flat order."""
    numels: tuple[int, ...]
    """Each parameter's element count."""
    step_group: int
    """The source flat group whose state entry gives this sub-group's ``step``."""


@dataclass(frozen=True)
class ReshardPlan:
    """Everything the rank files of the target are built from: rank 0's parsed source files and the new groups."""

    ckpt: PartitionedCheckpoint
    """The open source checkpoint (read plans, tensor infos)."""
    layout: OptimizerLayout
    """Where the source's optimizer state lies."""
    world_size: int
    """Data-parallel ranks of the target."""
    tag: str
    """The output tag folder."""
    model0: dict[str, Any]
    """Rank 0's model states, as parsed at open (tensors as references)."""
    model0_path: Path
    optim0: dict[str, Any]
    """Rank 0's optimizer states, as parsed at open."""
    optim0_path: Path
    subs: tuple[SubGroup, ...]
    """The target's fp32 flat groups, in order."""
    flat_dtype: torch.dtype
    """Element type of the fp32 flat groups (the masters' stored type)."""

    @property
    def prefix(self) -> str:
        """``"bf16_"`` when the source's optimizer files carry it (DeepSpeed's BF16 optimizer), else ``""``."""
        return "bf16_" if self.optim0_path.name.startswith("bf16_") else ""

    def file_names(self, rank: int) -> tuple[str, str]:
        """Rank ``rank``'s model-states and optimizer-states file names."""
        return (
            f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
            f"{self.prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )


def _config_int(ds_config: Any, key: str) -> int | None:
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    value = zero.get(key) if isinstance(zero, dict) else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _param_groups(layout: OptimizerLayout, param_shapes: list[dict[str, Any]], model0_path: Path) -> list[list[str]]:
    """Parameter names of each param group, in the flat order (``param_shapes`` holds one dict per sub-group)."""
    if len(param_shapes) != len(layout.param_group):
        raise PartitionMismatchError(
            f"'{model0_path}' records {len(param_shapes)} parameter groups in '{C.PARAM_SHAPES}', the optimizer "
            f"files {len(layout.param_group)} fp32 flat groups. The rank files come from different runs.",
            path=model0_path,
            expected=len(layout.param_group),
            found=len(param_shapes),
        )
    groups: list[list[str]] = [[] for _ in layout.param_groups]
    for j, shapes in enumerate(param_shapes):
        groups[layout.param_group[j]].extend(str(n) for n in shapes)
    return groups


def _sub_groups(
    ckpt: PartitionedCheckpoint, groups: list[list[str]], world_size: int, sub_group_size: int
) -> list[SubGroup]:
    subs = []
    for g, names in enumerate(groups):
        numels = [ckpt.info(n).numel for n in names]
        for members in zero3_sub_groups(numels, world_size, sub_group_size):
            chosen = tuple(names[i] for i in members)
            first = ckpt.read_plan(chosen[0]) if chosen else None
            pieces = getattr(first, "pieces", None)
            step_group = pieces[0].group if pieces else -1
            subs.append(SubGroup(g, chosen, tuple(numels[i] for i in members), step_group))
    return subs


def rank_reads(
    sources: Sequence[FlatPlan | WholePlan], numels: Sequence[int], world_size: int, rank: int
) -> list[RankRead]:
    """Rank ``rank``'s ZeRO-3 partition of each parameter: elements ``[rank*p, rank*p + count)`` plus padding."""
    reads: list[RankRead] = []
    for source, numel in zip(sources, numels):
        part = zero3_partition_numel(numel, world_size)
        count = max(0, min(part, numel - rank * part))
        reads.append((source, rank * part, count, part - count))
    return reads


def plan_reshard(
    ckpt: PartitionedCheckpoint,
    layout: OptimizerLayout,
    *,
    world_size: int,
    output_tag: str | None,
    sub_group_size: int | None,
) -> ReshardPlan:
    """Check what the source holds and lay out the target's sub-groups (metadata only).

    Raises:
        UnsupportedCheckpointError: MiCS/AutoEP partitioning or NVMe-offloaded optimizer state.
        PartitionMismatchError: the model and optimizer files disagree on the parameter groups.
        ValueError: ``output_tag`` is not a folder name.
    """
    meta = ckpt.metadata
    model0_path = meta.path / meta.extra["model_files"][0]
    optim0_path = layout.files[0]
    model0 = ckpt.file_tree(model0_path)  # rank 0's files are always parsed at open
    optim0 = ckpt.file_tree(optim0_path)
    require_dict(require(model0, C.MODULE, model0_path), C.MODULE, model0_path)
    ds_config = model0.get(C.DS_CONFIG)
    osd0 = require_dict(require(optim0, C.OPTIMIZER_STATE_DICT, optim0_path), C.OPTIMIZER_STATE_DICT, optim0_path)
    require_dict(require(osd0, C.OPTIMIZER_STATE_DICT, optim0_path), C.OPTIMIZER_STATE_DICT, optim0_path)
    if (_config_int(ds_config, "mics_shard_size") or 0) > 0 or "ds_zero_partition_groups" in osd0:
        raise UnsupportedCheckpointError(
            f"'{meta.path}' partitions parameters over sub-groups of ranks (MiCS or AutoEP); zeroio reshards plain "
            "ZeRO-3 checkpoints only.",
            path=meta.path,
        )
    if (meta.path / "offloaded_tensors").exists():
        raise UnsupportedCheckpointError(
            f"'{meta.path}' keeps optimizer state in 'offloaded_tensors/' (NVMe offload), which zeroio does not "
            "reshard yet.",
            path=meta.path,
        )
    if sub_group_size is None:
        sub_group_size = _config_int(ds_config, "sub_group_size")
        sub_group_size = DEFAULT_SUB_GROUP_SIZE if sub_group_size is None else sub_group_size
    tag = output_tag or meta.tag or f"global_step{meta.global_step or 0}"
    if os.sep in tag or tag in ("", ".", ".."):
        raise ValueError(f"output_tag must be a folder name, got {tag!r}.")

    param_shapes = require(model0, C.PARAM_SHAPES, model0_path)
    groups = _param_groups(layout, list(param_shapes), model0_path)
    subs = tuple(_sub_groups(ckpt, groups, world_size, sub_group_size))
    names = [n for s in subs for n in s.names]
    flat_dtype = ckpt.info(names[0]).dtype if names else torch.float32
    return ReshardPlan(ckpt, layout, world_size, tag, model0, model0_path, optim0, optim0_path, subs, flat_dtype)
