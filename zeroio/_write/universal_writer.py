"""``convert(fmt="universal")``: a DeepSpeed universal checkpoint, written parameter by parameter in bounded chunks.

The output is what DeepSpeed 0.19.8's ``ds_to_universal`` writes (``docs/format.md``, "Writing universal
checkpoints"), which ``engine.load_checkpoint`` resumes from with ``"checkpoint": {"load_universal": true}``
at any data-parallel world size. Unlike ``ds_to_universal`` it never holds a whole optimizer file, a flat group or
a temporary fragment folder: each tensor is streamed from the source's rank files into its own ``.pt`` file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _constants as C
from .._formats import (
    Checkpoint,
    OptimizerLayout,
    PartitionedCheckpoint,
    ReadOptions,
    ReadPlan,
    moment_source,
    open_checkpoint,
    optimizer_layout,
    read_plan_into,
)
from .._io.fileio import ChunkBuffers, create_new, write_new_file
from .._io.progress import ByteProgress
from .._messages import get_logger
from .._pickles import Chunks, RankFileBuilder, TensorRef, Where, writable
from .._types import StrPath
from ..errors import CheckpointFormatError, UnsupportedCheckpointError
from .atomic import AtomicDir
from .options import WriteOptions
from .result import Written

__all__ = ["LATEST_UNIVERSAL", "UNIVERSAL_STATE_FILES", "write_universal"]

logger = get_logger(__name__)

LATEST_UNIVERSAL = "latest_universal"
"""The root file naming the universal tag folder (``engine.load_checkpoint`` reads it when ``load_universal``)."""
ZERO_DIR = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
"""The per-element states ``ds_to_universal`` writes (DeepSpeed's loader maps every ``*.pt`` it finds)."""
UNIVERSAL_STATE_FILES = frozenset({"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"})
"""What a ``zero/<param>/`` folder may hold."""
_UC_PATTERN_KEYS = (
    "tp_replicated_parameter_patterns",
    "parameter_to_average_patterns",
    "parameter_with_row_parallelism_patterns",
    "vocabulary_parameter_patterns",
    "parameter_with_2_sub_params_cat_dim_0",
    "parameter_with_sub_params",
    "affine_map",
)
"""``universal_checkpoint_info`` entries that change how ``ds_to_universal`` merges a parameter (Megatron-style
tensor parallelism); zeroio writes the plain form only and refuses a source that sets any of them."""


@dataclass(frozen=True, slots=True)
class _File:
    """One ``.pt`` file of the output: its path in the tag folder, how to build its tree, its tensor bytes."""

    relpath: str
    nbytes: int
    build: Callable[[RankFileBuilder], Any]


# --------------------------------------------------------------------------- tensor bytes, chunk by chunk


def _plan_chunks(source: ReadPlan, numel: int, dtype: torch.dtype, buffers: ChunkBuffers, chunk_bytes: int) -> Chunks:
    """A consolidated tensor's elements (fp32 master or a moment), read in bounded chunks."""

    def run() -> Iterator[torch.Tensor]:
        step = max(1, chunk_bytes // dtype.itemsize)
        buf = buffers.get(dtype, min(step, numel))
        for start in range(0, numel, step):
            n = min(step, numel - start)
            read_plan_into(source, start, buf[:n])
            yield buf[:n]

    return run


def _cast_chunks(ref: TensorRef, buffers: ChunkBuffers, chunk_bytes: int) -> Chunks:
    """A stored module tensor as fp32 (``tensor.float()``, as ``ds_to_universal`` saves it), in bounded chunks."""

    def run() -> Iterator[torch.Tensor]:
        step = max(1, chunk_bytes // max(4, ref.dtype.itemsize))
        raw = buffers.get(ref.dtype, min(step, ref.numel))
        out = torch.empty(min(step, ref.numel), dtype=torch.float32)
        for start in range(0, ref.numel, step):
            n = min(step, ref.numel - start)
            ref.read(start, n, raw[:n])
            out[:n].copy_(raw[:n])
            yield out[:n]

    return run


def _ref_chunks(ref: TensorRef, buffers: ChunkBuffers, chunk_bytes: int) -> Chunks:
    """A stored tensor copied as it is (an optimizer file's ``step``), in bounded chunks."""

    def run() -> Iterator[torch.Tensor]:
        step = max(1, chunk_bytes // ref.dtype.itemsize)
        buf = buffers.get(ref.dtype, min(step, ref.numel))
        for start in range(0, ref.numel, step):
            n = min(step, ref.numel - start)
            ref.read(start, n, buf[:n])
            yield buf[:n]

    return run


# --------------------------------------------------------------------------- the source


def _check_source(ckpt: Checkpoint) -> tuple[Path, OptimizerLayout]:
    """A ZeRO-1/2/3 checkpoint with Adam moments, no experts, no tensor-parallel merge rules; rank 0's optim file."""
    meta = ckpt.metadata
    if not isinstance(ckpt, PartitionedCheckpoint) or meta.zero_stage not in (1, 2, 3):
        what = f"ZeRO stage {meta.zero_stage}" if meta.format == "zero" else f"a {meta.format} checkpoint"
        raise UnsupportedCheckpointError(
            f"'{meta.path}' is {what}; convert(fmt='universal') needs a DeepSpeed ZeRO-1/2/3 checkpoint with "
            "optimizer state (the folder engine.save_checkpoint() wrote).",
            path=meta.path,
            found=meta.zero_stage,
        )
    if meta.layout == "moe" or meta.extra.get("expert_files"):
        raise UnsupportedCheckpointError(
            f"'{meta.path}' holds DeepSpeed MoE expert files (layer_*_expert_*_model_states.pt); zeroio does not "
            "write universal checkpoints of expert-parallel models (DeepSpeed 0.19.8's ds_to_universal fails on "
            "them too). Resume it at its own expert-parallel size, or convert the weights (fmt='safetensors').",
            path=meta.path,
        )
    model0 = ckpt.file_tree(meta.path / meta.extra["model_files"][0])
    info = model0.get("universal_checkpoint_info") if isinstance(model0, dict) else None
    rules = [k for k in _UC_PATTERN_KEYS if isinstance(info, dict) and info.get(k)]
    if rules:
        raise UnsupportedCheckpointError(
            f"'{meta.path / meta.extra['model_files'][0]}' sets universal_checkpoint_info rules for "
            f"tensor-parallel merging ({', '.join(rules)}), which zeroio does not apply; use DeepSpeed's "
            "ds_to_universal for this checkpoint.",
            path=meta.path,
        )
    layout = optimizer_layout(ckpt, what="convert(fmt='universal')")
    if set(layout.moments) != set(MOMENTS):
        raise UnsupportedCheckpointError(
            f"'{layout.files[0]}' holds optimizer states {sorted(layout.moments)}; a universal checkpoint holds "
            f"{' and '.join(MOMENTS)} only (Adam/AdamW), so the others would be lost on resume. Resume it with "
            "engine.load_checkpoint at its own world size.",
            path=layout.files[0],
        )
    return layout.files[0], layout


def _safe_folder_name(name: str, path: Path) -> str:
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise CheckpointFormatError(
            f"'{path}' names a parameter {name!r}, which cannot be a folder name of zero/<param>/. The file is "
            "corrupted or was not written by DeepSpeed.",
            path=path,
            name=name,
        )
    return name


# --------------------------------------------------------------------------- the files


class _Planner:
    """Plans every output ``.pt`` file from metadata: one fp32/moment/step file per trainable parameter, ..."""

    def __init__(self, ckpt: Any, layout: OptimizerLayout, optim0_path: Path, chunk_bytes: int) -> None:
        self.ckpt, self.layout, self.optim0_path = ckpt, layout, optim0_path
        self.stage = int(ckpt.metadata.zero_stage)
        self.chunk_bytes = chunk_bytes
        self.buffers = ChunkBuffers()
        self.files: list[_File] = []
        self.trainable: list[str] = []

    def _tensor_file(
        self, relpath: str, shape: tuple[int, ...], dtype: torch.dtype, chunks: Chunks, extra: bool
    ) -> None:
        """ZeRO-3 sources: the flat 1-D tensor itself; ZeRO-1/2: ``{"cat_dim": 0, "param": shaped}`` (or
        ``{"param": ...}`` for a module value, ``extra=False``), as ``ds_to_universal`` writes them."""
        numel = 1
        for d in shape:
            numel *= d
        flat = self.stage == 3 and extra

        def build(builder: RankFileBuilder) -> Any:
            where: Where = () if flat else ("param",)
            tensor = builder.tensor(where, (numel,) if flat else shape, dtype, chunks)
            if flat:
                return tensor
            return {"cat_dim": 0, "param": tensor} if extra else {"param": tensor}

        self.files.append(_File(relpath, numel * dtype.itemsize, build))

    def plan_trainable(self) -> None:
        ckpt, layout, chunk_bytes = self.ckpt, self.layout, self.chunk_bytes
        for name, info in ckpt.infos.items():
            if info.kind != "trainable" or name in ckpt.tied:
                continue
            folder = f"{ZERO_DIR}/{_safe_folder_name(name, ckpt.metadata.path)}"
            source = ckpt.read_plan(name)
            self.trainable.append(name)
            shape = tuple(info.shape)
            self._tensor_file(
                f"{folder}/fp32.pt", shape, info.dtype,
                _plan_chunks(source, info.numel, info.dtype, self.buffers, chunk_bytes), True,
            )  # fmt: skip
            for key in MOMENTS:
                dtype = next((r.dtype for rank in layout.moments[key] for r in rank if r is not None), torch.float32)
                chunks = _plan_chunks(moment_source(layout, source, key), info.numel, dtype, self.buffers, chunk_bytes)
                self._tensor_file(f"{folder}/{key}.pt", shape, dtype, chunks, True)
            if self.stage != 3:
                self._step_file(f"{folder}/step.pt", source)

    def _step_file(self, relpath: str, source: Any) -> None:
        """ZeRO-1/2: the parameter's flat-group ``step`` as stored (a 0-d fp32 tensor for torch Adam/AdamW)."""
        g = source.pieces[0].group if source.pieces else 0
        value = self.layout.scalars[g].get("step") if g < len(self.layout.scalars) else None
        if value is None:
            return  # no per-group step (DeepSpeed's fused Adam): ds_to_universal writes none either
        if isinstance(value, TensorRef):
            ref = value

            def build(builder: RankFileBuilder) -> Any:
                return builder.tensor((), ref.shape, ref.dtype, _ref_chunks(ref, self.buffers, self.chunk_bytes))

            self.files.append(_File(relpath, ref.numel * ref.dtype.itemsize, build))
        else:
            self.files.append(_File(relpath, 0, lambda builder: value))

    def plan_module_values(self) -> None:
        """ZeRO-1/2: each module entry without optimizer state (frozen params, buffers, tied aliases) as fp32."""
        ckpt = self.ckpt
        model0_path = ckpt.metadata.path / ckpt.metadata.extra["model_files"][0]
        module = ckpt.file_tree(model0_path).get(C.MODULE) or {}
        done = set(self.trainable)
        for name, ref in module.items():
            if str(name) in done or not isinstance(ref, TensorRef):
                continue
            folder = f"{ZERO_DIR}/{_safe_folder_name(str(name), model0_path)}"
            self._tensor_file(
                f"{folder}/fp32.pt", tuple(ref.shape), torch.float32,
                _cast_chunks(ref, self.buffers, self.chunk_bytes), False,
            )  # fmt: skip

    def plan_optimizer_state(self) -> None:
        """``zero/optimizer_state.pt``: rank 0's optimizer file without its partitioned tensors, plus param_groups."""
        optim0 = self.ckpt.file_tree(self.optim0_path)
        osd = optim0[C.OPTIMIZER_STATE_DICT]
        source = self.optim0_path

        def copy(value: Any, where: Where, builder: RankFileBuilder) -> Any:
            def tensor(ref: TensorRef, path: Where) -> torch.Tensor:
                return builder.tensor(path, ref.shape, ref.dtype, _ref_chunks(ref, self.buffers, self.chunk_bytes))

            return writable(value, where, tensor=tensor, source=source)

        def build(builder: RankFileBuilder) -> Any:
            out: dict[str, Any] = {}
            if self.stage == 3:
                base = osd[C.OPTIMIZER_STATE_DICT]
                state = {
                    g: {k: copy(v, (C.OPTIMIZER_STATE_DICT, "state", g, k), builder)
                        for k, v in entry.items() if k not in self.layout.moments}
                    for g, entry in (base.get("state") or {}).items()
                }  # fmt: skip
                groups = copy(base.get("param_groups"), (C.OPTIMIZER_STATE_DICT, "param_groups"), builder)
                for k, v in osd.items():
                    if k == C.OPTIMIZER_STATE_DICT:
                        out[k] = {"state": state, "param_groups": groups}
                    elif k != C.FP32_FLAT_GROUPS:  # rank 0's partitions: DeepSpeed's loader never reads them
                        out[k] = copy(v, (k,), builder)
                out["param_groups"] = groups  # the same list, pickled once, as ds_to_universal's file has it
                return out
            skipped = (C.BASE_OPTIMIZER_STATE, C.PARAM_SLICE_MAPPINGS, C.SINGLE_PARTITION_OF_FP32_GROUPS)
            for k, v in osd.items():
                if k not in skipped:
                    out[k] = copy(v, (k,), builder)
            out["param_groups"] = copy(osd[C.BASE_OPTIMIZER_STATE]["param_groups"], ("param_groups",), builder)
            return out

        self.files.append(_File(f"{ZERO_DIR}/{OPTIMIZER_STATE_FILE}", 0, build))


def _copy_file(src: Path, dst: Path) -> int:
    """A model states file, byte for byte (``ds_to_universal`` copies them with ``shutil.copy2``), fsynced.

    ``src.open``, not ``open(src)``: the source may be at a URL (``zeroio._io.remote_path.RemotePath``)."""
    fd = create_new(dst)
    with src.open("rb") as reader, os.fdopen(fd, "wb") as writer:
        shutil.copyfileobj(reader, writer, 16 * 1024 * 1024)
        writer.flush()
        os.fsync(writer.fileno())
    return dst.stat().st_size


# --------------------------------------------------------------------------- the verb helper


def write_universal(src: StrPath, dst: Path, read: ReadOptions, write: WriteOptions) -> Written:
    """Write ``dst/latest_universal`` and ``dst/<tag>_universal/`` from a ZeRO-1/2/3 checkpoint, atomically (the
    ``WRITERS`` entry of ``fmt="universal"``).

    Raises:
        UnsupportedCheckpointError: not ZeRO-1/2/3, MoE experts, tensor-parallel merge rules, non-Adam state.
        CheckpointFormatError: no optimizer moments, or a parameter name that is not a folder name.
        OutputError: ``dst`` exists (without ``overwrite``) or cannot be written; nothing partial is left.
    """
    if not hasattr(torch.serialization, "skip_data"):
        raise ImportError("convert(fmt='universal') needs torch >= 2.6 (torch.serialization.skip_data)")
    out = AtomicDir(Path(dst), source=src, overwrite=write.overwrite)
    out.check()
    with open_checkpoint(src, read) as ckpt:
        # 1. The source, checked before anything is written; every file planned from metadata.
        optim0_path, layout = _check_source(ckpt)
        meta = ckpt.metadata
        utag = f"{meta.tag or f'global_step{meta.global_step or 0}'}_universal"
        planner = _Planner(ckpt, layout, optim0_path, write.chunk_bytes)
        planner.plan_trainable()
        if planner.stage != 3:
            planner.plan_module_values()
        planner.plan_optimizer_state()
        model_files = [meta.path / name for name in meta.extra["model_files"]]
        total = sum(f.nbytes for f in planner.files)
        # 2. The files, one tensor file at a time, in a temporary folder renamed into place when complete.
        meter = ByteProgress(write.progress, total, "Writing universal checkpoint")
        meter.start()
        written: list[Path] = []
        try:
            with out as tmp:
                folder = tmp / utag
                (folder / ZERO_DIR).mkdir(parents=True)
                for file in planner.files:
                    path = folder / file.relpath
                    path.parent.mkdir(exist_ok=True)
                    builder = RankFileBuilder()
                    builder.save(file.build(builder), path, meter.update)
                    written.append(out.dst / utag / file.relpath)
                for model_file in model_files:
                    _copy_file(model_file, folder / model_file.name)
                    written.append(out.dst / utag / model_file.name)
                write_new_file(tmp / LATEST_UNIVERSAL, utag)
                written.append(out.dst / LATEST_UNIVERSAL)
                ckpt.finish_crc_checks()
        finally:
            meter.close()
        tied = dict(ckpt.tied)
    logger.info("wrote universal checkpoint %s/%s (%d parameters) from %s", out.dst, utag, len(planner.trainable),
                meta.path)  # fmt: skip
    return Written(
        files=tuple(written), index_path=None, total_size=total, num_tensors=len(planner.trainable), tied=tied
    )
