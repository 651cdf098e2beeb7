"""DeepSpeed universal checkpoints (``ds_to_universal`` output): one ``zero/<param>/fp32.pt`` per parameter.

The converter writes ``latest_universal`` at the root and, in the tag folder, each trainable parameter's fp32
master (``zero/<name>/fp32.pt``: a flat 1-D tensor from ZeRO-3, ``{"param": shaped, "cat_dim": 0}`` from
ZeRO-1/2), its Adam moments beside it, and a copy of the source's ``*_model_states.pt``. Names, shapes, key order,
buffers, frozen parameters and ties come from those model states, exactly as for the source checkpoint; the
``fp32.pt`` files the converter writes for buffers, frozen parameters and tied aliases (ZeRO-1/2 sources only) are
fp32 copies of the 16-bit module values and are not read (``docs/format.md``, "Universal checkpoints").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._dtypes import FLOAT32
from ..._io.confine import confined_path
from ..._pickles import RankFile, TensorRef, load_pickle, to_plain
from ...errors import CheckpointFormatError, CheckpointNotFoundError, PartitionMismatchError, TensorNotFoundError
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo, require
from ..options import ReadOptions
from ..planned_checkpoint import PlannedCheckpoint
from ..read_plans import ReadPlan, TensorPlans, WholePlan, buffer_plans
from ..validate import ModelStates, ParamShapes, config_stage, model_states, numel_of, param_shapes, tensor_ref
from ..zero.file_layout import ZeroLayout, find_tag_dir, scan_tag_dir
from ..zero.reader import open_zero
from ..zero.stage3_plans import zero3_frozen
from ..zero.stage12_plans import zero12_frozen

__all__ = ["LATEST_UNIVERSAL", "UniversalCheckpoint", "is_universal", "is_universal_tag_dir", "open_universal"]

LATEST_UNIVERSAL = "latest_universal"
"""The root file ``ds_to_universal`` writes, naming the universal tag folder (as ``latest`` names a save's)."""
ZERO_DIR = "zero"
FP32_FILE = "fp32.pt"
STEP_FILE = "step.pt"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"


def is_universal_tag_dir(path: Path) -> bool:
    """True when ``path`` is a universal tag folder: model states and a ``zero/`` folder, no optimizer files."""
    if not path.is_dir() or not (path / ZERO_DIR).is_dir():
        return False
    names = [p.name for p in path.iterdir() if p.is_file()]
    return any(n.endswith(C.STATES_SUFFIX) for n in names) and not any(C.ZERO_OPTIM_FILE.match(n) for n in names)


def is_universal(path: Path) -> bool:
    """True for a universal root (``latest_universal``), tag folder, or a model states file inside one (names only)."""
    if path.is_file():
        return path.name.endswith(C.STATES_SUFFIX) and is_universal_tag_dir(path.parent)
    return (path / LATEST_UNIVERSAL).is_file() or is_universal_tag_dir(path)


class UniversalCheckpoint(PlannedCheckpoint):
    """A universal checkpoint, read lazily: each tensor is one stored tensor (a :class:`WholePlan`) or fragments."""

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        sources: dict[str, ReadPlan],
        files: list[RankFile],
        zero_dir: Path,
        param_group: dict[str, int],
        trusted_globals: frozenset[str],
    ) -> None:
        super().__init__(metadata, infos, tied, sources, files)
        self._zero_dir = zero_dir
        self._param_group = param_group
        self._trusted_globals = trusted_globals

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """A trainable parameter's optimizer state from its ``zero/<name>/`` folder, shaped like the parameter.

        Returns the per-element state files (``exp_avg``, ``exp_avg_sq``), ``step`` (the folder's ``step.pt``
        from a ZeRO-1/2 source, else the param group's entry in ``zero/optimizer_state.pt``) and the param group's
        hyper-parameters, like a ZeRO checkpoint's :meth:`optimizer_state`. Tied aliases give their source's state.
        """
        info = self._resolve(name)
        source = self.source_name(name)
        if self._infos[source].kind != "trainable":
            raise TensorNotFoundError(
                f"'{name}' is a {info.kind} tensor of '{self._metadata.path}': the optimizer holds no state for it.",
                path=self._metadata.path,
                name=name,
            )
        recorded = self._zero_dir.parent / str(self._metadata.extra["model_files"][0])
        folder = confined_path(self._zero_dir, source, source=recorded, what="parameter")
        result: dict[str, Any] = {}
        for found in sorted(folder.glob("*.pt")):
            if found.name == FP32_FILE:
                continue
            path = confined_path(self._zero_dir, source, found.name, source=recorded, what="parameter")
            tree, file = load_pickle(path, trusted_globals=self._trusted_globals)
            self._late_file(file.source)
            try:
                value = _stored_ref(tree, path).materialize()
            finally:
                file.close()
            if path.name == STEP_FILE:
                result["step"] = value
            elif value.numel() != info.numel:
                raise PartitionMismatchError(
                    f"'{path}' holds {value.numel()} elements, parameter '{source}' has {info.numel}. The folder "
                    "mixes files from different conversions; run ds_to_universal again.",
                    path=path,
                    name=source,
                    expected=info.numel,
                    found=value.numel(),
                )
            else:
                result[path.stem] = value.reshape(info.shape)
        hyper, steps = self._common_state()
        group = self._param_group[source]
        if "step" not in result and group in steps:
            result["step"] = steps[group]
        for key, value in (hyper[group] if group < len(hyper) else {}).items():
            result.setdefault(key, value)
        return result

    def _common_state(self) -> tuple[list[dict[str, Any]], dict[int, Any]]:
        """``zero/optimizer_state.pt``: each param group's hyper-parameters and (ZeRO-3 sources) its ``step``."""
        path = confined_path(self._zero_dir, OPTIMIZER_STATE_FILE, source=self._zero_dir, what="file")
        if not path.is_file():
            return [], {}
        tree, file = load_pickle(path, trusted_globals=self._trusted_globals)
        self._late_file(file.source)
        try:
            groups = tree.get("param_groups") if isinstance(tree, dict) else None
            hyper = [
                {str(k): to_plain(v) for k, v in g.items() if k != "params"}
                for g in (groups if isinstance(groups, list) else [])
                if isinstance(g, dict)
            ]
            osd = tree.get(C.OPTIMIZER_STATE_DICT) if isinstance(tree, dict) else None
            state = osd.get("state") if isinstance(osd, dict) else None
            steps = {
                int(k): to_plain(v["step"])
                for k, v in (state.items() if isinstance(state, dict) else [])
                if isinstance(k, int) and isinstance(v, dict) and "step" in v
            }
        finally:
            file.close()
        return hyper, steps


def _stored_ref(tree: Any, path: Path) -> TensorRef:
    """The tensor of a ``zero/<name>/*.pt`` file: the file itself (ZeRO-3 source) or its ``param`` (ZeRO-1/2)."""
    if isinstance(tree, dict):
        return tensor_ref(require(tree, "param", path, "universal checkpoint parameter file"), "'param'", path)
    return tensor_ref(tree, "the stored value", path)


def open_universal(path: Path, options: ReadOptions) -> Checkpoint:
    """Open a universal checkpoint lazily: parse the model states and each ``fp32.pt`` pickle, read no tensor bytes.

    A root that also holds ``latest`` (a training folder converted in place) opens the ZeRO checkpoint ``latest``
    names unless ``tag`` picks the universal folder.
    """
    tag, trusted_globals = options.tag, options.trusted_globals
    where = _universal_tag_dir(path, tag)
    if where is None:
        return open_zero(path, tag, trusted_globals=trusted_globals)
    tag_dir, tag_name = where
    layout = scan_tag_dir(tag_dir)
    files: list[RankFile] = []
    trees = []
    for model_file in layout.model_files:
        tree, file = load_pickle(model_file, trusted_globals=trusted_globals)
        files.append(file)
        trees.append(tree)
    states = model_states(trees[0], layout.model_files[0])
    shapes = param_shapes(states)

    found_plans = buffer_plans(states.module, states.buffer_names, states.path)
    if layout.partitioned_model_files:
        frozen = zero3_frozen(shapes.frozen, len(layout.model_files), layout.model_files, trees)
    else:
        frozen = zero12_frozen(states, shapes, None)
    found_plans.update(frozen)
    found_plans.update(_trainable(tag_dir / ZERO_DIR, shapes, states.path, files, trusted_globals))

    infos, tied = _tie_and_order(found_plans, shapes.shared, states.module)
    metadata = _metadata(tag_dir, tag_name, layout, states, shapes)
    groups = {name: g for g, group in enumerate(shapes.groups) for name, _ in group}
    return UniversalCheckpoint(
        metadata, infos, tied, found_plans.plans, files, tag_dir / ZERO_DIR, groups, trusted_globals
    )


def _universal_tag_dir(path: Path, tag: str | None) -> tuple[Path, str | None] | None:
    """The universal tag folder and its name, or None when ``path``/``tag`` lead to a ZeRO save instead."""
    if path.is_file():
        return path.parent, path.parent.name
    if tag is None and is_universal_tag_dir(path):
        return path, path.name
    if tag is None and (path / C.LATEST_FILE).is_file():
        return None  # a training folder converted in place: `latest` names the ZeRO save, as before
    found, found_tag = find_tag_dir(path, tag, latest_file=LATEST_UNIVERSAL)
    return (found, found_tag) if is_universal_tag_dir(found) else None


def _trainable(
    zero_dir: Path, shapes: ParamShapes, recorded: Path, files: list[RankFile], trusted_globals: frozenset[str]
) -> TensorPlans:
    """Each trainable parameter's fp32 master: ``zero/<name>/fp32.pt``, reshaped to its recorded shape.

    The names come from the model states file ``recorded``: each must name a folder inside ``zero/``."""
    found = TensorPlans()
    for group in shapes.groups:
        for name, shape in group:
            path = confined_path(zero_dir, name, FP32_FILE, source=recorded, what="parameter")
            if not path.is_file():
                raise CheckpointNotFoundError(
                    f"'{path}' is missing: a universal checkpoint holds each trainable parameter's fp32 weights in "
                    f"zero/<name>/{FP32_FILE}. Copy the whole folder again, or run ds_to_universal again.",
                    path=path,
                    name=name,
                )
            tree, file = load_pickle(path, trusted_globals=trusted_globals)
            files.append(file)
            ref = _stored_ref(tree, path)
            if ref.numel != numel_of(shape):
                raise PartitionMismatchError(
                    f"'{path}' holds {ref.numel} elements, the model states record '{name}' with shape {shape}. The "
                    "folder mixes files from different conversions; run ds_to_universal again.",
                    path=path,
                    name=name,
                    expected=shape,
                    found=ref.shape,
                )
            if not ref.dtype_spec.is_floating_point:
                raise CheckpointFormatError(
                    f"'{path}' holds a {ref.dtype_spec} tensor, not floating-point weights. The file is corrupted.",
                    path=path,
                    name=name,
                )
            found.add(TensorInfo(name, shape, ref.dtype_spec, "trainable", (path,)), WholePlan(ref))
    return found


def _tie_and_order(
    found: TensorPlans, shared: dict[str, str], module: dict[Any, Any]
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tied aliases (``shared_params``) share their source's plan; keys in ``model.state_dict()`` order."""
    infos = dict(found.infos)
    tied = {alias: src for alias, src in shared.items() if src in infos and alias not in infos}
    for alias, src in tied.items():
        base = infos[src]
        infos[alias] = TensorInfo(alias, base.shape, base.dtype_spec, base.kind, base.files, base.stored_spec, src)
    ordered = {name: infos[name] for name in module if name in infos}
    ordered.update((name, info) for name, info in infos.items() if name not in ordered)
    return ordered, tied


def _metadata(
    tag_dir: Path, tag_name: str | None, layout: ZeroLayout, states: ModelStates, shapes: ParamShapes
) -> CheckpointMetadata:
    """Checkpoint facts; the ZeRO stage and world size are the source checkpoint's, from its copied model states."""
    tree = states.tree
    ds_config = tree.get(C.DS_CONFIG)
    stage = config_stage(ds_config, default=3 if layout.partitioned_model_files else -1)
    world = tree.get(C.DP_WORLD_SIZE)
    train_dtype = FLOAT32
    for name in shapes.trainable:
        value = states.module.get(name)
        if isinstance(value, TensorRef) and value.dtype_spec.is_floating_point:
            train_dtype = value.dtype_spec
            break
    return CheckpointMetadata(
        format="universal",
        path=tag_dir,
        tag=tag_name,
        zero_stage=stage if stage >= 0 else None,
        world_size=world if isinstance(world, int) else None,
        train_dtype=train_dtype,
        ds_version=str(tree[C.DS_VERSION]) if tree.get(C.DS_VERSION) is not None else None,
        global_step=int(tree[C.GLOBAL_STEPS]) if isinstance(tree.get(C.GLOBAL_STEPS), int) else None,
        has_fp32_master=True,
        layout="universal",
        extra={
            "ds_config": ds_config,
            "model_files": [p.name for p in layout.model_files],
            "num_param_groups": len(shapes.groups),
        },
    )
