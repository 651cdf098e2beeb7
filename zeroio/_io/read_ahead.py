"""Read-ahead windows: many small reads of many files served by a few large reads of each file.

A ZeRO-3 parameter has a piece on every rank: converting 2,000 parameters of a 1,024-rank checkpoint was 820,000
reads of a few bytes each (20-24 s of CPU on 2 cores, a syscall and a CRC-32 fold apiece; 2.6 s now). Each rank file holds its
partition of the parameters back to back, in the order a conversion writes them, so one window per file (and
record), read ahead from the first small read, serves the next parameters' pieces from memory: each file is read in
``partition / window`` reads, and each window is folded into its record's CRC once as it is read.

Memory is bounded: one window per file and record, ``budget / windows`` bytes each (between :data:`MIN_WINDOW` and
:data:`MAX_WINDOW`), so 1,024 files share 64 MiB. A window never crosses the end of the zip record it starts in
(:meth:`~zeroio._io.integrity.CheckedFile.record_at`): it reads no byte of a record the conversion does not read
(the Adam moments after the fp32 partition), holds no more than its record has left, and the CRC of each record
it covers is still checked once all of the record's bytes have been seen. Only local files read ahead here; a
remote source has its own read-ahead.

No byte is read twice for a window: a window stops before bytes already read (a long read or an in-kernel copy's
check that went first), a long read takes what a window holds of it, and an in-kernel copy's check reads only the
bytes no read has seen (:meth:`~zeroio._io.integrity.CheckedFile.copy_to`). Reading ahead into a large tensor's bytes and then
reading them again cost a 1.3B conversion 2.4 GB of reads it did not need (docs/benchmarks.md, "Bytes a conversion
reads"). A window also stops at the runs the caller names long (:meth:`ReadAhead.fence`): with several IO threads,
a window that read into a long run was refilled elsewhere in its record (one window per record) before that run's
own read came, or raced it, and the run was read again (1.35 GB of a 1.3B bf16 conversion on 8 ranks).
"""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING

from .._env import env_bytes
from .integrity import CheckedFile, Record
from .sources import LocalFile

if TYPE_CHECKING:
    from .sources import ByteSource

__all__ = ["BUDGET", "MAX_WINDOW", "MIN_WINDOW", "WINDOWS_PER_FILE", "ReadAhead"]

BUDGET = 64 * 2**20
"""Bytes all windows hold together (as long as each holds at least :data:`MIN_WINDOW`); ``ZEROIO_READ_AHEAD_BYTES``
overrides it (tests make windows smaller than some of a fixture's tensors)."""
MIN_WINDOW = 4 * 1024
"""Smallest window: 8,192 files of 2 flat groups hold 64 MiB; reads stay 256 times fewer than 16-byte pieces."""
MAX_WINDOW = 4 * 2**20
"""Largest window (few files): past a few MiB a larger read saves nothing."""
WINDOWS_PER_FILE = 4
"""Records of one file with a window at once: a ZeRO-3 rank file's flat groups (one per param group, read in
turns); past that the oldest window is dropped."""


class _Window:
    """Bytes ``[start, stop)`` of one record of a file, in ``data``; ``checked``: that record's CRC check, asked
    before each read served (a record that failed its check raises on every later read, windows included)."""

    __slots__ = ("checked", "data", "record", "start", "stop")

    def __init__(self, record: int, checked: Record) -> None:
        self.record = record
        self.checked = checked
        self.start = self.stop = 0
        self.data = memoryview(bytearray(0))


class _File:
    """A file's windows, one per record read (a ZeRO-3 rank file's flat groups are read in turns), and its lock."""

    __slots__ = ("lock", "source", "windows")

    def __init__(self, source: CheckedFile) -> None:
        self.source = source  # held: files are keyed by id(source)
        self.lock = threading.Lock()
        self.windows: list[_Window] = []


def _holding(windows: list[_Window], at: int) -> _Window | None:
    for window in windows:
        if window.start <= at < window.stop:
            return window
    return None


def _next_start(windows: list[_Window], at: int, end: int) -> int:
    """Where the first window starting inside ``(at, end)`` starts, else ``end``."""
    return min((w.start for w in windows if at < w.start < end), default=end)


def _clip(span: tuple[int, int], spans: list[tuple[int, int]], offset: int) -> tuple[int, int] | None:
    """``span`` cut to the one of ``spans`` holding ``offset`` (None: none does)."""
    i = bisect.bisect_right(spans, (offset, 2**63)) - 1
    if i < 0 or spans[i][1] <= offset:
        return None
    return max(span[0], spans[i][0]), min(span[1], spans[i][1])


class ReadAhead:
    """Serves reads from a window per file and record: the bytes a window holds are copied from it, a short rest (at
    most a quarter window) is read ahead into a new window, a longer rest straight from the file. No byte is read
    twice for it: a window holds no byte read before it (by a read or an in-kernel copy's check), and a long read
    takes what a window holds of it. Safe for concurrent use by several threads (one lock per file)."""

    def __init__(
        self, files: int = 1, budget: int | None = None, spans: dict[int, list[tuple[int, int]]] | None = None
    ) -> None:
        """``budget``: :data:`BUDGET` unless given. ``spans``: by ``id(source)``, the sorted, disjoint byte spans
        this process reads (a distributed conversion's share): a window stays inside one, so no process reads bytes
        that only another one writes (a file not named: windows as they come)."""
        self._budget = env_bytes("ZEROIO_READ_AHEAD_BYTES", BUDGET) if budget is None else budget
        self._spans = spans
        self._files: dict[int, _File] = {}
        self._lock = threading.Lock()
        self._hint = files
        self._held = 0
        self._size = 0
        self._fences: dict[int, tuple[list[int], list[int]]] = {}
        self._resize()

    def fence(self, runs: dict[int, list[tuple[int, int]]]) -> None:
        """By ``id(source)``, the sorted, disjoint byte runs that are read whole and long (more than a quarter
        window, so straight from the file): no window reads into one. Windows read ahead only over the short pieces
        between them, which no other read takes."""
        self._fences = {key: ([lo for lo, _ in spans], [hi for _, hi in spans]) for key, spans in runs.items() if spans}

    def window_bytes(self) -> int:
        """The size of a window read now: the budget shared by the windows (one per file said, or as many as
        held), within the bounds."""
        return self._size

    def long_run_bytes(self) -> int:
        """Runs longer than this may be read straight from the file (more than a quarter of the smallest window
        this budget makes, with every file holding :data:`WINDOWS_PER_FILE` windows): what :meth:`fence` takes."""
        smallest = self._budget // max(1, self._hint * WINDOWS_PER_FILE)
        return max(MIN_WINDOW, min(MAX_WINDOW, smallest)) // 4

    def _resize(self) -> None:
        self._size = max(MIN_WINDOW, min(MAX_WINDOW, self._budget // max(1, self._hint, self._held)))

    def read_into(self, source: ByteSource, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``source``'s bytes at ``offset`` (a :class:`CheckedFile` checks them as it reads)."""
        file = self._files.get(id(source)) or self._file(source)
        if file is None:
            source.read_into(offset, out)  # not a local file: as asked
            return
        end = offset + len(out)
        straight: list[tuple[int, int]] = []  # long parts, read outside the lock
        with file.lock:
            at = offset
            while at < end:
                window = _holding(file.windows, at)
                stop = end if window is not None else _next_start(file.windows, at, end)
                if window is None and (stop - at) * 4 <= self._size:
                    window = self._fill(file, at, stop - at)
                if window is None:  # long, or not inside one record: as asked
                    straight.append((at, stop))
                    at = stop
                    continue
                if window.checked.found is not None:  # failed since the window was read
                    file.source.raise_if_failed(window.checked)
                stop = min(end, window.stop)
                out[at - offset : stop - offset] = window.data[at - window.start : stop - window.start]
                at = stop
        for lo, hi in straight:
            source.read_into(lo, out[lo - offset : hi - offset])

    def _fill(self, file: _File, offset: int, n: int) -> _Window | None:
        """Read the window of ``offset``'s record from ``offset`` on (the caller holds the file's lock)."""
        checked = file.source.record_at(offset)
        span = None if checked is None else (checked.start, checked.start + checked.size)
        limits = None if self._spans is None else self._spans.get(id(file.source))
        if span is not None and limits is not None:
            span = _clip(span, limits, offset)
        if checked is None or span is None or span[1] < offset + n or span == (offset, offset + n):
            return None  # not inside one record, or the whole record (a small tensor of its own): read as asked
        size, start = self.window_bytes(), offset
        window = next((w for w in file.windows if w.record == span[0]), None)
        if window is None:
            window = _Window(span[0], checked)
            file.windows.append(window)
            if len(file.windows) > WINDOWS_PER_FILE:  # the oldest: a file of many small records
                del file.windows[0]  # (DCP) holds a few windows, not all its small tensors
            else:
                with self._lock:
                    self._held += 1
                    self._resize()
            if offset - span[0] < size // 2:  # the record's first read: from its start (padding of a parameter
                start = span[0]  # this rank holds none of), so the CRC check has no gap left to read
        # Never a byte read before (a tensor's long read or an in-kernel copy's check went first): it is not needed
        # again, and reading it would read it twice.
        unseen = file.source.unseen_around(checked, offset, offset + n)
        start, stop = max(start, unseen[0]), min(offset + size, span[1], unseen[1])
        start, stop = self._fenced(file.source, offset, offset + n, start, stop)
        offset = start
        if not stop - offset <= len(window.data) <= 2 * size:  # held memory stays bounded
            window.data = memoryview(bytearray(stop - offset))
        window.start = window.stop = offset  # a failed read leaves no stale window
        file.source.read_into(offset, window.data[: stop - offset])
        window.stop = stop
        return window

    def _fenced(self, source: CheckedFile, lo: int, hi: int, start: int, stop: int) -> tuple[int, int]:
        """``[start, stop)`` (holding ``[lo, hi)``) cut so it reaches into no long run outside ``[lo, hi)``."""
        fences = self._fences.get(id(source))
        if fences is None:
            return start, stop
        los, his = fences
        i = bisect.bisect_right(his, lo)  # the first run ending after lo
        if i > 0:
            start = max(start, his[i - 1])
        if i < len(los) and los[i] < lo:  # a long run holding lo: no byte of it before lo
            start = max(start, lo)
        j = bisect.bisect_left(los, hi)  # the first run starting at or after hi
        if j < len(los):
            stop = min(stop, los[j])
        return start, stop

    def _file(self, source: ByteSource) -> _File | None:
        """``source``'s windows, made on first use; None where reads go straight to the source (not local)."""
        file = self._files.get(id(source))
        if file is not None:
            return file
        if not isinstance(source, CheckedFile) or not isinstance(source.source, LocalFile):
            return None
        with self._lock:
            return self._files.setdefault(id(source), _File(source))
