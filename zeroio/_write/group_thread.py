"""Joining a distributed conversion's process group on a thread, so the conversion need not wait for it.

Importing torch and gloo's rendezvous (which waits for the slowest process to start) take seconds; a process
needs the group only at its first exchange. With several readers each process opens the source and plans its files
meanwhile, then :class:`JoiningRanks` waits for the group at the first exchange. Process 0 of a one-host job
converts meanwhile where the platform has no abstract Unix sockets (:mod:`zeroio._write.one_reader`; on Linux those
processes meet without torch, :mod:`zeroio._host_ranks`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from .._messages import get_logger
from .._ranks import Ranks

__all__ = ["GroupFactory", "GroupOnThread", "JoiningRanks"]

logger = get_logger(__name__)

GroupFactory = Callable[[], contextlib.AbstractContextManager[Ranks]]
"""Joins the job's process group (a context manager yielding its :class:`~zeroio._ranks.Ranks`)."""


class GroupOnThread:
    """The process group, joined on a thread from the start; :meth:`comm` waits for it."""

    def __init__(self, factory: GroupFactory) -> None:
        self._stack = contextlib.ExitStack()
        self._comm: Ranks | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._join, args=(factory,), name="zeroio-group", daemon=True)
        self._thread.start()

    def _join(self, factory: GroupFactory) -> None:
        started = time.monotonic()
        try:
            self._comm = self._stack.enter_context(factory())
        except BaseException as exc:  # noqa: BLE001 - raised by comm() in the converting thread
            self._error = exc
        else:
            logger.debug(
                "joined the process group in %.2f s (torch's import and the rendezvous)", time.monotonic() - started
            )

    def comm(self) -> Ranks:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._comm is not None
        return self._comm

    def close(self) -> None:
        self._thread.join()
        self._stack.close()


class JoiningRanks:
    """:class:`~zeroio._ranks.Ranks` whose rank and size are known at once (torchrun's environment) and whose
    first exchange waits for the group being joined."""

    def __init__(self, joined: GroupOnThread, rank: int, world_size: int) -> None:
        self._joined = joined
        self.rank = rank
        self.world_size = world_size

    def all_gather(self, payload: Any) -> list[Any]:
        return self._joined.comm().all_gather(payload)
