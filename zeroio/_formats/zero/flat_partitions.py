"""Every rank's ZeRO optimizer state file checked against the others: one stage, one world size, the fp32 flat
partitions each rank holds (moved out of ``validate.py``, which checks raw values for every family)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._pickles import TensorRef
from ...errors import CheckpointFormatError, UnsupportedCheckpointError, WorldSizeMismatchError
from ..metadata import require, require_dict
from ..validate import config_stage, partition_count, ref_list
from .file_layout import ZeroLayout

__all__ = ["OptimizerPartitions", "optimizer_partitions"]


@dataclass(frozen=True, slots=True)
class OptimizerPartitions:
    """Every rank's optimizer state file, checked: one ZeRO stage, one world size, the fp32 flat partitions."""

    stage: int
    files: tuple[Path, ...]
    flat_groups: list[tuple[TensorRef, ...]]
    """``flat_groups[rank][group]``: the fp32 master partitions (as references)."""
    base_states: list[Any]
    """Each rank's base optimizer state (Adam moments), partitioned like ``flat_groups``."""
    first_state: dict[Any, Any]
    """Rank 0's ``optimizer_state_dict`` (paddings, partition counts)."""
    slice_mappings: list[Any]
    """Each rank's ``param_slice_mappings`` (ZeRO-1/2: which slice of each group it holds), None where absent."""

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the checkpoint was partitioned for."""
        return len(self.files)


def optimizer_partitions(
    layout: ZeroLayout, trees: Sequence[Any], ds_config: Any, tag_dir: Path
) -> OptimizerPartitions:
    """Check every rank's optimizer state (``trees``, in rank order) against the others and the model files."""
    stages, flat_groups, base_states, slice_mappings = [], [], [], []
    for rank, (opath, tree) in enumerate(zip(layout.optim_files, trees)):
        osd = require_dict(require(tree, C.OPTIMIZER_STATE_DICT, opath), C.OPTIMIZER_STATE_DICT, opath)
        if C.ZERO_STAGE not in osd and C.SINGLE_PARTITION_OF_FP32_GROUPS in osd:
            # DeepSpeed's BF16_Optimizer (ZeRO-1 + bf16 + fp32 gradient accumulation; up to 0.16 also bf16 at ZeRO
            # stage 0) records no stage and partitions exactly like ZeRO-1, whatever stage the config names (0 or
            # 1); zero_to_fp32 0.19.8 rejects these files ("is not a zero checkpoint").
            osd = {**osd, C.ZERO_STAGE: config_stage(ds_config, default=1) or 1}
        stage = int(require(osd, C.ZERO_STAGE, opath, "DeepSpeed ZeRO optimizer state"))
        count = partition_count(osd, opath)
        if count != len(layout.optim_files):
            raise WorldSizeMismatchError(
                f"Expected {count} optimizer shards matching '*_optim_states.pt' in '{tag_dir}' "
                f"(partition_count={count} in {opath.name}), found {len(layout.optim_files)}. A rank may have failed "
                "to save, or an older checkpoint was partly overwritten.",
                path=opath,
                rank=rank,
                expected=count,
                found=len(layout.optim_files),
            )
        key = C.FP32_FLAT_GROUPS if stage == 3 else C.SINGLE_PARTITION_OF_FP32_GROUPS
        if stage not in (1, 2, 3):
            raise UnsupportedCheckpointError(
                f"'{opath}' records ZeRO stage {stage}; zeroio reads stages 1, 2 and 3.", path=opath, found=stage
            )
        stages.append(stage)
        flat_groups.append(ref_list(require(osd, key, opath, f"ZeRO-{stage} optimizer state"), key, opath))
        base_states.append(osd.get(C.OPTIMIZER_STATE_DICT if stage == 3 else C.BASE_OPTIMIZER_STATE))
        slice_mappings.append(osd.get(C.PARAM_SLICE_MAPPINGS))
    stage = stages[0]
    if any(s != stage for s in stages):
        raise CheckpointFormatError(
            f"Rank files in '{tag_dir}' disagree on the ZeRO stage ({sorted(set(stages))}); the folder mixes "
            "checkpoints. Copy the whole tag folder again.",
            path=tag_dir,
        )
    if (stage == 3) != layout.partitioned_model_files:
        raise CheckpointFormatError(
            f"'{tag_dir}' has ZeRO-{stage} optimizer files but "
            f"{'per-rank' if layout.partitioned_model_files else 'a single'} model states file(s); the folder mixes "
            "checkpoints.",
            path=tag_dir,
        )
    _check_dtypes(flat_groups, layout.optim_files, stage)
    first_state = trees[0][C.OPTIMIZER_STATE_DICT]
    return OptimizerPartitions(stage, tuple(layout.optim_files), flat_groups, base_states, first_state, slice_mappings)


def _check_dtypes(flat_groups: list[tuple[TensorRef, ...]], files: Sequence[Path], stage: int) -> None:
    """Every rank's flat groups in rank 0's dtypes (at ZeRO-3 one dtype for all: a parameter may span two groups).
    A piece is read at the first file's element size, so a rank file from a run of another dtype read wrong bytes."""
    for rank, groups in enumerate(flat_groups):
        for g, ref in enumerate(groups):
            reference = flat_groups[0][0 if stage == 3 else min(g, len(flat_groups[0]) - 1)]
            if ref.dtype_spec != reference.dtype_spec:
                raise CheckpointFormatError(
                    f"'{files[rank]}': flat group {g} is stored as {ref.dtype_spec}, rank 0's as "
                    f"{reference.dtype_spec}: the folder mixes files from different saves; copy the whole tag folder "
                    "again.",
                    path=files[rank],
                    rank=rank,
                )
