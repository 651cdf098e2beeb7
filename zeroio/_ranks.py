"""How each process of a torch.distributed job learns how a step ended on every other: zeroio's one cross-rank
outcome exchange, used by a sharded ``load`` (:mod:`zeroio._load.rank_agreement`), ``convert(..., distributed=True)``
(:mod:`zeroio._write.comm`, :mod:`zeroio._write.one_reader`) and ``convert``/``push_to_hub`` called on every rank
(:mod:`zeroio._every_rank`).

The contract. The work between two exchanges is a *step*. After each step every rank calls :func:`settle` with its
own error (or None) and optional JSON data. It returns every rank's data, in rank order, only when every rank
succeeded; when any rank failed it raises on every rank: the failing rank its own error, the others the
``ZeroIOError`` their caller builds from the :class:`Failure` (rank, type, message, path). A rank that fails between
two exchanges calls ``settle(error)`` at once: an exchange is the same collectives whatever it carries, so the others,
already waiting in it, learn the failure within the time of one step, and no rank is left in a later collective
(data collectives, such as a broadcast, come only right after an exchange every rank passed). Within a long step,
an :class:`Alarm` in the job's store brings the others to that exchange early. A peer that died or stopped answering
for the group's timeout raises :class:`RanksLost`.

When one rank works for every rank that calls (``convert`` on every rank: the destination is claimed in the job's
key-value store, no collective, so ranks that never call are not waited for), the same outcome crosses the store:
:func:`work_for_all` publishes it, :func:`await_worker` reads it, bounded by the worker's heartbeat.

Only JSON crosses processes, never a pickle.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

from . import errors
from ._messages import get_logger

__all__ = [
    "TIMEOUT_ENV",
    "Alarm",
    "Failure",
    "GroupRanks",
    "OneRank",
    "Ranks",
    "RanksLost",
    "await_worker",
    "default_group",
    "gloo_detail",
    "in_job",
    "job_store",
    "settle",
    "timeout_seconds",
    "work_for_all",
]

logger = get_logger(__name__)

R = TypeVar("R")

TIMEOUT_ENV = "ZEROIO_DISTRIBUTED_TIMEOUT"
"""Seconds a process waits for the others: the gloo group's timeout of ``distributed=True``, and (at most 120) the
silence a waiter accepts from the rank that works for every rank."""

_BEAT = 1.0  # seconds between a worker's heartbeats in the store
_POLL = 0.2  # seconds between a waiter's looks at the store


def timeout_seconds(default: float) -> float:
    """``ZEROIO_DISTRIBUTED_TIMEOUT`` in seconds, or ``default`` when unset; ValueError naming it when not positive."""
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}.")
    return seconds


# --------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class Failure:
    """One rank's failure as the other ranks see it."""

    rank: int | None
    kind: str  # the exception's class name
    message: str  # its one line (what the failing rank chose to send)
    path: str | None
    zeroio: bool  # a ZeroIOError: ``message`` is self-explaining, and :meth:`rebuilt` gives its class back
    data: Any = None  # what the failing rank sent with it (where it failed)

    @property
    def line(self) -> str:
        """The message, prefixed with the exception's type unless it is a ZeroIOError."""
        return self.message if self.zeroio else f"{self.kind}: {self.message}"

    def rebuilt(self) -> errors.ZeroIOError | None:
        """The failing rank's ZeroIOError, same class, message and path, naming its rank (None: not a ZeroIOError)."""
        if not self.zeroio:
            return None
        cls = getattr(errors, self.kind, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.ZeroIOError)):
            cls = errors.ZeroIOError
        try:
            return cls(self.message, path=self.path, rank=self.rank)
        except TypeError:  # an error class with its own constructor
            return errors.ZeroIOError(self.message, path=self.path, rank=self.rank)


def outcome_of(error: BaseException, line: str | None = None) -> dict[str, Any]:
    """``error`` as JSON for the other ranks (``line``: the message to send instead of ``str(error)``)."""
    zeroio = isinstance(error, errors.ZeroIOError)
    path = getattr(error, "path", None) if zeroio else None
    return {
        "kind": type(error).__name__,
        "message": line if line is not None else str(error),  # a ZeroIOError's str() is its message
        "path": None if path is None else str(path),
        "zeroio": zeroio,
    }


def failure_of(outcome: dict[str, Any], rank: int | None, data: Any = None) -> Failure:
    return Failure(rank, outcome["kind"], outcome["message"], outcome["path"], bool(outcome["zeroio"]), data)


def _reraise(error: BaseException) -> NoReturn:
    raise error


# --------------------------------------------------------------------------- every rank ran the step


class RanksLost(Exception):
    """An exchange failed: another process died, or did not answer within the group's timeout."""


class Ranks(Protocol):
    """All-gathers of small JSON documents among the processes of one job."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, payload: Any) -> list[Any]:
        """Every process's ``payload``, in rank order. Raises :class:`RanksLost` when a process is gone."""
        ...


class OneRank:
    """One process alone: rank 0 of 1, nothing exchanged."""

    rank = 0
    world_size = 1

    def all_gather(self, payload: Any) -> list[Any]:
        return [payload]


def gloo_detail(exc: BaseException) -> str:
    """The gist of a gloo/c10d error: ``Connection closed by peer [127.0.0.1]:6884``, without the source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")


class GroupRanks:
    """JSON all-gathers over a torch.distributed group (``None``: the default one), tensors on ``device``.

    Lengths first (one int64 per rank), then the bytes padded to the longest, only when some rank sent any: an
    exchange where every rank sends ``None`` (all well, nothing to say) costs one 8-byte collective.
    """

    def __init__(self, group: Any = None, device: Any = None) -> None:
        import torch.distributed as dist

        self.group = group
        self.device = device if device is not None else "cpu"
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, payload: Any) -> list[Any]:
        import torch
        import torch.distributed as dist

        data = b"" if payload is None else json.dumps(payload).encode("utf-8")
        try:
            length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
            dist.all_gather(lengths, length, group=self.group)
            sizes = [int(n.item()) for n in lengths]
            if not any(sizes):
                return [None] * self.world_size
            mine = torch.zeros(max(sizes), dtype=torch.uint8)
            if data:
                mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            gathered = [torch.zeros(max(sizes), dtype=torch.uint8, device=self.device) for _ in sizes]
            dist.all_gather(gathered, mine.to(self.device), group=self.group)
        except RuntimeError as exc:  # DistBackendError, DistNetworkError: a peer closed its connection or timed out
            raise RanksLost(gloo_detail(exc)) from exc
        # numpy's bytes, not tolist(): a fingerprint of 20,000 files (1.3 MB) took 40 ms a rank as Python ints
        return [json.loads(t[:n].cpu().numpy().tobytes()) if n else None for t, n in zip(gathered, sizes)]


def _dist_of_several() -> Any:
    """torch.distributed when its default group is initialised with several processes, else None.

    Reads ``sys.modules``: a process that never imported torch.distributed has no group, and importing torch
    just to learn that would cost a torch-free conversion its start-up time.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist


def in_job() -> bool:
    """Whether this process belongs to an initialised torch.distributed job of several processes."""
    return _dist_of_several() is not None


def default_group() -> GroupRanks | None:
    """The initialised default process group, when it has several processes (else None); NCCL exchanges on this
    process's CUDA device, any other backend on the CPU."""
    dist = _dist_of_several()
    if dist is None:
        return None
    import torch

    nccl = dist.get_backend() == "nccl"
    return GroupRanks(None, torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))


def settle(
    ranks: Ranks,
    error: BaseException | None,
    data: Any = None,
    *,
    told: Callable[[list[Failure]], BaseException],
    line: str | None = None,
    own: Callable[[BaseException], NoReturn] = _reraise,
) -> list[Any]:
    """End a step on every rank: every rank's ``data`` when all succeeded; else raise on every rank.

    This rank's ``error`` is sent as ``line`` (default: its message) with ``data``, then raised by ``own``; another
    rank's failure raises ``told(failures)`` (every failed rank, in rank order). Raises :class:`RanksLost` when a
    process is gone.
    """
    payload = None
    if error is not None:
        payload = {"error": outcome_of(error, line), "data": data}
    elif data is not None:
        payload = {"error": None, "data": data}
    reports = ranks.all_gather(payload)
    if error is not None:
        own(error)
    failed = [failure_of(r["error"], rank, r["data"]) for rank, r in enumerate(reports) if r and r["error"]]
    if failed:
        raise told(failed)
    return [None if r is None else r["data"] for r in reports]


# --------------------------------------------------------------------------- the job's store


def job_store() -> tuple[Any, int] | None:
    """The initialised default group's key-value store and this rank, or None outside a job of several processes."""
    dist = _dist_of_several()
    if dist is None:
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store(), dist.get_rank()


class Alarm:
    """A failure flag in the job's store, for a long step without exchanges (a sharded load's fill): the failing
    rank :meth:`ring` s it before its ``settle(error)``; the others, between pieces of their work, see it
    (:meth:`rung`, one store look per ``every`` seconds) and go to their ``settle`` at once instead of at the end of
    the step. ``key`` must name this step alike on every rank, and never an earlier one."""

    def __init__(self, key: str, every: float = 0.2) -> None:
        self.key = key
        self.every = every
        self._job = job_store()
        self._next = 0.0

    def ring(self) -> None:
        if self._job is None:
            return
        try:
            self._job[0].set(self.key, str(self._job[1]))
        except Exception as exc:  # noqa: BLE001 - the store's host is gone: the exchange will say so
            logger.debug("could not raise the alarm %s: %s", self.key, exc)

    def rung(self) -> bool:
        now = time.monotonic()
        if self._job is None or now < self._next:
            return False
        self._next = now + self.every
        try:
            return bool(self._job[0].check([self.key]))
        except Exception as exc:  # noqa: BLE001 - the store's host is gone: the next exchange will say so
            logger.debug("could not look at the alarm %s: %s", self.key, exc)
            return False


# --------------------------------------------------------------------------- one rank works for all, in the store


class _Heartbeat:
    """Beats ``key`` in the store every second from a daemon thread while the worker works."""

    def __init__(self, store: Any, key: str) -> None:
        self._store, self._key = store, key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zeroio-heartbeat", daemon=True)

    def _run(self) -> None:
        beat = 0
        while not self._stop.wait(_BEAT):
            beat += 1
            try:
                self._store.set(self._key, str(beat))
            except Exception as exc:  # noqa: BLE001 - the store's host is gone: the waiters will notice
                logger.debug("heartbeat failed: %s", exc)
                return

    def __enter__(self) -> _Heartbeat:  # noqa: PYI034 - a private helper, never subclassed
        self._store.set(self._key, "0")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def work_for_all(store: Any, base: str, stale: float, work: Callable[[], R], encode: Callable[[R], Any]) -> R:
    """This rank works for every rank waiting under ``base`` (:func:`await_worker`): beat a heartbeat while
    ``work()`` runs, publish its result (``encode``-d) or its error, then give the ranks already waiting up to
    ``stale`` seconds to read it (rank 0 hosts the store: a script that exits right after would take the outcome
    with it). The ranks waiting are those that counted themselves in ``base/claim`` (this one included)."""
    try:
        with _Heartbeat(store, f"{base}/alive"):
            result = work()
    except BaseException as exc:
        _publish(store, base, stale, {"error": outcome_of(exc)})
        raise
    _publish(store, base, stale, {"result": encode(result)})
    return result


def _publish(store: Any, base: str, stale: float, outcome: dict[str, Any]) -> None:
    try:
        store.set(f"{base}/outcome", json.dumps(outcome))
        deadline = time.monotonic() + stale
        while int(store.add(f"{base}/read", 0)) < int(store.add(f"{base}/claim", 0)) - 1:
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL)
    except Exception as exc:  # noqa: BLE001 - the store's host died: the waiters raise on their own
        logger.debug("publishing the outcome failed: %s", exc)


def await_worker(
    store: Any, base: str, stale: float, who: Callable[[], int | None], lost: Callable[[int | None, str], BaseException]
) -> tuple[Any, Failure | None]:
    """Wait for the outcome :func:`work_for_all` publishes under ``base``, heartbeat by heartbeat: its encoded
    result and None, or None and its :class:`Failure` (naming the rank ``who()`` says worked).

    ``who()`` is asked at each look until it names a rank (it may raise, e.g. when the worker's arguments differ);
    ``lost(worker, detail)`` is raised when the worker is silent for ``stale`` seconds or the store stops answering.
    """
    worker: int | None = None
    last_beat, last_change = None, time.monotonic()
    try:
        while not store.check([f"{base}/outcome"]):
            if worker is None:
                worker = who()
            beat = store.get(f"{base}/alive") if store.check([f"{base}/alive"]) else None
            now = time.monotonic()
            if beat != last_beat:
                last_beat, last_change = beat, now
            elif now - last_change > stale:
                raise lost(worker, f"it gave no sign of life for {stale:g} s (set {TIMEOUT_ENV})")
            time.sleep(_POLL)
        if worker is None:  # the outcome came before this rank looked: the claim was published before it
            worker = who()
        outcome = json.loads(store.get(f"{base}/outcome"))
        store.add(f"{base}/read", 1)  # the worker may go now
    except errors.ZeroIOError:
        raise
    except RuntimeError as exc:  # DistStoreError, DistNetworkError: the store's host (rank 0) is gone
        raise lost(worker, f"the job's store stopped answering ({str(exc).splitlines()[0]})") from exc
    if "result" in outcome:
        return outcome["result"], None
    return None, failure_of(outcome["error"], worker)
