"""Megatron-Core ``torch_dist`` checkpoints (Megatron-LM, NeMo 2, Megatron-Bridge, verl's Megatron backend), read
lazily through the DCP reader, with the stacked transformer layers exposed one layer at a time.

Megatron saves ``ShardedTensor``s whose keys are not module names: every transformer layer's tensor is one
entry with a leading layer axis (``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, ...]``),
each stored chunk one layer thick. Un-stacking is metadata only: layer ``i`` of an entry is the entry's chunks at
offset ``i`` with that axis dropped, so reading ``decoder.layers.<i>.<rest>`` reads that layer's bytes and nothing
else. Optimizer moments (``optimizer.state.exp_avg.<key>``) are un-stacked the same way; ShardedObjects
(``..._extra_state/shard_*``, ``rng_state/shard_*``) are non-tensor state, listed in metadata, never unpickled.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._messages import get_logger
from ...errors import CheckpointFormatError, UnsupportedCheckpointError
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo
from ..options import ReadOptions
from .megatron_common import MEGATRON_GLOBALS, MegatronCommon, not_read, read_common
from .megatron_files import is_megatron, megatron_folder
from .megatron_hf import hf_view
from .megatron_optim import BUCKETS, OPTIMIZER_STATE, not_per_parameter, optimizer_refusal, shape_mismatches, unchained
from .metadata import Chunk, TensorEntry
from .reader import DcpCheckpoint, read_dcp_part

if TYPE_CHECKING:
    import torch

__all__ = ["MegatronCheckpoint", "is_megatron", "open_megatron", "unstack_layers"]

logger = get_logger(__name__)

_STACKED = re.compile(r"^(?P<head>(?:.+\.)?layers)\.(?P<rest>[^0-9.][^.]*(?:\..+)?)$")
"""``<...>layers.<rest>`` where ``rest`` does not start with a layer number: a layer-stacked ShardedTensor key."""


def unstack_layers(entry: TensorEntry) -> dict[str, TensorEntry] | None:
    """``{"<...>layers.<i>.<rest>": layer i}`` for a layer-stacked entry whose chunks are one layer thick (what
    Megatron-Core writes), each layer an entry over the same stored bytes; None for any other entry."""
    m = _STACKED.match(entry.fqn)
    if m is None or not entry.shape:
        return None
    live = [c for c in entry.chunks if c.numel]
    if any(c.sizes[0] != 1 for c in live):
        return None
    if entry.shape[0] > max(len(live), len(entry.chunks)):  # a layer without a chunk: only an empty tensor has one,
        return None  # and (10**9, 0) in a 27 KB .metadata made 10**9 layers (13 s and 1M tensors for 10**6)
    layers: dict[int, list[Chunk]] = {i: [] for i in range(entry.shape[0])}
    for c in live:
        layers[c.offsets[0]].append(Chunk(c.offsets[1:], c.sizes[1:], c.file, c.offset, c.length, c.stored_shape))
    head, rest = m.group("head"), m.group("rest")
    found = {}
    for i, chunks in layers.items():
        name = f"{head}.{i}.{rest}"
        found[name] = TensorEntry(name, entry.dtype, entry.shape[1:], tuple(chunks))
    return found


class MegatronCheckpoint(DcpCheckpoint):
    """A Megatron-Core ``torch_dist`` checkpoint; build it with ``zeroio.open``."""

    def __init__(self, *args: Any, step: torch.Tensor | None, unread_optimizer: str | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._step = step
        self._unread_optimizer = unread_optimizer

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The optimizer state of one parameter (per layer for stacked ones): ``exp_avg``, ``exp_avg_sq`` as
        stored (with a mixed-precision or distributed optimizer also its fp32 master copy, ``fp32_param`` or
        ``param``), Megatron's shared ``step`` from common.pt and the hyper-parameters every param group agrees on.

        Raises:
            UnsupportedCheckpointError: the state is in a layout zeroio does not read (:mod:`.megatron_optim`): the
                distributed optimizer's flat buckets (``dp_reshardable``), an unchecked sharding type, ...
        """
        self._refuse_unread(name)
        return self._with_step(super().optimizer_state(name))

    def optimizer_state_spec(self, name: str) -> dict[str, Any]:
        """:meth:`optimizer_state` with the state tensors on the ``meta`` device (nothing read)."""
        self._refuse_unread(name)
        return self._with_step(super().optimizer_state_spec(name))

    def _refuse_unread(self, name: str) -> None:
        if self._unread_optimizer is not None:
            raise UnsupportedCheckpointError(self._unread_optimizer, path=self._metadata.path, name=name)

    def describe(self) -> dict[str, Any]:
        """:meth:`Checkpoint.describe` plus ``metadata.not_read``: the non-tensor state zeroio does not return."""
        summary = super().describe()
        summary["metadata"].update(not_read(self._metadata.extra))
        return summary

    def _with_step(self, state: dict[str, Any]) -> dict[str, Any]:
        if self._step is not None:
            state.setdefault("step", self._step.clone())
        return state


def _split(
    tensors: dict[str, TensorEntry],
    where: Path,
) -> tuple[dict[str, TensorEntry], dict[str, dict[str, TensorEntry]], list[str], list[str]]:
    """Model tensors and optimizer moments by per-layer name; the keys of other tensors (those under
    ``optimizer.`` that are not per-parameter state last); stacked keys kept whole (``where``: the metadata file,
    for errors)."""
    model: dict[str, TensorEntry] = {}
    moments: dict[str, dict[str, TensorEntry]] = {}
    kept_stacked: list[str] = []
    unknown = [fqn for fqn in tensors if not_per_parameter(fqn)]  # the distributed optimizer's buckets, ...
    for fqn, entry in tensors.items():
        key = unchained(fqn)
        if not_per_parameter(fqn):  # optimizer state, never weights
            continue
        layers = unstack_layers(entry)
        if layers is None and _STACKED.match(fqn):
            kept_stacked.append(fqn)
        pieces = layers or {fqn: entry}
        if key.startswith(OPTIMIZER_STATE):
            moment, _, _ = key[len(OPTIMIZER_STATE) :].partition(".")
            prefix = f"{OPTIMIZER_STATE}{moment}."
            for name, piece in pieces.items():
                param = unchained(name)[len(prefix) :]
                states = moments.setdefault(param, {})
                if moment in states:  # two chained optimizers (dense, experts) never hold the same parameter
                    raise CheckpointFormatError(
                        f"'{where}': Megatron optimizer state '{fqn}' holds the {moment} of "
                        f"'{param}', which another chained optimizer's state holds too: the "
                        "checkpoint is corrupted or hostile; copy it again from where it was saved.",
                        path=where,
                    )
                states[moment] = piece
        else:
            for name, piece in pieces.items():
                if name in model:  # a plain entry named as a layer of a stacked one: one of them silently won
                    raise CheckpointFormatError(
                        f"'{where}': Megatron tensor '{name}' is recorded twice (as its own entry and as a layer of "
                        "a layer-stacked one): the checkpoint is corrupted or hostile; copy it again from where it "
                        "was saved.",
                        path=where,
                    )
                model[name] = piece
    model = {name: model[name] for name in _layer_order(list(model))}
    other = [f"{OPTIMIZER_STATE}{k}.{p}" for p, states in moments.items() if p not in model for k in states] + unknown
    moments = {name: states for name, states in moments.items() if name in model}
    return model, moments, other, kept_stacked


_LAYER = re.compile(r"^(?:.+?\.)?layers\.(\d+)\.")


def _layer_order(names: list[str]) -> list[str]:
    """Module order (as Megatron's own torch conversion and ``state_dict()`` list them): what precedes the first
    layer, then each layer's tensors, layer by layer, then the rest."""
    index = {name: _LAYER.match(name) for name in names}
    first = next((i for i, name in enumerate(names) if index[name]), len(names))
    layered = sorted((n for n in names if index[n]), key=lambda n: int(index[n].group(1)))  # type: ignore[union-attr]
    rest = [n for n in names if not index[n]]
    before = [n for n in rest if names.index(n) < first]
    return before + layered + [n for n in rest if n not in before]


def _shared_hyper(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The hyper-parameters (and ``step``) every param group agrees on: one group's all; the distributed
    optimizer's groups (weight decay on and off, each with its own step) their common values."""
    if not groups:
        return {}
    return {k: v for k, v in groups[0].items() if all(k in g and g[k] == v for g in groups[1:])}


def _non_tensor_keys(values: list[str]) -> list[str]:
    """ShardedObject keys (``<key>/shard_<i>_<n>`` entries) and other pickled values, each named once."""
    return sorted({fqn.partition("/shard_")[0] for fqn in values})


def _metadata(
    found: Any, common: MegatronCommon, model: dict[str, TensorEntry], extra: dict[str, Any], *, master: bool
) -> Any:
    args = common.args
    sizes = [("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size")]
    if args.get("num_experts"):  # MoE: the experts' own parallel sizes
        sizes += [("ep", "expert_model_parallel_size"), ("etp", "expert_tensor_parallel_size")]
    parallel = {
        short: args[key]
        for short, key in sizes
        if isinstance(args.get(key), int) and not isinstance(args.get(key), bool)
    }
    floats = {e.dtype for e in model.values() if e.dtype.is_floating_point}
    train = floats.pop() if len(floats) == 1 else None
    iteration = common.values.get("iteration")
    return CheckpointMetadata(
        format="megatron",
        path=found.root,
        tag=found.tag,
        train_dtype=train,
        global_step=iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None,
        has_fp32_master=master or (train is not None and train.name == "float32"),
        layout="torch_dist",
        parallel=parallel,
        optimizer=extra.pop("optimizer"),
        extra=extra,
    )


def _unread_optimizer(
    folder: Path,
    sharding: str | None,
    model: dict[str, TensorEntry],
    moments: dict[str, dict[str, TensorEntry]],
    other: list[str],
    objects: list[str],
) -> str | None:
    """Why the optimizer state is not read (:func:`.megatron_optim.optimizer_refusal`), or None. ``other``: the
    tensors that are neither weights nor per-parameter state; ``objects``: the non-tensor entries."""
    unknown = [k for k in other if not_per_parameter(k)]
    unknown += [k for k in objects if unchained(k).startswith(BUCKETS)]  # dp_zero_gather_scatter: objects only
    shapes = {name: {k: e.shape for k, e in states.items()} for name, states in moments.items()}
    mismatched = shape_mismatches(shapes, {name: model[name].shape for name in moments})
    return optimizer_refusal(folder, sharding=sharding, other=unknown, mismatched=mismatched)


def open_megatron(path: Path, options: ReadOptions) -> Checkpoint:
    """Open a Megatron ``torch_dist`` checkpoint: metadata.json, common.pt and .metadata only, no tensor bytes;
    ``names="hf"``: under transformers' Llama names (:mod:`.megatron_hf`)."""
    tag, trusted_globals, names = options.tag, options.trusted_globals, options.names
    found = megatron_folder(path, tag)
    part, _ = read_dcp_part(found.folder, trusted_globals | MEGATRON_GLOBALS, read_values=False)
    common = read_common(found.folder, trusted_globals)
    model, moments, other, kept_stacked = _split(part.meta.tensors, found.folder / ".metadata")
    if not model:
        raise CheckpointFormatError(
            f"'{found.folder}' is a Megatron checkpoint without model tensors (only "
            f"{', '.join(list(part.meta.tensors)[:5]) or 'non-tensor state'}).",
            path=found.folder,
        )
    non_tensor = _non_tensor_keys(list(part.meta.values))
    unread = _unread_optimizer(found.folder, common.optimizer_sharding, model, moments, other, non_tensor)
    if unread is not None:  # a layout zeroio does not read: no parameter has optimizer state, the weights stay
        moments = {}
    infos = {
        name: TensorInfo(
            name,
            entry.shape,
            entry.dtype,
            "trainable" if name in moments else "tensor",
            tuple(dict.fromkeys(found.folder / c.file for c in entry.chunks if c.numel)),
        )
        for name, entry in model.items()
    }
    kinds = {k for states in moments.values() for k in states}
    hyper = _shared_hyper(common.param_groups)
    extra: dict[str, Any] = {
        "optimizer": "Adam" if {"exp_avg", "exp_avg_sq"} <= kinds else None,
        "megatron": found.info,
        "common": common.values if common.unread is None else f"<not read: {common.unread}>",
        "non_tensor_state": non_tensor,
        "skipped": f"{len(non_tensor)} non-tensor entries (ShardedObjects: _extra_state, rng_state)"
        if non_tensor
        else None,
        "other_tensors": other,
        "stacked": kept_stacked,
        "files": list(part.meta.files),
        "save_id": part.meta.save_id,
    }
    metadata = _metadata(found, common, model, extra, master=bool(kinds & {"fp32_param", "param"}))
    logger.debug("opened %s: megatron torch_dist, %d tensors", found.folder, len(infos))
    entries = {name: (part, entry) for name, entry in model.items()}
    optim = {name: {k: (part, e) for k, e in states.items()} for name, states in moments.items()}
    ckpt = MegatronCheckpoint(
        metadata,
        infos,
        entries,
        optim,
        {name: hyper for name in optim},
        [part],
        step=common.step,
        unread_optimizer=unread,
    )
    return hf_view(ckpt, options.true_vocab_size) if names == "hf" else ckpt
