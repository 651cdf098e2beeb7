"""DeepSpeed ZeRO checkpoints: open a tag folder in numbered steps and serve its tensors from the read plans."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._dtypes import BFLOAT16, FLOAT32, DType
from ..._io.remote_path import as_path, is_url
from ..._messages import get_logger
from ..._pickles import RankFile, TensorRef, load_pickle, read_archive, template_of
from ...errors import CheckpointNotFoundError, UnsupportedCheckpointError
from ..metadata import CheckpointMetadata, TensorInfo
from ..optimizer.state import optimizer_state
from ..planned_checkpoint import PlannedCheckpoint
from ..read_plans import (
    ReadPlan,
    WholePlan,
    ZeroContents,
    buffer_plans,
)
from ..validate import (
    ModelStates,
    ParamShapes,
    base_optimizer_state,
    config_flag,
    model_states,
    param_shapes,
)
from .autoep import AutoEP, autoep_trainable, is_autoep
from .file_layout import ZeroLayout, find_tag_dir, scan_tag_dir
from .flat_partitions import OptimizerPartitions, optimizer_partitions
from .mics import check_mics_replicas, mics_shard_group, zero_variant_metadata
from .moe import Experts, insert_experts, parse_experts
from .moe_legacy import check_legacy_moe, check_placeholder_optim_files, complete_legacy_moe, is_legacy_moe
from .nvme_offload import attach_swapped_state
from .provenance import (
    ArchiveRecords,
    archive_records,
    check_archive_names,
    check_distinct_partitions,
    check_model_states_agree,
    check_optimizer_steps,
)
from .stage0_reader import bf16_masters_unsaved, open_stage0
from .stage3_plans import zero3_frozen, zero3_trainable
from .stage12_plans import zero12_frozen, zero12_trainable
from .training_facts import training_facts

__all__ = ["ZeroCheckpoint", "open_zero"]

logger = get_logger(__name__)


class ZeroCheckpoint(PlannedCheckpoint):
    """A DeepSpeed ZeRO-0/1/2/3 checkpoint, consolidated lazily; build it with :func:`zeroio.open`."""

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        sources: dict[str, ReadPlan],
        files: list[RankFile],
        optimizer_states: Sequence[Any] = (),
        trees: dict[Path, Any] | None = None,
    ) -> None:
        super().__init__(metadata, infos, tied, sources, files)
        # Each rank's base optimizer state (Adam moments as TensorRefs), partitioned like the fp32 flat groups.
        self._optimizer_states = tuple(optimizer_states)
        self._trees: dict[Path, Any] = {} if trees is None else trees

    def file_tree(self, path: Path) -> Any:
        """The parsed object tree of one rank file read at open (tensors as references), without re-parsing it.

        Raises KeyError for a file that was not read (e.g. a later rank's model states at ZeRO-1/2).
        """
        self.ensure_open()
        return self._trees[as_path(path)]

    @property
    def parsed_files(self) -> tuple[Path, ...]:
        """The rank files parsed at open, in the order they were read."""
        return tuple(self._trees)

    def read_plan(self, name: str) -> ReadPlan:
        """Where the stored tensor ``name`` (a stored name, see :meth:`source_name`) lives in the rank files."""
        return self._sources[name]

    @property
    def plans(self) -> dict[str, ReadPlan]:
        """``{stored name: read plan}`` for every stored tensor, in key order."""
        return dict(self._sources)

    @property
    def optimizer_states(self) -> tuple[Any, ...]:
        """Each rank's base optimizer state (moments as TensorRefs), partitioned like the fp32 flat groups."""
        return self._optimizer_states

    def pieces(self, name: str) -> list[tuple[Path, int, int, int]]:
        """Where a tensor's elements live: ``(file, element offset in that file's tensor, length, dest)`` rows."""
        source = self._sources[self.source_name(self.info(name).name)]
        if isinstance(source, WholePlan):
            return [(source.ref.file.path, 0, source.ref.numel, 0)]
        return [(source.groups[p.rank][p.group].file.path, p.start, p.length, p.dest) for p in source.pieces]

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The consolidated optimizer state of one trainable parameter (see :func:`.optimizer.optimizer_state`)."""
        return optimizer_state(self, name)

    @property
    def verify_crc(self) -> bool:
        """As :attr:`Checkpoint.verify_crc`, but False for legacy-serialized rank files: they carry no CRC-32."""
        return bool(super().verify_crc) and self.metadata.serialization != "legacy"

    @verify_crc.setter
    def verify_crc(self, on: bool) -> None:
        PlannedCheckpoint.verify_crc.fset(self, on)  # type: ignore[attr-defined]


_REMOTE_PARSERS = 8
"""Remote rank files whose metadata is fetched at once while opening (each holds a few small requests)."""

PARSE_LOCAL_CONCURRENTLY = False
"""Parse local rank files on ``_REMOTE_PARSERS`` threads too. Off: on a fast local disk the threads' contention for
the GIL cost more than the overlapped reads saved (8-rank 125M checkpoint, 2-core box, cold: 0.13 s one by one,
0.17-0.19 s on threads); ``benchmarks/open_cold.py`` measures both where the disk is slower."""


class _RankFiles:
    """The rank files unpickled while opening (restricted, lazy), kept open for the checkpoint's lifetime."""

    def __init__(self, trusted_globals: frozenset[str]) -> None:
        self.trusted_globals = trusted_globals
        self.opened: list[RankFile] = []
        self.trees: dict[Path, Any] = {}
        self.files: dict[Path, RankFile] = {}

    def parse(self, path: Path) -> Any:
        if path in self.trees:  # parsed already (a legacy MoE folder's files are read to rebuild its records)
            return self.trees[path]
        tree, file = load_pickle(path, trusted_globals=self.trusted_globals, legacy=True)
        return self._keep(path, tree, file)

    def _keep(self, path: Path, tree: Any, file: RankFile) -> Any:
        self.opened.append(file)
        self.trees[path] = tree
        self.files[path] = file
        return tree

    def parse_replicas(self, paths: Sequence[Path]) -> list[Any]:
        """ZeRO-3 model states of ranks 1 and up: each tree, in order. Their pickles are the same byte for byte in
        one save, so one is unpickled and the others, when their bytes match, share its tree
        (``zeroio._pickles.replica``): 1,024 ranks of 2,000 tensors opened in seconds, not minutes."""
        if any(is_url(str(p)) for p in paths):
            return self.parse_all(paths)
        trees, template = [], None
        for path in paths:
            archive = read_archive(path)
            found = template.parse(archive) if template is not None and archive is not None else None
            if found is None and archive is not None:
                tree, file, template = template_of(archive, self.trusted_globals)
                found = tree, file
            trees.append(self._keep(path, *found) if found is not None else self.parse(path))
        return trees

    def records(self, path: Path, *, storages: bool = True) -> ArchiveRecords:
        """``path``'s zip root folder and (unless ``storages`` is False) storage records: from its parse when it
        was parsed, else read."""
        file = self.files.get(path)
        if file is None:
            return archive_records(path)
        return ArchiveRecords(file.root, file.storage_records if file.root and storages else {})

    def parse_all(self, paths: Sequence[Path]) -> list[Any]:
        """Each path's tree, in order; remote files are fetched concurrently.

        Reading a remote rank file's metadata takes a few dependent round trips (end records, directory, pickle);
        one file after another, an 8-rank checkpoint's 16 files would wait ~50 of them in a row. Errors are raised
        as the one-by-one order would raise them: the first failing path's, once every fetch has ended.
        """
        if (
            len(paths) < 2
            or all(p in self.trees for p in paths)
            or not (PARSE_LOCAL_CONCURRENTLY or any(is_url(str(p)) for p in paths))
        ):
            return [self.parse(p) for p in paths]
        with ThreadPoolExecutor(min(_REMOTE_PARSERS, len(paths)), thread_name_prefix="zeroio-pickle") as pool:
            futures = [pool.submit(load_pickle, p, trusted_globals=self.trusted_globals, legacy=True) for p in paths]
        trees, failure = [], None
        for path, future in zip(paths, futures):
            error = future.exception()
            if error is not None:
                failure = failure or error
                continue
            tree, file = future.result()
            trees.append(self._keep(path, tree, file))  # closed with the others, whether or not a later file fails
        if failure is not None:
            raise failure
        return trees


def open_zero(
    path: Path, tag: str | None = None, *, trusted_globals: frozenset[str] = frozenset(), mp_rank: int | None = None
) -> ZeroCheckpoint:
    """Parse a DeepSpeed checkpoint's metadata (no tensor bytes) into a :class:`ZeroCheckpoint`.

    ``mp_rank`` opens one model-parallel rank's files only (see ``scan_tag_dir``).
    """
    # 1. Discover: locate the tag folder and classify its files (names only).
    tag_dir, tag_name = find_tag_dir(path, tag)
    layout = scan_tag_dir(tag_dir, mp_rank)
    rank_files = _RankFiles(trusted_globals)

    # 2. Rank 0's model states: names, shapes, buffers, ties; fail before touching optimizer files (but for a
    #    DeepSpeed <= 0.18 MoE save, whose shapes are rebuilt from its optimizer files).
    tree = rank_files.parse(layout.model_files[0])
    check_placeholder_optim_files(layout, rank_files.parse)
    legacy_moe = is_legacy_moe(tree)
    if legacy_moe:
        tree = complete_legacy_moe(layout, tree, rank_files.parse)
    states = model_states(tree, layout.model_files[0])
    if not layout.optim_files:
        if states.param_shapes is not None and not bf16_masters_unsaved(states.tree):
            raise CheckpointNotFoundError(
                f"'{tag_dir}' is a ZeRO stage 1-3 checkpoint ('{states.path.name}' records param_shapes) but has no "
                "'*_optim_states.pt' files, where the fp32 master weights live. Copy the whole tag folder again.",
                path=tag_dir,
            )
        contents = open_stage0(tag_dir, tag_name, states)
    else:
        # MiCS: read the first shard group; the other groups' rank files must be its replicas.
        layout, mics = mics_shard_group(layout, states.tree.get(C.DS_CONFIG), states.path)
        contents = _open_partitioned(tag_dir, tag_name, layout, states, rank_files)
        if legacy_moe:
            contents = check_legacy_moe(contents, layout, states.tree, rank_files.parse)
        if mics is not None:
            check_mics_replicas(layout, mics, rank_files.trees, rank_files.parse)
        contents = dataclasses.replace(contents, metadata=zero_variant_metadata(contents.metadata, mics))
    return ZeroCheckpoint(
        training_facts(contents.metadata, rank_files.opened, contents.optimizer_states),
        contents.infos,
        contents.tied,
        contents.plans,
        [*rank_files.opened, *contents.swap_files],
        contents.optimizer_states,
        rank_files.trees,
    )


def _open_partitioned(
    tag_dir: Path, tag_name: str | None, layout: ZeroLayout, states: ModelStates, rank_files: _RankFiles
) -> ZeroContents:
    """ZeRO-1/2/3: validate every rank file, then plan each tensor from the optimizer's fp32 partitions."""
    # 3. Validate: parameter shapes, one save's rank files each under its own name, then every rank's optimizer
    #    state (stage, world size, fp32 partitions).
    shapes = param_shapes(states)
    optim_trees = rank_files.parse_all(layout.optim_files)
    model_trees = [states.tree, *rank_files.parse_replicas(layout.model_files[1:])]
    _check_one_save(layout, model_trees, optim_trees, rank_files)
    optim = optimizer_partitions(layout, optim_trees, states.tree.get(C.DS_CONFIG), tag_dir)
    swap = attach_swapped_state(optim, states, shapes, tag_dir)  # NVMe offload: swapped sub-groups' files
    optim = swap.optim

    # 4. Buffers (whole tensors in rank 0's module) and MoE expert files.
    found = buffer_plans(states.module, states.buffer_names, states.path)
    if is_autoep(states.tree) and optim.stage != 3:
        raise UnsupportedCheckpointError(
            f"'{states.path}' records AutoEP MoE layers ('ds_autoep_layers'); zeroio reads deepspeed.moe.layer.MoE "
            "checkpoints only. Use DeepSpeed's ds_to_universal.py for this one.",
            path=states.path,
        )
    experts = (
        parse_experts(layout.expert_files, rank_files.parse, states.tree, states.path) if layout.expert_files else None
    )
    if layout.expert_files:
        check_archive_names(
            [(None, p) for p in layout.expert_files], {p: rank_files.records(p) for p in layout.expert_files}
        )

    autoep: AutoEP | None = None
    # 5-6. Dispatch to the stage: frozen parameters (training dtype), then trainable ones (fp32 masters).
    if optim.stage == 3:
        frozen = zero3_frozen(shapes.frozen, optim.world_size, layout.model_files, model_trees)
        if is_autoep(states.tree):  # AutoEP: sub-groups partitioned over their own ranks, experts per EP rank
            trainable, autoep = autoep_trainable(
                layout.model_files, model_trees, optim, optim_trees, shapes.frozen, tag_dir
            )
        else:
            trainable = zero3_trainable(shapes.groups, optim, states.path)
    else:
        frozen = zero12_frozen(states, shapes, experts)
        round_robin = config_flag(states.tree.get(C.DS_CONFIG), "round_robin_gradients")
        trainable = zero12_trainable(shapes.groups, optim, experts, states.path, tag_dir, round_robin=round_robin)
    found.update(frozen)
    found.update(trainable)

    # 6b. MoE expert tensors not trained (frozen experts) come from the expert files, in the training dtype.
    if experts is not None:
        for name, ref in experts.refs.items():
            if name not in found.infos:
                found.add(TensorInfo(name, ref.shape, ref.dtype_spec, "frozen", (experts.files[name],)), WholePlan(ref))

    # 7-8. Ties and key order, then the checkpoint-level facts.
    infos, tied = _tie_and_order(found.infos, shapes.shared, states.module, experts)
    metadata = _metadata(tag_dir, tag_name, layout, states, shapes, optim, list(frozen.infos))
    unsaved = [str(n) for n in states.module if str(n) not in infos and str(n) not in set(states.buffer_names)]
    if unsaved:
        # ZeRO-3 keeps only placeholders in `module`; DeepSpeed before 0.9.1 saved no frozen parameter (no
        # frozen_param_shapes/fragments), so those are in no file (exclude_frozen_parameters leaves them out of
        # `module` too).
        logger.warning(
            "%s: %d parameter(s) listed in '%s' are stored in no file (frozen parameters, which DeepSpeed before "
            "0.9.1 did not save at ZeRO-3) and are left out: %s",
            tag_dir,
            len(unsaved),
            states.path.name,
            ", ".join(unsaved[:5]) + (", ..." if len(unsaved) > 5 else ""),
        )
        metadata = dataclasses.replace(metadata, extra={**metadata.extra, "unsaved_params": unsaved})
    if autoep is not None:
        infos = {name: infos[name] for name in autoep.order(list(infos))}
        parallel = {"dp": optim.world_size, "ep": autoep.ep_size, "edp": autoep.edp_size}
        extra = {**metadata.extra, "autoep_layers": autoep.describe()}
        metadata = dataclasses.replace(metadata, layout="autoep", parallel=parallel, extra=extra)
    logger.debug("opened %s: ZeRO-%d, world size %d, %d tensors", tag_dir, optim.stage, optim.world_size, len(infos))
    if swap.folder is not None:
        extra = {**metadata.extra, "nvme_swap_folder": str(swap.folder)}
        metadata = dataclasses.replace(metadata, offload="nvme", extra=extra)
    return ZeroContents(metadata, infos, tied, found.plans, tuple(optim.base_states), swap.files)


def _check_one_save(layout: ZeroLayout, model_trees: list[Any], optim_trees: list[Any], files: _RankFiles) -> None:
    """Refuse a folder whose rank files come from different saves or sit under another rank's name."""
    records = {p: files.records(p, storages=False) for p in layout.model_files}  # names only: model states
    records.update((p, files.records(p)) for p in layout.optim_files)
    ranked_models = [(r if layout.partitioned_model_files else None, p) for r, p in enumerate(layout.model_files)]
    check_archive_names([*ranked_models, *enumerate(layout.optim_files)], records)
    if layout.partitioned_model_files:
        check_model_states_agree(layout.model_files, model_trees)
    check_optimizer_steps(layout.optim_files, [base_optimizer_state(t) for t in optim_trees], records)
    if len(layout.optim_files) > 1:
        check_distinct_partitions(layout.optim_files, records)


def _tie_and_order(
    infos: dict[str, TensorInfo], shared: dict[str, str], module: dict[Any, Any], experts: Experts | None
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Add tied aliases and put the keys in ``model.state_dict()`` order."""
    # 7. Tied aliases (DeepSpeed's shared_params: alias -> source), only where the source exists.
    tied = {alias: src for alias, src in shared.items() if src in infos and alias not in infos}
    for alias, src in tied.items():
        base = infos[src]
        infos[alias] = TensorInfo(alias, base.shape, base.dtype_spec, base.kind, base.files, base.stored_spec, src)

    # 8. Key order: model.state_dict() order as recorded in `module`, then anything module does not list.
    ordered = {name: infos[name] for name in module if name in infos}
    ordered.update((name, info) for name, info in infos.items() if name not in ordered)
    if experts is not None:
        ordered = {name: ordered[name] for name in insert_experts(list(ordered), experts)}
    return ordered, tied


def _train_dtype(layout: ZeroLayout, module: dict[str, Any], param_names: list[str]) -> DType:
    if layout.optim_files and layout.optim_files[0].name.startswith("bf16_"):
        return BFLOAT16
    for name in param_names:
        value = module.get(name)
        if isinstance(value, TensorRef) and value.dtype_spec.is_floating_point:
            return value.dtype_spec
    return FLOAT32


def _metadata(
    tag_dir: Path,
    tag_name: str | None,
    layout: ZeroLayout,
    states: ModelStates,
    shapes: ParamShapes,
    optim: OptimizerPartitions,
    frozen_names: list[str],
) -> CheckpointMetadata:
    model0 = states.tree
    return CheckpointMetadata(
        format="zero",
        path=tag_dir,
        tag=tag_name,
        zero_stage=optim.stage,
        world_size=optim.world_size,
        train_dtype=_train_dtype(layout, states.module, shapes.trainable + frozen_names),
        ds_version=str(model0.get(C.DS_VERSION)) if model0.get(C.DS_VERSION) is not None else None,
        global_step=int(model0[C.GLOBAL_STEPS]) if isinstance(model0.get(C.GLOBAL_STEPS), int) else None,
        has_fp32_master=True,
        layout="moe" if layout.expert_files else None,
        parallel={"dp": optim.world_size},
        extra={
            "ds_config": model0.get(C.DS_CONFIG),
            "optim_files": [p.name for p in layout.optim_files],
            "model_files": [p.name for p in layout.model_files],
            "num_param_groups": len(shapes.groups),
            "expert_files": [p.name for p in layout.expert_files],
        },
    )
