"""How the processes writing one output agree: shard ownership, and after each phase whether every process succeeded.

One process is the degenerate case (:class:`LocalComm`: world size 1, nothing exchanged), so ``convert`` and
``convert(..., distributed=True)`` run the same phases, as torch DCP has one save path for 1 or N processes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol

from ..errors import OutputError, ZeroIOError
from .atomic import AtomicDir

__all__ = [
    "COMMIT",
    "PLAN",
    "TEMP",
    "WRITE",
    "Comm",
    "CommLost",
    "Job",
    "LocalComm",
]

PLAN = "while planning"
TEMP = "while creating the temporary folder"
WRITE = "while writing its shards"
COMMIT = "while writing the index and renaming the output into place"


class CommLost(Exception):
    """A collective call failed: another process died, or did not answer within the timeout."""


class Comm(Protocol):
    """All-gathers of small JSON-able documents among the processes writing one output."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, payload: Any) -> list[Any]:
        """Every process's ``payload``, in rank order. Raises :class:`CommLost` when a process is gone."""
        ...


class LocalComm:
    """One process alone: rank 0 of 1, nothing to exchange."""

    rank = 0
    world_size = 1

    def all_gather(self, payload: Any) -> list[Any]:
        return [payload]


def _nothing() -> None:
    return None


class Job:
    """The phases of one output's write; after each one every process learns whether all succeeded.

    Args:
        comm: the processes (``LocalComm()`` for one).
        out: the destination; rank 0 creates its temporary folder and commits it.
        lost_advice: what to do when contact with another process is lost (never happens with one process).
        before_cleanup: called before the partial output is removed (e.g. to ignore SIGTERM during removal).
    """

    def __init__(
        self, comm: Comm, out: AtomicDir, *, lost_advice: str = "", before_cleanup: Callable[[], None] = _nothing
    ) -> None:
        self.comm = comm
        self.out = out
        self.lost_advice = lost_advice
        self.before_cleanup = before_cleanup
        self.tmp: Path | None = None
        """The shared temporary folder, once rank 0 created it; None again once rank 0 committed or removed it."""

    def _own_line(self, error: BaseException) -> str:
        """The one line this process's own error will say (what the others quote)."""
        if isinstance(error, ZeroIOError):
            return str(error)
        if self.tmp is not None:
            return str(self.out.error(error))
        return f"{type(error).__name__}: {error}"

    def remove_tmp(self) -> None:
        """Remove the partial output, if any."""
        if self.tmp is None:
            return
        self.before_cleanup()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.out.release()
        self.tmp = None

    def raise_own(self, error: BaseException) -> NoReturn:
        """Raise this process's own error, removing the partial output first (as :class:`AtomicDir` does)."""
        if self.tmp is not None:
            self.before_cleanup()
            self.tmp = None
            self.out.discard(error)  # removes the folder, raises OutputError
        raise error

    def settle(self, phase: str, error: BaseException | None, payload: Any = None) -> list[Any]:
        """All-gather every process's outcome of ``phase``; on any failure, clean up and raise on every process.

        Returns every process's ``payload`` when all succeeded.
        """
        n = self.comm.world_size
        try:
            reports = self.comm.all_gather({"error": None if error is None else self._own_line(error), "data": payload})
        except CommLost as lost:
            committing = phase == COMMIT
            removed = ""
            if not committing and self.tmp is not None:
                self.remove_tmp()
                removed = " Removed the partial output."
            if committing and self.comm.rank != 0:
                fix = f"'{self.out.dst}' exists only if process 0 completed the rename; check it, and process 0's log."
            else:
                fix = self.lost_advice
            where = phase.replace("its shards", "the shards")
            raise OutputError(
                f"Cannot write '{self.out.dst}': lost contact with the other processes {where} ({lost}).{removed} {fix}",
                path=self.out.dst,
            ) from lost.__cause__
        if error is not None:
            self.raise_own(error)
        failed = [(rank, report["error"]) for rank, report in enumerate(reports) if report["error"] is not None]
        if failed:
            self.remove_tmp()
            rank, line = failed[0]
            others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise OutputError(
                f"Process {rank} of {n}{others} failed {phase}, so '{self.out.dst}' was not written. Its error: {line}",
                path=self.out.dst,
                rank=rank,
            )
        return [report["data"] for report in reports]
