"""ZeRO-3 read plans: trainable parameters from the fp32 flat partitions, frozen ones from per-rank fragments."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._pickles import TensorRef
from ...errors import PartitionMismatchError
from ..metadata import TensorInfo, require, require_dict
from ..partition import Piece, Zero3Pieces, zero3_offsets, zero3_partition_numel
from ..read_plans import FlatPlan, GroupPlaces, TensorPlans
from ..validate import numel_of, tensor_ref
from .flat_partitions import OptimizerPartitions

__all__ = ["zero3_frozen", "zero3_trainable"]


def zero3_frozen(
    frozen_shapes: dict[str, tuple[int, ...]], world_size: int, model_files: Sequence[Path], model_trees: Sequence[Any]
) -> TensorPlans:
    """Frozen parameters, in their training dtype: each rank's model states hold its fragment of each."""
    found = TensorPlans()
    for name, shape in frozen_shapes.items():
        numel = numel_of(shape)
        part = zero3_partition_numel(numel, world_size)
        frags: list[tuple[TensorRef]] = []
        for rank, (mpath, tree) in enumerate(zip(model_files, model_trees)):
            fragments = require_dict(tree.get(C.FROZEN_PARAM_FRAGMENTS) or {}, C.FROZEN_PARAM_FRAGMENTS, mpath)
            frag = tensor_ref(
                require(fragments, name, mpath, "ZeRO-3 model state with this frozen fragment"),
                f"frozen fragment '{name}'",
                mpath,
            )
            needed = max(0, min(part, numel - rank * part))
            if frags and frag.dtype_spec != frags[0][0].dtype_spec:
                raise PartitionMismatchError(
                    f"'{mpath}': frozen parameter '{name}' is stored as {frag.dtype_spec}, rank 0's fragment as "
                    f"{frags[0][0].dtype_spec}: the folder mixes files from different saves; copy the whole tag folder again.",
                    path=mpath,
                    name=name,
                    rank=rank,
                )
            if frag.numel < needed:
                raise PartitionMismatchError(
                    f"'{mpath}': frozen parameter '{name}' {shape} needs {needed} elements from rank {rank}, the "
                    f"file holds {frag.numel}. The rank files come from different runs or world sizes.",
                    path=mpath,
                    name=name,
                    rank=rank,
                    expected=needed,
                    found=frag.numel,
                )
            frags.append((frag,))
        pieces = tuple(
            Piece(rank, 0, 0, min(part, numel - rank * part), rank * part)
            for rank in range(world_size)
            if numel - rank * part > 0
        )
        dtype = frags[0][0].dtype_spec
        found.add(TensorInfo(name, shape, dtype, "frozen", tuple(model_files)), FlatPlan(pieces, tuple(frags)))
    return found


def zero3_trainable(
    groups: list[list[tuple[str, tuple[int, ...]]]], optim: OptimizerPartitions, model0_path: Path
) -> TensorPlans:
    """Trainable parameters: fp32 master weights, each rank's partitions back to back in ``param_shapes`` order."""
    world_size, flat_groups = optim.world_size, optim.flat_groups
    numels = [numel_of(s) for g in groups for _, s in g]
    offsets, consumed = zero3_offsets(numels, world_size)
    group_sizes = [ref.numel for ref in flat_groups[0]]
    for rank, rank_groups in enumerate(flat_groups):
        sizes = [ref.numel for ref in rank_groups]
        if sum(sizes) != consumed:
            raise PartitionMismatchError(
                f"'{optim.files[rank]}': the fp32 partitions hold {sum(sizes)} elements, the "
                f"{len(numels)} parameters recorded in '{model0_path.name}' need {consumed} per rank at "
                f"world size {world_size}. The rank files come from different runs or world sizes.",
                path=optim.files[rank],
                rank=rank,
                expected=consumed,
                found=sum(sizes),
            )
        if sizes != group_sizes:
            raise PartitionMismatchError(
                f"'{optim.files[rank]}': flat group sizes {sizes} differ from rank 0's {group_sizes}.",
                path=optim.files[rank],
                rank=rank,
                expected=group_sizes,
                found=sizes,
            )
    found = TensorPlans()
    sizes_tuple, groups_tuple = tuple(group_sizes), tuple(flat_groups)
    places = GroupPlaces(groups_tuple)
    files = tuple(optim.files)  # one tuple for all: every parameter lies in every rank's file
    names_shapes = [(n, s) for g in groups for n, s in g]
    for (name, shape), numel, offset in zip(names_shapes, numels, offsets):
        found.add(
            TensorInfo(name, shape, flat_groups[0][0].dtype_spec, "trainable", files),
            FlatPlan(Zero3Pieces(numel, offset, world_size, sizes_tuple), groups_tuple, places),
        )
    return found
