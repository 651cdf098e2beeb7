"""A bounded pool of open read-only file descriptors, shared by every local byte source in the process.

A checkpoint of 512 ranks has over 1,024 rank files, the usual ``RLIMIT_NOFILE``; holding one descriptor per file
until close made an 8-rank checkpoint fail under a limit of 8 with a misleading "Too many open files" on the
output. Files are opened on demand, the least recently used idle descriptor is closed when the pool is full, and
a file reopened later must be the very file opened first (device, inode, size, modification time): a file
swapped behind zeroio's back never changes what later reads return.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from ..errors import ZeroIOError
from .confine import FileIdentity, open_regular

__all__ = ["CAPACITY", "DescriptorPool", "Opener", "default_capacity", "pool"]

Opener = Callable[[Path, FileIdentity | None], tuple[int, FileIdentity]]
"""Opens a file for the pool (:func:`open_regular`): a descriptor and the identity of the file it opened."""


CAPACITY = 4096
"""The most descriptors the pool keeps (before a quarter of the process's limit caps it): a ZeRO-3 read takes each
tensor from every rank's file in turn, so a pool smaller than the rank count misses on every read (it reopened a
file per read at 1,024 ranks with 256, 14 times the time at 256 ranks)."""


def default_capacity() -> int:
    """``min(CAPACITY, soft RLIMIT_NOFILE / 4)``, at least 1: room is left for outputs, sockets and the caller's
    files."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # no resource module (Windows): the usual 1,024-ish limits
        return 256
    if soft == resource.RLIM_INFINITY:
        return CAPACITY
    return max(1, min(CAPACITY, soft // 4))


class DescriptorPool:
    """At most ``capacity`` descriptors open; a leased one is never closed under its user.

    Leases of one file share its descriptor (``preadv`` and ``copy_file_range`` take explicit offsets). A thread
    that needs a new descriptor while all ``capacity`` are leased waits for a lease to end (at most a second, then
    it opens past the capacity). When the process's own limit is hit (``EMFILE``), idle descriptors are closed and
    the open retried after the next lease ends.
    """

    def __init__(self, capacity: int | None = None, opener: Opener | None = None) -> None:
        self._capacity = capacity
        self._opener = opener or open_regular  # called with the lock held (tests make it slow, as NFS can be)
        self._lock = threading.RLock()  # re-entered only to learn its holder (see release), never to nest
        self._cond = threading.Condition(self._lock)
        self._open: OrderedDict[object, tuple[int, FileIdentity]] = OrderedDict()  # least recently used first
        self._leases: dict[object, int] = {}
        self._waiting = 0
        self._deferred: deque[object] = deque()  # releases that found the lock taken (see release)

    @property
    def capacity(self) -> int:
        """The most descriptors kept open (read from ``RLIMIT_NOFILE`` on first use)."""
        if self._capacity is None:
            self._capacity = default_capacity()
        return self._capacity

    def open_count(self) -> int:
        """Descriptors open now (for tests and diagnostics)."""
        with self._lock:
            self._close_deferred()
            return len(self._open)

    def acquire(self, key: object, path: Path, identity: FileIdentity | None) -> tuple[int, FileIdentity]:
        """Lease an open descriptor of ``path`` until :meth:`end_lease` (always call it, in a ``finally``).

        Returns the descriptor and the file's identity. ``identity`` is what the first open found (None on that
        first open); a reopened file that differs raises :class:`~zeroio.errors.CheckpointFormatError`.
        """
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:  # the common case: one lock, two dict updates
                self._open.move_to_end(key)
                self._leases[key] = self._leases.get(key, 0) + 1
                return entry
        return self._acquire_slow(key, path, identity)

    def end_lease(self, key: object) -> None:
        """End one lease of ``key`` taken by :meth:`acquire`."""
        with self._lock:
            left = self._leases[key] - 1
            if left:
                self._leases[key] = left
            else:
                del self._leases[key]
                if self._deferred:
                    self._close_deferred()
                if len(self._open) > self.capacity:
                    self._shrink()
                if self._waiting:
                    self._cond.notify_all()

    def _acquire_slow(self, key: object, path: Path, identity: FileIdentity | None) -> tuple[int, FileIdentity]:
        """Open ``key``'s file, closing an idle descriptor first, or waiting for a lease to end when all are leased.

        zeroio never holds two files' leases in one thread, so a wait cannot be on the waiting thread itself; as a
        guard, a wait longer than a second opens past the capacity."""
        waits = 0
        with self._lock:
            while True:
                entry = self._open.get(key)
                if entry is not None:
                    self._open.move_to_end(key)
                    self._leases[key] = self._leases.get(key, 0) + 1
                    return entry
                self._shrink(room=1)
                if len(self._open) >= self.capacity and waits < 10:
                    waits += 1
                    self._wait(0.1)  # every descriptor is leased: the next lease to end makes room
                    continue
                try:
                    entry = self._opener(path, identity)
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    idle = [k for k in self._open if k not in self._leases]
                    for other in idle:  # the process's own limit: make room from this pool first
                        os.close(self._open.pop(other)[0])
                    if not idle and (not self._leases or waits >= 100):  # nothing to wait for, or waited 10 s
                        raise ZeroIOError(
                            f"Cannot open '{path}' for reading: the process has too many open files ({exc.strerror}; "
                            f"zeroio holds {len(self._open)}). Raise the limit (`ulimit -n`) or close other files.",
                            path=path,
                        ) from exc
                    if not idle:
                        waits += 1
                        self._wait(0.1)  # retry once a lease ends
                    continue
                self._open[key] = entry
                self._leases[key] = self._leases.get(key, 0) + 1
                return entry

    def _wait(self, timeout: float) -> None:
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def _shrink(self, room: int = 0) -> None:
        """Close least recently used idle descriptors until ``room`` more fit in ``capacity`` (lock held)."""
        excess = len(self._open) + room - self.capacity
        if excess <= 0:
            return
        victims = []
        for key in self._open:  # least recently used first: the idle ones to close come early (leases are few)
            if key not in self._leases:
                victims.append(key)
                if len(victims) == excess:
                    break
        for key in victims:
            os.close(self._open.pop(key)[0])

    def release(self, key: object) -> None:
        """Close ``key``'s descriptor now if it is open and idle (a source's ``close``).

        A checkpoint dropped unclosed is closed by its finalizer, which the garbage collector may run in a thread
        that is inside this pool (any allocation may collect): waiting for the lock there would never end, and
        changing the pool there would corrupt the operation under way. That thread leaves the descriptor to the
        pool's next lease end. Any other thread waits for the lock, however long it is held (a slow open on a
        network file system), so ``close()`` returns with the file closed: a deleted checkpoint frees its space.
        """
        self._deferred.append(key)
        if cast(Any, self._lock)._is_owned():  # this thread is inside the pool (threading.Condition asks the same)
            return
        with self._lock:
            self._close_deferred()

    def _close_deferred(self) -> None:
        """Close the idle descriptors whose release found the lock taken (lock held)."""
        closed = False
        while self._deferred:
            key = self._deferred.popleft()
            if key not in self._leases and key in self._open:
                os.close(self._open.pop(key)[0])
                closed = True
        if closed:
            self._cond.notify_all()


pool = DescriptorPool()
"""The process's pool: every :class:`zeroio._io.sources.LocalFile` leases its descriptor here."""
