"""Format readers and their registry: ``open`` asks each registered format, in order, whether it reads a path.

Adding a checkpoint layout takes one module (detect + open) and one line in ``FORMATS``; no verb changes. This
package's face (the names below) is all that the write engine and the verbs import from the readers.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._io.confine import require_regular_file
from .._io.nearest import did_you_mean
from .._io.remote_path import RemotePath, as_path
from .._types import StrPath
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError, ZeroIOError
from .checkpoint import Checkpoint, PartitionedCheckpoint, TensorReader
from .composite.pipeline import open_pipeline
from .composite.pipeline_files import is_pipeline
from .composite.tensor_parallel import is_tensor_parallel, open_tensor_parallel
from .composite.universal import is_universal, open_universal
from .dcp.hf_storage import is_dcp_hf, open_dcp_hf
from .dcp.megatron import is_megatron, open_megatron
from .dcp.reader import is_dcp, open_dcp
from .files.consolidated import is_consolidated, open_consolidated
from .files.quantization import QuantizedMode, dequantized_dtype, present_quantized
from .lora.config import AdapterConfigSource
from .lora.views import adapter_configs, adapter_view, peft_adapters
from .metadata import (
    CheckpointMetadata,
    TensorInfo,
    dtype_name,
    output_dtype,
    output_spec,
    parse_dtype,
    parse_dtype_spec,
    require,
    require_dict,
)
from .optimizer.state import (
    OptimizerLayout,
    moment_source,
    optimizer_layout,
    optimizer_state,
    param_group_of,
    require_partitioned,
    state_dtype,
    state_keys_of,
    step_of,
    trainable_source,
)
from .optimizer.views import ComposedOptimizerState
from .options import DcpKeys, NamesMode, ReadOptions, read_options
from .partition import zero3_partition_numel, zero3_sub_groups
from .read_plans import FlatPlan, ReadPlan, WholePlan, read_plan_into
from .tp_rules import TPRules
from .verl import is_verl, open_verl
from .zero.file_layout import is_zero_checkpoint
from .zero.reader import open_zero

__all__ = [
    "FORMATS",
    "AdapterConfigSource",
    "Checkpoint",
    "CheckpointMetadata",
    "ComposedOptimizerState",
    "DcpKeys",
    "FlatPlan",
    "Format",
    "NamesMode",
    "OptimizerLayout",
    "PartitionedCheckpoint",
    "QuantizedMode",
    "ReadOptions",
    "ReadPlan",
    "TPRules",
    "TensorInfo",
    "TensorReader",
    "WholePlan",
    "adapter_configs",
    "adapter_view",
    "dequantized_dtype",
    "dtype_name",
    "moment_source",
    "open",
    "open_checkpoint",
    "optimizer_layout",
    "optimizer_state",
    "output_dtype",
    "output_spec",
    "param_group_of",
    "parse_dtype",
    "parse_dtype_spec",
    "peft_adapters",
    "read_options",
    "read_plan_into",
    "require",
    "require_dict",
    "require_partitioned",
    "state_dtype",
    "state_keys_of",
    "step_of",
    "trainable_source",
    "zero3_partition_numel",
    "zero3_sub_groups",
]


@dataclass(frozen=True, slots=True)
class Format:
    """One checkpoint layout zeroio reads."""

    name: str
    detect: Callable[[Path], bool]
    """True when the path (checked by names only, nothing parsed) holds this layout."""
    open: Callable[[Path, ReadOptions], Checkpoint]
    """``open(path, options)``: the lazy checkpoint view (each reader takes the ``ReadOptions`` it needs)."""


def _consolidated_not_zero(path: Path) -> bool:
    return is_consolidated(path) and not is_zero_checkpoint(path)


def _open_consolidated(path: Path, options: ReadOptions) -> Checkpoint:
    return open_consolidated(path, trusted_globals=options.trusted_globals)


def _open_zero(path: Path, options: ReadOptions) -> Checkpoint:
    return open_zero(path, options.tag, trusted_globals=options.trusted_globals)


def _anything(path: Path) -> bool:
    return True


FORMATS: list[Format] = [
    # A Megatron torch_dist folder is a DCP folder too (plus metadata.json and common.pt): it goes first.
    Format("megatron", is_megatron, open_megatron),
    Format("dcp", is_dcp, open_dcp),
    Format("dcp-safetensors", is_dcp_hf, open_dcp_hf),
    Format("verl", is_verl, open_verl),
    Format("consolidated", _consolidated_not_zero, _open_consolidated),
    Format("universal", is_universal, open_universal),
    # Pipeline folders hold several mp_rank files too: named layer files tell them apart, so they go first.
    Format("pipeline", is_pipeline, open_pipeline),
    Format("tensor-parallel", is_tensor_parallel, open_tensor_parallel),
    # Last, and takes any path: its errors say what a DeepSpeed checkpoint folder should hold.
    Format("zero", _anything, _open_zero),
]
"""Registered formats, tried in order; the first whose ``detect`` is true opens the path (the last detects any)."""


def open(
    path: StrPath | RemotePath,
    tag: str | None = None,
    *,
    trusted_globals: Iterable[str] = (),
    verify_crc: bool = True,
    tp_rules: TPRules | None = None,
    ignore_recorded_tp: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    merge_lora: bool = False,
    adapter_config: AdapterConfigSource = None,
    names: NamesMode | None = None,
    dcp_keys: DcpKeys = "auto",
    quantized: QuantizedMode = "dequantize",
    true_vocab_size: int | None = None,
) -> Checkpoint:
    """Open a checkpoint lazily: read metadata now, tensor bytes only when asked.

    Args:
        path: a DeepSpeed checkpoint root (with ``latest``), a tag folder, a rank file, a consolidated
            checkpoint (``model.safetensors``, a sharded safetensors folder, a torch ``.bin``/``.pt`` state dict),
            or a PyTorch Distributed Checkpoint folder (FSDP2/FSDP1 ``.metadata`` + ``.distcp``, torchtitan's
            ``step-N/`` or the folder holding them, accelerate's folder holding ``pytorch_model_fsdp_0/``).
        tag: the tag folder to read (default: the one named in ``latest``; for torchtitan the newest ``step-N``).
        trusted_globals: extra pickle globals to accept, rebuilt as inert data (never called).
        verify_crc: check every zip record read (torch ``.pt``/``.bin`` files) against its stored CRC-32 and raise
            CheckpointFormatError on a mismatch (see :attr:`Checkpoint.verify_crc`). False reads corrupted bytes
            silently, as torch.load does. Safetensors files have no checksum to check.
        tp_rules: for a tensor-parallel checkpoint (``mp_rank_01`` files), how tensors the files do not describe
            are split: ``{regex: dim or "replicated"}`` (``re.search`` on the name), a preset (``"megatron"``,
            ``"neox"``) or that mapping as JSON text. A tensor neither recorded nor matched is refused by name.
            Ignored by layouts that are not tensor parallel.
        ignore_recorded_tp: set the partitions recorded in the files (AutoTP's ``universal_checkpoint_info``)
            aside, so ``tp_rules`` alone decide.
        storage_options: for a URL path (``s3://``, ``gs://``, ``hf://``, ``https://``), options of its fsspec
            filesystem (credentials, ``endpoint_url``, ...); the standard environment variables apply otherwise
            (docs/remote.md).
        merge_lora: a PEFT LoRA run read as its plain base model with the adapter merged in (each merged weight
            computed when read, in fp32, as ``merge_and_unload()`` computes it; docs/fine-tunes.md).
        adapter_config: with ``merge_lora``, the run's ``adapter_config.json`` (file, folder or dict) when it is
            not beside the checkpoint.
        names: ``"hf"`` reads a Megatron GPT of the Llama family (Qwen3 with QK norms; MoE models as Mixtral,
            Qwen2-MoE or Qwen3-MoE) under transformers' names (docs/formats.md).
        dcp_keys: for a DCP checkpoint, which tensors are the model's: ``"auto"`` strips ``model.`` when every
            other tensor is optimizer or training state (``dcp.save({"model": ..., "optim": ...})``) and keeps
            every name as stored otherwise (a Hugging Face-style ``model.embed_tokens.weight`` beside
            ``lm_head.weight``); ``"model"`` keeps only ``model.`` tensors, prefix stripped; ``"all"`` every tensor
            but optimizer state, as stored. ``metadata.extra["dcp_keys"]`` says what was done.
        quantized: block-scaled FP8 weights (``config.json``'s ``quantization_config`` ``quant_method: fp8``
            with ``weight_block_size``, or ``X`` / ``X_scale_inv`` pairs): ``"dequantize"`` (default) presents each
            as its dequantized tensor, exactly as DeepSeek's ``fp8_cast_bf16.py`` computes it, with no
            ``*_scale_inv`` key; ``"raw"`` reads every tensor as stored (float8 values and scales). Any other
            quantized layout, and a float8 tensor without a scale, is refused unless ``"raw"`` (docs/fine-tunes.md).
        true_vocab_size: with ``names="hf"``, the tokenizer's vocabulary size: the embedding and output layer keep
            their first ``true_vocab_size`` rows (the rest is Megatron's vocabulary padding) and ``config.json``
            says ``vocab_size: true_vocab_size``. Default: the size common.pt's args record where Megatron derives
            it from them (``NullTokenizer``, ``TikTokenizer``), else every stored row (docs/formats.md).

    Returns:
        A read-only ``Mapping[str, torch.Tensor]`` with ``metadata``, ``info()``, ``tied`` and ``state_dict()``.

    Raises:
        CheckpointNotFoundError: the path, tag or a rank file is missing.
        CheckpointFormatError: a file is not what a checkpoint holds (subclasses say how).

    Example:
        >>> import zeroio
        >>> with zeroio.open("fixtures/z3_ws2_fp32") as ckpt:
        ...     print(ckpt.metadata.zero_stage, ckpt.metadata.world_size, ckpt["emb.weight"].shape)
        3 2 torch.Size([13, 7])
    """
    options = read_options(
        tag=tag, verify_crc=verify_crc, trusted_globals=trusted_globals, tp_rules=tp_rules,
        ignore_recorded_tp=ignore_recorded_tp, storage_options=storage_options, merge_lora=merge_lora,
        adapter_config=adapter_config, names=names, dcp_keys=dcp_keys, quantized=quantized,
        true_vocab_size=true_vocab_size,
    )  # fmt: skip
    return open_checkpoint(path, options)


def open_checkpoint(path: StrPath | RemotePath, options: ReadOptions) -> Checkpoint:
    """:func:`open` with its keywords already validated: how every verb opens its source.

    ``path`` may be a :class:`RemotePath` already (its listing is then reused, not made again).
    """
    p = as_path(path, options.storage_options)
    try:
        exists = p.exists()
    except OSError as exc:  # a name the file system refuses (too long, a loop of links): Python 3.11 raises
        if exc.errno not in (errno.ENAMETOOLONG, errno.ELOOP):
            raise  # a URL's storage errors say more themselves (credentials, endpoints)
        raise CheckpointNotFoundError(
            f"Checkpoint path '{p}' cannot be looked up ({exc.strerror}): check the path.", path=p
        ) from None
    if not exists:
        raise CheckpointNotFoundError(f"Checkpoint path '{p}' does not exist.{did_you_mean(p)}", path=p)
    if not p.is_dir():
        require_regular_file(p)  # a FIFO, /dev/zero or a link to one: reading would block or never end
    # The first registered format that detects the path opens it, given the read options; the last one,
    # ZeRO, takes any path, so its errors say what a DeepSpeed checkpoint folder should hold.
    fmt = next((f for f in FORMATS if f.detect(p)), FORMATS[-1])
    if options.names and fmt.name != "megatron":
        raise UnsupportedCheckpointError(
            f"names={options.names!r} maps Megatron checkpoints only; '{p}' is read as {fmt.name}. Drop names.",
            path=p,
        )
    try:
        ckpt = fmt.open(p, options)
    except ZeroIOError:
        raise
    except (
        TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError, MemoryError,
        NotADirectoryError, IsADirectoryError,
    ) as exc:  # fmt: skip
        # Last line of defence, for every format: content of an unexpected shape (RecursionError is a RuntimeError)
        # must never surface as a bare Python error.
        raise CheckpointFormatError(
            f"'{p}' holds metadata zeroio cannot interpret ({type(exc).__name__}: {str(exc)[:200]}). The checkpoint "
            "is corrupted or was written by an unsupported version; please report it with `zeroio inspect --json`.",
            path=p,
        ) from exc
    try:
        ckpt = present_quantized(ckpt, options.quantized)
    except BaseException:
        ckpt.close()
        raise
    ckpt.verify_crc = options.verify_crc
    if options.merge_lora:
        from .lora.views import merged_lora_view

        try:
            return merged_lora_view(ckpt, p, options.adapter_config)
        except BaseException:
            ckpt.close()
            raise
    return ckpt
