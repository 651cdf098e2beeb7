"""The one write engine: plan -> execute -> commit, for one process or the N processes of a torch.distributed job.

Every process opens the source and plans the same files from metadata (:mod:`zeroio._write.plan`); each writes the
shards :func:`~zeroio._write.sharding.assign_shards` gives it into rank 0's temporary folder (:mod:`zeroio._write.shard_files`);
rank 0 writes the extra files, the index last, copies the side files and renames the folder into place
(:class:`~zeroio._write.atomic.AtomicDir`). After each phase every process learns whether all succeeded
(:class:`~zeroio._write.comm.Job`). With one process (:class:`~zeroio._ranks.OneRank`) that exchange is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._dtypes import DType
from .._formats import Checkpoint, CheckpointMetadata, ReadOptions
from .._io.fileio import naming, write_new_file
from .._messages import get_logger
from ..errors import OutputError
from .comm import CHECK, COMMIT, PLAN, TEMP, WRITE, Job
from .options import WriteOptions
from .plan import WritePlan, plan_write
from .readers import assign_to_readers
from .shard_files import write_shards
from .shared_checks import check_assigned, checks_of, partial_reports
from .side_files import copy_side_files, write_derived_config

__all__ = ["ExtraFiles", "WriteOutcome", "check_same_plans", "write_checkpoint"]

logger = get_logger(__name__)

ExtraFiles = Callable[[Checkpoint, WritePlan], Callable[[Path], None]]
"""A hook for more files beside the weights (the optimizer state): called while planning (so it fails before
anything is created) with the open source and the plan, it returns the writer that rank 0 calls with the
temporary folder after its shards."""


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """What the engine wrote (the same on every process)."""

    plan: WritePlan
    """The whole output's plan."""
    source: CheckpointMetadata
    """The source checkpoint's metadata (for model-card facts)."""
    files: tuple[Path, ...]
    """Weight files in the destination, in shard order."""
    index_path: Path | None
    """The index file, or None for a single file."""
    copied: tuple[Path, ...] = field(default=())
    """Config and tokenizer files copied from beside the source."""


def write_checkpoint(
    job: Job, src: Path, read: ReadOptions, write: WriteOptions, *, extra_files: ExtraFiles | None = None
) -> WriteOutcome:
    """Convert ``src`` into ``job.out``, all-or-nothing on every process.

    ``src`` is the source's one path (for a URL, the :class:`~zeroio._io.remote_path.RemotePath` whose listing
    the reader and the side files share); ``write.overwrite`` is ``job.out``'s already.

    Raises:
        OutputError: the destination exists or holds the source, cannot be written, or a process failed.
        ZeroIOError: the source cannot be read (raised before the destination is touched when found in metadata).
    """
    try:
        return _run(job, src, read, write, extra_files)
    except BaseException as exc:
        if job.tmp is not None and job.comm.rank == 0:  # an interrupt between phases: remove the partial output
            job.raise_own(exc)
        raise


def _run(job: Job, src: Path, read: ReadOptions, write: WriteOptions, extra_files: ExtraFiles | None) -> WriteOutcome:
    from .._formats import dequantized_dtype, open_checkpoint

    rank, world_size, out = job.comm.rank, job.comm.world_size, job.out
    with contextlib.ExitStack() as stack:
        # 1. Plan. Rank 0 refuses an existing destination (and cleans dead conversions' temporary folders) before
        #    anything is read; every process then opens the source and plans every file from metadata alone.
        error: BaseException | None = None
        fingerprint = None
        write_extra: Callable[[Path], None] | None = None
        try:
            if rank == 0:
                out.check()  # refuses a destination overlapping the source, too
            ckpt = stack.enter_context(open_checkpoint(src, read))
            logger.debug("converting %s to %s (%s)", ckpt.metadata.path, out.dst, write.fmt)
            plan = plan_write(ckpt, write)
            owners = assign_to_readers(plan.file_bytes, world_size, src)
            share = plan.subset([i for i, owner in enumerate(owners) if owner == rank])
            if extra_files is not None:
                write_extra = extra_files(ckpt, plan)
            fingerprint = plan.fingerprint()
        except BaseException as exc:  # noqa: BLE001 - reported to every process, then re-raised
            error = exc
        check_same_plans(job.settle(PLAN, error, fingerprint), out.dst, src)
        logger.debug(
            "process %d of %d writes %d of %d shards (%d bytes)",
            rank, world_size, len(share.shards.shards), len(plan.shards.shards), share.shards.total_size,
        )  # fmt: skip

        # 2. Rank 0 creates the temporary folder beside dst; everyone learns its path.
        tmp = _create_temp(job)

        # 3. Execute: each process writes its own shards into the shared folder (fsynced), reading only their
        #    tensors' byte ranges; rank 0 then the extra files. Everyone reports success or failure, with the
        #    records it read in part, whose CRC checks are then shared out (zeroio._write.shared_checks).
        error = None
        partial = None
        try:
            _check_visible(tmp, out.dst, rank)
            progress = write.progress
            shown = progress if (rank == 0 or callable(progress)) else False  # one bar per job, not per process
            part = len(share.shards.shards) != len(plan.shards.shards)  # reads stay within this share's bytes
            write_shards(
                ckpt, share, tmp, out.dst, workers=write.workers, chunk_bytes=write.chunk_bytes, progress=shown,
                part=part,
            )  # fmt: skip
            if write_extra is not None and rank == 0:
                write_extra(tmp)
            if world_size == 1:
                ckpt.finish_crc_checks()  # records read in part (flat-group padding): checked before the commit
            else:
                partial = partial_reports(ckpt.checked_files())  # checked once for all (below)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        reports = job.settle(WRITE, error, partial)
        if any(reports):  # the same on every process: one more exchange only when a record was read in part
            _check_shared(job, ckpt, reports)

        # 4. Commit: rank 0 checks every shard is there, writes the index last, copies side files and renames the
        #    folder into place; the others wait for its word.
        dequantized = dequantized_dtype(ckpt.metadata.extra)  # FP8 in, plain weights out
        dtype = write.dtype if write.dtype is not None else dequantized
        hf_config = ckpt.metadata.extra.get("hf_config")
        copied = _commit(
            job, plan, owners, src, tmp, dtype, hf_config, dequantized=dequantized is not None,
            read=ckpt.metadata.path,
        )  # fmt: skip
        source = ckpt.metadata

    files = tuple(out.dst / filename for filename, _ in plan.shards.shards)
    if rank == 0:
        processes = f" with {world_size} processes" if world_size > 1 else ""
        logger.info(
            "wrote %d tensors (%d bytes) in %d file(s) to %s%s",
            plan.num_tensors, plan.shards.total_size, len(files), out.dst, processes,
        )  # fmt: skip
    return WriteOutcome(
        plan=plan,
        source=source,
        files=files,
        index_path=out.dst / plan.index_name if plan.index is not None else None,
        copied=tuple(out.dst / name for name in copied),
    )


def check_same_plans(fingerprints: list[Any], dst: Path, src: Path) -> None:
    """Every process's plan fingerprint (rank order) is the same, else OutputError naming the first that differs."""
    if len(set(fingerprints)) != 1:
        other = next(r for r, f in enumerate(fingerprints) if f != fingerprints[0])
        raise OutputError(
            f"Cannot write '{dst}': processes 0 and {other} planned different outputs from '{src}', so they read "
            "different checkpoints. Put the checkpoint on a filesystem shared by every process, at the same path, "
            "and do not change it during the conversion.",
            path=dst,
            rank=other,
        )


def _check_shared(job: Job, ckpt: Checkpoint, reports: list[Any]) -> None:
    """Step 3's end with several processes: each checks the records read in part given to it; all learn the outcome."""
    error = None
    try:
        checks = checks_of(reports, job.comm.rank)
        shared = sum(1 for _, record in checks if record[4])
        logger.debug("process %d checks %d records read in part, %d of them shared", job.comm.rank, len(checks), shared)
        check_assigned(ckpt.checked_files(), checks)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    job.settle(CHECK, error)


def _check_visible(tmp: Path, dst: Path, rank: int) -> None:
    if not tmp.is_dir():
        raise OutputError(
            f"Cannot write '{dst}': process {rank} cannot see the temporary folder '{tmp}' that process 0 created. "
            "A distributed conversion needs the destination on a filesystem shared by every process, at the same "
            "path.",
            path=dst,
            rank=rank,
        )


def _create_temp(job: Job) -> Path:
    """Step 2 of :func:`write_checkpoint`: rank 0 creates the temporary folder; every process learns its path."""
    rank, out = job.comm.rank, job.out
    error, tmp_text = None, None
    try:
        if rank == 0:
            job.tmp = out.create()
            tmp_text = str(job.tmp)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    tmp = Path(job.settle(TEMP, error, tmp_text)[0])
    job.tmp = tmp
    if rank != 0:
        out.adopt(tmp)  # so a failure here removes the shared folder and names it "partial output"
    return tmp


def _commit(
    job: Job,
    plan: WritePlan,
    owners: tuple[int, ...],
    src: Path,
    tmp: Path,
    dtype: DType | None,
    config: Any = None,
    *,
    dequantized: bool = False,
    read: Path | None = None,
) -> list[str]:
    """Step 4 of :func:`write_checkpoint`: rank 0 checks the shards, writes the index last, copies the side files
    and renames the folder into place; every process returns the names of the side files copied. ``dequantized``:
    the source's quantized weights were written dequantized (``config.json`` loses ``quantization_config``);
    ``read``: the folder the checkpoint was read from (side files may sit beside it, under ``src``)."""
    rank, out = job.comm.rank, job.out
    error, copied = None, []
    if rank == 0:
        try:
            _check_shards(plan, owners, tmp, out.dst)
            if plan.index is not None:
                with naming(out.dst / plan.index_name):
                    write_new_file(tmp / plan.index_name, plan.index)
            copied = list(copy_side_files(src, tmp, dtype=dtype, dequantized=dequantized, read=read))  # config, ...
            copied += write_derived_config(config, tmp, dtype=dtype)  # names="hf": the config the mapping implies
            if job.before_commit is not None:
                job.before_commit(plan.fingerprint())
        except BaseException as exc:  # noqa: BLE001
            error = exc
        if error is None:
            job.tmp = None
            try:
                out.commit()  # fsync, rename; on failure removes the folder and raises
            except BaseException as exc:  # noqa: BLE001
                error = exc
    else:
        job.tmp = None  # rank 0 owns the folder from here: it commits it or removes it
    try:
        copied = job.settle(COMMIT, error, copied)[0]
    except OutputError as exc:
        if rank != 0 or error is not None or not isinstance(exc.__cause__, RuntimeError):
            raise
        # The output is complete and in place: every process had reported its shards written.
        logger.warning("renamed %s into place, then lost contact with the other processes: %s", out.dst, exc)
    return copied


def _check_shards(plan: WritePlan, owners: tuple[int, ...], tmp: Path, dst: Path) -> None:
    """Every shard is in the shared folder, at its planned size (safetensors), before the index names it."""
    for i, (filename, _) in enumerate(plan.shards.shards):
        path = tmp / filename
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = None
        expected = plan.layouts[i][1].size if plan.layouts else None
        if size is None or (expected is not None and size != expected):
            found = "missing" if size is None else f"{size} bytes, not {expected}"
            raise OutputError(
                f"Cannot write '{dst}': shard '{filename}' that process {owners[i]} wrote is {found} in "
                f"'{tmp}' as process 0 sees it. A distributed conversion needs the destination on a filesystem "
                "shared by every process, at the same path.",
                path=dst,
                rank=owners[i],
            )
