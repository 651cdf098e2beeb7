"""ZeRO-3 + AutoEP read plans: each sub-group partitioned over its own ranks, experts rebuilt as logical ``[E, ...]``.

DeepSpeed 0.19.8 AutoEP at ZeRO-3 writes plain ZeRO-3 rank files, but a sub-group is not always partitioned over
every rank: each rank's optimizer state records, per sub-group, ``ds_zero_partition_groups[g] = {partition_count,
partition_rank, partition_ranks, families}``. Dense sub-groups (family ``replicated``) span the data-parallel
ranks; expert sub-groups (family ``autoep_expert``) span only the ranks sharing one EP rank's experts, whose
``param_shapes`` hold the LOCAL stack ``[E_local, ...]`` under one name on every EP rank. The logical tensor puts
each EP rank's experts at the global ids its placement lists (``ds_to_universal`` writes the same tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import _constants as C
from ...errors import CheckpointFormatError, PartitionMismatchError, UnsupportedCheckpointError
from ..metadata import TensorInfo, require, require_dict
from ..partition import Piece, zero3_partition_numel
from ..read_plans import FlatPlan, TensorPlans
from ..validate import numel_of, shape_of
from .autoep_layers import AUTOEP_LAYERS, AutoEPLayer, autoep_layers
from .flat_partitions import OptimizerPartitions

__all__ = ["AUTOEP_LAYERS", "AutoEP", "autoep_trainable", "is_autoep"]

_PARTITION_GROUPS = "ds_zero_partition_groups"


def is_autoep(model0: dict[Any, Any]) -> bool:
    """True when rank 0's model states record AutoEP MoE layers."""
    return bool(model0.get(AUTOEP_LAYERS))


@dataclass(frozen=True, slots=True)
class _Fragment:
    """One rank's ZeRO-3 partition of one (local) parameter: ``flat_groups[rank][group][offset:]``."""

    rank: int
    group: int
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AutoEP:
    """What the AutoEP records say, for metadata and key order."""

    layers: dict[str, AutoEPLayer]

    @property
    def ep_size(self) -> int:
        return max(layer.ep_size for layer in self.layers.values())

    @property
    def edp_size(self) -> int:
        return max(layer.edp_size for layer in self.layers.values())

    def describe(self) -> list[dict[str, Any]]:
        """JSON-friendly placement summary (``metadata.extra["autoep_layers"]``)."""
        return [
            {
                "expert_key_prefix": layer.prefix,
                "module_path": layer.module_path,
                "num_experts": layer.num_experts,
                "ep_size": layer.ep_size,
                "expert_data_parallel_size": layer.edp_size,
                "placement": [list(experts) for experts in layer.placement],
            }
            for layer in self.layers.values()
        ]

    def order(self, names: list[str]) -> list[str]:
        """Put each layer's expert tensors after the last other key of its module (``model.state_dict()`` order)."""
        experts = {
            prefix: [n for n in names if n.rpartition(".")[0] == prefix]
            for prefix in self.layers  # always a prefix of its expert names
        }
        placed = {n for block in experts.values() for n in block}
        rest = [n for n in names if n not in placed]
        for prefix, block in experts.items():
            module = self.layers[prefix].module_path + "."
            anchor = [i for i, n in enumerate(rest) if n.startswith(module)]
            at = anchor[-1] + 1 if anchor else len(rest)
            rest[at:at] = block
        return rest


def _partition_groups(optim_tree: Any, path: Path, count: int) -> list[dict[Any, Any]]:
    osd = require_dict(require(optim_tree, C.OPTIMIZER_STATE_DICT, path), C.OPTIMIZER_STATE_DICT, path)
    raw = osd.get(_PARTITION_GROUPS)
    if not isinstance(raw, list) or len(raw) != count or not all(isinstance(g, dict) for g in raw):
        raise CheckpointFormatError(
            f"'{path}': an AutoEP ZeRO-3 optimizer file should record '{_PARTITION_GROUPS}' for each of its {count} "
            f"sub-groups, found {type(raw).__name__}. The file is corrupted or from another run.",
            path=path,
            expected=count,
        )
    return raw


def _fragments(
    model_files: Sequence[Path],
    model_trees: Sequence[Any],
    optim: OptimizerPartitions,
    optim_trees: Sequence[Any],
    layers: dict[str, AutoEPLayer],
    positions: list[dict[str, tuple[int, int]]],
) -> tuple[dict[tuple[str, Any], dict[int, _Fragment]], dict[str, int]]:
    """Every rank's partition of every parameter, keyed by (name, copy) then partition rank; and partition counts.

    A copy is one full local tensor: the dense tensor (keyed by its partition ranks) or one EP rank's stack.
    """
    found: dict[tuple[str, Any], dict[int, _Fragment]] = {}
    counts: dict[str, int] = {}
    for rank, (mpath, tree) in enumerate(zip(model_files, model_trees)):
        opath = optim.files[rank]
        raw_shapes = require(tree, C.PARAM_SHAPES, mpath)
        flat = optim.flat_groups[rank]
        if not isinstance(raw_shapes, list) or len(raw_shapes) != len(flat):
            raise PartitionMismatchError(
                f"'{mpath}' records {len(raw_shapes) if isinstance(raw_shapes, list) else 0} parameter sub-groups, "
                f"'{opath.name}' holds {len(flat)} fp32 flat groups. The rank files come from different runs.",
                path=mpath,
                rank=rank,
                expected=len(flat),
            )
        for g, (group, meta) in enumerate(zip(raw_shapes, _partition_groups(optim_trees[rank], opath, len(flat)))):
            count, prank, pranks = meta.get("partition_count"), meta.get("partition_rank"), meta.get("partition_ranks")
            if not (isinstance(count, int) and isinstance(prank, int) and isinstance(pranks, list)) or not (
                0 <= prank < count == len(pranks) and pranks[prank] == rank
            ):
                raise CheckpointFormatError(
                    f"'{opath}': {_PARTITION_GROUPS}[{g}] = partition {prank!r} of {count!r} over ranks {pranks!r} "
                    f"does not include this file's rank {rank}. The file is corrupted or renamed.",
                    path=opath,
                    rank=rank,
                )
            expert_group = "autoep_expert" in (meta.get("families") or ())
            offset = 0
            for name, value in require_dict(group, f"{C.PARAM_SHAPES}[{g}]", mpath).items():
                name = str(name)
                shape = shape_of(value, name, mpath)
                prefix = name.rpartition(".")[0]
                if expert_group != (prefix in layers):
                    raise UnsupportedCheckpointError(
                        f"'{opath}': '{name}' sits in a {'n expert' if expert_group else ' dense'} sub-group but "
                        f"{'is not' if expert_group else 'is'} a parameter of an AutoEP layer "
                        f"{sorted(layers)}; zeroio cannot place it.",
                        path=opath,
                        name=name,
                    )
                copy = positions[rank][prefix][0] if expert_group else tuple(pranks)
                if counts.setdefault(name, count) != count:
                    raise PartitionMismatchError(
                        f"'{opath}': '{name}' is partitioned over {count} ranks here and {counts[name]} elsewhere.",
                        path=opath,
                        name=name,
                        expected=counts[name],
                        found=count,
                    )
                found.setdefault((name, copy), {})[prank] = _Fragment(rank, g, offset, shape)
                offset += zero3_partition_numel(numel_of(shape), count)
            if flat[g].numel != offset:
                raise PartitionMismatchError(
                    f"'{opath}': fp32 flat group {g} holds {flat[g].numel} elements, its parameters recorded in "
                    f"'{mpath.name}' need {offset} at partition count {count}. The rank files come from different "
                    "runs.",
                    path=opath,
                    rank=rank,
                    expected=offset,
                    found=flat[g].numel,
                )
    return found, counts


def _local_pieces(
    name: str, parts: dict[int, _Fragment], count: int, tag_dir: Path
) -> tuple[tuple[int, ...], list[Piece]]:
    """One copy's pieces in its local flat order, checking every partition rank is there with one shape."""
    shapes = {f.shape for f in parts.values()}
    if sorted(parts) != list(range(count)) or len(shapes) != 1:
        raise PartitionMismatchError(
            f"'{tag_dir}': '{name}' should be partitioned over {count} ranks, found partitions {sorted(parts)} with "
            f"shapes {sorted(shapes)}. A rank file is missing or from another run.",
            path=tag_dir,
            name=name,
            expected=count,
            found=len(parts),
        )
    shape = shapes.pop()
    numel = numel_of(shape)
    part = zero3_partition_numel(numel, count)
    pieces = [
        Piece(f.rank, f.group, f.offset, min(part, numel - k * part), k * part)
        for k, f in sorted(parts.items())
        if numel - k * part > 0
    ]
    return shape, pieces


def _expert_plan(
    name: str, layer: AutoEPLayer, copies: dict[Any, dict[int, _Fragment]], count: int, tag_dir: Path
) -> tuple[tuple[int, ...], list[Piece]]:
    """Pieces of the logical ``[E, ...]`` tensor: each EP rank's local stack mapped through its placement runs."""
    pieces: list[Piece] = []
    trailing: set[tuple[int, ...]] = set()
    for ep_rank, experts in enumerate(layer.placement):
        if ep_rank not in copies:
            if experts:
                raise PartitionMismatchError(
                    f"'{tag_dir}': no rank file holds EP rank {ep_rank}'s '{name}' (experts {list(experts)}).",
                    path=tag_dir,
                    name=name,
                )
            continue
        shape, local = _local_pieces(name, copies[ep_rank], count, tag_dir)
        if not shape or shape[0] != len(experts):
            raise PartitionMismatchError(
                f"'{tag_dir}': EP rank {ep_rank}'s '{name}' has shape {shape}, its placement lists {len(experts)} "
                "experts. The rank files come from different runs.",
                path=tag_dir,
                name=name,
                expected=len(experts),
                found=shape[0] if shape else None,
            )
        trailing.add(shape[1:])
        for run in layer.runs(ep_rank, numel_of(shape[1:])):
            for p in local:
                lo, hi = max(p.dest, run.local), min(p.dest + p.length, run.local + run.length)
                if lo < hi:
                    pieces.append(Piece(p.rank, p.group, p.start + lo - p.dest, hi - lo, run.logical + lo - run.local))
    if len(trailing) != 1:
        raise PartitionMismatchError(
            f"'{tag_dir}': EP ranks disagree on the expert shape of '{name}': {sorted(trailing)}.",
            path=tag_dir,
            name=name,
        )
    return (layer.num_experts, *trailing.pop()), sorted(pieces, key=lambda p: p.dest)


def autoep_trainable(
    model_files: Sequence[Path],
    model_trees: Sequence[Any],
    optim: OptimizerPartitions,
    optim_trees: Sequence[Any],
    frozen: dict[str, tuple[int, ...]],
    tag_dir: Path,
) -> tuple[TensorPlans, AutoEP]:
    """Trainable parameters of an AutoEP ZeRO-3 checkpoint (fp32 masters), experts in logical ``[E, ...]`` form."""
    layers, positions = autoep_layers(model_files, model_trees)
    frozen_experts = sorted(n for n in frozen if n.rpartition(".")[0] in layers)
    if frozen_experts:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}': frozen AutoEP expert parameters {frozen_experts[:3]} are not in the optimizer's fp32 "
            "partitions; zeroio (like DeepSpeed's ds_to_universal) does not read them yet.",
            path=tag_dir,
            name=frozen_experts[0],
        )
    fragments, counts = _fragments(model_files, model_trees, optim, optim_trees, layers, positions)
    by_name: dict[str, dict[Any, dict[int, _Fragment]]] = {}
    for (name, copy), parts in fragments.items():
        by_name.setdefault(name, {})[copy] = parts
    found = TensorPlans()
    dtype = optim.flat_groups[0][0].dtype_spec
    for name, copies in by_name.items():
        layer = layers.get(name.rpartition(".")[0])
        if layer is not None:
            shape, pieces = _expert_plan(name, layer, copies, counts[name], tag_dir)
        else:
            shape, pieces = _local_pieces(name, next(iter(copies.values())), counts[name], tag_dir)
        if sum(p.length for p in pieces) != numel_of(shape):
            raise PartitionMismatchError(
                f"'{tag_dir}': the partitions of '{name}' cover {sum(p.length for p in pieces)} of its "
                f"{numel_of(shape)} elements.",
                path=tag_dir,
                name=name,
            )
        files = tuple(optim.files[r] for r in sorted({p.rank for p in pieces}))
        found.add(TensorInfo(name, shape, dtype, "trainable", files), FlatPlan(tuple(pieces), tuple(optim.flat_groups)))
    return found, AutoEP(layers)
