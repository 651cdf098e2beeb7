"""The DeepSpeed ZeRO backend: parse rank files into per-tensor read plans, then execute them lazily."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from . import _constants as C
from ._checkpoint import Checkpoint
from ._layout import ZeroLayout, find_tag_dir, scan_tag_dir
from ._metadata import CheckpointMetadata, TensorInfo, require, require_dict
from ._partition import Piece, zero3_offsets, zero3_partition_numel, zero3_plan, zero12_offsets, zero12_plan
from ._unpickle import RankFile, TensorRef, load_pickle
from .errors import (
    CheckpointFormatError,
    PartitionMismatchError,
    UnsupportedCheckpointError,
    WorldSizeMismatchError,
)

__all__ = ["ZeroCheckpoint", "open_zero"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _FlatSource:
    """Elements gathered from the ranks' flat groups (trainable params, ZeRO-3 frozen fragments)."""

    pieces: tuple[Piece, ...]
    groups: tuple[tuple[TensorRef, ...], ...]  # groups[rank][group]


@dataclass(frozen=True, slots=True)
class _WholeSource:
    """A tensor stored whole in one file (buffers, ZeRO-1/2 frozen params)."""

    ref: TensorRef


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _shape(value: Any, name: str, path: Path) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in value)
    except (TypeError, ValueError):
        raise CheckpointFormatError(
            f"'{path}': the shape recorded for '{name}' is {value!r:.60}, not a sequence of ints. The file is "
            "corrupted.",
            path=path,
            name=name,
        ) from None
    if any(s < 0 for s in shape):
        raise CheckpointFormatError(f"'{path}': negative shape {shape} recorded for '{name}'.", path=path, name=name)
    return shape


def _tensor_ref(value: Any, what: str, path: Path) -> TensorRef:
    if not isinstance(value, TensorRef):
        raise CheckpointFormatError(
            f"'{path}': {what} should be a tensor, found {type(value).__name__}. The file is corrupted or not a "
            "DeepSpeed checkpoint.",
            path=path,
        )
    return value


def _ref_list(value: Any, key: str, path: Path) -> tuple[TensorRef, ...]:
    if not isinstance(value, (list, tuple)):
        raise CheckpointFormatError(
            f"'{path}': '{key}' should be a list of tensors, found {type(value).__name__}.", path=path
        )
    return tuple(_tensor_ref(v, f"'{key}[{i}]'", path) for i, v in enumerate(value))


def _partition_count(osd: dict[str, Any], path: Path) -> int:
    count = require(osd, C.PARTITION_COUNT, path, "DeepSpeed ZeRO optimizer state")
    # ZeRO-1/2 record one count per param group (expert groups may differ); DeepSpeed uses the max.
    if isinstance(count, (list, tuple)):
        count = max(int(c) for c in count) if count else 0
    return int(count)


class ZeroCheckpoint(Checkpoint):
    """A DeepSpeed ZeRO-1/2/3 checkpoint, consolidated lazily; build it with :func:`zeroio.open`."""

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        sources: dict[str, _FlatSource | _WholeSource],
        files: list[RankFile],
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._sources = sources
        self._files = files

    def _release(self) -> None:
        for file in self._files:
            file.close()

    def _read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        source = self._sources[name]
        end = start + out.numel()
        if isinstance(source, _WholeSource):
            source.ref.read(start, out.numel(), out)
            return
        for piece in source.pieces:
            lo = max(start, piece.dest)
            hi = min(end, piece.dest + piece.length)
            if lo >= hi:
                continue
            ref = source.groups[piece.rank][piece.group]
            ref.read(piece.start + (lo - piece.dest), hi - lo, out[lo - start : hi - start])

    def pieces(self, name: str) -> list[tuple[Path, int, int, int]]:
        """Where a tensor's elements live: ``(file, element offset in that file's tensor, length, dest)`` rows."""
        source = self._sources[self._source_name(self.info(name).name)]
        if isinstance(source, _WholeSource):
            return [(source.ref.file.path, 0, source.ref.numel, 0)]
        return [(source.groups[p.rank][p.group].file.path, p.start, p.length, p.dest) for p in source.pieces]


def _train_dtype(layout: ZeroLayout, module: dict[str, Any], param_names: list[str]) -> torch.dtype:
    if layout.optim_files and layout.optim_files[0].name.startswith("bf16_"):
        return torch.bfloat16
    for name in param_names:
        value = module.get(name)
        if isinstance(value, TensorRef) and value.dtype.is_floating_point:
            return value.dtype
    return torch.float32


def open_zero(path: Path, tag: str | None = None, *, trusted_globals: frozenset[str] = frozenset()) -> ZeroCheckpoint:
    """Parse a DeepSpeed checkpoint's metadata (no tensor bytes) into a :class:`ZeroCheckpoint`."""
    # 1. Locate the tag folder and classify its files (names only).
    tag_dir, tag_name = find_tag_dir(path, tag)
    layout = scan_tag_dir(tag_dir)
    files: list[RankFile] = []

    def parse(p: Path) -> Any:
        tree, file = load_pickle(p, trusted_globals=trusted_globals)
        files.append(file)
        return tree

    # 2. Model states of rank 0: names, shapes, buffers, ties; fail before touching optimizer files.
    model0_path = layout.model_files[0]
    model0 = parse(model0_path)
    module = require_dict(require(model0, C.MODULE, model0_path), C.MODULE, model0_path)
    buffer_names = [str(b) for b in (require(model0, C.BUFFER_NAMES, model0_path) or [])]
    param_shapes_raw = model0.get(C.PARAM_SHAPES)
    if not layout.optim_files:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' has no '*_optim_states.pt' files: a ZeRO stage 0 (or weights-only) checkpoint, whose fp32 "
            "master weights are not partitioned. zeroio reads ZeRO stages 1-3; load "
            f"'{model0_path.name}'['module'] with torch.load(weights_only=True) instead.",
            path=tag_dir,
        )
    if not isinstance(param_shapes_raw, list):
        raise CheckpointFormatError(
            f"'{model0_path}' has no parameter shapes ('{C.PARAM_SHAPES}' is {type(param_shapes_raw).__name__}); "
            "it was saved without ZeRO optimizer state. Save with engine.save_checkpoint() under ZeRO 1-3.",
            path=model0_path,
        )
    group_shapes: list[list[tuple[str, tuple[int, ...]]]] = []
    for g, group in enumerate(param_shapes_raw):
        group = require_dict(group, f"{C.PARAM_SHAPES}[{g}]", model0_path)
        group_shapes.append([(str(n), _shape(s, str(n), model0_path)) for n, s in group.items()])
    trainable = [name for group in group_shapes for name, _ in group]
    shared = {str(k): str(v) for k, v in (model0.get(C.SHARED_PARAMS) or {}).items()}
    frozen_shapes = {
        str(n): _shape(s, str(n), model0_path) for n, s in (model0.get(C.FROZEN_PARAM_SHAPES) or {}).items()
    }

    # 3. Optimizer states of every rank: stage, world size and the fp32 flat partitions (as references).
    optim_trees = [parse(p) for p in layout.optim_files]
    stages, flat_groups = [], []
    for rank, (opath, tree) in enumerate(zip(layout.optim_files, optim_trees)):
        osd = require_dict(require(tree, C.OPTIMIZER_STATE_DICT, opath), C.OPTIMIZER_STATE_DICT, opath)
        stage = int(require(osd, C.ZERO_STAGE, opath, "DeepSpeed ZeRO optimizer state"))
        count = _partition_count(osd, opath)
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
        flat_groups.append(_ref_list(require(osd, key, opath, f"ZeRO-{stage} optimizer state"), key, opath))
    stage = stages[0]
    if any(s != stage for s in stages):
        raise CheckpointFormatError(
            f"Rank files in '{tag_dir}' disagree on the ZeRO stage ({sorted(set(stages))}); the folder mixes "
            "checkpoints. Copy the whole tag folder again.",
            path=tag_dir,
        )
    world_size = len(layout.optim_files)
    if (stage == 3) != layout.partitioned_model_files:
        raise CheckpointFormatError(
            f"'{tag_dir}' has ZeRO-{stage} optimizer files but "
            f"{'per-rank' if layout.partitioned_model_files else 'a single'} model states file(s); the folder mixes "
            "checkpoints.",
            path=tag_dir,
        )
    model_trees = [model0] + [parse(p) for p in layout.model_files[1:]]

    infos: dict[str, TensorInfo] = {}
    sources: dict[str, _FlatSource | _WholeSource] = {}

    # 4. Buffers: whole tensors in rank 0's module. DeepSpeed's consolidation returns floating buffers as fp32.
    for name in buffer_names:
        ref = _tensor_ref(require(module, name, model0_path, "model state with this buffer"), f"buffer '{name}'", model0_path)
        dtype = torch.float32 if ref.dtype.is_floating_point else ref.dtype
        infos[name] = TensorInfo(
            name, ref.shape, dtype, "buffer", (model0_path,), ref.dtype if ref.dtype != dtype else None
        )
        sources[name] = _WholeSource(ref)

    # 5. Frozen parameters, in their training dtype.
    frozen_names = list(frozen_shapes)
    if stage == 3:
        for name, shape in frozen_shapes.items():
            numel = _numel(shape)
            part = zero3_partition_numel(numel, world_size)
            frags = []
            for rank, (mpath, tree) in enumerate(zip(layout.model_files, model_trees)):
                fragments = require_dict(tree.get(C.FROZEN_PARAM_FRAGMENTS) or {}, C.FROZEN_PARAM_FRAGMENTS, mpath)
                frag = _tensor_ref(
                    require(fragments, name, mpath, "ZeRO-3 model state with this frozen fragment"),
                    f"frozen fragment '{name}'",
                    mpath,
                )
                needed = max(0, min(part, numel - rank * part))
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
            dtype = frags[0][0].dtype
            infos[name] = TensorInfo(name, shape, dtype, "frozen", tuple(layout.model_files))
            sources[name] = _FlatSource(pieces, tuple(frags))
    else:
        fragments = require_dict(model0.get(C.FROZEN_PARAM_FRAGMENTS) or {}, C.FROZEN_PARAM_FRAGMENTS, model0_path)
        if not frozen_names:
            # Older DeepSpeed (or ZeRO-1) may not record frozen shapes: frozen = module params not optimized.
            skip = set(buffer_names) | set(trainable) | set(shared)
            frozen_names = [n for n in module if n not in skip]
        for name in frozen_names:
            value = fragments.get(name, module.get(name))
            ref = _tensor_ref(value, f"frozen parameter '{name}'", model0_path)
            shape = frozen_shapes.get(name, ref.shape)
            if _numel(shape) != ref.numel:
                raise PartitionMismatchError(
                    f"'{model0_path}': frozen parameter '{name}' should have shape {shape}, the stored tensor has "
                    f"{ref.numel} elements.",
                    path=model0_path,
                    name=name,
                    expected=shape,
                    found=ref.shape,
                )
            infos[name] = TensorInfo(name, tuple(shape), ref.dtype, "frozen", (model0_path,))
            sources[name] = _WholeSource(ref)

    # 6. Trainable parameters: fp32 master weights from the optimizer partitions.
    if stage == 3:
        numels = [_numel(s) for g in group_shapes for _, s in g]
        offsets, consumed = zero3_offsets(numels, world_size)
        group_sizes = [ref.numel for ref in flat_groups[0]]
        for rank, groups in enumerate(flat_groups):
            sizes = [ref.numel for ref in groups]
            if sum(sizes) != consumed:
                raise PartitionMismatchError(
                    f"'{layout.optim_files[rank]}': the fp32 partitions hold {sum(sizes)} elements, the "
                    f"{len(numels)} parameters recorded in '{model0_path.name}' need {consumed} per rank at "
                    f"world size {world_size}. The rank files come from different runs or world sizes.",
                    path=layout.optim_files[rank],
                    rank=rank,
                    expected=consumed,
                    found=sum(sizes),
                )
            if sizes != group_sizes:
                raise PartitionMismatchError(
                    f"'{layout.optim_files[rank]}': flat group sizes {sizes} differ from rank 0's {group_sizes}.",
                    path=layout.optim_files[rank],
                    rank=rank,
                    expected=group_sizes,
                    found=sizes,
                )
        names_shapes = [(n, s) for g in group_shapes for n, s in g]
        for (name, shape), numel, offset in zip(names_shapes, numels, offsets):
            pieces = zero3_plan(numel, offset, world_size, group_sizes)
            infos[name] = TensorInfo(name, shape, flat_groups[0][0].dtype, "trainable", tuple(layout.optim_files))
            sources[name] = _FlatSource(tuple(pieces), tuple(flat_groups))
    else:
        osd0 = optim_trees[0][C.OPTIMIZER_STATE_DICT]
        paddings = osd0.get(C.PARAM_ALIGNMENT_PADDINGS)
        if len(flat_groups[0]) != len(group_shapes):
            raise PartitionMismatchError(
                f"'{layout.optim_files[0]}' holds {len(flat_groups[0])} fp32 groups, '{model0_path.name}' records "
                f"{len(group_shapes)} param groups.",
                path=layout.optim_files[0],
                expected=len(group_shapes),
                found=len(flat_groups[0]),
            )
        for g, group in enumerate(group_shapes):
            numels = [_numel(s) for _, s in group]
            group_padding = None if paddings is None else [int(p) for p in paddings[g]]
            try:
                offsets, consumed = zero12_offsets(numels, group_padding)
            except ValueError as exc:
                raise PartitionMismatchError(f"'{layout.optim_files[0]}': {exc}.", path=layout.optim_files[0]) from None
            partition_sizes = []
            for rank, groups in enumerate(flat_groups):
                if len(groups) != len(group_shapes):
                    raise PartitionMismatchError(
                        f"'{layout.optim_files[rank]}' holds {len(groups)} fp32 groups, rank 0 holds "
                        f"{len(group_shapes)}.",
                        path=layout.optim_files[rank],
                        rank=rank,
                    )
                partition_sizes.append(groups[g].numel)
            available = sum(partition_sizes)
            # DeepSpeed pads each group to a multiple of 2*world_size; consumed and available may differ by that.
            align = 2 * world_size
            if consumed > available or math.ceil(consumed / align) != math.ceil(available / align):
                raise PartitionMismatchError(
                    f"Param group {g}: its {len(numels)} parameters need {consumed} elements, the {world_size} "
                    f"ranks' fp32 partitions hold {available} in '{tag_dir}'. The rank files come from different "
                    "runs or world sizes.",
                    path=tag_dir,
                    expected=consumed,
                    found=available,
                )
            for (name, shape), numel, offset in zip(group, numels, offsets):
                pieces = zero12_plan(numel, offset, g, partition_sizes)
                files_used = tuple(sorted({layout.optim_files[p.rank] for p in pieces})) or (layout.optim_files[0],)
                infos[name] = TensorInfo(name, shape, flat_groups[0][g].dtype, "trainable", files_used)
                sources[name] = _FlatSource(tuple(pieces), tuple(flat_groups))

    # 7. Tied aliases (DeepSpeed's shared_params: alias -> source), only where the source exists.
    tied = {alias: src for alias, src in shared.items() if src in infos and alias not in infos}
    for alias, src in tied.items():
        base = infos[src]
        infos[alias] = TensorInfo(alias, base.shape, base.dtype, base.kind, base.files, base.stored_dtype, src)

    # 8. Key order: model.state_dict() order as recorded in `module`, then anything module does not list.
    ordered = {name: infos[name] for name in module if name in infos}
    ordered.update((name, info) for name, info in infos.items() if name not in ordered)

    metadata = CheckpointMetadata(
        format="zero",
        path=tag_dir,
        tag=tag_name,
        zero_stage=stage,
        world_size=world_size,
        train_dtype=_train_dtype(layout, module, trainable + frozen_names),
        ds_version=str(model0.get(C.DS_VERSION)) if model0.get(C.DS_VERSION) is not None else None,
        global_step=int(model0[C.GLOBAL_STEPS]) if isinstance(model0.get(C.GLOBAL_STEPS), int) else None,
        has_fp32_master=True,
        extra={
            "ds_config": model0.get(C.DS_CONFIG),
            "optim_files": [p.name for p in layout.optim_files],
            "model_files": [p.name for p in layout.model_files],
            "num_param_groups": len(group_shapes),
        },
    )
    logger.debug("opened %s: ZeRO-%d, world size %d, %d tensors", tag_dir, stage, world_size, len(ordered))
    return ZeroCheckpoint(metadata, ordered, tied, sources, files)
