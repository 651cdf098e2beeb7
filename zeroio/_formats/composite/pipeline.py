"""DeepSpeed pipeline-parallel checkpoints (``deepspeed.pipe.PipelineModule``): every stage merged into one state dict.

Each stage is a ZeRO-1 checkpoint of its own (``mp_rank_SS_model_states.pt`` records its ``param_shapes``; its
data-parallel ranks' optimizer files hold the fp32 masters); the layer files hold what no optimizer has: frozen
parameters and buffers, as the replica that wrote the file had them. Names are ``PipelineModule.state_dict()``
names (``tied_modules.<key>.<param>`` for a ``TiedLayerSpec``, ``<layer index>.<param>`` otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._dtypes import FLOAT32, DType
from ..._messages import get_logger, listing
from ..._pickles import RankFile, TensorRef, load_pickle
from ...errors import CheckpointFormatError, CheckpointNotFoundError, PartitionMismatchError, UnsupportedCheckpointError
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo, require_dict
from ..optimizer.views import StageView, stage_of, stage_views
from ..options import ReadOptions
from ..planned_checkpoint import PlannedCheckpoint
from ..read_plans import TensorPlans, WholePlan, buffer_plans, casts_to
from ..tp_rules import Rule, describe_rule, parse_tp_rules
from ..validate import (
    ModelStates,
    base_optimizer_state,
    config_flag,
    config_stage,
    param_shapes,
    tensor_ref,
)
from ..zero.file_layout import ZeroLayout, find_tag_dir
from ..zero.flat_partitions import OptimizerPartitions, optimizer_partitions
from ..zero.provenance import (
    MIXED_SAVES,
    archive_records,
    check_archive_names,
    check_distinct_partitions,
    check_optimizer_steps,
)
from ..zero.reader import open_zero
from ..zero.stage12_plans import zero12_trainable
from .pipeline_files import PipelineFiles, has_layer_files, layer_file_name, scan_pipeline_dir
from .tensor_parallel import TensorParallelCheckpoint, plan_tp_merges

__all__ = ["PipelineCheckpoint", "open_pipeline"]

logger = get_logger(__name__)

_TIED = "tied_modules."


class PipelineCheckpoint(PlannedCheckpoint):
    """A DeepSpeed pipeline-parallel checkpoint, its stages merged lazily; build it with :func:`zeroio.open`."""

    # ---- optimizer state (zeroio/_formats/optimizer/views.py): each stage is a ZeRO-1 checkpoint of its own.
    _stages: dict[str, StageView] | None = None

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The Adam moments, step and hyper-parameters of a trainable parameter, from the stage that holds it."""
        return self._stage_of(name).optimizer_state(self.source_name(name))

    def optimizer_state_spec(self, name: str) -> dict[str, Any]:
        """As :meth:`optimizer_state` with meta tensors (keys, dtypes, shapes): nothing read."""
        return self._stage_of(name).optimizer_state(self.source_name(name), meta=True)

    def _stage_of(self, name: str) -> StageView:
        info = self.info(name)
        if self._stages is None:
            self._stages = stage_views(self.metadata, self.infos, self._sources, self.ensure_open, self._files)
        return stage_of(self._stages, self.info(self.source_name(info.name)), self.metadata.path)


class _Parsed:
    """The files unpickled while opening (restricted, lazy), kept open for the checkpoint's lifetime."""

    def __init__(self, trusted_globals: frozenset[str]) -> None:
        self.trusted_globals = trusted_globals
        self.opened: list[RankFile] = []

    def parse(self, path: Path) -> Any:
        tree, file = load_pickle(path, trusted_globals=self.trusted_globals)
        self.opened.append(file)
        return tree


def open_pipeline(path: Path, options: ReadOptions) -> Checkpoint:
    """Open a pipeline checkpoint; a tag folder without layer files is a plain ZeRO one.

    With tensor parallelism (``layer_XX-model_YY`` files) each tp rank's stages are merged as a pipeline, then the
    tp ranks' shards are merged by ``tp_rules``: ``PipelineModule`` records no partition, so the rules decide and a
    tensor they do not describe is refused by name.
    """
    tag, trusted_globals, tp_rules = options.tag, options.trusted_globals, options.tp_rules
    tag_dir, tag_name = find_tag_dir(path, tag)
    if not has_layer_files(tag_dir):
        return open_zero(path, tag, trusted_globals=trusted_globals)
    per_tp = scan_pipeline_dir(tag_dir)
    opened: list[PipelineCheckpoint] = []
    parsed = _Parsed(trusted_globals)
    try:
        for files in per_tp:
            parsed = _Parsed(trusted_globals)
            opened.append(_open(files, tag_name, parsed))
        if len(opened) == 1:
            return opened[0]
        return _merge_tp(per_tp, opened, parse_tp_rules(tp_rules))
    except BaseException:
        for file in parsed.opened:
            file.close()
        for ckpt in opened:
            ckpt.close()
        raise


def _merge_tp(
    per_tp: tuple[PipelineFiles, ...], ranks: list[PipelineCheckpoint], rules: dict[str, Rule] | None
) -> TensorParallelCheckpoint:
    """One checkpoint from the tp ranks' merged pipelines, each tensor concatenated or replicated by ``rules``."""
    files0, meta0 = per_tp[0], ranks[0].metadata
    for files, rank in zip(per_tp[1:], ranks[1:]):
        if list(rank.infos) != list(ranks[0].infos):
            differ = sorted(set(rank.infos) ^ set(ranks[0].infos))
            raise CheckpointFormatError(
                f"'{files.model_files[0]}' holds other tensors than tensor-parallel rank 0 "
                f"({listing(differ) or 'another order'}): {MIXED_SAVES}",
                path=files.model_files[0],
                found=differ,
            )
        if rank.metadata.global_step != meta0.global_step:
            raise CheckpointFormatError(
                f"'{files.model_files[0]}' records global step {rank.metadata.global_step}, tensor-parallel rank 0 "
                f"{meta0.global_step}: {MIXED_SAVES}",
                path=files.model_files[0],
            )
    tp = len(ranks)
    kind = f"pipeline + tensor parallel (pp={files0.pp}, tp={tp}; PipelineModule records no partition)"
    plan = plan_tp_merges(files0.tag_dir, ranks, rules, {}, kind)
    extra = dict(meta0.extra)
    for key in ("model_files", "optim_files", "layer_files"):
        extra[key] = sorted(name for rank in ranks for name in rank.metadata.extra.get(key, []))
    extra["tp_partition"] = {name: describe_rule(merge.rule) for name, merge in plan.merges.items()}
    extra["tp_rule_source"] = dict(plan.sources)
    metadata = replace(meta0, parallel={"dp": files0.dp, "pp": files0.pp, "tp": tp}, extra=extra)
    logger.debug("opened %s: pipeline pp=%d tp=%d dp=%d", files0.tag_dir, files0.pp, tp, files0.dp)
    return TensorParallelCheckpoint(metadata, plan.infos, plan.tied, ranks, plan.merges)


@dataclass(frozen=True, slots=True)
class _Stage:
    """One pipeline stage, validated: its model states, its dp ranks' fp32 partitions, its trainable names."""

    states: ModelStates
    optim: OptimizerPartitions
    groups: list[list[str]]
    """Trainable names per param group, in partition order."""
    shapes: dict[str, tuple[int, ...]]
    """Recorded shapes (``param_shapes``; empty under ZeRO-0, where the layer files give them)."""


def _open(files: PipelineFiles, tag_name: str | None, parsed: _Parsed) -> PipelineCheckpoint:
    # 1. Each stage: its model states (param_shapes, buffer_names) and its dp ranks' fp32 partitions.
    stages = [_read_stage(files, stage, parsed) for stage in range(files.pp)]
    _check_same_step(files.model_files, [stage.states.tree for stage in stages])
    names = list(dict.fromkeys(n for stage in stages for group in stage.groups for n in group))
    buffers = list(dict.fromkeys(b for stage in stages for b in stage.states.buffer_names))

    # 2. Layer files: which state_dict name each of their keys has, in key order.
    layers, order = _name_layers(files, names, buffers, parsed)
    by_name = {name: ref for _, named in layers for name, ref in named.items()}

    # 3. Trainable parameters: each stage's fp32 masters; a tied weight from the first stage that holds it.
    trainable = TensorPlans()
    for stage in stages:
        path = stage.states.path
        groups = [
            [(n, stage.shapes.get(n) or _layer_shape(by_name, n, files.tag_dir)) for n in g] for g in stage.groups
        ]
        round_robin = config_flag(stage.states.tree.get(C.DS_CONFIG), "round_robin_gradients")
        planned = zero12_trainable(groups, stage.optim, None, path, files.tag_dir, round_robin=round_robin)
        for name, info in planned.infos.items():
            if name not in trainable.infos:
                trainable.add(info, planned.plans[name])
            elif trainable.infos[name].shape != info.shape:  # a tied weight: every stage holds an fp32 copy
                raise PartitionMismatchError(
                    f"'{path}': tied parameter '{name}' has shape {info.shape}, an earlier stage records "
                    f"{trainable.infos[name].shape}: {MIXED_SAVES}",
                    path=path,
                    name=name,
                )

    # 4. Frozen parameters and buffers from the layer files, each file checked against the masters.
    found, train_dtype = _layer_tensors(layers, trainable, buffers)
    infos = {name: found.infos.get(name) or trainable.infos[name] for name in order}
    plans = {name: found.plans.get(name) or trainable.plans[name] for name in order}
    model0 = stages[0].states.tree
    metadata = _metadata(files, tag_name, model0, config_stage(model0.get(C.DS_CONFIG), default=1), train_dtype)
    logger.debug("opened %s: pipeline pp=%d dp=%d, %d tensors", files.tag_dir, files.pp, files.dp, len(infos))
    return PipelineCheckpoint(metadata, infos, {}, plans, parsed.opened)


def _read_stage(files: PipelineFiles, stage: int, parsed: _Parsed) -> _Stage:
    """One stage's model states and optimizer partitions (ZeRO-1; ZeRO-0 bf16 trains with BF16_Optimizer)."""
    model_path = files.model_files[stage]
    tree = require_dict(parsed.parse(model_path), "model states", model_path)
    if tree.get(C.MODULE) is not None:
        raise CheckpointFormatError(
            f"'{model_path}' holds a 'module' state dict, which a pipeline stage's model states never do "
            f"(its weights live in the layer files): {MIXED_SAVES}",
            path=model_path,
        )
    states = ModelStates(model_path, tree, {}, [str(b) for b in (tree.get(C.BUFFER_NAMES) or [])])
    optim_files = files.optim_files[stage]
    layout = ZeroLayout(files.tag_dir, optim_files, (model_path,), False)
    optim_trees = [parsed.parse(p) for p in optim_files]
    records = {p: archive_records(p) for p in (model_path, *optim_files)}
    check_archive_names([(None, model_path), *enumerate(optim_files)], records)
    check_optimizer_steps(optim_files, [base_optimizer_state(t) for t in optim_trees], records)
    if len(optim_files) > 1:
        check_distinct_partitions(optim_files, records)
    # BF16_Optimizer records no stage and partitions like ZeRO-1 whatever the configured stage (0 or 1).
    optim = optimizer_partitions(layout, optim_trees, None, files.tag_dir)
    if optim.stage != 1 and optim.stage != 2:
        raise UnsupportedCheckpointError(
            f"'{optim_files[0]}' records ZeRO stage {optim.stage}; DeepSpeed pipelines train with ZeRO stage 0 or 1.",
            path=optim_files[0],
            found=optim.stage,
        )
    if states.param_shapes is None:  # ZeRO-0: the names are in the optimizer's slice mappings only
        return _Stage(states, optim, _slice_mapping_names(optim, optim_files[0]), {})
    shapes = param_shapes(states)
    return _Stage(states, optim, [[n for n, _ in g] for g in shapes.groups], dict(p for g in shapes.groups for p in g))


def _slice_mapping_names(optim: OptimizerPartitions, path: Path) -> list[list[str]]:
    """Trainable names per param group from every rank's ``param_slice_mappings``, in partition order."""
    groups: list[list[str]] = []
    for rank, mappings in enumerate(optim.slice_mappings):
        if not isinstance(mappings, (list, tuple)) or len(mappings) != len(optim.flat_groups[rank]):
            raise CheckpointFormatError(
                f"'{optim.files[rank]}' records neither param_shapes nor one param_slice_mappings per fp32 group; "
                "zeroio cannot name its parameters.",
                path=optim.files[rank],
            )
        for g, mapping in enumerate(mappings):
            if g == len(groups):
                groups.append([])
            groups[g] += [str(n) for n in require_dict(mapping, C.PARAM_SLICE_MAPPINGS, path) if n not in groups[g]]
    return groups


def _layer_shape(by_name: dict[str, TensorRef], name: str, tag_dir: Path) -> tuple[int, ...]:
    if name not in by_name:
        raise _no_layer_file(tag_dir, name)
    return tuple(by_name[name].shape)


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


def _name_layers(
    files: PipelineFiles, trainable: list[str], buffers: list[str], parsed: _Parsed
) -> tuple[list[tuple[Path, dict[str, TensorRef]]], list[str]]:
    """Each layer file's tensors under their state_dict names, and every key in ``PipelineModule.state_dict()`` order."""
    known = set(trainable) | set(buffers)
    tied = _tied_modules([*trainable, *buffers])
    layers: list[tuple[Path, dict[str, TensorRef]]] = []
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
        if prefix.startswith(_TIED) and keys and prefix + keys[0] in tied_order:
            continue  # a later stage's copy of a tied module: the first stage's file is the one DeepSpeed loads
        named = {prefix + str(k): tensor_ref(v, f"layer tensor '{k}'", path) for k, v in tree.items()}
        layers.append((path, named))
        (tied_order if prefix.startswith(_TIED) else layer_order).extend(named)
    seen = set(tied_order) | set(layer_order)
    for name in [*trainable, *buffers]:
        if name not in seen:
            raise _no_layer_file(files.tag_dir, name)
    return layers, tied_order + layer_order


def _layer_tensors(
    layers: list[tuple[Path, dict[str, TensorRef]]], trainable: TensorPlans, buffers: list[str]
) -> tuple[TensorPlans, DType]:
    """Frozen parameters and buffers from the layer files (checked against the masters), and the training dtype."""
    found = TensorPlans()
    train_dtype = FLOAT32
    for path, named in layers:
        found.update(buffer_plans(named, [n for n in named if n in buffers], path))
        for name, ref in named.items():
            if name in trainable.infos:
                train_dtype = ref.dtype_spec if ref.dtype_spec.is_floating_point else train_dtype
                if tuple(ref.shape) != trainable.infos[name].shape:
                    raise PartitionMismatchError(
                        f"'{path}': '{name}' has shape {tuple(ref.shape)}, the optimizer's fp32 master "
                        f"{trainable.infos[name].shape}: {MIXED_SAVES}",
                        path=path,
                        name=name,
                    )
            elif name not in buffers:
                found.add(TensorInfo(name, tuple(ref.shape), ref.dtype_spec, "frozen", (path,)), WholePlan(ref))
        _check_same_save(path, named, trainable)
    return found, train_dtype


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
    if ref.dtype_spec.is_floating_point and not casts_to(trainable.plans[name], ref, info.numel, info.dtype_spec):
        raise CheckpointFormatError(
            f"'{path}': '{name}' is not the optimizer's fp32 master cast to {ref.dtype_spec}, so the layer file comes "
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
    files: PipelineFiles, tag_name: str | None, model0: dict[Any, Any], zero_stage: int, train_dtype: DType
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
