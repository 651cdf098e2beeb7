"""The DeepSpeed ZeRO backend: parse rank files into per-tensor read plans, then execute them lazily."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import _constants as C
from ._checkpoint import Checkpoint
from ._layout import ZeroLayout, find_tag_dir, scan_tag_dir
from ._metadata import CheckpointMetadata, TensorInfo, TensorKind, require, require_dict
from ._partition import Piece, zero3_offsets, zero3_partition_numel, zero3_plan, zero12_offsets, zero12_plan
from ._pickles import RankFile, TensorRef, load_pickle
from ._storage import ByteRange
from .errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    PartitionMismatchError,
    UnsupportedCheckpointError,
    WorldSizeMismatchError,
)

__all__ = ["FlatPlan", "WholePlan", "ZeroCheckpoint", "open_zero", "read_plan_into"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FlatPlan:
    """Elements gathered from the ranks' flat groups (trainable params, ZeRO-3 frozen fragments)."""

    pieces: tuple[Piece, ...]
    groups: tuple[tuple[TensorRef, ...], ...]  # groups[rank][group]


@dataclass(frozen=True, slots=True)
class WholePlan:
    """A tensor stored whole in one file (buffers, ZeRO-1/2 frozen params)."""

    ref: TensorRef


def read_plan_into(source: FlatPlan | WholePlan, start: int, out: torch.Tensor) -> None:
    """Fill ``out`` with a tensor's flattened elements ``[start, start + out.numel())``; reads only those bytes."""
    end = start + out.numel()
    if isinstance(source, WholePlan):
        source.ref.read(start, out.numel(), out)
        return
    for piece in source.pieces:
        lo = max(start, piece.dest)
        hi = min(end, piece.dest + piece.length)
        if lo >= hi:
            continue
        ref = source.groups[piece.rank][piece.group]
        ref.read(piece.start + (lo - piece.dest), hi - lo, out[lo - start : hi - start])


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
        sources: dict[str, FlatPlan | WholePlan],
        files: list[RankFile],
        optimizer_states: Sequence[Any] = (),
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._sources = sources
        self._files = files
        # Each rank's base optimizer state (Adam moments as TensorRefs), partitioned like the fp32 flat groups.
        self._optimizer_states = tuple(optimizer_states)
        self._trees: dict[Path, Any] = {}

    def file_tree(self, path: Path) -> Any:
        """The parsed object tree of one rank file read at open (tensors as references), without re-parsing it.

        Raises KeyError for a file that was not read (e.g. a later rank's model states at ZeRO-1/2).
        """
        self.ensure_open()
        return self._trees[Path(path)]

    @property
    def parsed_files(self) -> tuple[Path, ...]:
        """The rank files parsed at open, in the order they were read."""
        return tuple(self._trees)

    def read_plan(self, name: str) -> FlatPlan | WholePlan:
        """Where the stored tensor ``name`` (a stored name, see :meth:`source_name`) lives in the rank files."""
        return self._sources[name]

    @property
    def plans(self) -> dict[str, FlatPlan | WholePlan]:
        """``{stored name: read plan}`` for every stored tensor, in key order."""
        return dict(self._sources)

    @property
    def optimizer_states(self) -> tuple[Any, ...]:
        """Each rank's base optimizer state (moments as TensorRefs), partitioned like the fp32 flat groups."""
        return self._optimizer_states

    def _release(self) -> None:
        for file in self._files:
            file.close()

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        read_plan_into(self._sources[name], start, out)

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        source = self._sources[name]
        if isinstance(source, WholePlan):
            whole = source.ref.byte_range(0, source.ref.numel)
            return None if whole is None else [whole]
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

    def pieces(self, name: str) -> list[tuple[Path, int, int, int]]:
        """Where a tensor's elements live: ``(file, element offset in that file's tensor, length, dest)`` rows."""
        source = self._sources[self.source_name(self.info(name).name)]
        if isinstance(source, WholePlan):
            return [(source.ref.file.path, 0, source.ref.numel, 0)]
        return [(source.groups[p.rank][p.group].file.path, p.start, p.length, p.dest) for p in source.pieces]

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The consolidated optimizer state of one trainable parameter (see :func:`zeroio._optim.optimizer_state`)."""
        from ._optim import optimizer_state

        return optimizer_state(self, name)


def _train_dtype(layout: ZeroLayout, module: dict[str, Any], param_names: list[str]) -> torch.dtype:
    if layout.optim_files and layout.optim_files[0].name.startswith("bf16_"):
        return torch.bfloat16
    for name in param_names:
        value = module.get(name)
        if isinstance(value, TensorRef) and value.dtype.is_floating_point:
            return value.dtype
    return torch.float32


def _config_stage(ds_config: Any, *, default: int) -> int:
    """``ds_config['zero_optimization']['stage']``, or ``default`` when the config does not say."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return int(stage) if isinstance(stage, int) else default


# --------------------------------------------------------------------------- value matching

_SAMPLE = 2048  # elements compared at each end of a tensor; tensors up to 2 * _SAMPLE are compared whole


def _sample_ranges(numel: int) -> list[tuple[int, int]]:
    if numel <= 2 * _SAMPLE:
        return [(0, numel)]
    return [(0, _SAMPLE), (numel - _SAMPLE, _SAMPLE)]


def _casts_to(master: FlatPlan | WholePlan, low: TensorRef, numel: int, master_dtype: torch.dtype) -> bool:
    """True when the fp32 ``master`` rounds to ``low``'s stored bits (compared at both ends).

    DeepSpeed 0.19.8's 16-bit wrappers copy the fp32 master into the 16-bit parameter after every step
    (``fp16_param.data.copy_(fp32_param.data)``), so a parameter's stored value is exactly its master cast.
    """
    for start, count in _sample_ranges(numel):
        hp = torch.empty(count, dtype=master_dtype)
        read_plan_into(master, start, hp)
        lp = low.read(start, count)
        if not torch.equal(hp.to(lp.dtype).view(torch.uint8), lp.view(torch.uint8)):
            return False
    return True


def _same_bits(a: TensorRef, b: TensorRef) -> bool:
    """True when two tensors of one shape and dtype hold the same bits (compared at both ends)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return all(
        torch.equal(a.read(start, count).view(torch.uint8), b.read(start, count).view(torch.uint8))
        for start, count in _sample_ranges(a.numel)
    )


# --------------------------------------------------------------------------- ZeRO stage 0


@dataclass(frozen=True, slots=True)
class _Stage0Masters:
    """Where a stage-0 checkpoint's fp32 master weights are, per parameter name."""

    layout: str
    masters: dict[str, FlatPlan | WholePlan]
    kinds: dict[str, TensorKind]
    unresolved: tuple[str, ...] = ()


def _stage0_params(
    module: dict[Any, Any], buffer_names: list[str], path: Path
) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Distinct parameters of ``module`` and tied aliases, found by storage identity.

    Stage 0 records no ``shared_params``; torch.save keeps storage sharing, so tied names point at one
    storage, offset, shape and stride.
    """
    buffers = set(buffer_names)
    params: dict[str, TensorRef] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for key, value in module.items():
        name = str(key)
        if name in buffers:
            continue
        ref = _tensor_ref(value, f"parameter '{name}'", path)
        identity = (ref.storage.key, ref.storage_offset, ref.shape, ref.stride)
        if identity in seen:
            tied[name] = seen[identity]
        else:
            seen[identity] = name
            params[name] = ref
    return params, tied


def _fused_masters(optimizer: dict[str, Any], params: dict[str, TensorRef], path: Path) -> _Stage0Masters:
    """FP16_Optimizer (FusedAdam): one flat fp32 tensor per param group, ``fp32_groups_flat``.

    Its 16-bit parameters are views into one flat 16-bit buffer per group (``p.data = flat[...]``), and
    torch.save keeps that sharing: the group's parameters are the tensors on the storage whose size equals
    the fp32 flat's, at their storage offsets.
    """
    flats = _ref_list(optimizer["fp32_groups_flat"], "optimizer.fp32_groups_flat", path)
    members: dict[str, list[tuple[int, str, TensorRef]]] = {}
    for name, ref in params.items():
        if ref.dtype.is_floating_point and ref.is_contiguous:
            members.setdefault(ref.storage.key, []).append((ref.storage_offset, name, ref))
    tiled: dict[str, list[tuple[int, str, TensorRef]]] = {}
    for key, rows in members.items():
        rows.sort(key=lambda row: row[0])
        cursor = 0
        for off, _, ref in rows:
            if off != cursor:
                break
            cursor += ref.numel
        else:
            if cursor == rows[0][2].storage.numel:  # the parameters tile the whole storage
                tiled[key] = rows
    groups = (tuple(flats),)
    masters: dict[str, FlatPlan | WholePlan] = {}
    unresolved: list[str] = []
    used: set[str] = set()
    for g, flat in enumerate(flats):
        candidates = [
            key for key, rows in tiled.items()
            if key not in used and sum(r.numel for _, _, r in rows) == flat.numel
        ]
        if len(candidates) > 1:  # equal sizes: keep the storage whose values are this flat rounded
            candidates = [
                key for key in candidates
                if all(
                    _casts_to(FlatPlan((Piece(0, g, off, ref.numel, 0),), groups), ref, ref.numel, flat.dtype)
                    for off, _, ref in tiled[key]
                )
            ]
        if len(candidates) != 1:
            unresolved.append(f"fp32_groups_flat[{g}]")
            continue
        used.add(candidates[0])
        for off, name, ref in tiled[candidates[0]]:
            masters[name] = FlatPlan((Piece(0, g, off, ref.numel, 0),), groups)
    kinds: dict[str, TensorKind] = {
        name: "trainable" if name in masters else ("tensor" if unresolved else "frozen") for name in params
    }
    return _Stage0Masters("FP16_Optimizer (fused): optimizer['fp32_groups_flat']", masters, kinds, tuple(unresolved))


def _unfused_masters(optimizer: dict[str, Any], params: dict[str, TensorRef], path: Path) -> _Stage0Masters:
    """FP16_UnfusedOptimizer (any optimizer but FusedAdam): one fp32 tensor per trainable parameter.

    ``fp32_groups`` lists them per param group without names; each is matched to the one parameter of its
    shape whose stored 16-bit value is the master rounded (shape alone decides when it is unique).
    """
    raw = optimizer["fp32_groups"]
    if not isinstance(raw, (list, tuple)):
        raise CheckpointFormatError(
            f"'{path}': 'optimizer.fp32_groups' should be a list of lists of tensors, found {type(raw).__name__}.",
            path=path,
        )
    hp = [ref for g, group in enumerate(raw) for ref in _ref_list(group, f"optimizer.fp32_groups[{g}]", path)]
    by_shape: dict[tuple[int, ...], tuple[list[TensorRef], list[str]]] = {}
    for ref in hp:
        by_shape.setdefault(ref.shape, ([], []))[0].append(ref)
    for name, ref in params.items():
        if ref.dtype.is_floating_point:
            by_shape.setdefault(ref.shape, ([], []))[1].append(name)
    masters: dict[str, FlatPlan | WholePlan] = {}
    unresolved: list[str] = []
    unsure: set[str] = set()
    for shape, (tensors, names) in by_shape.items():
        if not tensors:
            continue
        if len(tensors) == 1 and len(names) == 1:
            masters[names[0]] = WholePlan(tensors[0])
            continue
        candidates = [
            [n for n in names if _casts_to(WholePlan(t), params[n], t.numel, t.dtype)] for t in tensors
        ]
        taken: set[str] = set()
        pending = list(range(len(tensors)))
        progress = True
        while pending and progress:
            progress = False
            for i in list(pending):
                free = [n for n in candidates[i] if n not in taken]
                if len(free) == 1:
                    masters[free[0]] = WholePlan(tensors[i])
                    taken.add(free[0])
                    pending.remove(i)
                    progress = True
        if pending:
            free = sorted({n for i in pending for n in candidates[i] if n not in taken}, key=names.index)
            same = all(_same_bits(tensors[pending[0]], tensors[i]) for i in pending)
            if same and len(free) == len(pending):  # identical masters: any pairing gives the same tensors
                for i, name in zip(pending, free):
                    masters[name] = WholePlan(tensors[i])
            else:
                unresolved.extend(f"fp32 master of shape {list(shape)}" for _ in pending)
                unsure.update(n for n in names if n not in masters)
    kinds: dict[str, TensorKind] = {
        name: "trainable" if name in masters else ("tensor" if name in unsure else "frozen") for name in params
    }
    return _Stage0Masters("FP16_UnfusedOptimizer: optimizer['fp32_groups']", masters, kinds, tuple(unresolved))


def _plain_kinds(optimizer: Any, params: dict[str, TensorRef]) -> dict[str, TensorKind]:
    """Trainable or frozen, for a stage-0 checkpoint without a 16-bit wrapper (the parameters are the weights).

    The torch optimizer state has no names; a parameter whose shape no optimizer state has is frozen, and
    a shape held by as many states as parameters is trainable. Anything else stays ``tensor``.
    """
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    if not isinstance(state, dict) or not state:
        return {name: "tensor" for name in params}
    counts: dict[tuple[int, ...], int] = {}
    for entry in state.values():
        if not isinstance(entry, dict):
            return {name: "tensor" for name in params}
        refs = [entry.get(k) for k in ("exp_avg", "momentum_buffer", "square_avg", "sum")]
        refs += [v for v in entry.values() if isinstance(v, TensorRef) and v.shape]
        ref = next((r for r in refs if isinstance(r, TensorRef)), None)
        if ref is None:
            return {name: "tensor" for name in params}
        counts[ref.shape] = counts.get(ref.shape, 0) + 1
    per_shape: dict[tuple[int, ...], int] = {}
    for ref in params.values():
        per_shape[ref.shape] = per_shape.get(ref.shape, 0) + 1
    kinds: dict[str, TensorKind] = {}
    for name, ref in params.items():
        held = counts.get(ref.shape, 0)
        kinds[name] = "frozen" if held == 0 else "trainable" if held == per_shape[ref.shape] else "tensor"
    return kinds


def _open_stage0(
    tag_dir: Path,
    tag_name: str | None,
    model0_path: Path,
    model0: dict[str, Any],
    module: dict[Any, Any],
    buffer_names: list[str],
    files: list[RankFile],
) -> ZeroCheckpoint:
    """A ZeRO stage 0 checkpoint: ``mp_rank_00_model_states.pt`` alone, optimizer state inside it.

    DeepSpeed 0.19.8 writes no optim files without ZeRO; ``model_states['optimizer']`` holds the 16-bit
    wrapper's state, whose fp32 masters are unnamed. zero_to_fp32 fails on these folders.
    """
    # 1. Buffers, parameters and ties from `module`.
    infos, sources = _buffer_infos(module, buffer_names, model0_path)
    params, tied = _stage0_params(module, buffer_names, model0_path)

    # 2. The fp32 masters: where the optimizer wrapper keeps them.
    optimizer = model0.get("optimizer")
    if isinstance(optimizer, dict) and "fp32_groups_flat" in optimizer:
        found = _fused_masters(optimizer, params, model0_path)
    elif isinstance(optimizer, dict) and "fp32_groups" in optimizer:
        found = _unfused_masters(optimizer, params, model0_path)
    else:
        label = "torch optimizer (no 16-bit wrapper)" if isinstance(optimizer, dict) else "no optimizer state"
        found = _Stage0Masters(label, {}, _plain_kinds(optimizer, params))
    if found.unresolved:
        logger.warning(
            "%s: could not place %s (%s); those parameters are returned in their stored 16-bit dtype",
            tag_dir, ", ".join(found.unresolved[:5]), found.layout,
        )

    # 3. Parameters: fp32 master where found, else the stored tensor (frozen, fp32 training, or no master).
    has_fp32_master = True
    for name, ref in params.items():
        if name in found.masters:
            infos[name] = TensorInfo(name, ref.shape, torch.float32, "trainable", (model0_path,))
            sources[name] = found.masters[name]
            continue
        kind = found.kinds.get(name, "tensor")
        if kind != "frozen" and ref.dtype.is_floating_point and ref.dtype != torch.float32:
            has_fp32_master = False
        infos[name] = TensorInfo(name, ref.shape, ref.dtype, kind, (model0_path,))
        sources[name] = WholePlan(ref)
    for alias, src in tied.items():
        base = infos[src]
        infos[alias] = TensorInfo(alias, base.shape, base.dtype, base.kind, base.files, base.stored_dtype, src)

    floating = [ref.dtype for ref in params.values() if ref.dtype.is_floating_point]
    dp = model0.get(C.DP_WORLD_SIZE)
    metadata = CheckpointMetadata(
        format="zero",
        path=tag_dir,
        tag=tag_name,
        zero_stage=0,
        world_size=dp if isinstance(dp, int) else None,
        train_dtype=floating[0] if floating else torch.float32,
        ds_version=str(model0.get(C.DS_VERSION)) if model0.get(C.DS_VERSION) is not None else None,
        global_step=int(model0[C.GLOBAL_STEPS]) if isinstance(model0.get(C.GLOBAL_STEPS), int) else None,
        has_fp32_master=has_fp32_master,
        extra={
            "ds_config": model0.get(C.DS_CONFIG),
            "optim_files": [],
            "model_files": [model0_path.name],
            "fp32_master_source": found.layout,
        },
    )
    ordered = {str(name): infos[str(name)] for name in module if str(name) in infos}
    logger.debug("opened %s: ZeRO stage 0 (%s), %d tensors", tag_dir, found.layout, len(ordered))
    return ZeroCheckpoint(metadata, ordered, tied, sources, files)


def _buffer_infos(
    module: dict[Any, Any], buffer_names: list[str], path: Path
) -> tuple[dict[str, TensorInfo], dict[str, FlatPlan | WholePlan]]:
    """Buffers: whole tensors in rank 0's module. DeepSpeed's consolidation returns floating buffers as fp32."""
    infos: dict[str, TensorInfo] = {}
    sources: dict[str, FlatPlan | WholePlan] = {}
    for name in buffer_names:
        ref = _tensor_ref(require(module, name, path, "model state with this buffer"), f"buffer '{name}'", path)
        dtype = torch.float32 if ref.dtype.is_floating_point else ref.dtype
        infos[name] = TensorInfo(name, ref.shape, dtype, "buffer", (path,), ref.dtype if ref.dtype != dtype else None)
        sources[name] = WholePlan(ref)
    return infos, sources


# --------------------------------------------------------------------------- Mixture of Experts (ZeRO-1/2)

# DeepSpeed 0.19.8 deepspeed.moe.layer.MoE parameter names: <prefix>.deepspeed_moe.experts.deepspeed_experts.<id>.<rest>
_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*?)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<id>\d+)\.(?P<rest>.+)$")
_EXPERT_FILE = re.compile(r"^(?:layer_(?P<layer>\d+)_)?expert_(?P<expert>\d+)_mp_rank_\d+_model_states\.pt$")


@dataclass(frozen=True, slots=True)
class _Experts:
    """The expert files of a MoE checkpoint: every expert's tensors under its global name."""

    refs: dict[str, TensorRef]
    files: dict[str, Path]
    layer_of: dict[str, int]
    num_experts: tuple[int, ...]

    def global_name(self, local_name: str, ep_rank: int, ep_size: int) -> str | None:
        """Name of a rank's local expert parameter under its global expert id (as in the expert files)."""
        m = _EXPERT_PARAM.match(local_name)
        if m is None or m["prefix"] not in self.layer_of:
            return None
        num_local = self.num_experts[self.layer_of[m["prefix"]]] // ep_size
        return f"{m['prefix']}.deepspeed_moe.experts.deepspeed_experts.{ep_rank * num_local + int(m['id'])}.{m['rest']}"


def _parse_experts(paths: Sequence[Path], parse: Any, model0: dict[str, Any], model0_path: Path) -> _Experts:
    refs: dict[str, TensorRef] = {}
    files: dict[str, Path] = {}
    layer_of: dict[str, int] = {}
    seen: dict[int, set[int]] = {}
    for path in paths:
        fm = _EXPERT_FILE.match(path.name)
        if fm is None:  # _layout matched it with a looser pattern
            raise UnsupportedCheckpointError(f"'{path}': unrecognised MoE expert file name.", path=path)
        layer, expert = int(fm["layer"] or 0), int(fm["expert"])
        seen.setdefault(layer, set()).add(expert)
        tree = require_dict(parse(path), path.name, path)
        for key, value in tree.items():
            name = str(key)
            pm = _EXPERT_PARAM.match(name)
            if pm is None or int(pm["id"]) != expert or layer_of.setdefault(pm["prefix"], layer) != layer:
                raise CheckpointFormatError(
                    f"'{path}' holds '{name}', which is not a parameter of expert {expert} of MoE layer {layer} "
                    "(expected '<module>.deepspeed_moe.experts.deepspeed_experts.<expert>.<param>').",
                    path=path,
                    name=name,
                )
            refs[name] = _tensor_ref(value, f"expert tensor '{name}'", path)
            files[name] = path
    raw = model0.get("num_experts")  # one count per MoE layer (DeepSpeed 0.19.8 engine.num_experts)
    num_experts = tuple(n if isinstance(n, int) else -1 for n in raw) if isinstance(raw, (list, tuple)) else ()
    if any(layer >= len(num_experts) or num_experts[layer] < 1 for layer in seen):
        num_experts = tuple(max(seen.get(layer, {-1})) + 1 for layer in range(max(seen) + 1))
    for layer, experts in seen.items():
        missing = sorted(set(range(num_experts[layer])) - experts)
        if missing:
            name = f"layer_{layer}_expert_{missing[0]}_mp_rank_00_model_states.pt"
            raise CheckpointNotFoundError(
                f"Missing MoE expert file(s) for layer {layer}, expert(s) {missing[:5]} in '{model0_path.parent}' "
                f"('{model0_path.name}' records {num_experts[layer]} experts): '{name}'. Copy the whole tag folder "
                "again.",
                path=model0_path.parent / name,
            )
    return _Experts(refs, files, layer_of, num_experts)


def _expert_rank_sets(count: int, world_size: int, *, expert_major: bool) -> list[list[int]]:
    """Data-parallel ranks holding each expert-parallel rank's partitions of an expert param group.

    DeepSpeed 0.19.8 groups.py: by default expert-data-parallel group ``e`` is ranks ``e, e + ep, ...``;
    with ``use_data_before_expert_parallel_`` it is ``e * count, ..., e * count + count - 1``.
    """
    ep = world_size // count
    if expert_major:
        return [[e + k * ep for k in range(count)] for e in range(ep)]
    return [[e * count + k for k in range(count)] for e in range(ep)]


def _insert_experts(names: list[str], experts: _Experts) -> list[str]:
    """Place each MoE layer's expert tensors after that layer's gate, as model.state_dict() orders them."""
    by_prefix: dict[str, list[tuple[int, int, str]]] = {}
    for position, name in enumerate(experts.refs):
        m = _EXPERT_PARAM.match(name)
        if m is not None:  # always, checked in _parse_experts
            by_prefix.setdefault(m["prefix"], []).append((int(m["id"]), position, name))
    rest = [n for n in names if not _EXPERT_PARAM.match(n)]
    for prefix, rows in by_prefix.items():
        block = [name for _, _, name in sorted(rows)]
        anchor = [i for i, n in enumerate(rest) if n.startswith(f"{prefix}.deepspeed_moe.")]
        at = anchor[-1] + 1 if anchor else len(rest)
        rest[at:at] = block
    return rest


_Placement = list[tuple[list[int], list[str]]]
"""Per copy of a param group: the data-parallel ranks holding its partitions, and its parameters' names."""


def _expert_group_layouts(
    g: int,
    group: list[tuple[str, tuple[int, ...]]],
    count: int,
    world_size: int,
    experts: _Experts | None,
    tag_dir: Path,
) -> list[_Placement]:
    """Candidate placements of a MoE expert param group (one per rank order DeepSpeed may have used)."""
    if experts is None or count < 1 or world_size % count:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}': param group {g} is partitioned over {count} of {world_size} ranks, and the folder has "
            "no MoE expert files to name its parameters; zeroio cannot place it.",
            path=tag_dir,
            expected=world_size,
            found=count,
        )
    ep = world_size // count
    layouts = []
    for expert_major in ([True] if count == 1 else [True, False]):
        placement: _Placement = []
        for e, ranks in enumerate(_expert_rank_sets(count, world_size, expert_major=expert_major)):
            names = []
            for name, _ in group:
                global_name = experts.global_name(name, e, ep)
                if global_name is None:
                    raise UnsupportedCheckpointError(
                        f"'{tag_dir}': param group {g} is partitioned over {count} of {world_size} ranks (an expert "
                        f"group) but holds '{name}', which is not a deepspeed.moe expert parameter.",
                        path=tag_dir,
                        name=name,
                    )
                names.append(global_name)
            placement.append((ranks, names))
        layouts.append(placement)
    return layouts


def _plan_zero12_group(
    g: int,
    group: list[tuple[str, tuple[int, ...]]],
    numels: list[int],
    offsets: list[int],
    consumed: int,
    placement: _Placement,
    flat_groups: list[tuple[TensorRef, ...]],
    tag_dir: Path,
) -> list[tuple[str, tuple[int, ...], list[Piece]]]:
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


def _plan_matches_experts(
    planned: list[tuple[str, tuple[int, ...], list[Piece]]],
    flat_groups: list[tuple[TensorRef, ...]],
    experts: _Experts | None,
) -> bool:
    """True when every planned expert master rounds to the tensor in its expert file (ZeRO-1/2 copy the
    fp32 partition into the training-dtype parameter after each step)."""
    if experts is None:
        return False
    groups = tuple(flat_groups)
    for name, _, pieces in planned:
        low = experts.refs.get(name)
        if low is None or not _casts_to(FlatPlan(tuple(pieces), groups), low, low.numel, torch.float32):
            return False
    return True


def open_zero(path: Path, tag: str | None = None, *, trusted_globals: frozenset[str] = frozenset()) -> ZeroCheckpoint:
    """Parse a DeepSpeed checkpoint's metadata (no tensor bytes) into a :class:`ZeroCheckpoint`."""
    trees: dict[Path, Any] = {}
    ckpt = _open_zero(path, tag, trusted_globals, trees)
    ckpt._trees = trees
    return ckpt


def _open_zero(path: Path, tag: str | None, trusted_globals: frozenset[str], trees: dict[Path, Any]) -> ZeroCheckpoint:
    # 1. Locate the tag folder and classify its files (names only).
    tag_dir, tag_name = find_tag_dir(path, tag)
    layout = scan_tag_dir(tag_dir)
    files: list[RankFile] = []

    def parse(p: Path) -> Any:
        tree, file = load_pickle(p, trusted_globals=trusted_globals)
        files.append(file)
        trees[p] = tree
        return tree

    # 2. Model states of rank 0: names, shapes, buffers, ties; fail before touching optimizer files.
    model0_path = layout.model_files[0]
    model0 = parse(model0_path)
    module = require_dict(require(model0, C.MODULE, model0_path), C.MODULE, model0_path)
    buffer_names = [str(b) for b in (require(model0, C.BUFFER_NAMES, model0_path) or [])]
    param_shapes_raw = model0.get(C.PARAM_SHAPES)
    if not layout.optim_files:
        if param_shapes_raw is not None:
            raise CheckpointNotFoundError(
                f"'{tag_dir}' is a ZeRO stage 1-3 checkpoint ('{model0_path.name}' records param_shapes) but has no "
                "'*_optim_states.pt' files, where the fp32 master weights live. Copy the whole tag folder again.",
                path=tag_dir,
            )
        return _open_stage0(tag_dir, tag_name, model0_path, model0, module, buffer_names, files)
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
    stages, flat_groups, base_states = [], [], []
    for rank, (opath, tree) in enumerate(zip(layout.optim_files, optim_trees)):
        osd = require_dict(require(tree, C.OPTIMIZER_STATE_DICT, opath), C.OPTIMIZER_STATE_DICT, opath)
        if C.ZERO_STAGE not in osd and C.SINGLE_PARTITION_OF_FP32_GROUPS in osd:
            # DeepSpeed's BF16_Optimizer (ZeRO-1 + bf16 + fp32 gradient accumulation) records no stage and
            # partitions exactly like ZeRO-1; zero_to_fp32 0.19.8 rejects these files ("is not a zero checkpoint").
            osd = {**osd, C.ZERO_STAGE: _config_stage(model0.get(C.DS_CONFIG), default=1)}
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
        base_states.append(osd.get(C.OPTIMIZER_STATE_DICT if stage == 3 else "base_optimizer_state"))
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

    # 4. Buffers: whole tensors in rank 0's module. DeepSpeed's consolidation returns floating buffers as fp32.
    infos, sources = _buffer_infos(module, buffer_names, model0_path)
    if model0.get("ds_autoep_layers"):
        raise UnsupportedCheckpointError(
            f"'{model0_path}' records AutoEP MoE layers ('ds_autoep_layers'); zeroio reads deepspeed.moe.layer.MoE "
            "checkpoints only. Use DeepSpeed's ds_to_universal.py for this one.",
            path=model0_path,
        )
    experts = _parse_experts(layout.expert_files, parse, model0, model0_path) if layout.expert_files else None

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
            sources[name] = FlatPlan(pieces, tuple(frags))
    else:
        fragments = require_dict(model0.get(C.FROZEN_PARAM_FRAGMENTS) or {}, C.FROZEN_PARAM_FRAGMENTS, model0_path)
        if not frozen_names:
            # Older DeepSpeed (or ZeRO-1) may not record frozen shapes: frozen = module params not optimized.
            skip = set(buffer_names) | set(trainable) | set(shared)
            frozen_names = [n for n in module if n not in skip]
        if experts is not None:
            # MoE: rank 0 records its own experts under local ids; every expert is in the expert files.
            frozen_names = [n for n in frozen_names if not _EXPERT_PARAM.match(n)]
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
            sources[name] = WholePlan(ref)

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
            pieces = tuple(zero3_plan(numel, offset, world_size, group_sizes))
            infos[name] = TensorInfo(name, shape, flat_groups[0][0].dtype, "trainable", tuple(layout.optim_files))
            sources[name] = FlatPlan(tuple(pieces), tuple(flat_groups))
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
        counts = osd0.get(C.PARTITION_COUNT)
        for rank, groups in enumerate(flat_groups):
            if len(groups) != len(group_shapes):
                raise PartitionMismatchError(
                    f"'{layout.optim_files[rank]}' holds {len(groups)} fp32 groups, rank 0 holds "
                    f"{len(group_shapes)}.",
                    path=layout.optim_files[rank],
                    rank=rank,
                )
        for g, group in enumerate(group_shapes):
            numels = [_numel(s) for _, s in group]
            group_padding = None if paddings is None else [int(p) for p in paddings[g]]
            try:
                offsets, consumed = zero12_offsets(numels, group_padding)
            except ValueError as exc:
                raise PartitionMismatchError(f"'{layout.optim_files[0]}': {exc}.", path=layout.optim_files[0]) from None
            count = counts[g] if isinstance(counts, (list, tuple)) and g < len(counts) else world_size
            count = count if isinstance(count, int) else world_size
            if count == world_size:
                layouts = [[(list(range(world_size)), [name for name, _ in group])]]
            else:
                # MoE expert group: partitioned over an expert-data-parallel group of `count` ranks, one copy
                # per expert-parallel rank; rank 0's param_shapes name its own experts by local id.
                layouts = _expert_group_layouts(g, group, count, world_size, experts, tag_dir)
            placed = None
            if len(layouts) == 1:
                placed = _plan_zero12_group(g, group, numels, offsets, consumed, layouts[0], flat_groups, tag_dir)
            for candidate in layouts if placed is None else []:
                try:
                    planned = _plan_zero12_group(g, group, numels, offsets, consumed, candidate, flat_groups, tag_dir)
                except PartitionMismatchError:  # this rank order does not even fit the partition sizes
                    continue
                if _plan_matches_experts(planned, flat_groups, experts):
                    placed = planned
                    break
            if placed is None:
                raise UnsupportedCheckpointError(
                    f"'{tag_dir}': the fp32 partitions of MoE param group {g} match the expert files under neither "
                    "of DeepSpeed's expert/data-parallel rank orders; zeroio cannot place them. Use DeepSpeed's "
                    "ds_to_universal.py for this one.",
                    path=tag_dir,
                )
            for name, shape, plan in placed:
                files_used = tuple(sorted({layout.optim_files[p.rank] for p in plan})) or (layout.optim_files[0],)
                infos[name] = TensorInfo(name, shape, flat_groups[0][g].dtype, "trainable", files_used)
                sources[name] = FlatPlan(tuple(plan), tuple(flat_groups))

    # 6b. MoE expert tensors not trained (frozen experts) come from the expert files, in the training dtype.
    if experts is not None:
        for name, ref in experts.refs.items():
            if name not in infos:
                infos[name] = TensorInfo(name, ref.shape, ref.dtype, "frozen", (experts.files[name],))
                sources[name] = WholePlan(ref)

    # 7. Tied aliases (DeepSpeed's shared_params: alias -> source), only where the source exists.
    tied = {alias: src for alias, src in shared.items() if src in infos and alias not in infos}
    for alias, src in tied.items():
        base = infos[src]
        infos[alias] = TensorInfo(alias, base.shape, base.dtype, base.kind, base.files, base.stored_dtype, src)

    # 8. Key order: model.state_dict() order as recorded in `module`, then anything module does not list.
    ordered = {name: infos[name] for name in module if name in infos}
    ordered.update((name, info) for name, info in infos.items() if name not in ordered)
    if experts is not None:
        ordered = {name: ordered[name] for name in _insert_experts(list(ordered), experts)}

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
            "expert_files": [p.name for p in layout.expert_files],
        },
    )
    logger.debug("opened %s: ZeRO-%d, world size %d, %d tensors", tag_dir, stage, world_size, len(ordered))
    return ZeroCheckpoint(metadata, ordered, tied, sources, files, base_states)
