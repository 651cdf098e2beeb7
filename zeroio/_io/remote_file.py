"""A remote object read with ranged requests: a :class:`~zeroio._io.sources.ByteSource` over an fsspec filesystem.

How bytes are fetched (docs/remote.md has the measured numbers):

* every fetch is one ranged request (made and checked by :mod:`zeroio._io.remote_fetch`: bounded body, checked
  range, pinned version), retried with exponential backoff and jitter on transient errors (connection resets,
  5xx, timeouts, short bodies) within ``retry_timeout``; credentials, missing or changed objects and bad responses
  are not retried but raised as :mod:`zeroio.errors` errors naming the URL and the fix;
* a large read is split into parts of :data:`PART_BYTES` fetched in parallel by one process-wide pool of
  :data:`MAX_IN_FLIGHT` threads, so requests in flight are bounded whatever the number of readers;
* a file of at most :data:`SMALL_FILE_BYTES` is fetched whole by its first data read (a record header or a
  tensor) and served from memory after that: one request instead of one per record;
* a record's local header is read together with the data after it (:meth:`RemoteFile.read_ahead`), and a small
  read (a bias, a norm weight) fetches :data:`COALESCE_BYTES` from its offset, so the tensors stored after it are
  served from that one request (adjacent pieces coalesced). The read-ahead never crosses a *fence*
  (:meth:`RemoteFile.fence`: the end of a zip record, set by ``_integrity``), so it never fetches the Adam
  moments stored after the weights; concurrent reads of the same bytes wait for one request instead of
  fetching twice, and a fetched segment is dropped once all its bytes were copied out (memory stays about
  the chunks in flight);
* a read that continues an earlier one (sequential reading: a rank file's pieces, tensor after tensor) also starts
  fetching the next :data:`AHEAD_WINDOWS` windows of :data:`COALESCE_BYTES` after it on the pool, up to the next
  fence: one reading thread then keeps several GETs in flight instead of waiting for one window at a time (an
  object store limits each connection and answers each GET after a first-byte delay). Windows fetched ahead and
  not yet read hold at most :data:`AHEAD_BUDGET` bytes in all files together; each is read once, by the reads that
  reach it.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._messages import redact, redact_exception
from ..errors import CheckpointFormatError, CheckpointNotFoundError, RemoteStorageError
from .remote_fetch import WHOLE_OBJECT_BYTES, ObjectChanged, RangeError, Timeouts
from .sources import writable_bytes

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

__all__ = [
    "AHEAD_BUDGET",
    "AHEAD_WINDOWS",
    "COALESCE_BYTES",
    "MAX_IN_FLIGHT",
    "PART_BYTES",
    "SMALL_FILE_BYTES",
    "RemoteFile",
    "call_with_retries",
]

PART_BYTES = 8 * 2**20
"""Largest single ranged request of a big read; its parts are fetched in parallel."""
COALESCE_BYTES = 4 * 2**20
"""A read smaller than this fetches this much (up to the next fence), serving the reads that follow it."""
SMALL_FILE_BYTES = 2**20
"""A file this small is fetched whole by its first data read. A request costs a round trip (~10-50 ms to an
object store, ~1 ms through moto on loopback) while 1 MiB costs ~1 ms at 1 GB/s, so below this size one GET is
cheaper than the one-per-record ranged GETs it replaces (model-states files, small ranks, ``latest``-sized
files). Metadata reads (zip directory, pickle) stay exact, so ``inspect`` never fetches a tensor record."""
MAX_IN_FLIGHT = 16
"""Parts fetched at once by the shared pool (plus one per reading thread)."""
AHEAD_WINDOWS = 8
"""Windows fetched ahead of a sequential read, per file (up to the next fence): GETs kept in flight by one reader."""
AHEAD_BUDGET = 64 * 2**20
"""Bytes fetched ahead and not yet read, all files together: past it no window is fetched ahead."""
METADATA_CACHE_BYTES = 4 * 2**20
"""Metadata bytes (zip directories, pickles) kept per file: parsers re-read them (e.g. the central directory)."""
MAX_CACHED = 8
"""Fetched segments kept for reads still to come, per file; older ones are dropped."""
ATTEMPTS = 6
"""Tries of one request before a transient error is raised."""
BACKOFF_S = 0.2
"""First retry delay; doubled each retry (with jitter), capped at :data:`BACKOFF_MAX_S`."""
BACKOFF_MAX_S = 5.0

_POOL: cf.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_AHEAD_LOCK = threading.Lock()
_ahead_held = 0  # bytes of windows fetched ahead, not yet read (AHEAD_BUDGET)

_AUTH_WORDS = ("credential", "accessdenied", "access denied", "forbidden", "invalidaccesskeyid",
               "signaturedoesnotmatch", "unauthorized", "invalidtoken", "expiredtoken")  # fmt: skip
_AUTH_STATUS = re.compile(r"(?<![\w.:/-])40[13](?![\w.])")
"""401 or 403 as a status of its own (``403, message='Forbidden'``, ``(403)``), not inside a port or a number."""
_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")


def _pool() -> cf.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = cf.ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT, thread_name_prefix="zeroio-remote")
        return _POOL


def _is_auth_error(exc: BaseException) -> bool:
    if isinstance(exc, PermissionError):
        return True
    if getattr(exc, "status", None) in (401, 403):
        return True
    said = _URL.sub(" ", f"{type(exc).__name__} {exc}".lower())  # a URL's port or path is no status (":40403")
    text = said.replace(" ", "")
    return any(word.replace(" ", "") in text for word in _AUTH_WORDS) or _AUTH_STATUS.search(said) is not None


def call_with_retries(
    url: str, what: str, fix_auth: str, fn: Callable[[], Any], *, retry_timeout: float = Timeouts.retry_timeout
) -> Any:
    """``fn()`` with retries on transient errors; zeroio errors (naming ``url``) for everything else.

    ``fix_auth`` is the one-line fix for a credentials problem, worded for the URL's storage. No retry starts
    more than ``retry_timeout`` seconds after the first try (each try is bounded by the backend's timeouts).
    """
    delay = BACKOFF_S
    started = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return fn()
        except FileNotFoundError as exc:
            redact_exception(exc)
            raise CheckpointNotFoundError(f"'{url}' does not exist ({what}).", path=url) from exc
        except Exception as exc:  # fsspec backends raise many types; sort them into the three outcomes
            redact_exception(exc)  # raised as the zeroio error's cause: a traceback prints it
            if _is_auth_error(exc):
                raise RemoteStorageError(
                    f"Access to '{url}' was refused ({type(exc).__name__}: {str(exc)[:160]}): {fix_auth}",
                    path=url,
                ) from exc
            pause = min(BACKOFF_MAX_S, delay) * (0.5 + random.random())
            spent = time.monotonic() - started
            if (
                isinstance(exc, (ValueError, TypeError, NotImplementedError))
                or attempt == ATTEMPTS
                or spent + pause > retry_timeout
            ):
                detail = str(exc)[:160] or (
                    "timed out (storage_options: connect_timeout, read_timeout, retry_timeout)"
                    if isinstance(exc, TimeoutError)
                    else "no detail"
                )
                raise RemoteStorageError(
                    f"Cannot read '{url}' ({what}) after {attempt} attempt(s) in {spent:.1f} s ({type(exc).__name__}: "
                    f"{detail}). Check the endpoint and the network, then run again.",
                    path=url,
                ) from exc
        time.sleep(pause)
        delay *= 2
    raise AssertionError("unreachable")


@dataclass(eq=False)
class _Segment:
    """Bytes ``[start, end)`` of the file: being fetched (``done`` unset), fetched, or failed."""

    start: int
    end: int
    done: threading.Event = field(default_factory=threading.Event)
    data: bytes = b""
    error: BaseException | None = None
    left: int = 0
    """Bytes not yet copied out to a reader; the segment is dropped at 0."""
    ahead: bool = False
    """Fetched ahead of the reads, none of it read yet: counted in :data:`AHEAD_BUDGET` until read or dropped."""

    def __post_init__(self) -> None:
        self.left = self.end - self.start


def _reserve(nbytes: int) -> bool:
    """Count ``nbytes`` fetched ahead in :data:`AHEAD_BUDGET`; False (nothing counted) when they do not fit."""
    global _ahead_held
    with _AHEAD_LOCK:
        if _ahead_held + nbytes > AHEAD_BUDGET:
            return False
        _ahead_held += nbytes
        return True


def _release(seg: _Segment) -> None:
    """``seg`` is no longer unread bytes fetched ahead (read from, dropped, or failed)."""
    global _ahead_held
    with _AHEAD_LOCK:
        if seg.ahead:
            seg.ahead = False
            _ahead_held -= seg.end - seg.start


class RemoteFile:
    """One remote object read with bounded, coalesced, retried ranged requests (see the module doc)."""

    def __init__(
        self,
        url: str,
        fetch: Callable[[int, int], bytes],
        size: int,
        fix_auth: str,
        *,
        retry_timeout: float = Timeouts.retry_timeout,
    ) -> None:
        self._url = url
        self._retry_timeout = retry_timeout
        self._fetch_raw = fetch
        self._size = size
        self._fix_auth = fix_auth
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []  # sorted by start, disjoint
        self._fences: list[int] = []
        self._metadata: list[tuple[int, bytes]] = []  # (start, bytes) read by read_bytes/prefetch, oldest first
        self._whole: bytes | None = None  # the object, when its server answered a range with all of it
        self._ends: list[int] = []  # where the last data reads ended: a read starting at one continues it
        self.requests = 0
        """Ranged requests made (retries included): for tests and docs/remote.md's numbers."""

    def __repr__(self) -> str:
        return f"RemoteFile('{redact(self._url)}')"

    @property
    def name(self) -> str:
        return self._url

    @property
    def size(self) -> int:
        return self._size

    def fence(self, offset: int) -> None:
        """Never read ahead across ``offset`` (a record end: the bytes after it may never be needed)."""
        with self._lock:
            i = bisect.bisect_left(self._fences, offset)
            if i == len(self._fences) or self._fences[i] != offset:
                self._fences.insert(i, offset)

    def close(self) -> None:
        with self._lock:
            for seg in self._segments:
                _release(seg)
            self._segments = [s for s in self._segments if not s.done.is_set()]

    def copy_to(self, fd: int, offset: int, nbytes: int, dst_offset: int) -> int | None:
        return None  # no kernel path from a remote object: the engine streams through read_into

    # ----------------------------------------------------------------- reads

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """Exact bytes (metadata: zip directories, headers, pickles), served from :meth:`prefetch`ed ones if there."""
        end = min(self._size, offset + nbytes)
        if end <= offset:
            return b""
        with self._lock:
            piece = self._remembered(offset, end)
            if piece is not None:
                return piece[1][offset - piece[0] : end - piece[0]]
            for seg in self._segments:
                if seg.start <= offset and end <= seg.end and seg.done.is_set() and seg.error is None:
                    return seg.data[offset - seg.start : end - seg.start]
        data = self._fetch(offset, end)
        if end - offset <= METADATA_CACHE_BYTES // 4:
            self._remember(offset, data)
        return data

    def prefetch(self, start: int, end: int) -> None:
        """Fetch ``[start, end)`` in one request for the :meth:`read_bytes` calls about to read it in pieces."""
        start, end = max(0, start), min(self._size, end)
        with self._lock:
            if end <= start or self._remembered(start, end) is not None:
                return
        self._remember(start, self._fetch(start, end))

    def _remembered(self, start: int, end: int) -> tuple[int, bytes] | None:
        """The metadata-cache piece ``(offset, bytes)`` holding all of ``[start, end)``, if any (lock held)."""
        return next(((at, data) for at, data in self._metadata if at <= start and end <= at + len(data)), None)

    def _remember(self, start: int, data: bytes) -> None:
        with self._lock:
            self._metadata.append((start, data))
            while sum(len(d) for _, d in self._metadata) > METADATA_CACHE_BYTES and len(self._metadata) > 1:
                self._metadata.pop(0)

    def read_into(self, offset: int, out: torch.Tensor | Buffer, what: str = "a tensor's data") -> None:
        view = writable_bytes(out)  # a tensor, or a plain buffer (the torch-free convert path)
        nbytes = len(view)
        if nbytes == 0:
            return
        if offset + nbytes > self._size:
            raise CheckpointFormatError(
                f"'{self._url}' ends after {self._size} bytes, inside {what} (bytes {offset}..{offset + nbytes}): "
                "the object is truncated. Upload it again from where it was saved.",
                path=self._url,
            )
        self._read(offset, view)

    def read_ahead(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` at ``offset`` fetched as a data read: with the bytes after it, up to the next fence.

        A record's local header is read this way just before its data, so both come in one request (a small file:
        the whole file)."""
        nbytes = max(0, min(nbytes, self._size - offset))
        buffer = bytearray(nbytes)
        if nbytes:
            self._read(offset, memoryview(buffer))
        return bytes(buffer)

    def _read(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes at ``offset`` from planned segments (fetching those not yet there)."""
        nbytes = len(view)
        with self._lock:
            piece = self._remembered(offset, offset + nbytes)  # e.g. a small legacy file, read whole for its pickles
            if piece is not None:
                view[:] = piece[1][offset - piece[0] : offset + nbytes - piece[0]]
                return
        uses, mine = self._plan(offset, offset + nbytes)
        with self._lock:
            continues = offset in self._ends or bool(uses and uses[0] not in mine)
            self._ends = [*self._ends[-7:], offset + nbytes]
        futures = [_pool().submit(self._run, seg) for seg in mine[1:]]
        if continues and self._size > SMALL_FILE_BYTES:
            self._fetch_ahead(offset + nbytes)
        if mine:
            self._run(mine[0])
        try:
            for seg in uses:
                seg.done.wait()
                if seg.error is not None:
                    raise seg.error
                lo, hi = max(offset, seg.start), min(offset + nbytes, seg.end)
                view[lo - offset : hi - offset] = seg.data[lo - seg.start : hi - seg.start]
                self._consumed(seg, hi - lo)
        finally:
            cf.wait(futures)

    def _plan(self, lo: int, hi: int) -> tuple[list[_Segment], list[_Segment]]:
        """The segments covering ``[lo, hi)`` (existing ones reused), and those this call must fetch."""
        uses: list[_Segment] = []
        mine: list[_Segment] = []
        with self._lock:
            at = lo
            if self._size <= SMALL_FILE_BYTES and not self._segments:  # fetched whole, kept until close
                seg = _Segment(0, self._size)
                self._segments.append(seg)
                return [seg], [seg]
            while at < hi:
                i = bisect.bisect_right([s.start for s in self._segments], at) - 1
                if i >= 0 and self._segments[i].end > at:
                    uses.append(self._segments[i])
                    at = self._segments[i].end
                    continue
                nxt = self._segments[i + 1].start if i + 1 < len(self._segments) else self._size
                f = bisect.bisect_right(self._fences, at)
                stop = min(nxt, self._fences[f] if f < len(self._fences) else self._size, self._size)
                want = min(hi, stop) if hi - at >= COALESCE_BYTES else min(max(hi, at + COALESCE_BYTES), stop)
                want = max(want, min(hi, nxt))  # a fence inside the read itself does not shorten it
                while at < want:
                    seg = _Segment(at, min(want, at + PART_BYTES))
                    bisect.insort(self._segments, seg, key=lambda s: s.start)
                    uses.append(seg)
                    mine.append(seg)
                    at = seg.end
            self._evict()
        return uses, mine

    def _fetch_ahead(self, at: int) -> None:
        """Start fetching the windows after ``at`` (up to :data:`AHEAD_WINDOWS`, the next fence and the budget)
        that no segment holds yet, on the pool: the reads that continue this one find them fetched or in flight."""
        ahead: list[_Segment] = []
        with self._lock:
            f = bisect.bisect_left(self._fences, at)
            stop = min(self._fences[f] if f < len(self._fences) else self._size, at + AHEAD_WINDOWS * COALESCE_BYTES)
            while at < stop:
                i = bisect.bisect_right([s.start for s in self._segments], at) - 1
                if i >= 0 and self._segments[i].end > at:
                    at = self._segments[i].end
                    continue
                nxt = self._segments[i + 1].start if i + 1 < len(self._segments) else self._size
                seg = _Segment(at, min(stop, nxt, at + COALESCE_BYTES), ahead=True)
                if not _reserve(seg.end - seg.start):
                    break
                bisect.insort(self._segments, seg, key=lambda s: s.start)
                ahead.append(seg)
                at = seg.end
        for seg in ahead:
            _pool().submit(self._run, seg)

    def _evict(self) -> None:
        done = [s for s in self._segments if s.done.is_set() and not s.ahead]  # unread ahead: bounded by the budget
        for seg in done[: max(0, len(done) - MAX_CACHED)]:
            self._segments.remove(seg)

    def _consumed(self, seg: _Segment, nbytes: int) -> None:
        with self._lock:
            _release(seg)
            seg.left -= nbytes
            if seg.left <= 0 and seg in self._segments:
                self._segments.remove(seg)

    def _run(self, seg: _Segment) -> None:
        try:
            seg.data = self._fetch(seg.start, seg.end)
        except Exception as exc:  # noqa: BLE001 - handed to every reader of the segment, raised there
            seg.error = exc
            self._forget(seg)
        except BaseException as exc:  # an interrupt: the readers waiting on this segment fail too
            seg.error = exc
            self._forget(seg)
            raise
        finally:
            seg.done.set()

    def _forget(self, seg: _Segment) -> None:
        with self._lock:
            _release(seg)
            if seg in self._segments:
                self._segments.remove(seg)  # a later read tries again

    def _fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` in one ranged request, retried; a body of the wrong length is retried too."""

        def once() -> bytes:
            whole = self._whole
            if whole is not None:
                return whole[start:end]
            self.requests += 1
            data = self._fetch_raw(start, end)
            if len(data) == self._size and len(data) > end - start:  # the server ignored the Range header
                if self._size > WHOLE_OBJECT_BYTES:
                    raise RangeError(
                        f"is served without HTTP range support (the server sent the whole {self._size}-byte object "
                        f"for bytes {start}..{end}); zeroio reads such objects only up to {WHOLE_OBJECT_BYTES} bytes"
                    )
                self._whole = data
                return data[start:end]
            if len(data) > end - start:
                raise RangeError(
                    f"answers a {end - start}-byte range with {len(data)} bytes, neither the range nor the whole "
                    "object: the server mishandles HTTP ranges"
                )
            if len(data) != end - start:
                raise _ShortBody(f"asked bytes {start}..{end}, got {len(data)}")
            return data

        try:
            result: bytes = call_with_retries(
                self._url, f"bytes {start}..{end}", self._fix_auth, once, retry_timeout=self._retry_timeout
            )
        except RemoteStorageError as exc:
            if isinstance(exc.__cause__, ObjectChanged):
                raise RemoteStorageError(
                    f"'{self._url}' changed while it was read ({exc.__cause__}): another writer replaced it, and "
                    "zeroio never mixes two versions of an object. Run again once the upload is complete.",
                    path=self._url,
                ) from exc
            if isinstance(exc.__cause__, RangeError):
                raise RemoteStorageError(
                    f"'{self._url}' {exc.__cause__}. Download the file and open the local copy.", path=self._url
                ) from exc
            if isinstance(exc.__cause__, _ShortBody):
                raise CheckpointFormatError(
                    f"'{self._url}' returns fewer bytes than its listed size ({exc.__cause__}): the object is "
                    "truncated or being rewritten. Upload it again from where it was saved.",
                    path=self._url,
                ) from exc
            raise
        return result


class _ShortBody(OSError):
    """A response body shorter than the range asked (transient until the retries run out)."""
