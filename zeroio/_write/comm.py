"""How the processes writing one output agree after each phase whether every process succeeded: a
:func:`zeroio._ranks.settle` per phase, with the partial output removed on any failure.

One process is the degenerate case (:class:`~zeroio._ranks.OneRank`: world size 1, nothing exchanged), so
``convert`` and ``convert(..., distributed=True)`` run the same phases, as torch DCP has one save path for 1 or N
processes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from .._ranks import Failure, Ranks, RanksLost, settle
from ..errors import OutputError, ZeroIOError
from .atomic import AtomicDir

__all__ = ["CHECK", "COMMIT", "PLAN", "TEMP", "WRITE", "Job"]

PLAN = "while planning"
TEMP = "while creating the temporary folder"
WRITE = "while writing its shards"
CHECK = "while checking the CRC-32 of the source records it was given"
COMMIT = "while writing the index and renaming the output into place"


def _nothing() -> None:
    return None


class Job:
    """The phases of one output's write; after each one every process learns whether all succeeded.

    Args:
        comm: the processes (``OneRank()`` for one).
        out: the destination; rank 0 creates its temporary folder and commits it.
        lost_advice: what to do when contact with another process is lost (never happens with one process).
        before_cleanup: called before the partial output is removed (e.g. to ignore SIGTERM during removal).
        before_commit: called by rank 0 with the plan's fingerprint once the output is complete, right before it is
            renamed into place; raising fails the commit (one reader per job: the other processes' agreement).
    """

    def __init__(
        self,
        comm: Ranks,
        out: AtomicDir,
        *,
        lost_advice: str = "",
        before_cleanup: Callable[[], None] = _nothing,
        before_commit: Callable[[str], None] | None = None,
    ) -> None:
        self.comm = comm
        self.out = out
        self.lost_advice = lost_advice
        self.before_cleanup = before_cleanup
        self.before_commit = before_commit
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
        """Settle ``phase`` on every process (:func:`zeroio._ranks.settle`); on any failure, clean up and raise on
        every process. Returns every process's ``payload`` when all succeeded.
        """
        line = None if error is None else self._own_line(error)
        try:
            return settle(self.comm, error, payload, told=partial(self._told, phase), line=line, own=self.raise_own)
        except RanksLost as lost:
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

    def _told(self, phase: str, failed: list[Failure]) -> OutputError:
        """Another process failed ``phase``: remove the partial output; the error every other process raises."""
        self.remove_tmp()
        first = failed[0]
        others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return OutputError(
            f"Process {first.rank} of {self.comm.world_size}{others} failed {phase}, so '{self.out.dst}' was not "
            f"written. Its error: {first.message}",
            path=self.out.dst,
            rank=first.rank,
        )
