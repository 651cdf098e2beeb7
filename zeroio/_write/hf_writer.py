"""``fmt="safetensors"`` / ``"torch"``: the Hugging Face layout, written by the engine in one process or, with
``distributed=True``, by every process of a torch.distributed job; ``include_optimizer`` adds the optimizer files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .._formats import Checkpoint, ReadOptions
from .._ranks import OneRank
from .atomic import AtomicDir
from .comm import Job
from .options import WriteOptions
from .phases import ExtraFiles, WriteOutcome, write_checkpoint
from .plan import WritePlan
from .result import CardInputs, Written

__all__ = ["write_hf"]


def write_hf(src: Path, dst: Path, read: ReadOptions, write: WriteOptions) -> Written:
    """Refuse an existing destination before reading anything, plan every file from metadata, stream the tensors
    into a temporary folder beside ``dst`` and rename it into place (``zeroio/_write/phases.py``)."""
    if write.distributed:
        from .distributed import convert_distributed  # torch.distributed: imported only when asked for

        return written_by_engine(convert_distributed(src, dst, read, write))
    extra_files = _optimizer_files(write) if write.include_optimizer else None
    job = Job(OneRank(), AtomicDir(dst, source=src, overwrite=write.overwrite))
    return written_by_engine(write_checkpoint(job, src, read, write, extra_files=extra_files))


def _optimizer_files(write: WriteOptions) -> ExtraFiles:
    """``include_optimizer``: optimizer.safetensors + optimizer.json beside the weights
    (``zeroio/_write/optimizer_files.py``), planned with the weights (a source without optimizer state fails
    before anything is created)."""
    from .optimizer_files import plan_optimizer_files, write_optimizer_files

    def plan(ckpt: Checkpoint, weights: WritePlan) -> Callable[[Path], None]:
        optim = plan_optimizer_files(ckpt, list(weights.names), max_shard_size=write.max_shard_size)

        def write_files(tmp: Path) -> None:
            write_optimizer_files(ckpt, optim, tmp, chunk_bytes=write.chunk_bytes)

        return write_files

    return plan


def written_by_engine(outcome: WriteOutcome) -> Written:
    """The engine's outcome as a writer's result."""
    plan = outcome.plan
    card = CardInputs(
        outcome.source, fmt=plan.fmt, target=plan.target, out_dtypes=[plan.dtypes[n] for n in plan.names],
        excluded=plan.excluded, num_params=plan.num_params,
    )  # fmt: skip
    return Written(
        files=outcome.files,
        index_path=outcome.index_path,
        total_size=plan.shards.total_size,
        num_tensors=plan.num_tensors,
        tied=dict(plan.ties),
        copied=outcome.copied,
        card=card,
    )
