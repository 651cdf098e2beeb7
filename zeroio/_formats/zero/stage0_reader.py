"""ZeRO stage 0 (no partitioning): the fp32 masters of DeepSpeed's fp16 wrappers, fused or unfused, matched by value."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._dtypes import FLOAT32
from ..._messages import get_logger
from ..._pickles import TensorRef
from ...errors import CheckpointFormatError
from ..metadata import CheckpointMetadata, TensorInfo, TensorKind
from ..partition import Piece
from ..read_plans import FlatPlan, ReadPlan, WholePlan, ZeroContents, buffer_plans, casts_to, same_bits
from ..validate import ModelStates, config_stage, ref_list, tensor_ref

__all__ = ["bf16_masters_unsaved", "open_stage0"]

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Stage0Masters:
    """Where a stage-0 checkpoint's fp32 master weights are, per parameter name."""

    layout: str
    masters: dict[str, ReadPlan]
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
        ref = tensor_ref(value, f"parameter '{name}'", path)
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
    flats = ref_list(optimizer["fp32_groups_flat"], "optimizer.fp32_groups_flat", path)
    members: dict[str, list[tuple[int, str, TensorRef]]] = {}
    for name, ref in params.items():
        if ref.dtype_spec.is_floating_point and ref.is_contiguous:
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
    masters: dict[str, ReadPlan] = {}
    unresolved: list[str] = []
    used: set[str] = set()
    for g, flat in enumerate(flats):
        candidates = [
            key for key, rows in tiled.items() if key not in used and sum(r.numel for _, _, r in rows) == flat.numel
        ]
        if len(candidates) > 1:  # equal sizes: keep the storage whose values are this flat rounded
            candidates = [
                key
                for key in candidates
                if all(
                    casts_to(FlatPlan((Piece(0, g, off, ref.numel, 0),), groups), ref, ref.numel, flat.dtype_spec)
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
    hp = [ref for g, group in enumerate(raw) for ref in ref_list(group, f"optimizer.fp32_groups[{g}]", path)]
    by_shape: dict[tuple[int, ...], tuple[list[TensorRef], list[str]]] = {}
    for ref in hp:
        by_shape.setdefault(ref.shape, ([], []))[0].append(ref)
    for name, ref in params.items():
        if ref.dtype_spec.is_floating_point:
            by_shape.setdefault(ref.shape, ([], []))[1].append(name)
    masters: dict[str, ReadPlan] = {}
    unresolved: list[str] = []
    unsure: set[str] = set()
    for shape, (tensors, names) in by_shape.items():
        if not tensors:
            continue
        if len(tensors) == 1 and len(names) == 1:
            masters[names[0]] = WholePlan(tensors[0])
            continue
        candidates = [[n for n in names if casts_to(WholePlan(t), params[n], t.numel, t.dtype_spec)] for t in tensors]
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
            same = all(same_bits(tensors[pending[0]], tensors[i]) for i in pending)
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


_UNSAVED_MASTERS = ((0, 17, 6), (0, 18, 4))
"""DeepSpeed releases whose ``DDP_BFLOAT16`` and ``BFLOAT16`` wrapper names are both ``"bf16"`` (0.17.6 added the
first, 0.18.5 renamed it ``"ddp_bf16"``; read in their sources, 0.17.6 run)."""


def _release(version: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(version).split("+")[0].split(".")[:3])
    except ValueError:
        return None


def bf16_masters_unsaved(tree: dict[Any, Any]) -> bool:
    """True for a bf16 save of DeepSpeed 0.17.6-0.18.4 at ZeRO stage 0 or 1 whose fp32 masters were never written.

    There the engine's check for DeepSpeed's BF16_Optimizer (ZeRO-1 + bf16 + fp32 gradient accumulation) returns
    ``"bf16"``, which the next line takes for the DDP wrapper's name: the optimizer becomes FP16_UnfusedOptimizer, and
    ``_save_checkpoint`` (``zero_optimization() or bfloat16_enabled()``) saves as if ZeRO files held its state:
    ``param_shapes`` recorded, ``optimizer`` None, and no optimizer file written. Only the bf16 weights remain.
    """
    config = tree.get(C.DS_CONFIG)
    release = _release(tree.get(C.DS_VERSION))
    if not isinstance(config, dict) or release is None or not _UNSAVED_MASTERS[0] <= release <= _UNSAVED_MASTERS[1]:
        return False
    bf16 = config.get("bf16", config.get("bfloat16"))
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    enabled = isinstance(bf16, dict) and bf16.get("enabled") is True
    return enabled and stage in (0, 1) and tree.get("optimizer") is None and tree.get(C.PARAM_SHAPES) is not None


def open_stage0(tag_dir: Path, tag_name: str | None, states: ModelStates) -> ZeroContents:
    """A ZeRO stage 0 checkpoint: ``mp_rank_00_model_states.pt`` alone, optimizer state inside it.

    DeepSpeed 0.19.8 writes no optim files without ZeRO; ``model_states['optimizer']`` holds the 16-bit
    wrapper's state, whose fp32 masters are unnamed. zero_to_fp32 fails on these folders.
    """
    model0_path, model0, module = states.path, states.tree, states.module
    # 1. Buffers, parameters and ties from `module`.
    found_plans = buffer_plans(module, states.buffer_names, model0_path)
    infos, sources = found_plans.infos, found_plans.plans
    params, tied = _stage0_params(module, states.buffer_names, model0_path)

    # 2. The fp32 masters: where the optimizer wrapper keeps them.
    optimizer = model0.get("optimizer")
    unsaved = bf16_masters_unsaved(model0)
    if unsaved:
        logger.warning(
            "%s: DeepSpeed %s did not save the fp32 master weights or optimizer state of this bf16 run (its "
            "BF16_Optimizer was taken for the DDP bf16 wrapper); the bf16 weights are returned. Save with "
            "DeepSpeed >= 0.18.5 to keep the masters.",
            tag_dir,
            model0.get(C.DS_VERSION),
        )
    if isinstance(optimizer, dict) and "fp32_groups_flat" in optimizer:
        found = _fused_masters(optimizer, params, model0_path)
    elif isinstance(optimizer, dict) and "fp32_groups" in optimizer:
        found = _unfused_masters(optimizer, params, model0_path)
    else:
        label = "torch optimizer (no 16-bit wrapper)" if isinstance(optimizer, dict) else "no optimizer state"
        label = "not saved (DeepSpeed 0.17.6-0.18.4 bf16 wrapper)" if unsaved else label
        found = _Stage0Masters(label, {}, _plain_kinds(optimizer, params))
    if found.unresolved:
        logger.warning(
            "%s: could not place %s (%s); those parameters are returned in their stored 16-bit dtype",
            tag_dir,
            ", ".join(found.unresolved[:5]),
            found.layout,
        )

    # 3. Parameters: fp32 master where found, else the stored tensor (frozen, fp32 training, or no master).
    has_fp32_master = True
    for name, ref in params.items():
        if name in found.masters:
            infos[name] = TensorInfo(name, ref.shape, FLOAT32, "trainable", (model0_path,))
            sources[name] = found.masters[name]
            continue
        kind = found.kinds.get(name, "tensor")
        if kind != "frozen" and ref.dtype_spec.is_floating_point and ref.dtype_spec != FLOAT32:
            has_fp32_master = False
        infos[name] = TensorInfo(name, ref.shape, ref.dtype_spec, kind, (model0_path,))
        sources[name] = WholePlan(ref)
    for alias, src in tied.items():
        base = infos[src]
        infos[alias] = TensorInfo(alias, base.shape, base.dtype_spec, base.kind, base.files, base.stored_spec, src)

    floating = [ref.dtype_spec for ref in params.values() if ref.dtype_spec.is_floating_point]
    dp = model0.get(C.DP_WORLD_SIZE)
    metadata = CheckpointMetadata(
        format="zero",
        path=tag_dir,
        tag=tag_name,
        zero_stage=config_stage(model0.get(C.DS_CONFIG), default=0) if unsaved else 0,
        world_size=dp if isinstance(dp, int) else None,
        train_dtype=floating[0] if floating else FLOAT32,
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
    return ZeroContents(metadata, ordered, tied, sources)
