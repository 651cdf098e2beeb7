"""``fmt="peft"``: each LoRA adapter of a PEFT run as ``adapter_model.safetensors`` + ``adapter_config.json``.

The folder is what ``PeftModel.save_pretrained`` writes (peft 0.21.2): the ``default`` adapter at the top, any
other adapter in ``<name>/``; keys are ``get_peft_model_state_dict``'s (``base_model.model.`` kept, the adapter
name dropped). Tensors stream from the checkpoint through the write engine's shard writer, all-or-nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .._formats import Checkpoint, ReadOptions, output_spec
from .._io.fileio import naming, write_new_file
from .._messages import get_logger
from .atomic import AtomicDir
from .options import WriteOptions
from .plan import WritePlan
from .safetensors_writer import plan_file
from .shard_files import write_shards
from .sharding import ShardPlan

__all__ = ["ADAPTER_WEIGHTS", "PeftOutcome", "write_peft"]

logger = get_logger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""PEFT's adapter weights file (``SAFETENSORS_WEIGHTS_NAME`` in peft 0.21.2)."""


@dataclass(frozen=True, slots=True)
class PeftOutcome:
    """What :func:`write_peft` wrote."""

    files: tuple[Path, ...]
    """``adapter_model.safetensors`` of each adapter, ``default`` first."""
    total_size: int
    """Bytes of tensor data."""
    num_tensors: int
    """Tensors written, all adapters together."""
    adapters: tuple[str, ...]
    """The adapters written, in checkpoint order."""


def write_peft(src: Path, dst: Path, read: ReadOptions, write: WriteOptions) -> PeftOutcome:
    """Write every LoRA adapter in ``src`` into the folder ``dst`` as PEFT loads it.

    Raises:
        UnsupportedCheckpointError: ``src`` holds no LoRA adapter.
        CheckpointNotFoundError: an adapter's ``adapter_config.json`` is neither beside ``src`` nor given.
        OutputError: ``dst`` exists (without ``overwrite``) or cannot be written; nothing is left behind.
    """
    from .._formats import adapter_configs, adapter_view, open_checkpoint, peft_adapters

    if read.merge_lora:
        raise ValueError("fmt='peft' writes the adapter itself: drop merge_lora (merged weights go to other formats).")
    out = AtomicDir(dst, source=src, overwrite=write.overwrite)
    out.check()  # 1. refuse an existing destination before reading anything
    with open_checkpoint(src, read) as ckpt:
        # 2. Plan every adapter from metadata: its keys, the config to write beside, its file's layout.
        adapters = peft_adapters(ckpt)
        configs = adapter_configs(ckpt, src, adapters, read.adapter_config)
        views = {adapter: adapter_view(ckpt, adapter, configs[adapter]) for adapter in adapters}
        plans = {adapter: _adapter_plan(view, write) for adapter, view in views.items()}
        # 3. Stream each adapter into the temporary folder, its config beside; rename into place when complete.
        with out as tmp:
            for adapter in adapters:
                sub = "" if adapter == "default" else adapter
                (tmp / sub).mkdir(exist_ok=True)
                write_shards(
                    views[adapter], plans[adapter], tmp / sub, out.dst / sub, workers=write.workers,
                    chunk_bytes=write.chunk_bytes, progress=write.progress,
                )  # fmt: skip
                with naming(out.dst / sub / "adapter_config.json"):
                    write_new_file(tmp / sub / "adapter_config.json", configs[adapter].raw)
            ckpt.finish_crc_checks()
    files = tuple(out.dst / ("" if a == "default" else a) / ADAPTER_WEIGHTS for a in adapters)
    total = sum(p.shards.total_size for p in plans.values())
    count = sum(p.num_tensors for p in plans.values())
    logger.info("wrote %d LoRA adapter(s) (%d tensors, %d bytes) to %s", len(adapters), count, total, out.dst)
    return PeftOutcome(files=files, total_size=total, num_tensors=count, adapters=tuple(adapters))


def _adapter_plan(view: Checkpoint, write: WriteOptions) -> WritePlan:
    """One adapter as the single file PEFT reads, ``adapter_model.safetensors``: no index, header metadata
    ``{"format": "pt"}`` (as ``save_pretrained``'s ``safetensors.torch.save_file`` writes), every tensor in its
    returned dtype (fp32 masters for trained factors) unless ``dtype`` casts it."""
    infos = view.infos
    names = tuple(infos)
    dtypes = {n: output_spec(infos[n], write.dtype) for n in names}
    layout = plan_file([(n, dtypes[n], infos[n].shape) for n in names], metadata={"format": "pt"})
    shards = ShardPlan(shards=((ADAPTER_WEIGHTS, names),), weight_map=dict.fromkeys(names, ADAPTER_WEIGHTS),
                       total_size=layout.data_bytes)  # fmt: skip
    return WritePlan(
        fmt="safetensors", target=write.dtype, names=names, excluded=(), ties={}, dtypes=dtypes, shards=shards,
        index=None, layouts=((ADAPTER_WEIGHTS, layout),), file_bytes=(layout.size,), data_bytes=(layout.data_bytes,),
        num_params=sum(infos[n].numel for n in names),
    )  # fmt: skip
