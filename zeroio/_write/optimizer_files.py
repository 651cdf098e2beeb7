"""Optimizer state export: ``optimizer.safetensors`` and ``optimizer.json`` beside converted weights."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._dtypes import to_torch
from .._formats import (
    Checkpoint,
    ComposedOptimizerState,
    FlatPlan,
    OptimizerLayout,
    PartitionedCheckpoint,
    moment_source,
    optimizer_layout,
    param_group_of,
    read_plan_into,
    require_partitioned,
    state_dtype,
    state_keys_of,
    step_of,
    trainable_source,
)
from .._io.fileio import create_new, preallocate, pwrite_all, write_new_file
from .._messages import get_logger
from ..errors import TensorNotFoundError, UnsupportedCheckpointError
from .safetensors_writer import SafetensorsLayout, plan_file, write_chunks
from .sharding import ShardPlan, index_json, plan_shards

__all__ = ["OPTIMIZER_INDEX", "OPTIMIZER_JSON", "OptimizerFiles", "plan_optimizer_files", "write_optimizer_files"]

logger = get_logger(__name__)

OPTIMIZER_FILE_PATTERN = "optimizer{suffix}.safetensors"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
OPTIMIZER_JSON = "optimizer.json"
_FORMAT = "zeroio.optimizer.v1"

# --------------------------------------------------------------------------- convert(include_optimizer=True)


@dataclass(frozen=True, slots=True)
class OptimizerFiles:
    """The optimizer files :func:`zeroio.convert` writes beside the weights, planned from metadata."""

    layout: OptimizerLayout | None
    """None for pipeline and tensor-parallel checkpoints: each parameter's state comes from ``optimizer_state``."""
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
    if isinstance(ckpt, ComposedOptimizerState) and not isinstance(ckpt, PartitionedCheckpoint):
        return _plan_composed(ckpt, names, max_shard_size=max_shard_size)
    zckpt = require_partitioned(ckpt, "include_optimizer=True")
    layout = optimizer_layout(zckpt, what="include_optimizer=True", by_name=True)
    wanted = set(names)
    tensors: dict[str, tuple[str, str]] = {}
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    members: list[list[str]] = [[] for _ in layout.param_groups]
    steps: list[dict[str, Any]] = [{} for _ in layout.param_groups]
    for name, info in zckpt.infos.items():
        if name not in wanted or name in zckpt.tied or info.kind != "trainable":
            continue
        _, source = trainable_source(zckpt, name)
        g = param_group_of(layout, source)
        members[g].append(name)
        steps[g][name] = _step_json(step_of(layout, source))
        for key in state_keys_of(layout, source):  # each param group's own keys (Muon: two halves)
            tensors[f"{name}.{key}"] = (name, key)
            shapes[f"{name}.{key}"] = (state_dtype(layout, key), info.shape)
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


def _plan_composed(ckpt: Checkpoint, names: Sequence[str], *, max_shard_size: int) -> OptimizerFiles:
    """Plan the optimizer files of a pipeline or tensor-parallel checkpoint from each parameter's state spec
    (keys, dtypes, merged shapes; nothing read). Param groups are the distinct hyper-parameter sets."""
    assert isinstance(ckpt, ComposedOptimizerState)
    wanted = set(names)
    tensors: dict[str, tuple[str, str]] = {}
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    groups: dict[str, dict[str, Any]] = {}
    steps: dict[str, dict[str, Any]] = {}
    keys: dict[str, None] = {}
    trainable = [n for n, i in ckpt.infos.items() if n in wanted and n not in ckpt.tied and i.kind == "trainable"]
    if not trainable:
        for name in list(ckpt.infos)[:1]:
            with contextlib.suppress(TensorNotFoundError):
                ckpt.optimizer_state_spec(name)  # the reader's own reason (e.g. state it cannot read), by name
        raise UnsupportedCheckpointError(
            f"'{ckpt.metadata.path}' has no parameters with optimizer state; drop include_optimizer.",
            path=ckpt.metadata.path,
        )
    for name in trainable:
        spec = ckpt.optimizer_state_spec(name)
        state = [k for k, v in spec.items() if isinstance(v, torch.Tensor) and v.device.type == "meta"]
        hyper = {k: _jsonable(v) for k, v in spec.items() if k not in state and k != "step"}
        group = groups.setdefault(json.dumps(hyper, sort_keys=True), {"params": [], **hyper})
        group["params"].append(name)
        steps.setdefault(json.dumps(hyper, sort_keys=True), {})[name] = _step_json(spec.get("step"))
        for key in state:
            keys[key] = None
            tensors[f"{name}.{key}"] = (name, key)
            shapes[f"{name}.{key}"] = (spec[key].dtype, tuple(spec[key].shape))
    sizes = {k: math.prod(shape) * dtype.itemsize for k, (dtype, shape) in shapes.items()}
    shards = plan_shards(sizes, max_shard_size=max_shard_size, filename_pattern=OPTIMIZER_FILE_PATTERN)
    files = tuple(
        (filename, plan_file([(k, *shapes[k]) for k in ks], metadata={"format": "pt"}))
        for filename, ks in shards.shards
    )
    param_groups = []
    for key, group in groups.items():
        distinct = {json.dumps(v) for v in steps[key].values()}
        step = next(iter(steps[key].values())) if len(distinct) <= 1 else steps[key]
        param_groups.append({"params": group.pop("params"), "step": step, **group})
    meta = ckpt.metadata
    summary = {
        "format": _FORMAT,
        "state_keys": list(keys),
        "tensor_key": "<parameter name>.<state key>",
        "files": [filename for filename, _ in shards.shards],
        "param_groups": param_groups,
        "tied": {a: s for a, s in ckpt.tied.items() if a in wanted and s in {n for n, _ in tensors.values()}},
        "source": {
            "tag": meta.tag,
            "zero_stage": meta.zero_stage,
            "world_size": meta.world_size,
            "layout": meta.layout,
            "parallel": meta.parallel,
            "global_step": meta.global_step,
            "ds_version": meta.ds_version,
        },
    }
    index = index_json(shards) if shards.is_sharded else None
    return OptimizerFiles(None, shards, files, index, tensors, json.dumps(summary, indent=2) + "\n")


def _state_chunks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[torch.Tensor]:
    flat = tensor.reshape(-1)
    step = max(1, chunk_bytes // tensor.dtype.itemsize)
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


def _chunks(
    ckpt: PartitionedCheckpoint, source: FlatPlan, numel: int, dtype: torch.dtype, chunk_bytes: int
) -> Iterator[torch.Tensor]:
    step = max(1, chunk_bytes // dtype.itemsize)
    buf = torch.empty(min(step, numel), dtype=dtype)
    for start in range(0, numel, step):
        n = min(step, numel - start)
        read_plan_into(source, start, buf[:n])
        yield buf[:n]


def write_optimizer_files(
    ckpt: Checkpoint, plan: OptimizerFiles, folder: Path, *, chunk_bytes: int
) -> tuple[Path, ...]:
    """Stream the planned optimizer files into ``folder`` (memory: one chunk; for a pipeline or tensor-parallel
    checkpoint one parameter's state); index and JSON last."""
    zckpt = None if plan.layout is None else require_partitioned(ckpt, "include_optimizer=True")
    written = []
    held: tuple[str, dict[str, Any]] = ("", {})
    for filename, layout in plan.files:
        fd = create_new(folder / filename)
        try:
            preallocate(fd, layout.size)
            pwrite_all(fd, layout.header, 0)
            for slot in layout.slots:
                name, key = plan.tensors[slot.name]
                if zckpt is None or plan.layout is None:
                    if held[0] != name:
                        held = (name, ckpt.optimizer_state(name))
                    write_chunks(fd, slot, _state_chunks(held[1][key], chunk_bytes))
                    continue
                _, source = trainable_source(zckpt, name)
                zckpt.ensure_open(name)
                chunks = _chunks(
                    zckpt,
                    moment_source(plan.layout, source, key),
                    math.prod(slot.shape),
                    to_torch(slot.dtype),
                    chunk_bytes,
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
