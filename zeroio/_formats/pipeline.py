"""DeepSpeed pipeline-parallel checkpoints (``deepspeed.pipe.PipelineModule``): every stage merged into one state dict.

Each stage is a ZeRO-1 checkpoint of its own (``mp_rank_SS_model_states.pt`` records its ``param_shapes``; its
data-parallel ranks' optimizer files hold the fp32 masters); the layer files hold what no optimizer has: frozen
parameters and buffers, as the replica that wrote the file had them. Names are ``PipelineModule.state_dict()``
names (``tied_modules.<key>.<param>`` for a ``TiedLayerSpec``, ``<layer index>.<param>`` otherwise).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from .. import _constants as C
from .._layout import ZeroLayout, find_tag_dir
from .._metadata import CheckpointMetadata, TensorInfo, require_dict
from .._pickles import RankFile, TensorRef, load_pickle
from ..errors import CheckpointFormatError, CheckpointNotFoundError, PartitionMismatchError, UnsupportedCheckpointError
from .pipeline_files import PipelineFiles, has_layer_files, layer_file_name, scan_pipeline_dir
from .planned import PlannedCheckpoint
from .plans import TensorPlans, WholePlan, buffer_plans, casts_to
from .provenance import (
    MIXED_SAVES,
    archive_records,
    check_archive_names,
    check_distinct_partitions,
    check_optimizer_steps,
)
from .validate import (
    ModelStates,
    base_optimizer_state,
    optimizer_partitions,
    param_shapes,
    tensor_ref,
)
from .zero import open_zero
from .zero12 import zero12_trainable

__all__ = ["PipelineCheckpoint", "open_pipeline"]

logger = logging.getLogger(__name__)

_TIED = "tied_modules."


class PipelineCheckpoint(PlannedCheckpoint):
    """A DeepSpeed pipeline-parallel checkpoint, its stages merged lazily; build it with :func:`zeroio.open`."""


class _Parsed:
    """The files unpickled while opening (restricted, lazy), kept open for the checkpoint's lifetime."""

    def __init__(self, trusted_globals: frozenset[str]) -> None:
        self.trusted_globals = trusted_globals
        self.opened: list[RankFile] = []

    def parse(self, path: Path) -> Any:
        tree, file = load_pickle(path, trusted_globals=self.trusted_globals)
        self.opened.append(file)
        return tree


def open_pipeline(path: Path, tag: str | None, trusted_globals: frozenset[str]) -> PlannedCheckpoint:
    """Open a pipeline checkpoint; a tag folder without layer files is a plain ZeRO one."""
    tag_dir, tag_name = find_tag_dir(path, tag)
    if not has_layer_files(tag_dir):
        return open_zero(path, tag, trusted_globals=trusted_globals)
    files = scan_pipeline_dir(tag_dir)
    parsed = _Parsed(trusted_globals)
    try:
        return _open(files, tag_name, parsed)
    except BaseException:
        for file in parsed.opened:
            file.close()
        raise


def _open(files: PipelineFiles, tag_name: str | None, parsed: _Parsed) -> PipelineCheckpoint:
    # 1. Each stage: its model states (param_shapes, buffer_names) and its dp ranks' fp32 partitions.
    trainable = TensorPlans()
    buffers: list[str] = []
    trees = []
    zero_stages: set[int] = set()
    stage_of: dict[str, int] = {}
    for stage, model_path in enumerate(files.model_files):
        tree = require_dict(parsed.parse(model_path), "model states", model_path)
        trees.append(tree)
        if tree.get(C.MODULE) is not None:
            raise CheckpointFormatError(
                f"'{model_path}' holds a 'module' state dict, which a pipeline stage's model states never do "
                f"(its weights live in the layer files): {MIXED_SAVES}",
                path=model_path,
            )
        states = ModelStates(model_path, tree, {}, [str(b) for b in (tree.get(C.BUFFER_NAMES) or [])])
        buffers += [b for b in states.buffer_names if b not in buffers]
        stage_plans, zero_stage = _stage_trainable(files, stage, states, parsed)
        zero_stages.add(zero_stage)
        for name, info in stage_plans.infos.items():
            if name not in trainable.infos:
                trainable.add(info, stage_plans.plans[name])
                stage_of[name] = stage
            elif trainable.infos[name].shape != info.shape:  # a tied weight: every stage holds an fp32 copy
                raise PartitionMismatchError(
                    f"'{model_path}': tied parameter '{name}' has shape {info.shape}, stage {stage_of[name]} records "
                    f"{trainable.infos[name].shape}: {MIXED_SAVES}",
                    path=model_path,
                    name=name,
                )
    _check_same_step(files.model_files, trees)

    # 2. Layer files: names, frozen parameters and buffers.
    found, order, train_dtype = _layer_tensors(files, trainable, buffers, parsed)
    infos = {name: found.infos.get(name) or trainable.infos[name] for name in order}
    plans = {name: found.plans.get(name) or trainable.plans[name] for name in order}
    metadata = _metadata(files, tag_name, trees[0], max(zero_stages), train_dtype)
    logger.debug("opened %s: pipeline pp=%d dp=%d, %d tensors", files.tag_dir, files.pp, files.dp, len(infos))
    return PipelineCheckpoint(metadata, infos, {}, plans, parsed.opened)


def _stage_trainable(files: PipelineFiles, stage: int, states: ModelStates, parsed: _Parsed) -> tuple[TensorPlans, int]:
    """One stage's trainable parameters: fp32 masters partitioned over its data-parallel ranks (ZeRO-1)."""
    shapes = param_shapes(states)
    optim_files = files.optim_files[stage]
    layout = ZeroLayout(files.tag_dir, optim_files, (states.path,), False)
    optim_trees = [parsed.parse(p) for p in optim_files]
    records = {p: archive_records(p) for p in (states.path, *optim_files)}
    check_archive_names([(None, states.path), *enumerate(optim_files)], records)
    check_optimizer_steps(optim_files, [base_optimizer_state(t) for t in optim_trees], records)
    if len(optim_files) > 1:
        check_distinct_partitions(optim_files, records)
    optim = optimizer_partitions(layout, optim_trees, states.tree.get(C.DS_CONFIG), files.tag_dir)
    if optim.stage != 1 and optim.stage != 2:
        raise UnsupportedCheckpointError(
            f"'{optim_files[0]}' records ZeRO stage {optim.stage}; DeepSpeed pipelines train with ZeRO stage 0 or 1.",
            path=optim_files[0],
            found=optim.stage,
        )
    return zero12_trainable(shapes.groups, optim, None, states.path, files.tag_dir), optim.stage


def _check_same_step(model_files: tuple[Path, ...], trees: list[dict[Any, Any]]) -> None:
    """Every stage's model states come from one save: the same global step."""
    steps = [tree.get(C.GLOBAL_STEPS) for tree in trees]
    for path, step in zip(model_files, steps):
        if step != steps[0]:
            raise CheckpointFormatError(
                f"'{path}' records global step {step}, stage 0 records {steps[0]}: {MIXED_SAVES}", path=path
            )


def _tied_modules(names: list[str]) -> dict[str, set[str]]:
    """``{tie key: its layer-local names}`` from ``tied_modules.<key>.<local>`` names."""
    tied: dict[str, set[str]] = {}
    for name in names:
        if name.startswith(_TIED):
            key, _, local = name[len(_TIED) :].partition(".")
            tied.setdefault(key, set()).add(local)
    return tied


def _layer_prefix(layer: int, keys: list[str], known: set[str], tied: dict[str, set[str]], path: Path) -> str:
    """The state_dict prefix of a layer file's keys: ``<layer>.``, or ``tied_modules.<key>.`` for a tied layer."""
    if any(f"{layer}.{k}" in known for k in keys):
        return f"{layer}."
    matches = [key for key, local in tied.items() if local == set(keys)]
    if len(matches) > 1:
        raise UnsupportedCheckpointError(
            f"'{path}' could be the layer of tied modules {sorted(matches)} (same parameter names); zeroio cannot "
            "tell which one. Use DeepSpeed's ds_to_universal.py for this one.",
            path=path,
        )
    return f"{_TIED}{matches[0]}." if matches else f"{layer}."


def _layer_tensors(
    files: PipelineFiles, trainable: TensorPlans, buffers: list[str], parsed: _Parsed
) -> tuple[TensorPlans, list[str], torch.dtype]:
    """Frozen parameters and buffers from the layer files, and every key in ``PipelineModule.state_dict()`` order."""
    known = set(trainable.infos) | set(buffers)
    tied = _tied_modules([*trainable.infos, *buffers])
    found = TensorPlans()
    train_dtype = torch.float32
    tied_order: list[str] = []
    layer_order: list[str] = []
    records = {p: archive_records(p) for p in files.layer_files.values()}
    for layer, path in files.layer_files.items():
        root = records[path].root
        if root not in (None, "archive", path.name[: -len(".pt")]):
            raise CheckpointFormatError(f"'{path}' was saved as '{root}.pt': {MIXED_SAVES}", path=path)
        tree = require_dict(parsed.parse(path), "layer state dict", path)
        keys = [str(k) for k in tree]
        prefix = _layer_prefix(layer, keys, known, tied, path)
        order = tied_order if prefix.startswith(_TIED) else layer_order
        if prefix.startswith(_TIED) and prefix + keys[0] in tied_order:
            continue  # a later stage's copy of a tied module: the first stage's file is the one DeepSpeed loads
        named = {prefix + k: tensor_ref(v, f"layer tensor '{k}'", path) for k, v in tree.items()}
        found.update(buffer_plans(named, [n for n in named if n in buffers], path))
        for name, ref in named.items():
            order.append(name)
            if name in trainable.infos:
                train_dtype = ref.dtype if ref.dtype.is_floating_point else train_dtype
                if tuple(ref.shape) != trainable.infos[name].shape:
                    raise PartitionMismatchError(
                        f"'{path}': '{name}' has shape {tuple(ref.shape)}, the optimizer's fp32 master "
                        f"{trainable.infos[name].shape}: {MIXED_SAVES}",
                        path=path,
                        name=name,
                    )
            elif name not in buffers:
                found.add(TensorInfo(name, tuple(ref.shape), ref.dtype, "frozen", (path,)), WholePlan(ref))
        _check_same_save(path, named, trainable)
    seen = set(tied_order) | set(layer_order)
    for name in [*trainable.infos, *buffers]:
        if name not in seen:
            raise _no_layer_file(files.tag_dir, name)
    return found, tied_order + layer_order, train_dtype


def _check_same_save(path: Path, named: dict[str, TensorRef], trainable: TensorPlans) -> None:
    """A layer file's first trainable tensor must be its fp32 master cast to the training dtype.

    DeepSpeed copies the updated master into the parameter after every step, so a layer file from another save
    (whose frozen parameters and buffers would otherwise be served silently) shows here; one tensor per file is
    compared, at both ends.
    """
    name = next((n for n in named if n in trainable.infos), None)
    if name is None:
        return
    info, ref = trainable.infos[name], named[name]  # shapes already checked
    if ref.dtype.is_floating_point and not casts_to(trainable.plans[name], ref, info.numel, info.dtype):
        raise CheckpointFormatError(
            f"'{path}': '{name}' is not the optimizer's fp32 master cast to {ref.dtype}, so the layer file comes "
            f"from another save than the optimizer files: {MIXED_SAVES}",
            path=path,
            name=name,
        )


def _no_layer_file(tag_dir: Path, name: str) -> CheckpointNotFoundError:
    head = name.split(".")[0]
    if head.isdigit():
        path = tag_dir / layer_file_name(int(head))
        what = f"'{path}' is missing or lacks '{name}'"
    else:
        path = tag_dir
        what = f"no layer file in '{tag_dir}' holds '{name}'"
    return CheckpointNotFoundError(
        f"{what}: the stage's writer failed or the copy is incomplete; copy the whole tag folder again.",
        path=path,
        name=name,
    )


def _metadata(
    files: PipelineFiles, tag_name: str | None, model0: dict[Any, Any], zero_stage: int, train_dtype: torch.dtype
) -> CheckpointMetadata:
    return CheckpointMetadata(
        format="zero",
        path=files.tag_dir,
        tag=tag_name,
        zero_stage=zero_stage,
        world_size=files.dp,
        train_dtype=train_dtype,
        ds_version=str(model0.get(C.DS_VERSION)) if model0.get(C.DS_VERSION) is not None else None,
        global_step=int(model0[C.GLOBAL_STEPS]) if isinstance(model0.get(C.GLOBAL_STEPS), int) else None,
        has_fp32_master=True,
        layout="pipeline",
        parallel={"dp": files.dp, "pp": files.pp},
        extra={
            "ds_config": model0.get(C.DS_CONFIG),
            "model_files": [p.name for p in files.model_files],
            "optim_files": [p.name for stage in files.optim_files for p in stage],
            "layer_files": [p.name for p in files.layer_files.values()],
        },
    )
