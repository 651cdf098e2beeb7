"""A distributed conversion whose storage gives one reader (all processes on one host): process 0 converts alone,
as plain ``convert`` does, from its first instant; the others plan the same output from metadata and learn how it
ended, so every process returns the same :class:`~zeroio._write.engine.WriteOutcome`.

Two exchanges, both at process 0's commit. The first, once the output is written and fsynced, right before it is
renamed into place: every process's plan fingerprint, or its error (a failure anywhere fails every process and no
destination appears, as with several readers). The second, after the rename: whether it succeeded, and the side
files copied. A process 0 that fails before its commit goes straight to its one exchange, with its error.

On Linux these exchanges run over a Unix socket (:class:`~zeroio._host_ranks.HostRanks`), so no process imports
torch or joins a gloo group, which cost each process 2-4 s of CPU and delayed process 0's answer; elsewhere (or with
``ZEROIO_HOST_SOCKETS=0``) the gloo group is joined on a background thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from pathlib import Path

from .._formats import ReadOptions
from .._host_ranks import HostRanks, host_sockets
from .._messages import get_logger
from .._ranks import Failure, OneRank, Ranks, RanksLost, settle
from ..errors import OutputError, ZeroIOError
from .atomic import AtomicDir
from .comm import Job
from .group_thread import GroupFactory, GroupOnThread, JoiningRanks
from .options import WriteOptions
from .phases import WriteOutcome, check_same_plans, write_checkpoint
from .plan import plan_write

__all__ = ["GroupFactory", "convert_one_reader"]

logger = get_logger(__name__)

_CALLS = itertools.count()  # this process's one-host conversions: every process makes the same calls, in order


def _line(error: BaseException) -> str:
    return str(error) if isinstance(error, ZeroIOError) else f"{type(error).__name__}: {error}"


def _failed(dst: Path, world_size: int, failed: list[Failure]) -> OutputError:
    """What every other process raises when process ``failed[0].rank`` failed (process 0: anywhere; another one:
    while planning)."""
    first = failed[0]
    where = "" if first.rank == 0 else " while planning"
    return OutputError(
        f"Process {first.rank} of {world_size} failed{where}, so '{dst}' was not written. Its error: {first.message}",
        path=dst,
        rank=first.rank,
    )


def convert_one_reader(
    src: Path,
    out: AtomicDir,
    read: ReadOptions,
    write: WriteOptions,
    rank: int,
    world_size: int,
    group: GroupFactory,
    timeout: float,
    before_cleanup: Callable[[], None],
) -> WriteOutcome:
    """Process ``rank`` of ``world_size``'s part: process 0 writes ``out`` whole; all return the same outcome.
    ``group`` joins the gloo group where the host has no Unix sockets; ``timeout`` (seconds) bounds every wait.

    Raises:
        OutputError: another process failed, or planned another output (nothing is renamed into place), or contact
            with process 0 was lost.
        ZeroIOError: this process's own failure (the output is not in place).
    """
    call = next(_CALLS)
    if not host_sockets():
        joined = GroupOnThread(group)
        try:
            comm = JoiningRanks(joined, rank, world_size)
            if rank == 0:
                return _write_alone(src, out, read, write, comm, before_cleanup)
            return _wait_for_writer(src, out, read, write, comm)
        finally:
            joined.close()
    if rank == 0:
        try:
            ranks = HostRanks(0, world_size, out.dst, call, timeout)  # listens before the first read
        except OSError as exc:
            raise OutputError(
                f"Cannot write '{out.dst}': the processes of this job cannot meet on this host: zeroio's socket for "
                f"this conversion is taken ({exc}). Is the same conversion running twice with the same MASTER_PORT?",
                path=out.dst,
            ) from exc
        try:
            return _write_alone(src, out, read, write, ranks, before_cleanup)
        finally:
            ranks.close()
    try:
        ranks = HostRanks(rank, world_size, out.dst, call, timeout)  # connected: process 0's death is seen at once
    except RanksLost as lost:
        raise _lost(out.dst, lost) from None
    try:
        return _wait_for_writer(src, out, read, write, ranks)
    finally:
        ranks.close()


def _lost(dst: Path, lost: RanksLost) -> OutputError:
    return OutputError(
        f"Cannot confirm '{dst}': lost contact with process 0, which writes it ({lost}). '{dst}' exists only if "
        "process 0 completed; check it, and process 0's log.",
        path=dst,
    )


class _Agreement:
    """Process 0's first exchange (``Job.before_commit``): the others' plans, right before the rename."""

    def __init__(self, comm: Ranks, dst: Path, src: Path) -> None:
        self.comm, self.dst, self.src = comm, dst, src
        self.held = False  # the exchange began
        self.passed = False  # ... and every process planned this output: the rename may go ahead

    def __call__(self, fingerprint: str) -> None:
        self.held = True
        told = partial(_failed, self.dst, self.comm.world_size)
        try:
            fingerprints = settle(self.comm, None, fingerprint, told=told)
        except RanksLost as lost:
            raise OutputError(
                f"Cannot write '{self.dst}': lost contact with another process before the commit ({lost}). Removed "
                "the partial output. A process was killed or crashed: check the other processes' logs and run the "
                "conversion again.",
                path=self.dst,
            ) from lost.__cause__
        check_same_plans(fingerprints, self.dst, self.src)
        self.passed = True
        logger.debug("every process planned this output; committing")


def _write_alone(
    src: Path,
    out: AtomicDir,
    read: ReadOptions,
    write: WriteOptions,
    comm: Ranks,
    cleanup: Callable[[], None],
) -> WriteOutcome:
    agreement = _Agreement(comm, out.dst, src)
    outcome: WriteOutcome | None = None
    error: BaseException | None = None
    try:
        job = Job(OneRank(), out, before_cleanup=cleanup, before_commit=agreement)
        outcome = write_checkpoint(job, src, read, write)
    except BaseException as exc:  # told to the others, then re-raised (or already told, in the agreement)
        error = exc
        if agreement.held and not agreement.passed:  # it failed there, and every process learned it there
            raise
    copied = None if outcome is None else [p.name for p in outcome.copied]
    logger.debug("%s; telling the other processes", "failed" if error is not None else "output in place")
    try:
        told = partial(_failed, out.dst, comm.world_size)
        settle(comm, error, copied, told=told, line=None if error is None else _line(error))
    except (RanksLost, ZeroIOError, RuntimeError) as lost:
        if lost is error:
            raise
        if error is None:  # the output is complete and in place; only the others' word is missing
            logger.warning("wrote %s, then could not tell the other processes: %s", out.dst, lost)
    else:
        logger.debug("the other processes know")
    if error is not None:
        raise error
    assert outcome is not None
    return outcome


def _wait_for_writer(src: Path, out: AtomicDir, read: ReadOptions, write: WriteOptions, comm: Ranks) -> WriteOutcome:
    from .._formats import open_checkpoint

    told = partial(_failed, out.dst, comm.world_size)
    error: BaseException | None = None
    fingerprint = None
    try:
        with open_checkpoint(src, read) as ckpt:  # metadata only: the same plan as process 0's
            plan = plan_write(ckpt, write)
            source = ckpt.metadata
        fingerprint = plan.fingerprint()
    except BaseException as exc:  # noqa: BLE001 - told to process 0 (which then commits nothing), then re-raised
        error = exc
    logger.debug("planned; waiting for process 0's word")
    try:
        fingerprints = settle(comm, error, fingerprint, told=told, line=None if error is None else _line(error))
        check_same_plans(fingerprints, out.dst, src)
        copied = settle(comm, None, told=told)[0]
    except RanksLost as lost:
        raise _lost(out.dst, lost) from lost.__cause__
    logger.debug("told by process 0: the output is in place")
    return WriteOutcome(
        plan=plan,
        source=source,
        files=tuple(out.dst / filename for filename, _ in plan.shards.shards),
        index_path=out.dst / plan.index_name if plan.index is not None else None,
        copied=tuple(out.dst / name for name in copied),
    )
