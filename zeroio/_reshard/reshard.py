"""``zeroio.reshard``: rewrite a DeepSpeed ZeRO-3 checkpoint for another data-parallel world size, streaming."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _constants as C
from .._formats import PartitionedCheckpoint, ReadOptions, open_checkpoint, optimizer_layout, read_options
from .._io.fileio import write_new_file
from .._io.progress import ByteProgress, Progress, check_progress
from .._io.remote_path import as_path, is_url
from .._messages import get_logger
from .._pickles import PickleTemplate
from .._types import StrPath
from .._write.atomic import AtomicDir
from ..errors import UnsupportedCheckpointError
from .targets import ReshardPlan, plan_reshard
from .trees import RankTrees

__all__ = ["DEFAULT_CHUNK_BYTES", "NO_TEMPLATES_ENV", "ReshardResult", "reshard"]

logger = get_logger(__name__)

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
"""Largest piece of a tensor held in memory while resharding."""

NO_TEMPLATES_ENV = "ZEROIO_NO_PICKLE_TEMPLATES"
"""Set to 1: pickle every rank file afresh (tests compare the files with those written from a template)."""


@dataclass(frozen=True, slots=True)
class ReshardResult:
    """What :func:`reshard` wrote."""

    path: Path
    """The output checkpoint folder (holds ``latest`` and the tag folder): pass it to ``engine.load_checkpoint``."""
    tag: str
    """The tag folder written (and named in ``latest``)."""
    world_size: int
    """Data-parallel ranks the checkpoint is partitioned for."""
    files: tuple[Path, ...]
    """Every rank file, model states first, then optimizer states, in rank order."""
    total_size: int
    """Bytes of tensor data written."""
    source_world_size: int
    """Data-parallel ranks of the source checkpoint."""


# --------------------------------------------------------------------------- the public verb


def reshard(
    src: StrPath,
    dst: StrPath,
    *,
    world_size: int,
    tag: str | None = None,
    output_tag: str | None = None,
    sub_group_size: int | None = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress = False,
    verify_crc: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> ReshardResult:
    """Write a DeepSpeed ZeRO-3 checkpoint of ``src`` partitioned for ``world_size`` data-parallel ranks.

    The output is what ``engine.save_checkpoint`` would have written from a run at ``world_size`` ranks in the
    same state: per rank, ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (module placeholders and buffers,
    ``param_shapes``, frozen-parameter fragments, ``shared_params``, step counters, lr scheduler and client
    state) and ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (fp32 master partitions, Adam moments and
    step per sub-group, param groups, loss scaler), with ZeRO-3's padding for ``world_size``; plus ``latest``.
    DeepSpeed resumes from it with ``engine.load_checkpoint(dst)`` at ``world_size`` ranks. zeroio never
    imports DeepSpeed: its classes (``ZeroStageEnum``, ``LossScaler``) are written by name into the pickles.

    Tensors are streamed in chunks of ``chunk_bytes`` straight into their place in each file, so memory stays
    near one chunk whatever the model size. The output is built beside ``dst`` and renamed into place.

    Args:
        src: a DeepSpeed ZeRO-3 checkpoint (root or tag folder) with optimizer state.
        dst: the output checkpoint folder to create, or a URL (``s3://``, ``gs://``): built locally, then uploaded
            with ``latest`` last (docs/remote.md).
        world_size: data-parallel ranks of the run that will load it.
        tag: the source tag (default: the one in ``latest``).
        output_tag: the output tag folder (default: the source's tag).
        sub_group_size: ZeRO-3 ``sub_group_size`` of the run that will load it (default: the source's config,
            else DeepSpeed's default 1e9); it decides how many fp32 flat groups each rank has.
        overwrite: replace an existing ``dst``.
        chunk_bytes: largest piece of a tensor read at once.
        progress: ``True`` draws a tqdm bar (bytes), or pass ``callable(done, total)``.
        verify_crc: check every record read from a torch zip file (``.pt``/``.bin``) against its stored CRC-32 and
            raise CheckpointFormatError on a mismatch (see ``Checkpoint.verify_crc``); False skips the check.
        storage_options: options of the source URL's fsspec filesystem (``s3://``, ``gs://``, ``hf://``,
            ``https://``: keys, endpoint, token; docs/remote.md); default: the backend's environment credentials.

    Returns:
        A :class:`ReshardResult`: output folder, tag, world sizes, files and bytes written.

    Raises:
        UnsupportedCheckpointError: the source is not ZeRO-3 (or uses MiCS / AutoEP partitioning).
        CheckpointFormatError: the source holds no optimizer moments (stripped, or saved before a step).
        OutputError: ``dst`` exists (without ``overwrite``) or cannot be written; nothing partial is left.
        ValueError, TypeError: a bad argument.

    Example:
        >>> import zeroio
        >>> result = zeroio.reshard("fixtures/z3_ws2_fp32", "out/ws3", world_size=3)  # doctest: +SKIP
        >>> [p.name for p in result.files][:2]  # doctest: +SKIP
        ['zero_pp_rank_0_mp_rank_00_model_states.pt', 'zero_pp_rank_1_mp_rank_00_model_states.pt']
    """
    # 1. Arguments, without IO.
    for label, value in (("world_size", world_size), ("chunk_bytes", chunk_bytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be a positive int, got {value!r}.")
        if value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}.")
    if sub_group_size is not None and (
        isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size < 0
    ):
        raise ValueError(f"sub_group_size must be a non-negative int, got {sub_group_size!r}.")
    check_progress(progress)
    if not hasattr(torch.serialization, "skip_data"):
        raise ImportError("zeroio.reshard needs torch >= 2.6 (torch.serialization.skip_data): pip install -U torch")
    read = read_options(tag=tag, verify_crc=verify_crc, storage_options=storage_options)
    target = _Target(world_size, output_tag, sub_group_size, chunk_bytes, progress, str(dst))
    if is_url(str(dst)):
        return _reshard_to_url(src, str(dst), read, target, overwrite=overwrite)
    return _reshard_into(src, AtomicDir(Path(dst), source=src, overwrite=overwrite), read, target)


@dataclass(frozen=True, slots=True)
class _Target:
    """The output arguments of :func:`reshard`, validated."""

    world_size: int
    output_tag: str | None
    sub_group_size: int | None
    chunk_bytes: int
    progress: Progress
    dst: str
    """The destination as the caller named it (a URL is staged in a local folder first), for messages."""


def _reshard_into(src: StrPath, out: AtomicDir, read: ReadOptions, target: _Target) -> ReshardResult:
    out.check()
    with open_checkpoint(src, read) as ckpt:
        # 2. The source: ZeRO-3 partitions with optimizer state (fails here, before anything is written).
        meta = ckpt.metadata
        if not isinstance(ckpt, PartitionedCheckpoint) or meta.zero_stage != 3:
            what = f"ZeRO stage {meta.zero_stage}" if meta.format == "zero" else f"a consolidated {meta.format} file"
            fix = (
                f"For ZeRO-1/2, write a universal checkpoint, which DeepSpeed resumes at any world size: `zeroio "
                f'convert {src} {target.dst} --format universal`, then load it with "checkpoint": {{"load_universal": true}}.'
                if meta.format == "zero" and meta.zero_stage in (1, 2)
                else "Pass a ZeRO-3 checkpoint with optimizer state (the folder engine.save_checkpoint() wrote)."
            )
            raise UnsupportedCheckpointError(
                f"'{meta.path}' is {what}; zeroio reshards ZeRO-3 checkpoints only (yet). {fix}",
                path=meta.path,
                found=meta.zero_stage,
            )
        layout = optimizer_layout(ckpt, what="reshard()")
        # 3. The target layout (metadata only), then the files.
        plan = plan_reshard(
            ckpt, layout, world_size=target.world_size, output_tag=target.output_tag,
            sub_group_size=target.sub_group_size,
        )  # fmt: skip
        return _write(plan, RankTrees(plan, target.chunk_bytes), out, target.progress)


def _reshard_to_url(src: StrPath, url: str, read: ReadOptions, target: _Target, *, overwrite: bool) -> ReshardResult:
    """Reshard into a local staging folder, then upload it, ``latest`` last (``zeroio._write.remote_output``)."""
    from .._write.remote_output import write_to_url

    source_read = read if is_url(str(src)) else dataclasses.replace(read, storage_options=None)

    def write_local(local: Path) -> ReshardResult:
        return _reshard_into(src, AtomicDir(Path(local), source=src, overwrite=False), source_read, target)

    local, uploaded = write_to_url(url, read.storage_options, overwrite=overwrite, write=write_local, source=src)
    files = tuple(uploaded[p.resolve()] for p in local.files)
    return dataclasses.replace(local, path=as_path(url.rstrip("/"), read.storage_options), files=files)


def _write(plan: ReshardPlan, trees: RankTrees, out: AtomicDir, progress: Progress) -> ReshardResult:
    """Size the bytes of a rank's files (every rank's hold the same: 2 trees planned, not 2,048 at 1,024 ranks),
    then write rank by rank, counting what is written."""
    meta, world_size = plan.ckpt.metadata, plan.world_size
    each = [trees.model_file(r)[1].nbytes + trees.optim_file(r)[1].nbytes for r in range(min(2, world_size))]
    total = each[0] + each[-1] * (world_size - 1)  # rank 0 differs from the others in no tensor; to be sure: both
    trees.read_ahead(each[-1])
    meter = ByteProgress(progress, total, "Resharding")
    meter.start()
    files: list[Path] = []
    try:
        with out as tmp:
            folder = tmp / plan.tag
            folder.mkdir()
            written = 0
            templates: dict[Hashable, PickleTemplate] = {}  # one pickle per kind of file (pickle_template.py)
            for kind, build in ((0, trees.model_file), (1, trees.optim_file)):
                for rank in range(world_size):
                    tree, builder = build(rank)
                    name = plan.file_names(rank)[kind]
                    template = None
                    if os.environ.get(NO_TEMPLATES_ENV) != "1":
                        key = trees.pickle_kind(kind, rank)
                        template = templates.get(key) or templates.setdefault(key, PickleTemplate())
                    builder.save(tree, folder / name, meter.update, template)
                    written += builder.nbytes
                    files.append(out.dst / plan.tag / name)
            write_new_file(tmp / C.LATEST_FILE, plan.tag)
            plan.ckpt.finish_crc_checks()  # records read in part (flat-group padding): checked before the commit
    finally:
        meter.close()
    logger.info("resharded %s (world size %s) to %s for world size %d", meta.path, meta.world_size, out.dst, world_size)
    return ReshardResult(out.dst, plan.tag, world_size, tuple(files), written, int(meta.world_size or 0))
