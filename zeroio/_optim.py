"""Consolidated optimizer state (Adam moments, step, hyper-parameters), read with the weights' partition plans."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ._fileio import create_new, preallocate, pwrite_all, write_new_file
from ._pickles import TensorRef
from ._safetensors_writer import SafetensorsLayout, plan_file, write_chunks
from ._sharding import ShardPlan, index_json, plan_shards
from ._text import listing
from .errors import CheckpointFormatError, PartitionMismatchError, TensorNotFoundError, UnsupportedCheckpointError

if TYPE_CHECKING:
    from ._checkpoint import Checkpoint
    from ._zero import FlatPlan, ZeroCheckpoint

__all__ = [
    "OPTIMIZER_INDEX",
    "OPTIMIZER_JSON",
    "OptimizerFiles",
    "OptimizerLayout",
    "moment_source",
    "optimizer_layout",
    "optimizer_state",
    "plan_optimizer_files",
    "write_optimizer_files",
]

logger = logging.getLogger(__name__)

OPTIMIZER_FILE_PATTERN = "optimizer{suffix}.safetensors"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
OPTIMIZER_JSON = "optimizer.json"
_FORMAT = "zeroio.optimizer.v1"


def _names(names: Sequence[str]) -> str:
    return listing(names)


@dataclass(frozen=True, slots=True)
class OptimizerLayout:
    """Where each rank's base optimizer state lies, per fp32 flat group (metadata only, nothing read).

    DeepSpeed's base optimizer (torch Adam/AdamW) owns one flat fp32 tensor per ZeRO-3 sub-group (per param
    group at ZeRO-1/2); its per-element state (``exp_avg``, ``exp_avg_sq``) has the flat group's layout, so a
    parameter's moments sit at the very offsets of its fp32 master elements.
    """

    files: tuple[Path, ...]
    """Each rank's optimizer file."""
    entries: tuple[Any, ...]
    """Base-optimizer state key of each flat group (its position in the param groups' ``params`` lists)."""
    param_group: tuple[int, ...]
    """Param group index of each flat group."""
    moments: dict[str, tuple[tuple[TensorRef | None, ...], ...]]
    """Per-element state (``exp_avg``, ``exp_avg_sq``, ...): ``moments[key][rank][flat group]``."""
    scalars: tuple[dict[str, Any], ...]
    """Rank 0's other state values (``step``) per flat group."""
    param_groups: tuple[dict[str, Any], ...]
    """Rank 0's param groups without ``params``: the hyper-parameters (lr, betas, eps, weight_decay, ...)."""


def _plain(value: Any) -> Any:
    """Hyper-parameter and step values as plain objects (0-d tensors read, containers rebuilt)."""
    if isinstance(value, TensorRef):
        return value.materialize()
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _zero_checkpoint(ckpt: Checkpoint, what: str) -> ZeroCheckpoint:
    from ._zero import ZeroCheckpoint

    meta = ckpt.metadata
    if not isinstance(ckpt, ZeroCheckpoint):
        raise UnsupportedCheckpointError(
            f"'{meta.path}' is a consolidated {meta.format} checkpoint without optimizer state; {what} needs a "
            "DeepSpeed ZeRO checkpoint folder (the one engine.save_checkpoint() wrote).",
            path=meta.path,
        )
    if meta.zero_stage not in (1, 2, 3) or not ckpt.optimizer_states:
        raise UnsupportedCheckpointError(
            f"'{meta.path}' is a ZeRO stage {meta.zero_stage} checkpoint: DeepSpeed keeps its optimizer state "
            f"unnamed in model_states['optimizer'], which zeroio does not read yet; {what} needs ZeRO stage 1-3. "
            "The weights can still be read with zeroio.open().",
            path=meta.path,
        )
    return ckpt


def optimizer_layout(ckpt: Checkpoint, *, what: str = "optimizer state") -> OptimizerLayout:
    """Check every rank's base optimizer state against the fp32 flat groups; no tensor byte is read.

    Raises:
        UnsupportedCheckpointError: not a ZeRO-1/2/3 checkpoint, or an elastic (list-form) optimizer state.
        CheckpointFormatError: the optimizer state is missing or empty (stripped, or saved before any step).
        PartitionMismatchError: the state does not fit the flat groups.
    """
    zckpt = _zero_checkpoint(ckpt, what)
    from ._zero import FlatPlan

    files = tuple(zckpt.metadata.path / name for name in zckpt.metadata.extra.get("optim_files", ()))
    flat = next(
        (
            s.groups
            for n, s in zckpt.plans.items()
            if isinstance(s, FlatPlan) and zckpt.info(n).kind == "trainable"
        ),
        None,
    )
    if flat is None:
        raise CheckpointFormatError(
            f"'{zckpt.metadata.path}' has no trainable parameters, so no optimizer state to read.",
            path=zckpt.metadata.path,
        )
    no_state = (
        "{path} holds no optimizer moments ({why}): it was stripped, or saved before the optimizer's first step, "
        f"so {what} cannot proceed. The weights can still be read (zeroio.open, zeroio.convert without "
        "include_optimizer)."
    )
    moments: dict[str, list[list[TensorRef | None]]] = {}
    entries: tuple[Any, ...] = ()
    param_group: tuple[int, ...] = ()
    scalars: list[dict[str, Any]] = []
    param_groups: tuple[dict[str, Any], ...] = ()
    for rank, (base, groups) in enumerate(zip(zckpt.optimizer_states, flat)):
        path = files[rank] if rank < len(files) else zckpt.metadata.path
        if base is None:
            raise CheckpointFormatError(
                no_state.format(path=f"'{path}'", why="its base optimizer state is missing"), path=path, rank=rank
            )
        if isinstance(base, list):
            raise UnsupportedCheckpointError(
                f"'{path}' holds an elastic (per-group list) optimizer state, which zeroio does not read yet. "
                "Save with zero_optimization.elastic_checkpoint=false.",
                path=path,
            )
        state, pgroups = base.get("state") if isinstance(base, dict) else None, None
        if isinstance(base, dict):
            pgroups = base.get("param_groups")
        if not isinstance(state, dict) or not isinstance(pgroups, list):
            raise CheckpointFormatError(
                f"'{path}': the base optimizer state should be a torch optimizer state_dict with 'state' and "
                f"'param_groups', found {type(base).__name__}. The file is corrupted.",
                path=path,
                rank=rank,
            )
        if not state:
            raise CheckpointFormatError(
                no_state.format(path=f"'{path}'", why="its base optimizer state is empty"), path=path, rank=rank
            )
        ids = [(pid, g) for g, group in enumerate(pgroups) for pid in (group.get("params") or [])]
        if len(ids) != len(groups):
            raise PartitionMismatchError(
                f"'{path}': the base optimizer's param groups list {len(ids)} parameters, the file holds "
                f"{len(groups)} fp32 flat groups. The file is corrupted or was written by another optimizer layout.",
                path=path,
                rank=rank,
                expected=len(groups),
                found=len(ids),
            )
        if rank == 0:
            entries = tuple(pid for pid, _ in ids)
            param_group = tuple(g for _, g in ids)
            param_groups = tuple({k: _plain(v) for k, v in group.items() if k != "params"} for group in pgroups)
            first = next((e for e in state.values() if isinstance(e, dict) and e), {})
            for key, value in first.items():
                if isinstance(value, TensorRef) and len(value.shape) == 1:
                    moments[key] = []
            if not moments:
                raise CheckpointFormatError(
                    no_state.format(path=f"'{path}'", why="its state has no per-element tensors"), path=path, rank=rank
                )
        for per_rank in moments.values():
            per_rank.append([])
        for j, ((pid, _), group) in enumerate(zip(ids, groups)):
            entry = state.get(pid)
            if group.numel == 0 and not entry:
                for key in moments:
                    moments[key][rank].append(None)
                if rank == 0:
                    scalars.append({})
                continue
            if not isinstance(entry, dict) or not entry:
                raise CheckpointFormatError(
                    no_state.format(path=f"'{path}'", why=f"no state for flat group {j}"), path=path, rank=rank
                )
            for key in moments:
                ref = entry.get(key)
                if not isinstance(ref, TensorRef) or len(ref.shape) != 1 or ref.numel < group.numel:
                    found = (
                        "nothing"
                        if ref is None
                        else (f"shape {list(ref.shape)}" if isinstance(ref, TensorRef) else type(ref).__name__)
                    )
                    raise PartitionMismatchError(
                        f"'{path}': optimizer state '{key}' of flat group {j} should be a 1-D tensor of at least "
                        f"{group.numel} elements (the fp32 partition), found {found}. The file is corrupted.",
                        path=path,
                        rank=rank,
                        expected=group.numel,
                        found=None if not isinstance(ref, TensorRef) else ref.numel,
                    )
                moments[key][rank].append(ref)
            if rank == 0:
                scalars.append({k: v for k, v in entry.items() if k not in moments})
    return OptimizerLayout(
        files=files,
        entries=entries,
        param_group=param_group,
        moments={k: tuple(tuple(r) for r in v) for k, v in moments.items()},
        scalars=tuple(scalars),
        param_groups=param_groups,
    )


def _trainable_source(ckpt: ZeroCheckpoint, name: str) -> tuple[str, FlatPlan]:
    """The flat source of a trainable parameter (aliases resolved), or TensorNotFoundError saying why not."""
    from ._zero import FlatPlan

    info = ckpt.info(name)  # TensorNotFoundError for unknown names
    source_name = ckpt.source_name(name)
    source = ckpt.read_plan(source_name) if source_name in ckpt else None
    if info.kind != "trainable" or not isinstance(source, FlatPlan):
        what = {"frozen": "a frozen parameter", "buffer": "a buffer"}.get(
            info.kind, "not a parameter the optimizer owns"
        )
        trainable = [n for n, i in ckpt.infos.items() if i.kind == "trainable" and n not in ckpt.tied]
        raise TensorNotFoundError(
            f"No optimizer state for '{name}' in '{ckpt.metadata.path}': it is {what}, which the optimizer does not "
            f"own. Parameters with optimizer state: {_names(trainable)}.",
            path=ckpt.metadata.path,
            name=name,
        )
    return source_name, source


def moment_source(layout: OptimizerLayout, source: FlatPlan, key: str) -> FlatPlan:
    """The read plan of a parameter's ``key`` state: its fp32 master pieces, pointed at the moment tensors."""
    from ._zero import FlatPlan

    refs = layout.moments[key]
    return FlatPlan(source.pieces, refs)  # type: ignore[arg-type]  # None only where no piece reads


def _param_group_of(layout: OptimizerLayout, source: FlatPlan) -> int:
    return layout.param_group[source.pieces[0].group] if source.pieces else 0


def _step_of(layout: OptimizerLayout, source: FlatPlan) -> Any:
    """The parameter's ``step``: its state entry's (torch Adam), else its param group's (DeepSpeed FusedAdam)."""
    g = source.pieces[0].group if source.pieces else 0
    scalars = layout.scalars[g] if g < len(layout.scalars) else {}
    if "step" in scalars:
        return _plain(scalars["step"])
    return layout.param_groups[_param_group_of(layout, source)].get("step")


def optimizer_state(ckpt: Checkpoint, name: str) -> dict[str, Any]:
    """The consolidated optimizer state of one trainable parameter, reading only its bytes.

    The moments of every rank are gathered with the same piece plan as the parameter's fp32 master weight
    (DeepSpeed partitions them identically), so ``exp_avg`` and ``exp_avg_sq`` come back with the parameter's
    full shape, in their stored dtype (fp32).

    Args:
        ckpt: an open DeepSpeed ZeRO-1/2/3 checkpoint.
        name: a trainable parameter (a tied alias gives its source's state).

    Returns:
        ``{"exp_avg": Tensor, "exp_avg_sq": Tensor, ..., "step": ..., "lr": ..., "betas": ..., "eps": ...,
        "weight_decay": ..., ...}``: every per-element state tensor, the step as stored (a 0-d fp32 tensor for
        torch Adam/AdamW) and the hyper-parameters of the parameter's param group.

    Raises:
        TensorNotFoundError: no such tensor, or a frozen parameter or buffer (the optimizer holds no state).
        CheckpointFormatError: the checkpoint holds no optimizer moments (stripped or saved before a step).
        UnsupportedCheckpointError: a consolidated file or a ZeRO stage 0 checkpoint.

    Example:
        >>> with zeroio.open("fixtures/z3_ws2_fp32") as ckpt:  # doctest: +SKIP
        ...     state = ckpt.optimizer_state("emb.weight")
        >>> state["exp_avg"].shape, float(state["step"]), state["lr"]  # doctest: +SKIP
        (torch.Size([13, 7]), 2.0, 0.05)
    """
    zckpt = _zero_checkpoint(ckpt, "optimizer_state()")
    zckpt.ensure_open(name)
    _, source = _trainable_source(zckpt, name)
    layout = optimizer_layout(zckpt, what="optimizer_state()")
    from ._zero import read_plan_into

    info = zckpt.info(name)
    result: dict[str, Any] = {}
    for key, refs in layout.moments.items():
        dtype = next((r.dtype for rank in refs for r in rank if r is not None), torch.float32)
        out = torch.empty(info.numel, dtype=dtype)
        if info.numel:
            read_plan_into(moment_source(layout, source, key), 0, out)
        result[key] = out.view(info.shape)
    result["step"] = _step_of(layout, source)
    for key, value in layout.param_groups[_param_group_of(layout, source)].items():
        result.setdefault(key, value)
    return result


# --------------------------------------------------------------------------- convert(include_optimizer=True)


@dataclass(frozen=True, slots=True)
class OptimizerFiles:
    """The optimizer files :func:`zeroio.convert` writes beside the weights, planned from metadata."""

    layout: OptimizerLayout
    shards: ShardPlan
    """``optimizer.safetensors`` (or ``optimizer-0000K-of-0000N.safetensors``) and their tensors."""
    files: tuple[tuple[str, SafetensorsLayout], ...]
    index: str | None
    """``optimizer.safetensors.index.json`` text when sharded."""
    tensors: dict[str, tuple[str, str]]
    """``{file key: (parameter name, state key)}``, e.g. ``{"emb.weight.exp_avg": ("emb.weight", "exp_avg")}``."""
    summary: str
    """``optimizer.json``: param groups (hyper-parameters, step, parameter names) and the source's facts."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _step_json(value: Any) -> Any:
    value = _jsonable(value)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def plan_optimizer_files(ckpt: Checkpoint, names: Sequence[str], *, max_shard_size: int) -> OptimizerFiles:
    """Plan ``optimizer.safetensors`` (keys ``<param>.<state key>``) and ``optimizer.json`` from metadata.

    Only trainable parameters among ``names`` are written (tied aliases under their source's name only).

    Raises:
        the errors of :func:`optimizer_layout`, before anything is written.
    """
    zckpt = _zero_checkpoint(ckpt, "include_optimizer=True")
    layout = optimizer_layout(zckpt, what="include_optimizer=True")
    wanted = set(names)
    tensors: dict[str, tuple[str, str]] = {}
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    members: list[list[str]] = [[] for _ in layout.param_groups]
    steps: list[dict[str, Any]] = [{} for _ in layout.param_groups]
    for name, info in zckpt.infos.items():
        if name not in wanted or name in zckpt.tied or info.kind != "trainable":
            continue
        _, source = _trainable_source(zckpt, name)
        g = _param_group_of(layout, source)
        members[g].append(name)
        steps[g][name] = _step_json(_step_of(layout, source))
        for key, refs in layout.moments.items():
            dtype = next((r.dtype for rank in refs for r in rank if r is not None), torch.float32)
            tensors[f"{name}.{key}"] = (name, key)
            shapes[f"{name}.{key}"] = (dtype, info.shape)
    sizes = {k: math.prod(shape) * dtype.itemsize for k, (dtype, shape) in shapes.items()}
    shards = plan_shards(sizes, max_shard_size=max_shard_size, filename_pattern=OPTIMIZER_FILE_PATTERN)
    meta = {"format": "pt"}
    files = tuple(
        (filename, plan_file([(k, *shapes[k]) for k in keys], metadata=meta)) for filename, keys in shards.shards
    )
    groups = []
    for g, hyper in enumerate(layout.param_groups):
        group: dict[str, Any] = {"params": members[g]}
        distinct = {json.dumps(v) for v in steps[g].values()}
        if len(distinct) <= 1:
            group["step"] = next(iter(steps[g].values()), _step_json(hyper.get("step")))
        else:  # never seen: sub-groups of one param group that stepped differently
            group["step"] = steps[g]
        group.update((k, _jsonable(v)) for k, v in hyper.items() if k != "step")
        groups.append(group)
    meta_ck = zckpt.metadata
    tensors_of = {name for name, _ in tensors.values()}  # aliases share their source's state
    summary = {
        "format": _FORMAT,
        "state_keys": list(layout.moments),
        "tensor_key": "<parameter name>.<state key>",
        "files": [filename for filename, _ in shards.shards],
        "param_groups": groups,
        "tied": {a: s for a, s in zckpt.tied.items() if a in wanted and s in tensors_of},
        "source": {
            "tag": meta_ck.tag,
            "zero_stage": meta_ck.zero_stage,
            "world_size": meta_ck.world_size,
            "global_step": meta_ck.global_step,
            "ds_version": meta_ck.ds_version,
        },
    }
    index = index_json(shards) if shards.is_sharded else None
    return OptimizerFiles(layout, shards, files, index, tensors, json.dumps(summary, indent=2) + "\n")


def _chunks(
    ckpt: ZeroCheckpoint, source: FlatPlan, numel: int, dtype: torch.dtype, chunk_bytes: int
) -> Iterator[torch.Tensor]:
    from ._zero import read_plan_into

    step = max(1, chunk_bytes // dtype.itemsize)
    buf = torch.empty(min(step, numel), dtype=dtype)
    for start in range(0, numel, step):
        n = min(step, numel - start)
        read_plan_into(source, start, buf[:n])
        yield buf[:n]


def write_optimizer_files(
    ckpt: Checkpoint, plan: OptimizerFiles, folder: Path, *, chunk_bytes: int
) -> tuple[Path, ...]:
    """Stream the planned optimizer files into ``folder`` (memory: one chunk); index and JSON last."""
    zckpt = _zero_checkpoint(ckpt, "include_optimizer=True")
    written = []
    for filename, layout in plan.files:
        fd = create_new(folder / filename)
        try:
            preallocate(fd, layout.size)
            pwrite_all(fd, layout.header, 0)
            for slot in layout.slots:
                name, key = plan.tensors[slot.name]
                _, source = _trainable_source(zckpt, name)
                zckpt.ensure_open(name)
                chunks = _chunks(
                    zckpt, moment_source(plan.layout, source, key), math.prod(slot.shape), slot.dtype, chunk_bytes
                )
                write_chunks(fd, slot, chunks)
            os.fsync(fd)
        finally:
            os.close(fd)
        written.append(folder / filename)
    if plan.index is not None:
        write_new_file(folder / OPTIMIZER_INDEX, plan.index)
        written.append(folder / OPTIMIZER_INDEX)
    write_new_file(folder / OPTIMIZER_JSON, plan.summary)
    written.append(folder / OPTIMIZER_JSON)
    logger.debug("wrote optimizer state of %d tensors to %s", len(plan.tensors), folder)
    return tuple(written)
