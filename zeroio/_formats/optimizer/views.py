"""Optimizer state of checkpoints made of several ZeRO-1 checkpoints: pipeline stages and tensor-parallel ranks.

A pipeline stage is a ZeRO-1 checkpoint of its own: its data-parallel ranks' optimizer files hold the moments in
the same flat partitions as its fp32 masters, so a :class:`StageView` (the stage's trainable parameters, their
piece plans and those files' base optimizer states) is read by :func:`.optimizer.optimizer_state` unchanged.
A tensor-parallel rank's moments are its shard's, so they merge along the weight's partition dimension (a
replicated parameter takes tp rank 0's, as DeepSpeed's ``ds_to_universal`` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..._pickles import RankFile, load_pickle
from ...errors import CheckpointFormatError, TensorNotFoundError
from ..metadata import CheckpointMetadata, TensorInfo
from ..read_plans import FlatPlan, ReadPlan
from ..validate import base_optimizer_state
from .state import optimizer_state

__all__ = ["ComposedOptimizerState", "StageView", "merge_tp_states", "stage_of", "stage_views"]


@runtime_checkable
class ComposedOptimizerState(Protocol):
    """A checkpoint whose optimizer state is assembled per parameter from several ZeRO checkpoints."""

    def optimizer_state(self, name: str) -> dict[str, Any]: ...

    def optimizer_state_spec(self, name: str) -> dict[str, Any]:
        """As ``optimizer_state`` with every state tensor on the ``meta`` device: keys, dtypes, shapes; no read."""
        ...


class StageView:
    """One pipeline stage seen as a ZeRO-1 checkpoint: what :mod:`.optimizer` reads (a ``PartitionedCheckpoint``).

    Its rank files are the stage's optimizer files, parsed for it (``file_tree``) and checked by it
    (``finish_crc_checks``); they close with the pipeline checkpoint.
    """

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        plans: dict[str, ReadPlan],
        files: Sequence[tuple[RankFile, Any]],
        ensure_open: Callable[[str | None], None],
    ) -> None:
        self._metadata = metadata
        self._infos = infos
        self._plans = plans
        self._files = tuple(file for file, _ in files)
        self._trees = {file.path: tree for file, tree in files}
        self._optimizer_states = tuple(base_optimizer_state(tree) for _, tree in files)
        self._ensure_open = ensure_open

    @property
    def metadata(self) -> CheckpointMetadata:
        return self._metadata

    @property
    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    @property
    def tied(self) -> dict[str, str]:
        return {}

    @property
    def plans(self) -> dict[str, ReadPlan]:
        return self._plans

    @property
    def optimizer_states(self) -> tuple[Any, ...]:
        return self._optimizer_states

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def source_name(self, name: str) -> str:
        return name

    def read_plan(self, name: str) -> ReadPlan:
        return self._plans[name]

    def file_tree(self, path: Path) -> Any:
        """The parsed tree of one of the stage's optimizer files (KeyError for any other file)."""
        self._ensure_open(None)
        return self._trees[path]

    def ensure_open(self, name: str | None = None) -> None:
        self._ensure_open(name)

    def finish_crc_checks(self) -> None:
        """Check the records of the stage's optimizer files read in part (as ``Checkpoint.finish_crc_checks``)."""
        self._ensure_open(None)
        for file in self._files:
            file.source.finish()

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def optimizer_state(self, name: str, *, meta: bool = False) -> dict[str, Any]:
        return optimizer_state(self, name, meta=meta)


def stage_views(
    metadata: CheckpointMetadata,
    infos: dict[str, TensorInfo],
    plans: dict[str, ReadPlan],
    ensure_open: Callable[[str | None], None],
    opened: list[RankFile],
) -> dict[str, StageView]:
    """``{trainable name: its stage's view}`` (a tied weight: the first stage's, the copy DeepSpeed loads).

    The stages are told apart by the optimizer files their parameters' fp32 partitions lie in; those files are
    parsed again (restricted, lazy: no tensor byte read) for their base optimizer states, and the handles appended
    to ``opened`` so they close with the checkpoint.
    """
    by_files: dict[tuple[Path, ...], list[str]] = {}
    for name, plan in plans.items():
        if isinstance(plan, FlatPlan) and infos[name].kind == "trainable":
            files = tuple(rank[0].file.path for rank in plan.groups)
            by_files.setdefault(files, []).append(name)
    views: dict[str, StageView] = {}
    for files, names in by_files.items():
        parsed = []
        for path in files:
            tree, file = load_pickle(path)
            opened.append(file)
            parsed.append((file, tree))
        extra = dict(metadata.extra, optim_files=[str(p.relative_to(metadata.path)) for p in files])
        stage_meta = dataclasses.replace(metadata, zero_stage=1, world_size=len(files), extra=extra)
        view = StageView(stage_meta, {n: infos[n] for n in names}, {n: plans[n] for n in names}, parsed, ensure_open)
        for name in names:
            views.setdefault(name, view)
    return views


def stage_of(views: dict[str, StageView], info: TensorInfo, path: Path) -> StageView:
    """The stage view holding trainable parameter ``info`` (resolved name), or TensorNotFoundError saying why not."""
    view = views.get(info.name)
    if view is None:
        what = {"frozen": "a frozen parameter", "buffer": "a buffer"}.get(
            info.kind, "not a parameter the optimizer owns"
        )
        raise TensorNotFoundError(
            f"No optimizer state for '{info.name}' in '{path}': it is {what}, which the optimizer does not own. "
            f"Parameters with optimizer state: {', '.join(list(views)[:8])}{' ...' if len(views) > 8 else ''}.",
            path=path,
            name=info.name,
        )
    return view


def merge_tp_states(name: str, states: Sequence[dict[str, Any]], dim: int | None, path: Path) -> dict[str, Any]:
    """One parameter's state from its tp ranks' shard states: tensors concatenated along ``dim`` (None:
    replicated, tp rank 0's), everything else (step, hyper-parameters) tp rank 0's."""
    import torch  # the states are tensors already: torch is loaded; kept local so opening stays torch-free

    merged = dict(states[0])
    if dim is None:
        return merged
    for key, value in states[0].items():
        if not isinstance(value, torch.Tensor) or value.dim() <= dim:
            continue
        shards = [s.get(key) for s in states]
        if not all(isinstance(s, torch.Tensor) and s.dim() == value.dim() for s in shards):
            raise CheckpointFormatError(
                f"'{path}': the tp ranks' optimizer state '{key}' of '{name}' does not have one shape per rank "
                "like the weight's shards. The folder mixes different saves; copy the whole tag folder again.",
                path=path,
                name=name,
            )
        merged[key] = torch.cat(shards, dim=dim)  # type: ignore[arg-type]  # checked above
    return merged
