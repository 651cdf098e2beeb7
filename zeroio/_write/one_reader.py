"""A distributed conversion whose storage gives one reader (all processes on one host): process 0 converts alone,
as plain ``convert`` does, from its first instant; the others only learn how it ended.

The process group is joined on a background thread (importing torch and gloo's rendezvous take seconds that the
reads need not wait for), and used once, at the end: process 0 tells every process whether the output is in
place. The others plan the output from metadata meanwhile, so every process returns the same
:class:`~zeroio._write.engine.WriteOutcome`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from .._formats import ReadOptions
from .._messages import get_logger
from .._ranks import Failure, OneRank, RanksLost, settle
from ..errors import OutputError, ZeroIOError
from .atomic import AtomicDir
from .comm import Job
from .group_thread import GroupFactory, GroupOnThread
from .options import WriteOptions
from .phases import WriteOutcome, write_checkpoint
from .plan import plan_write

__all__ = ["GroupFactory", "convert_one_reader"]

logger = get_logger(__name__)


def _line(error: BaseException) -> str:
    return str(error) if isinstance(error, ZeroIOError) else f"{type(error).__name__}: {error}"


def _process_0_failed(dst: Path, world_size: int, failed: list[Failure]) -> OutputError:
    return OutputError(
        f"Process 0 of {world_size} failed, so '{dst}' was not written. Its error: {failed[0].message}",
        path=dst,
        rank=0,
    )


def convert_one_reader(
    src: Path,
    out: AtomicDir,
    read: ReadOptions,
    write: WriteOptions,
    rank: int,
    world_size: int,
    group: GroupFactory,
    before_cleanup: Callable[[], None],
) -> WriteOutcome:
    """Process ``rank`` of ``world_size``'s part: process 0 writes ``out`` whole; all return the same outcome.

    Raises:
        OutputError: process 0 failed (on every process), or, on another process, contact with it was lost.
        ZeroIOError: this process's own failure (process 0: the output is not in place).
    """
    joined = GroupOnThread(group)
    try:
        if rank == 0:
            return _write_alone(src, out, read, write, joined, before_cleanup)
        return _wait_for_writer(src, out, read, write, joined)
    finally:
        joined.close()


def _write_alone(
    src: Path,
    out: AtomicDir,
    read: ReadOptions,
    write: WriteOptions,
    joined: GroupOnThread,
    cleanup: Callable[[], None],
) -> WriteOutcome:
    outcome: WriteOutcome | None = None
    error: BaseException | None = None
    try:
        outcome = write_checkpoint(Job(OneRank(), out, before_cleanup=cleanup), src, read, write)
    except BaseException as exc:  # noqa: BLE001 - told to the others, then re-raised
        error = exc
    copied = None if outcome is None else [p.name for p in outcome.copied]
    try:
        comm = joined.comm()
        told = partial(_process_0_failed, out.dst, comm.world_size)  # the others send no error: never raised
        settle(comm, error, copied, told=told, line=None if error is None else _line(error))
    except (RanksLost, ZeroIOError, RuntimeError) as lost:
        if lost is error:
            raise
        if error is None:  # the output is complete and in place; only the others' word is missing
            logger.warning("wrote %s, then could not tell the other processes: %s", out.dst, lost)
    if error is not None:
        raise error
    assert outcome is not None
    return outcome


def _wait_for_writer(
    src: Path, out: AtomicDir, read: ReadOptions, write: WriteOptions, joined: GroupOnThread
) -> WriteOutcome:
    from .._formats import open_checkpoint

    with open_checkpoint(src, read) as ckpt:  # metadata only: the same plan as process 0's
        plan = plan_write(ckpt, write)
        source = ckpt.metadata
    comm = joined.comm()
    try:
        copied = settle(comm, None, told=partial(_process_0_failed, out.dst, comm.world_size))[0]
    except RanksLost as lost:
        raise OutputError(
            f"Cannot confirm '{out.dst}': lost contact with process 0, which writes it ({lost}). '{out.dst}' exists "
            "only if process 0 completed; check it, and process 0's log.",
            path=out.dst,
        ) from lost.__cause__
    return WriteOutcome(
        plan=plan,
        source=source,
        files=tuple(out.dst / filename for filename, _ in plan.shards.shards),
        index_path=out.dst / plan.index_name if plan.index is not None else None,
        copied=tuple(out.dst / name for name in copied),
    )
