"""``zeroio.convert(..., distributed=True)``: torch.distributed plumbing (gloo group, torchrun, SIGTERM) around the
one write engine, whose processes each write their share of shards."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import FrameType

from .._formats import ReadOptions
from .._messages import get_logger
from .._ranks import TIMEOUT_ENV, GroupRanks, gloo_detail, timeout_seconds
from ..errors import OutputError
from .atomic import AtomicDir
from .comm import Job
from .group_thread import GroupOnThread, JoiningRanks
from .one_reader import convert_one_reader
from .options import WriteOptions
from .phases import WriteOutcome, write_checkpoint
from .plan import WRITE_FORMATS
from .readers import reader_ranks

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "TORCHRUN_ENV", "convert_distributed", "torchrun_env"]

logger = get_logger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long a process waits for the others at each synchronisation point before failing the job.

The longest wait is at the end of the writes, for the slowest process: it must finish its shards within this
time of the fastest one. A process that died is noticed at once (its connections close); one that hangs, after
this timeout (``ZEROIO_DISTRIBUTED_TIMEOUT``, in seconds, overrides it)."""

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables ``torchrun`` sets that ``init_process_group``'s ``env://`` rendezvous reads."""


def torchrun_env() -> bool:
    """True when the process was started by ``torchrun`` (or with its environment variables set by hand)."""
    return all(os.environ.get(name) for name in TORCHRUN_ENV)


def _timeout() -> timedelta:
    return timedelta(seconds=timeout_seconds(DEFAULT_TIMEOUT.total_seconds()))


@contextlib.contextmanager
def _process_group(dst: Path, timeout: timedelta) -> Iterator[GroupRanks]:
    """A gloo group with ``timeout`` over every process: a new group inside an initialised job, or one created
    from torchrun's environment (and destroyed afterwards)."""
    import torch.distributed as dist

    owned = False
    if not dist.is_initialized():
        if not torchrun_env():
            raise ValueError(
                "distributed=True needs an initialised torch.distributed process group or torchrun's environment "
                f"({', '.join(TORCHRUN_ENV)}); launch with `torchrun ... -m zeroio convert SRC DST --distributed` or "
                "call torch.distributed.init_process_group() first."
            )
        try:
            dist.init_process_group(backend="gloo", timeout=timeout)
        except RuntimeError as exc:  # DistNetworkError, DistStoreError: rendezvous failed or timed out
            raise OutputError(
                f"Cannot write '{dst}': could not join the torch.distributed job ({gloo_detail(exc)}). Check "
                "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and that every process was started.",
                path=dst,
            ) from exc
        owned = True
    group = None
    try:
        # Our own gloo group: CPU collectives even when the job's group is NCCL, and our timeout, not the job's.
        group = None if owned else dist.new_group(backend="gloo", timeout=timeout)
        yield GroupRanks(group)  # JSON exchanges on the CPU (zeroio._ranks)
    finally:
        try:
            if owned:
                dist.destroy_process_group()
            elif group is not None:
                dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001 - tearing down after a dead peer must not hide the real error
            logger.debug("destroying the process group failed: %s", exc)


class _SigtermAsInterrupt:
    """While converting, SIGTERM (what ``torchrun`` sends the other workers when one fails) raises
    KeyboardInterrupt, so the partial output is removed, except during that removal itself."""

    def __init__(self) -> None:
        self.cleaning = False

    def start_cleaning(self) -> None:
        """From now on SIGTERM no longer interrupts: the partial output is being removed."""
        self.cleaning = True

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.cleaning:
            raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[_SigtermAsInterrupt]:
    state = _SigtermAsInterrupt()
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield state
        return
    previous = signal.signal(signal.SIGTERM, state.handle)
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, previous)


def _group_initialised() -> bool:
    """Whether this process already belongs to an initialised torch.distributed job (torch not imported: no)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def convert_distributed(src: Path, dst: Path, read: ReadOptions, write: WriteOptions) -> WriteOutcome:
    """:func:`zeroio.convert` with ``distributed=True`` (arguments already validated): see ``docs/distributed.md``.

    The write engine (:mod:`zeroio._write.phases`) over a gloo group of every process: each writes the shards
    :func:`assign_shards` gives it into rank 0's temporary folder (a filesystem shared by all, at the same path);
    rank 0 writes the index last and renames the folder into place once every process reported success. Any
    failure fails every process.
    """
    if write.fmt not in WRITE_FORMATS:
        raise ValueError(
            f"distributed=True writes sharded 'safetensors' or 'torch' folders, not fmt={write.fmt!r} (one file): "
            "convert it in one process."
        )
    timeout = _timeout()
    out = AtomicDir(dst, source=src, overwrite=write.overwrite)
    lost_advice = (
        f"A process was killed, crashed or stopped answering (timeout {timeout.total_seconds():g} s, "
        f"set with {TIMEOUT_ENV}): check the other processes' logs and run the conversion again."
    )
    if not _group_initialised() and torchrun_env():
        world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        group = partial(_process_group, out.dst, timeout)
        with _sigterm_as_interrupt() as sigterm:
            if reader_ranks(world_size, src) == (0,):  # one reader (one host): converts alone, at once, torch-free
                return convert_one_reader(
                    src, out, read, write, rank, world_size, group, timeout.total_seconds(), sigterm.start_cleaning
                )
            joined = GroupOnThread(group)  # torch's import and the rendezvous run while this process plans
            try:
                comm = JoiningRanks(joined, rank, world_size)
                job = Job(comm, out, lost_advice=lost_advice, before_cleanup=sigterm.start_cleaning)
                return write_checkpoint(job, src, read, write)
            finally:
                joined.close()
    with _sigterm_as_interrupt() as sigterm, _process_group(out.dst, timeout) as group_comm:
        job = Job(group_comm, out, lost_advice=lost_advice, before_cleanup=sigterm.start_cleaning)
        return write_checkpoint(job, src, read, write)
