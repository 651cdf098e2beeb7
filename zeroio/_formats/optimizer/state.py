"""Reading DeepSpeed's partitioned optimizer state (Adam moments, step, hyper-parameters) with the weights' plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._dtypes import FLOAT32
from ..._messages import listing
from ..._pickles import TensorRef, to_plain
from ...errors import CheckpointFormatError, TensorNotFoundError, UnsupportedCheckpointError
from ..checkpoint import Checkpoint, PartitionedCheckpoint
from ..read_plans import FlatPlan, read_plan_into
from ..zero.muon import WholeMatrices, uses_whole_matrices, whole_matrices, whole_matrix_source
from .rank_states import (
    NO_STATE,
    base_state_dict,
    flat_group_ids,
    group_keys_of,
    moments_of_rank,
    per_element_keys,
    require_laid_out,
    require_same_keys,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "OptimizerLayout",
    "moment_source",
    "optimizer_layout",
    "optimizer_state",
    "param_group_of",
    "require_partitioned",
    "state_dtype",
    "state_keys_of",
    "step_of",
    "trainable_source",
]


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
    group_keys: tuple[tuple[str, ...], ...] = ()
    """Per-element state keys of each flat group (differ between the Muon and Adam halves of a Muon run)."""
    whole_keys: frozenset[tuple[int, str]] = frozenset()
    """``(flat group, key)`` whose state covers whole matrices (:mod:`.muon`), not the fp32 partition."""
    whole: WholeMatrices | None = None
    """Where each parameter's whole matrix sits in those buffers."""


def require_partitioned(ckpt: Checkpoint | PartitionedCheckpoint, what: str) -> PartitionedCheckpoint:
    meta = ckpt.metadata
    if not isinstance(ckpt, PartitionedCheckpoint):
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


def optimizer_layout(
    ckpt: Checkpoint | PartitionedCheckpoint,
    *,
    what: str = "optimizer state",
    by_name: bool = False,
    elastic: bool = False,
) -> OptimizerLayout:
    """Check every rank's base optimizer state against the fp32 flat groups; no tensor byte is read.

    ``by_name`` (readers that take each parameter's state by its own keys: ``optimizer_state``,
    ``include_optimizer``) also accepts param groups with different state keys and Muon's whole-matrix
    ``momentum_buffer``; without it (reshard, universal) those are refused. ``elastic`` (``optimizer_state``) also
    takes ZeRO-1/2's elastic list form, which records no hyper-parameters (``param_groups`` then hold none).

    Raises:
        UnsupportedCheckpointError: not a ZeRO-1/2/3 checkpoint, or an elastic (list-form) optimizer state without
            ``elastic``.
        CheckpointFormatError: the optimizer state is missing or empty (stripped, or saved before any step).
        PartitionMismatchError: the state does not fit the flat groups.
    """
    zckpt = require_partitioned(ckpt, what)
    files = tuple(zckpt.metadata.path / name for name in zckpt.metadata.extra.get("optim_files", ()))
    flat = _trainable_flat_groups(zckpt)
    no_state = NO_STATE.replace("{what}", what)
    ranks = []
    for rank, (base, groups) in enumerate(zip(zckpt.optimizer_states, flat)):
        path = files[rank] if rank < len(files) else zckpt.metadata.path
        state, pgroups = base_state_dict(base, path, rank, no_state, elastic=elastic)
        ranks.append((path, state, pgroups, flat_group_ids(pgroups, groups, path, rank), groups))
    path0, _, pgroups0, ids0, _ = ranks[0]
    whole_keys: set[tuple[int, str]] = set()
    whole = None
    if by_name:
        offloaded = zckpt.metadata.offload is not None
        whole_keys = {
            (j, key)
            for _, state, pgroups, ids, _ in ranks
            for j, (pid, g) in enumerate(ids)
            if uses_whole_matrices(pgroups[g], zckpt.metadata.zero_stage, offloaded)
            for key in per_element_keys(state.get(pid))
        }
        whole = whole_matrices(_trainable_sources(zckpt)) if whole_keys else None
    for rank, (path, state, _, ids, groups) in enumerate(ranks):
        require_laid_out(state, ids, groups, whole_keys, whole, path, rank, what)
    group_keys = group_keys_of([(state, ids) for _, state, _, ids, _ in ranks], len(ids0))
    if not by_name:
        require_same_keys(group_keys, path0, what)
    keys = list(dict.fromkeys(k for g in group_keys for k in g))
    if not keys:
        raise CheckpointFormatError(
            no_state.format(path=f"'{path0}'", why="its state has no per-element tensors"), path=path0, rank=0
        )
    moments: dict[str, list[tuple[TensorRef | None, ...]]] = {key: [] for key in keys}
    scalars: list[dict[str, Any]] = []
    for rank, (path, state, _, ids, groups) in enumerate(ranks):
        rank_moments, rank_scalars = moments_of_rank(state, ids, groups, group_keys, keys, path, rank, no_state)
        for key, refs in rank_moments.items():
            moments[key].append(refs)
        if rank == 0:
            scalars = rank_scalars
    return OptimizerLayout(
        files=files,
        entries=tuple(pid for pid, _ in ids0),
        param_group=tuple(g for _, g in ids0),
        moments={k: tuple(v) for k, v in moments.items()},
        scalars=tuple(scalars),
        param_groups=tuple({k: to_plain(v) for k, v in group.items() if k != "params"} for group in pgroups0),
        group_keys=group_keys,
        whole_keys=frozenset(whole_keys),
        whole=whole,
    )


def _trainable_sources(zckpt: PartitionedCheckpoint) -> list[FlatPlan]:
    return [s for n, s in zckpt.plans.items() if isinstance(s, FlatPlan) and zckpt.info(n).kind == "trainable"]


def _trainable_flat_groups(zckpt: PartitionedCheckpoint) -> tuple[tuple[TensorRef, ...], ...]:
    """Every rank's fp32 flat groups, as the trainable parameters' read plans point at them."""
    flat = next(
        (s.groups for n, s in zckpt.plans.items() if isinstance(s, FlatPlan) and zckpt.info(n).kind == "trainable"),
        None,
    )
    if flat is None:
        raise CheckpointFormatError(
            f"'{zckpt.metadata.path}' has no trainable parameters, so no optimizer state to read.",
            path=zckpt.metadata.path,
        )
    return flat


def trainable_source(ckpt: PartitionedCheckpoint, name: str) -> tuple[str, FlatPlan]:
    """The flat source of a trainable parameter (aliases resolved), or TensorNotFoundError saying why not."""
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
    """The read plan of a parameter's ``key`` state: its fp32 master pieces, pointed at the moment tensors
    (or, for Muon's whole-matrix momentum, one run in the first holding rank's buffer)."""
    refs = layout.moments[key]
    g = source.pieces[0].group if source.pieces else 0
    if (g, key) in layout.whole_keys and layout.whole is not None:
        return whole_matrix_source(layout.whole, source, refs)
    return FlatPlan(source.pieces, refs)  # type: ignore[arg-type]  # None only where no piece reads


def state_keys_of(layout: OptimizerLayout, source: FlatPlan) -> tuple[str, ...]:
    """The per-element state keys of a parameter's flat group (all keys for layouts read without ``by_name``)."""
    g = source.pieces[0].group if source.pieces else 0
    if layout.group_keys and g < len(layout.group_keys) and layout.group_keys[g]:
        return tuple(k for k in layout.moments if k in layout.group_keys[g])
    return tuple(layout.moments)


def state_dtype(layout: OptimizerLayout, key: str) -> torch.dtype:
    """The stored dtype of state ``key`` (fp32 moments; Muon's momentum follows the gradient dtype)."""
    return next((r.dtype_spec for rank in layout.moments[key] for r in rank if r is not None), FLOAT32).torch


def param_group_of(layout: OptimizerLayout, source: FlatPlan) -> int:
    return layout.param_group[source.pieces[0].group] if source.pieces else 0


def step_of(layout: OptimizerLayout, source: FlatPlan) -> Any:
    """The parameter's ``step``: its state entry's (torch Adam), else its param group's (DeepSpeed FusedAdam)."""
    g = source.pieces[0].group if source.pieces else 0
    scalars = layout.scalars[g] if g < len(layout.scalars) else {}
    if "step" in scalars:
        return to_plain(scalars["step"])
    return layout.param_groups[param_group_of(layout, source)].get("step")


def optimizer_state(ckpt: Checkpoint | PartitionedCheckpoint, name: str, *, meta: bool = False) -> dict[str, Any]:
    """The consolidated optimizer state of one trainable parameter, reading only its bytes.

    The moments of every rank are gathered with the same piece plan as the parameter's fp32 master weight
    (DeepSpeed partitions them identically), so ``exp_avg`` and ``exp_avg_sq`` come back with the parameter's
    full shape, in their stored dtype (fp32). Each parameter gets its own param group's keys: under DeepSpeed's
    Muon the matrices get ``momentum_buffer`` (read from the whole-matrix buffer, in its stored bf16 or fp32)
    and the rest the Adam half's ``exp_avg``, ``exp_avg_sq`` and ``step``.

    Args:
        ckpt: an open DeepSpeed ZeRO-1/2/3 checkpoint.
        name: a trainable parameter (a tied alias gives its source's state).
        meta: put the state tensors on the ``meta`` device instead of reading them (keys, dtypes, shapes only).

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
    zckpt = require_partitioned(ckpt, "optimizer_state()")
    zckpt.ensure_open(name)
    _, source = trainable_source(zckpt, name)
    layout = optimizer_layout(zckpt, what="optimizer_state()", by_name=True, elastic=True)

    import torch

    info = zckpt.info(name)
    result: dict[str, Any] = {}
    for key in state_keys_of(layout, source):
        out = torch.empty(info.numel, dtype=state_dtype(layout, key), device="meta" if meta else None)
        if info.numel and not meta:
            read_plan_into(moment_source(layout, source, key), 0, out)
        result[key] = out.view(info.shape)
    result["step"] = step_of(layout, source)
    for key, value in layout.param_groups[param_group_of(layout, source)].items():
        result.setdefault(key, value)
    return result
