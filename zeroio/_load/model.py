"""``zeroio.load``: stream a checkpoint into any ``nn.Module`` (hooks, meta device, ties, prefixes, strict checks)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._formats import Checkpoint, CheckpointMetadata, parse_dtype, read_options
from .._io.progress import ByteProgress, Progress, check_progress
from .._messages import get_logger
from .._types import DTypeLike, InitHook, StrPath
from ..errors import StateDictMismatchError
from . import rank_agreement, shard_reads, sharded
from .device_copy import DeviceFiller, Ranges
from .init_hooks import run_init_hooks
from .key_map import KeyMap, apply_key_map, normalise_prefixes
from .mismatch import strict_failure

if TYPE_CHECKING:
    from .._formats import DcpKeys, NamesMode, QuantizedMode, TPRules

__all__ = ["KeyMap", "LoadReport", "load"]

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What :func:`zeroio.load` did; key lists use torch's names."""

    missing_keys: tuple[str, ...]
    """Model keys (parameters and persistent buffers) that no checkpoint tensor filled."""
    unexpected_keys: tuple[str, ...]
    """Checkpoint keys (after ``key_map``) that match no model key."""
    mismatched_shapes: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    """``(model key, checkpoint shape, model shape)`` for each key left unloaded because the shapes differ."""
    loaded_keys: tuple[str, ...]
    """Model keys now holding checkpoint values (tied aliases included), in ``model.state_dict()`` order."""
    tied: dict[str, str] = field(default_factory=dict)
    """Model ties after loading, ``{alias: source}``: ``alias`` and ``source`` are the very same tensor object."""
    renamed_keys: dict[str, str] = field(default_factory=dict)
    """Checkpoint key -> model key for every key that ``key_map`` or prefix normalisation renamed."""
    dropped_keys: tuple[str, ...] = ()
    """Checkpoint keys that ``key_map`` mapped to ``None``."""
    meta_keys: tuple[str, ...] = ()
    """Parameters and buffers (non-persistent ones included) still on the ``meta`` device after loading."""
    hooks_called: tuple[str, ...] = ()
    """The init hooks that ran, e.g. ``("configure_model",)``."""
    metadata: CheckpointMetadata | None = None
    """The checkpoint's metadata (format, ZeRO stage, world size, ...)."""


# --------------------------------------------------------------------------- the model's tensors


@dataclass(eq=False, slots=True)
class _Slot:
    """One distinct tensor object of the model and every place it is registered (several when tied)."""

    tensor: torch.Tensor
    is_param: bool
    names: list[str]
    owners: list[tuple[nn.Module, str]]
    persistent: bool


def _slots(model: nn.Module) -> tuple[dict[str, _Slot], list[_Slot]]:
    """``{state_dict key: slot}`` for parameters and persistent buffers, and every slot (non-persistent too)."""
    by_id: dict[int, _Slot] = {}
    by_key: dict[str, _Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        registered: list[tuple[str, torch.Tensor, bool, bool]] = [
            (n, p, True, True) for n, p in module._parameters.items() if p is not None
        ]
        registered += [
            (n, b, False, n not in module._non_persistent_buffers_set)
            for n, b in module._buffers.items()
            if b is not None
        ]
        for attr, tensor, is_param, persistent in registered:
            slot = by_id.get(id(tensor))
            if slot is None:
                slot = by_id[id(tensor)] = _Slot(tensor, is_param, [], [], persistent)
            key = dot + attr
            if key not in slot.names:
                slot.names.append(key)
                slot.owners.append((module, attr))
            if persistent:
                by_key[key] = slot
    return by_key, list(by_id.values())


# --------------------------------------------------------------------------- loading


def _target_device(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    target = torch.device(device)
    if target.type == "cuda" and target.index is None and torch.cuda.is_available():
        target = torch.device("cuda", torch.cuda.current_device())
    return target


def _prepared_filler(target: torch.device | None) -> DeviceFiller | None:
    """A :class:`DeviceFiller` for ``target`` already making its CUDA context and pinned ring, or None."""
    if target is None or target.type != "cuda" or not torch.cuda.is_available():
        return None
    filler = DeviceFiller(target)
    filler.prepare()
    return filler


def _filled(slot: _Slot, meter: ByteProgress, nbytes: int, new: torch.Tensor | None) -> None:
    if new is not None:
        _install(slot, new)
    meter.update(nbytes)


@dataclass(slots=True)
class _OnDevice:
    """A CUDA tensor filled by :class:`DeviceFiller`: all of checkpoint tensor ``key`` into ``dest``, or, for a
    sharded parameter, its ``ranges`` into its local part (put in place by ``target.finish()``)."""

    slot: _Slot
    key: str
    dest: torch.Tensor
    ranges: Ranges = None
    target: sharded.ShardTarget | None = None


def _fill_target(
    ckpt: Checkpoint, name: str, plan: sharded.ShardPlan, target: sharded.ShardTarget, fill: shard_reads.Fill
) -> torch.Tensor | None:
    """Fill a sharded parameter's local part (on a :class:`sharded.ShardFills` thread) and put it in place."""
    fill(ckpt, name, plan.runs, target.dest)
    return target.finish()


def _fill(ckpt: Checkpoint, name: str, dest: torch.Tensor) -> None:
    """Copy checkpoint tensor ``name`` into ``dest`` chunk by chunk (casting and moving as ``copy_`` does).

    Read straight in ``dest``'s floating dtype: one rounding from what is stored, as the sharded and device paths
    do (a dequantized FP8 weight reaches an fp32 parameter as its fp32 products, not rounded to bf16 first)."""
    dtype = dest.dtype if dest.is_floating_point() else None
    if dest.is_contiguous():
        flat = dest.view(-1)
        offset = 0
        for chunk in ckpt.iter_chunks(name, dtype=dtype):
            flat[offset : offset + chunk.numel()].copy_(chunk)
            offset += chunk.numel()
    else:
        dest.copy_(ckpt.get_tensor(name, dtype=dtype).view(dest.shape))


def _install(slot: _Slot, tensor: torch.Tensor) -> None:
    """Register ``tensor`` at every place the slot's old tensor was, so ties stay ties."""
    new: torch.Tensor
    if slot.is_param:
        new = nn.Parameter(tensor, requires_grad=slot.tensor.requires_grad)
    else:
        new = tensor
    for module, attr in slot.owners:
        setattr(module, attr, new)
    slot.tensor = new


def load(
    path: StrPath | Checkpoint,
    model: nn.Module,
    *,
    init_hook: InitHook | None = None,
    strict: bool = True,
    dtype: DTypeLike | None = None,
    device: str | torch.device | None = None,
    tag: str | None = None,
    key_map: KeyMap | None = None,
    progress: Progress | None = False,
    verify_crc: bool = True,
    tp_rules: TPRules | None = None,
    storage_options: Mapping[str, Any] | None = None,
    broadcast_from_rank0: bool = False,
    merge_lora: bool = False,
    adapter_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    quantized: QuantizedMode = "dequantize",
    names: NamesMode | None = None,
    dcp_keys: DcpKeys = "auto",
    true_vocab_size: int | None = None,
) -> LoadReport:
    """Load a checkpoint into ``model``, one tensor at a time.

    Steps: open the checkpoint (metadata only); run the init hook once; match keys and shapes (all of them
    checked before any parameter changes); stream each tensor into place.

    Args:
        path: a DeepSpeed checkpoint (root with ``latest``, or a tag folder), a ``.safetensors`` file or sharded
            folder, a torch ``.bin``/``.pt`` state dict or Lightning ``.ckpt``, or a checkpoint already opened
            with :func:`zeroio.open` (left open).
        model: any ``nn.Module``: built normally, on the ``meta`` device, or with layers the hook creates.
        init_hook: called as ``init_hook(model)`` once, before keys are matched, to build lazily created layers.
            When None and ``model`` is a ``LightningModule``, its own Lightning hooks run if its class overrides
            them (``configure_sharded_model``, then ``configure_model``, as Lightning's Trainer does); a plain
            ``nn.Module`` gets no implicit call. Pass ``init_hook=lambda m: None`` to run nothing. When every
            parameter of ``model`` is on ``meta``, the hook runs under ``torch.device("meta")``, so the layers
            it builds are never randomly initialised in memory first. In a torch.distributed job of several
            processes it runs even when the checkpoint could not be opened, so ranks that opened it meet this one
            in the hook's collectives and learn its error.
        strict: raise :class:`~zeroio.errors.StateDictMismatchError` on any missing key, unexpected key or shape
            mismatch, before modifying anything. With False, load what matches and report the rest.
        dtype: cast every floating tensor (parameters and buffers, like ``model.to(dtype)``) to this dtype.
            None keeps each model tensor's own dtype (checkpoint values are cast into it, like
            ``load_state_dict``).
        device: place loaded tensors here (``"cpu"``, ``"cuda:0"``). None keeps each tensor's device; tensors on
            ``meta`` land on the CPU.
        tag: the DeepSpeed tag folder to read (default: the one named in ``latest``).
        key_map: renames checkpoint keys (a dict, or a callable); ``None`` drops a key. Applied before the
            automatic ``module.`` / ``_forward_module.`` / ``model.`` prefix normalisation.
        progress: ``True`` draws a tqdm bar in bytes on a terminal, ``False`` (or None) is silent, or pass
            ``callable(done, total)``: called with bytes loaded and total bytes after each tensor.
        verify_crc: check every record read from a torch zip file (``.pt``/``.bin``) against its stored CRC-32 and
            raise CheckpointFormatError on a mismatch (see ``Checkpoint.verify_crc``); False skips the check.
        tp_rules: how a tensor-parallel checkpoint's tensors are split where its files do not record it, as for
            :func:`zeroio.open` (``{regex: dim or "replicated"}``, ``"megatron"`` or ``"neox"``).
        storage_options: options of the URL's fsspec filesystem (``s3://``, ``gs://``, ``hf://``,
            ``https://``: keys, endpoint, token; docs/remote.md); default: the backend's environment credentials.
        broadcast_from_rank0: every rank calls ``load``; rank 0 alone reads tensor data and broadcasts it chunk by
            chunk, each rank keeping its slice (docs/loading.md "Sharded models": for storage slow under many readers).
        merge_lora: the checkpoint is a PEFT LoRA run (``base_model.model.<module>.lora_A.default.weight``, ...):
            fill a plain base model (``model``) with the adapter merged in, as PEFT's ``merge_and_unload()`` does
            (``W + lora_alpha / r * B @ A``, computed in fp32; docs/fine-tunes.md).
        adapter_config: with ``merge_lora``, the run's ``adapter_config.json`` (file, folder or dict) when it is
            not beside the checkpoint (``checkpoint-N/adapter_config.json``).
        quantized: block-scaled FP8 weights are loaded dequantized (``"dequantize"``, DeepSeek's algorithm, cast
            into each parameter's dtype) or as stored (``"raw"``), as for :func:`zeroio.open`.
        names: ``"hf"`` loads a Megatron GPT of the Llama family into transformers' model (``LlamaForCausalLM``),
            under its names and layouts, as for :func:`zeroio.open` (docs/formats.md).
        dcp_keys: which tensors of a DCP checkpoint are the model's (``"auto"``, ``"model"``, ``"all"``), as for
            :func:`zeroio.open`.
        true_vocab_size: with ``names="hf"``, the embedding and output rows to load (the tokenizer's vocabulary;
            the rest is Megatron's padding), as for :func:`zeroio.open`.

    Returns:
        A :class:`LoadReport`: missing/unexpected/mismatched/loaded keys, ties, renames, hooks run.

    Raises:
        StateDictMismatchError: ``strict`` and the keys or shapes differ (the model is untouched).
        ZeroIOError: the init hook raised (its exception is ``__cause__``; nothing was loaded).
        CheckpointNotFoundError, CheckpointFormatError: the checkpoint cannot be read.

    Example:
        >>> import torch, zeroio
        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     model = MyModel()
        >>> report = zeroio.load("checkpoints/run1", model, dtype="bf16")  # doctest: +SKIP
        >>> model.head.weight is model.emb.weight, report.missing_keys  # doctest: +SKIP
        (True, ())
    """
    # 1. Validate arguments and open the checkpoint (metadata only) before anything touches the model.
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if init_hook is not None and not callable(init_hook):
        raise TypeError(f"init_hook must be a callable taking the model, got {type(init_hook).__name__}.")
    if key_map is not None and not (isinstance(key_map, Mapping) or callable(key_map)):
        raise TypeError(f"key_map must be a dict or a callable, got {type(key_map).__name__}.")
    if progress is None:  # the default before progress=True/False existed
        progress = False
    check_progress(progress)
    target_dtype = parse_dtype(dtype)
    target_device = _target_device(device)
    # The CUDA context and pinned staging are made on a thread while the checkpoint opens and keys are matched.
    prepared = _prepared_filler(target_device) if not broadcast_from_rank0 else None
    owned = not isinstance(path, Checkpoint)
    fill = shard_reads.broadcast_segments if broadcast_from_rank0 else shard_reads.read_segments
    # Any error on this rank, from opening on, reaches the other ranks of a sharded load (rank_agreement.py).
    in_collectives = partial(_in_collectives, model, broadcast_from_rank0)
    with rank_agreement.LoadSteps(str(path), in_collectives, partial(run_init_hooks, model, init_hook)) as steps:
        if isinstance(path, Checkpoint):
            ckpt = path
        else:
            from .._formats import open_checkpoint

            read = read_options(
                tag=tag, verify_crc=verify_crc, tp_rules=tp_rules, storage_options=storage_options,
                merge_lora=merge_lora, adapter_config=adapter_config, quantized=quantized, names=names,
                dcp_keys=dcp_keys, true_vocab_size=true_vocab_size,
            )  # fmt: skip
            try:
                ckpt = open_checkpoint(path, read)
            except BaseException:
                if prepared is not None:
                    prepared.close()
                raise
        try:
            report, sharded_load = _load(
                ckpt, model, steps, strict, target_dtype, target_device, key_map, progress, fill, prepared
            )
            # Every rank filled its part: none returns while another failed.
            steps.last(str(ckpt.metadata.path), sharded_load)
            if not sharded_load:  # a sharded load reads only its slice: checking whole records would read them all
                ckpt.finish_crc_checks()  # records read in part (flat-group padding)
            return report
        finally:
            if prepared is not None:
                prepared.close()
            if owned:
                ckpt.close()


def _in_collectives(model: nn.Module, broadcast: bool) -> bool:
    """Whether this load's ranks meet in collectives (so an error on one must be sent to the others)."""
    if not rank_agreement.in_process_group():
        return False
    return broadcast or any(sharded.is_sharded(t) for t in [*model.parameters(), *model.buffers()])


def _load(
    ckpt: Checkpoint,
    model: nn.Module,
    steps: rank_agreement.LoadSteps,
    strict: bool,
    target_dtype: torch.dtype | None,
    target_device: torch.device | None,
    key_map: KeyMap | None,
    progress: Progress,
    fill: shard_reads.Fill,
    prepared: DeviceFiller | None = None,
) -> tuple[LoadReport, bool]:
    """Steps 2-5 of :func:`load`; also says whether the model was sharded (each rank read only its slice)."""
    where = str(ckpt.metadata.path)

    # 2. The init hook builds lazily created layers; it runs exactly once, before keys are matched.
    hooks = steps.init_hooks(where)

    # 3. Match checkpoint keys to the model's parameters and persistent buffers (names and shapes only).
    by_key, all_slots = _slots(model)
    sharded.check_supported(model, where)
    broadcast = fill is shard_reads.broadcast_segments
    is_sharded = broadcast or any(sharded.is_sharded(slot.tensor) for slot in all_slots)
    infos = ckpt.infos
    mapped, dropped = apply_key_map(list(infos), key_map)
    mapped = normalise_prefixes(mapped, by_key)
    plan, unexpected, mismatched = _match(ckpt, by_key, mapped, where)
    # A tied model tensor is satisfied by any of its names; a size-mismatched one is reported once, as such.
    accounted = set(plan) | {id(by_key[name]) for name, _, _ in mismatched}
    missing = [k for k, slot in by_key.items() if id(slot) not in accounted]
    failure = strict_failure(model, (missing, unexpected, mismatched), where, len(plan)) if strict else None
    # A sharded model: each rank plans its slices, and all ranks agree on any failure before anyone writes.
    targets = {id(slot): (slot.tensor, slot.names[0]) for slot, _ in plan.values()}
    shard_plans = sharded.plan_agreed(targets, failure, where, broadcast, ckpt) if is_sharded else {}
    if failure is not None:
        raise failure
    if prepared is not None and not is_sharded:  # the disk starts while the CUDA context is still being made
        prepared.read_ahead(ckpt, [key for _, key in plan.values()])

    # 4. Stream, in storage order, in bounded chunks: in place (copy_) when dtype and device fit (Parameters, ties and
    #    optimizer references survive), else a new tensor at its final place, registered at every name.
    total = sum(infos[key].nbytes for _, key in plan.values())
    meter = ByteProgress(progress, total, "Loading")
    # A caller's default-device context must not redirect our reads.
    on_device: dict[torch.device, list[_OnDevice]] = {}  # filled through pinned staging, reads overlapping copies
    fills = sharded.ShardFills(sharded.readers_per_rank() if fill is shard_reads.read_segments else 1)
    with closing(meter), closing(fills), torch.no_grad(), torch.device("cpu"), ckpt.reading_in_order(not is_sharded):
        for slot, key in plan.values():
            steps.check(where)  # another rank failed meanwhile: stop here, on every rank
            old = slot.tensor
            if id(slot) in shard_plans:
                shard_plan = shard_plans[id(slot)]
                target = sharded.shard_target(old, shard_plan, target_dtype, target_device)
                ranges = sharded.contiguous_runs(shard_plan)
                if fill is shard_reads.read_segments and ranges is not None and DeviceFiller.handles(target.dest):
                    on_device.setdefault(target.dest.device, []).append(
                        _OnDevice(slot, key, target.dest, ranges, target)
                    )
                    continue
                job = partial(_fill_target, ckpt, key, shard_plan, target, fill)
                fills.run(job, partial(_filled, slot, meter, infos[key].nbytes))
                continue
            want_dtype = target_dtype if (target_dtype is not None and old.is_floating_point()) else old.dtype
            want_device = target_device or (torch.device("cpu") if old.is_meta else old.device)
            if not old.is_meta and old.dtype == want_dtype and old.device == want_device:
                dest = old
            else:
                dest = torch.empty(old.shape, dtype=want_dtype, device=want_device)
            if broadcast:
                shard_reads.fill_whole(ckpt, key, dest, fill)
            elif DeviceFiller.handles(dest):
                on_device.setdefault(dest.device, []).append(_OnDevice(slot, key, dest))
                continue
            else:
                _fill(ckpt, key, dest)
            if dest is not old:
                _install(slot, dest)
            meter.update(infos[key].nbytes)
        fills.finish()
        for device, jobs in on_device.items():
            filler = prepared if prepared is not None and prepared.device == device else DeviceFiller(device)
            filler.fill(ckpt, [(e.key, e.dest, e.ranges) for e in jobs], lambda k: meter.update(infos[k].nbytes))
            for entry in jobs:
                new = entry.dest if entry.target is None else entry.target.finish()
                if new is not None and new is not entry.slot.tensor:
                    _install(entry.slot, new)
    # 5. Report.
    report = _report(ckpt, by_key, all_slots, plan, hooks, (missing, unexpected, mismatched), mapped, dropped)
    logger.info(
        "loaded %d tensors (%d bytes) from '%s' into %s: %d missing, %d unexpected, %d shape mismatches",
        len(plan),
        total,
        where,
        type(model).__name__,
        len(missing),
        len(unexpected),
        len(mismatched),
    )
    return report, is_sharded


def _match(
    ckpt: Checkpoint, by_key: dict[str, _Slot], mapped: dict[str, str], where: str
) -> tuple[dict[int, tuple[_Slot, str]], list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Step 3 of :func:`load`: each checkpoint key's model slot (names and shapes only), the unexpected keys and
    the shape mismatches (in model order, as torch reports them)."""
    infos = ckpt.infos
    plan: dict[int, tuple[_Slot, str]] = {}  # id(slot) -> (slot, checkpoint key), in checkpoint order
    claimed: dict[str, str] = {}  # model key -> checkpoint key
    unexpected: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for key, name in mapped.items():
        slot = by_key.get(name)
        if slot is None:
            unexpected.append(name)
            continue
        if name in claimed:
            other = claimed[name]
            if ckpt.tied.get(key, key) == ckpt.tied.get(other, other):
                continue  # two names of one checkpoint tensor; one of them suffices
            raise StateDictMismatchError(
                f"Checkpoint keys '{other}' and '{key}' both map to model key '{name}' in '{where}'. "
                "Fix key_map so that each model key receives one tensor.",
                path=where,
            )
        claimed[name] = key
        ckpt_shape = tuple(infos[key].shape)
        model_shape = sharded.global_shape(slot.tensor)
        if ckpt_shape != model_shape:
            mismatched.append((name, ckpt_shape, model_shape))
            continue
        plan.setdefault(id(slot), (slot, key))
    order = {k: i for i, k in enumerate(by_key)}
    mismatched.sort(key=lambda m: order[m[0]])  # model order, as torch reports them
    return plan, unexpected, mismatched


def _report(
    ckpt: Checkpoint,
    by_key: dict[str, _Slot],
    all_slots: list[_Slot],
    plan: dict[int, tuple[_Slot, str]],
    hooks: tuple[str, ...],
    keys: tuple[list[str], list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]],
    mapped: dict[str, str],
    dropped: list[str],
) -> LoadReport:
    """Step 5 of :func:`load`: the report, warning about tensors the checkpoint left on the meta device."""
    missing, unexpected, mismatched = keys
    where = str(ckpt.metadata.path)
    loaded_keys = [k for k, slot in by_key.items() if id(slot) in plan]
    tied = {alias: slot.names[0] for slot in all_slots for alias in slot.names[1:]}
    meta_keys = [n for slot in all_slots if slot.tensor.is_meta for n in slot.names]
    if meta_keys:
        logger.warning(
            "%d tensor(s) still on the meta device after loading '%s' (first: %s): the checkpoint does not hold them "
            "(non-persistent buffers are never saved); set them before using the model",
            len(meta_keys),
            where,
            meta_keys[0],
        )
    report = LoadReport(
        missing_keys=tuple(missing),
        unexpected_keys=tuple(unexpected),
        mismatched_shapes=tuple(mismatched),
        loaded_keys=tuple(loaded_keys),
        tied=tied,
        renamed_keys={k: v for k, v in mapped.items() if k != v},
        dropped_keys=tuple(dropped),
        meta_keys=tuple(meta_keys),
        hooks_called=hooks,
        metadata=ckpt.metadata,
    )
    return report
