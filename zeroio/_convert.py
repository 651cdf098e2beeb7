"""``zeroio.convert``: validate the keywords once, look the output format's writer up in ``WRITERS``, run it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._every_rank import convert_destination, once_per_job
from ._formats import read_options
from ._io.progress import Progress
from ._model_card import written_card_facts
from ._types import StrPath
from ._write import Written, write_output
from ._write.options import DEFAULT_CHUNK_BYTES, DcpLayout, OutputFormat, write_options

if TYPE_CHECKING:
    import torch

    from ._formats import DcpKeys, NamesMode, QuantizedMode, TPRules

__all__ = ["ConvertResult", "convert"]


@dataclass(frozen=True, slots=True)
class ConvertResult:
    """What :func:`convert` wrote."""

    files: tuple[Path, ...]
    """Weight files in the destination, in shard order."""
    index_path: Path | None
    """``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``, or None for a single file."""
    total_size: int
    """Bytes of tensor data (each tied group once): the index's ``metadata.total_size``."""
    num_tensors: int
    """Distinct tensors stored (a tied alias is not counted: it shares its source's bytes)."""
    tied: dict[str, str] = field(default_factory=dict)
    """Tied aliases, ``{alias: source}``, recorded in the output so loaders re-tie them."""
    card_facts: dict[str, Any] = field(default_factory=dict)
    """Facts for a Hub model card: ``source_format``, ``tag``, ``ds_version``, ``zero_stage``, ``world_size``,
    ``global_step``, ``train_dtype``, ``output_dtype``, ``format``, ``num_params``, ``excluded_frozen``."""
    copied: tuple[Path, ...] = ()
    """Config and tokenizer files copied from beside the source (an HF Trainer ``checkpoint-N/``), in the output."""


# --------------------------------------------------------------------------- the public verb

_SAME_ON_EVERY_RANK = ("src", "fmt", "dtype", "max_shard_size", "tag", "exclude_frozen", "include_optimizer")


@once_per_job("convert", convert_destination, ConvertResult, _SAME_ON_EVERY_RANK)  # docs/distributed.md
def convert(
    src: StrPath,
    dst: StrPath,
    *,
    fmt: OutputFormat = "safetensors",
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    tag: str | None = None,
    exclude_frozen: bool = False,
    overwrite: bool = False,
    workers: int | None = None,
    progress: Progress = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    distributed: bool = False,
    include_optimizer: bool = False,
    verify_crc: bool = True,
    trusted_globals: Iterable[str] = (),
    tp_rules: TPRules | None = None,
    storage_options: Mapping[str, Any] | None = None,
    dcp_layout: DcpLayout = "torchtitan",
    merge_lora: bool = False,
    adapter_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    names: NamesMode | None = None,
    dcp_keys: DcpKeys = "auto",
    quantized: QuantizedMode = "dequantize",
    true_vocab_size: int | None = None,
) -> ConvertResult:
    """Convert a checkpoint into the files Hugging Face tools load, streaming and all-or-nothing.

    ``fmt="safetensors"`` writes ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` ... plus
    ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size``: the names, shard split,
    header metadata (``{"format": "pt"}``) and index that ``huggingface_hub.save_torch_state_dict`` writes.
    Tied weights are stored once under their source name; each alias is recorded as ``alias: source`` in the
    header metadata (one file) or in the index's ``metadata`` (sharded), as huggingface_hub records them.
    Every offset is computed from metadata before a tensor is read; tensors are then streamed in chunks of
    ``chunk_bytes`` into one reused buffer per IO thread, so memory stays near ``workers * chunk_bytes`` (twice
    that when casting) whatever the model or shard size.

    ``fmt="torch"`` writes ``pytorch_model.bin`` (or ``pytorch_model-0000K-of-0000N.bin`` plus
    ``pytorch_model.bin.index.json``), loadable with ``torch.load(weights_only=True)``; tied names are both
    keys and share one tensor. It holds one shard in memory at a time (``torch.save`` needs whole tensors).

    ``fmt="lightning"`` writes the single consolidated ``.ckpt`` file PyTorch Lightning users deploy (``dst`` is
    that file): ``state_dict`` plus the client state Lightning saved (``epoch``, ``global_step``,
    ``hyper_parameters``, ``loops``, ``callbacks``, ...), loadable with ``LightningModule.load_from_checkpoint``
    (from a checkpoint without Lightning state, e.g. plain DeepSpeed, it holds ``state_dict`` and the
    ``pytorch-lightning_version`` that loading needs; the module's ``__init__`` arguments are then yours to pass).
    It holds the whole state dict in memory (a torch pickle); ``max_shard_size``, ``workers``, ``chunk_bytes``
    and ``progress`` do not apply.

    ``fmt="universal"`` writes a DeepSpeed universal checkpoint (``dst/latest_universal`` and
    ``dst/<tag>_universal/``: the files ``ds_to_universal`` writes) from a ZeRO-1/2/3 checkpoint, which DeepSpeed
    resumes at another world size with ``"checkpoint": {"load_universal": true}``; tensors are streamed parameter
    by parameter in chunks of ``chunk_bytes`` (``docs/format.md``, "Writing universal checkpoints"). ``dtype``,
    ``exclude_frozen``, ``distributed``, ``include_optimizer``, ``max_shard_size`` and ``workers`` do not apply.

    ``fmt="dcp"`` writes a PyTorch Distributed Checkpoint that FSDP2 resumes from with ``dcp.load`` plus
    ``set_model_state_dict``/``set_optimizer_state_dict`` (``dcp_layout``: ``"torchtitan"``, ``dst`` being the
    ``step-N`` folder, or ``"accelerate"``: ``dst/pytorch_model_fsdp_0`` and ``dst/optimizer_0``); tensors are
    streamed as row blocks of ``chunk_bytes``, and ``include_optimizer`` adds the Adam state (``docs/dcp.md``).
    ``max_shard_size``, ``exclude_frozen``, ``distributed`` and ``workers`` do not apply.

    ``fmt="peft"`` writes the LoRA adapter(s) of a PEFT run as ``PeftModel.save_pretrained`` does:
    ``adapter_model.safetensors`` (``get_peft_model_state_dict``'s keys: ``base_model.model.`` kept, the adapter
    name dropped) and ``adapter_config.json`` (copied from beside the source, or from ``adapter_config``); a named
    adapter other than ``default`` goes to ``dst/<name>/``. ``merge_lora=True`` instead writes, in any other
    format, the plain base model with the adapter merged in as ``merge_and_unload()`` does (docs/fine-tunes.md).

    ``config.json``, ``generation_config.json`` and tokenizer files found beside the source (the HF Trainer's
    ``checkpoint-N/``, or the parent of a tag folder or file) are copied into a ``safetensors``/``torch``
    output folder, so ``transformers`` loads it as it is; a plain DeepSpeed checkpoint has none.

    The output is built in a temporary folder (file) beside ``dst`` and renamed into place when complete.

    Args:
        src: anything :func:`zeroio.open` reads: a DeepSpeed checkpoint (root or tag folder) or a consolidated
            safetensors/torch checkpoint (to re-shard or cast).
        dst: the output folder to create (the ``.ckpt`` file for ``fmt="lightning"``).
        fmt: ``"safetensors"`` (default), ``"torch"``, ``"lightning"``, ``"universal"``, ``"dcp"`` or ``"peft"``.
        dtype: cast floating tensors (``"fp32"``, ``"fp16"``, ``"bf16"`` or a torch dtype), with torch's own
            rounding (``tensor.to(dtype)``); integer buffers keep their dtype. Default: as stored (fp32 master
            weights, frozen parameters in their training dtype).
        max_shard_size: largest shard, ``"5GB"``, ``"500MB"``, ``"1.5GB"`` (decimal units) or bytes. A tensor
            larger than this gets a shard of its own.
        tag: the DeepSpeed tag to read (default: the one in ``latest``).
        exclude_frozen: leave out frozen (``requires_grad=False``) parameters of a DeepSpeed checkpoint
            (consolidated files do not say which parameters were frozen). Not with ``fmt="lightning"``:
            ``load_from_checkpoint`` needs every parameter.
        overwrite: replace an existing ``dst``: a file, or a folder holding only what zeroio writes (weights,
            index, optimizer files, copied config/tokenizer files, reshard's ``latest`` and tag folders); a
            folder holding anything else is refused, naming those files (``docs/converting.md``).
        workers: IO threads (default: up to 4).
        progress: ``True`` draws a tqdm bar in bytes on a terminal, ``False`` is silent, or pass
            ``callable(done, total)`` (bytes; it may be called from IO threads).
        chunk_bytes: largest piece of a tensor read at once, per thread.
        distributed: run as one process of a ``torch.distributed`` job (an initialised process group, or
            ``torchrun``'s environment): every process must call ``convert`` with the same arguments; each writes
            its share of the shards into one folder on a filesystem shared by all, and every process returns the
            same result. See ``docs/distributed.md``. Without it, when a process group is initialised and several
            ranks call ``convert`` with the same ``dst`` (code written for DeepSpeed's ``zero_to_fp32``), the first
            writes, the others wait and return its result or raise its error.
        include_optimizer: also write the consolidated optimizer state of a DeepSpeed ZeRO-1/2/3 checkpoint:
            ``optimizer.safetensors`` (keys ``<param>.exp_avg``, ``<param>.exp_avg_sq``; sharded like the
            weights) and ``optimizer.json`` (param groups, steps), or, with ``fmt="dcp"``, the ``optimizer`` state
            dict FSDP2 loads. ``fmt="safetensors"``/``"dcp"`` only; a source without optimizer state fails before
            anything is written. See ``docs/resharding.md``.
        verify_crc: check every record read from a torch zip file (``.pt``/``.bin``) against its stored CRC-32 and
            raise CheckpointFormatError on a mismatch (see ``Checkpoint.verify_crc``); False skips the check.
        trusted_globals: extra pickle globals to accept when reading the source, as for :func:`zeroio.open`
            (rebuilt as inert data, never called).
        tp_rules: how a tensor-parallel source's tensors are split where its files do not record it, as for
            :func:`zeroio.open` (``{regex: dim or "replicated"}``, ``"megatron"`` or ``"neox"``).
        storage_options: options of the fsspec filesystem of ``src`` and/or ``dst`` where they are URLs (``s3://``,
            ``gs://``, ``hf://``, ``https://``: keys, endpoint, token; docs/remote.md); default: the backend's
            environment credentials. A URL ``dst`` (``s3://bucket/model``) is written locally, then uploaded,
            the index last; a failed upload removes what it uploaded.
        dcp_layout: with ``fmt="dcp"``, ``"torchtitan"`` (default) or ``"accelerate"``.
        dcp_keys: which tensors of a DCP source are the model's, as for :func:`zeroio.open`.
        merge_lora: the source is a PEFT LoRA run: write the base model's weights (``base_model.model.`` and
            ``.base_layer`` dropped, LoRA tensors left out) with each adapted weight ``W + scale * B @ A``
            (transposed for ``fan_in_fan_out`` layers; ``scale = lora_alpha / r``, rsLoRA ``lora_alpha / sqrt(r)``),
            computed and returned in fp32, then cast to ``dtype`` if given (other tensors keep theirs). One weight's rows and
            its two factors are in memory at a time. DoRA and other variants are refused by name.
        adapter_config: the run's ``adapter_config.json`` (a file, a folder laid out as ``save_pretrained`` writes
            it, or a dict) for ``fmt="peft"`` / ``merge_lora`` when it is not in the training output folder.
        names: ``"hf"`` writes a Megatron GPT of the Llama family (Qwen3 with QK norms; MoE models as Mixtral,
            Qwen2-MoE or Qwen3-MoE) under transformers' names, with its ``config.json`` (docs/formats.md).
        quantized: block-scaled FP8 weights are written dequantized (``"dequantize"``, DeepSeek's algorithm; the
            output's ``config.json`` loses ``quantization_config`` and names the dtype written) or as stored
            (``"raw"``), as for :func:`zeroio.open`.
        true_vocab_size: with ``names="hf"``, write the first ``true_vocab_size`` rows of the embedding and output
            layer (the tokenizer's vocabulary; the rest is Megatron's padding) and ``vocab_size`` in
            ``config.json``, as for :func:`zeroio.open`.

    Returns:
        A :class:`ConvertResult`: files, index path, total size, tensor count, ties, model-card facts and the
        copied config/tokenizer files. For ``fmt="lightning"``: ``files=(dst,)``, ``index_path=None``.

    Raises:
        OutputError: ``dst`` exists (without ``overwrite``) or holds the source, cannot be written, the disk
            filled, or the conversion was interrupted (KeyboardInterrupt); the partial output is removed.
        CheckpointNotFoundError, CheckpointFormatError: the source cannot be read (raised before ``dst`` is
            touched when found in metadata).
        ValueError: an argument has a bad value (format, dtype, shard size, workers), or ``exclude_frozen``
            with ``fmt="lightning"``.
        UnsupportedCheckpointError: ``fmt="lightning"`` and the client state holds an object zeroio cannot
            rebuild.
        TypeError: an argument has the wrong type.

    Example:
        >>> import zeroio
        >>> result = zeroio.convert("fixtures/z3_ws2_bf16", "out/model", dtype="bf16", progress=False)  # doctest: +SKIP
        >>> [p.name for p in result.files]  # doctest: +SKIP
        ['model.safetensors']
    """
    # 1. Arguments, without IO: validated here once, then passed down as two values.
    write = write_options(
        fmt=fmt, dtype=dtype, max_shard_size=max_shard_size, exclude_frozen=exclude_frozen, overwrite=overwrite,
        workers=workers, progress=progress, chunk_bytes=chunk_bytes, distributed=distributed,
        include_optimizer=include_optimizer, dcp_layout=dcp_layout,
    )  # fmt: skip
    read = read_options(
        tag=tag, verify_crc=verify_crc, trusted_globals=trusted_globals, tp_rules=tp_rules,
        storage_options=storage_options, merge_lora=merge_lora, adapter_config=adapter_config, names=names,
        dcp_keys=dcp_keys, quantized=quantized, true_vocab_size=true_vocab_size,
    )  # fmt: skip
    if merge_lora and (fmt in ("universal", "peft") or include_optimizer):
        what = "include_optimizer" if include_optimizer else f"fmt={fmt!r}"
        raise ValueError(f"merge_lora=True writes merged model weights; {what} does not take them: drop one of them.")
    return _result(write_output(src, dst, read, write))


def _result(written: Written) -> ConvertResult:
    """The writer's result, with the model-card facts rendered from what it wrote."""
    return ConvertResult(
        files=written.files,
        index_path=written.index_path,
        total_size=written.total_size,
        num_tensors=written.num_tensors,
        tied=written.tied,
        card_facts=written_card_facts(written.card),
        copied=written.copied,
    )
