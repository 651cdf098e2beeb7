"""``convert`` / ``push_to_hub`` called on every rank of a torch.distributed job: one rank writes, the others wait.

Code written for DeepSpeed calls the converter on every rank at the end of training, into one output folder
(DeepSpeed's ``zero_to_fp32`` overwrites with ``exist_ok=True``). When a process group is initialised, the first
rank to call with a destination claims it in the job's key-value store (``store.add``: atomic, no collective, so
ranks that never call are not waited for); it writes and publishes its result or its error; the other callers wait
for that and return the same result or raise the same error. While the writer works it beats a heartbeat into the
store; a waiter whose writer stops beating (killed, hung) for :func:`stale_seconds` raises OutputError, and one
that loses the store (rank 0, its host, died) raises at once. ``distributed=True`` is another thing: every process
writes a share (``_distributed.py``), and is not routed here.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from . import errors
from ._io.remote_path import as_path
from ._messages import get_logger

__all__ = ["STALE_ENV", "convert_destination", "once_per_job", "push_destination", "stale_seconds"]

logger = get_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

STALE_ENV = "ZEROIO_DISTRIBUTED_TIMEOUT"
"""The same variable as ``distributed=True``'s timeout: seconds without a heartbeat before a waiter gives up."""

_DEFAULT_STALE = 120.0
_BEAT = 1.0  # seconds between the writer's heartbeats
_POLL = 0.2  # seconds between a waiter's looks at the store

_calls: dict[str, int] = {}  # (verb, destination) -> calls made by this process: one claim per call, on every rank
_calls_lock = threading.Lock()


def stale_seconds() -> float:
    """How long a waiter accepts silence from the writer: ``ZEROIO_DISTRIBUTED_TIMEOUT`` seconds, at most 120."""
    text = os.environ.get(STALE_ENV)
    try:
        seconds = float(text) if text else _DEFAULT_STALE
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{STALE_ENV} must be a positive number of seconds, got {text!r}.")
    return min(seconds, _DEFAULT_STALE)


def _job_store() -> tuple[Any, int] | None:
    """The initialised default group's store and this rank, or None outside a job of several processes.

    Reads ``sys.modules``: a process that never imported torch.distributed has no group, and importing torch
    just to learn that would cost a torch-free conversion its start-up time.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store(), dist.get_rank()


# --------------------------------------------------------------------------- results as JSON


def _encode(value: Any) -> Any:
    """A result as JSON, tagged so that :func:`_decode` rebuilds paths, tuples and dataclasses exactly."""
    if isinstance(value, Path) or type(value).__name__ == "RemotePath":
        return {"path": str(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"cannot send {type(value).__name__} to the other ranks")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "path" in value:
            return as_path(value["path"])
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        return {_decode(k): _decode(v) for k, v in value["dict"]}
    return value


def _result_fields(result: Any) -> dict[str, Any]:
    return {name: getattr(result, name) for name in result.__dataclass_fields__}


# --------------------------------------------------------------------------- the writer and the waiters


class _Heartbeat:
    """Beats ``key`` in the store every second from a daemon thread while the writer works."""

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


def _outcome_of(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, errors.ZeroIOError):
        return {
            "error": type(exc).__name__,
            "message": exc.message,
            "path": None if exc.path is None else str(exc.path),
        }
    what = "was interrupted" if isinstance(exc, KeyboardInterrupt) else f"failed: {type(exc).__name__}: {exc}"
    return {"error": "OutputError", "message": what, "path": None}


def _write(store: Any, base: str, rank: int, args: str, call: Callable[[], R]) -> R:
    """This rank claimed the destination: write, publishing the outcome for the waiters."""
    store.set(f"{base}/writer", json.dumps({"rank": rank, "args": args}))
    outcome: dict[str, Any]
    try:
        with _Heartbeat(store, f"{base}/alive"):
            result = call()
    except BaseException as exc:
        outcome = _outcome_of(exc)
        _publish(store, base, outcome)
        raise
    _publish(store, base, {"result": _encode(_result_fields(result))})
    return result


def _publish(store: Any, base: str, outcome: dict[str, Any]) -> None:
    """Publish the outcome, then give the ranks already waiting up to :func:`stale_seconds` to read it: a writer on
    rank 0 hosts the store, and a script that exits right after ``convert`` would take the outcome with it."""
    try:
        store.set(f"{base}/outcome", json.dumps(outcome))
        deadline = time.monotonic() + stale_seconds()
        while int(store.add(f"{base}/read", 0)) < int(store.add(f"{base}/claim", 0)) - 1:
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL)
    except Exception as exc:  # noqa: BLE001 - the store's host died: the waiters raise on their own
        logger.debug("publishing the outcome failed: %s", exc)


def _lost(what: str, dst: str, rank: int | None, detail: str) -> errors.OutputError:
    return errors.OutputError(
        f"Waiting for rank {'?' if rank is None else rank} to write '{dst}' for every rank: {detail}. Check that "
        f"rank's log and run again ({what} is written once per job when a process group is initialised).",
        path=dst,
        rank=rank,
    )


def _check_claim(store: Any, base: str, what: str, dst: str, args: str) -> int:
    """The writer's rank, once its arguments are checked against this rank's."""
    claim = json.loads(store.get(f"{base}/writer"))
    writer = int(claim["rank"])
    if claim["args"] != args:
        raise errors.OutputError(
            f"Rank {writer} writes '{dst}' with other arguments than this rank ({claim['args']} vs {args}): call "
            f"{what} with the same arguments on every rank, or give each its own destination.",
            path=dst,
            rank=writer,
        )
    return writer


def _wait(store: Any, base: str, what: str, dst: str, args: str, result_type: type[R]) -> R:
    """Another rank claimed the destination: wait for its outcome, heartbeat by heartbeat."""
    stale = stale_seconds()
    writer: int | None = None
    last_beat, last_change = None, time.monotonic()
    try:
        while not store.check([f"{base}/outcome"]):
            if writer is None and store.check([f"{base}/writer"]):
                writer = _check_claim(store, base, what, dst, args)
            beat = store.get(f"{base}/alive") if store.check([f"{base}/alive"]) else None
            now = time.monotonic()
            if beat != last_beat:
                last_beat, last_change = beat, now
            elif now - last_change > stale:
                raise _lost(what, dst, writer, f"it gave no sign of life for {stale:g} s (set {STALE_ENV})")
            time.sleep(_POLL)
        if writer is None:  # the outcome came before this rank looked: the claim was published before it
            writer = _check_claim(store, base, what, dst, args)
        outcome = json.loads(store.get(f"{base}/outcome"))
        store.add(f"{base}/read", 1)  # the writer may go now
    except errors.ZeroIOError:
        raise
    except RuntimeError as exc:  # DistStoreError, DistNetworkError: the store's host (rank 0) is gone
        raise _lost(what, dst, writer, f"the job's store stopped answering ({str(exc).splitlines()[0]})") from exc
    if "result" in outcome:
        return result_type(**_decode(outcome["result"]))
    cls = getattr(errors, outcome["error"], errors.ZeroIOError)
    try:
        error = cls(outcome["message"], path=outcome["path"], rank=writer)
    except TypeError:  # an error class with its own constructor
        error = errors.ZeroIOError(outcome["message"], path=outcome["path"], rank=writer)
    if outcome["error"] == "OutputError" and outcome["path"] is None:
        error = _lost(what, dst, writer, f"it {outcome['message']}")
    raise error


def convert_destination(bound: inspect.BoundArguments) -> str | None:
    """``convert``'s destination: ``dst`` as an absolute path (or its URL); None with ``distributed=True``."""
    if bound.arguments.get("distributed"):
        return None
    dst = str(bound.arguments["dst"])
    return dst if "://" in dst else os.path.abspath(dst)


def push_destination(bound: inspect.BoundArguments) -> str | None:
    """``push_to_hub``'s destination: the Hub, repo and branch (or pull request) pushed to."""
    args = bound.arguments
    where = args.get("revision") or ("a new pull request" if args.get("create_pr") else "main")
    return f"{args.get('endpoint') or 'the Hub'} {args['repo_id']} {where}"


def once_per_job(
    what: str,
    destination: Callable[[inspect.BoundArguments], str | None],
    result_type: type[R],
    compared: tuple[str, ...],
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a verb so that, in a torch.distributed job, the ranks calling it with one ``destination`` write once.

    ``destination(bound)`` names what is written (None: this call is not coordinated, e.g. ``distributed=True``);
    ``compared`` names the arguments every rank must pass alike (never a token or credentials: they would be
    written into the job's store).
    """

    def decorate(verb: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(verb)

        @functools.wraps(verb)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            job = _job_store()
            if job is None:
                return verb(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            dst = destination(bound)
            if dst is None:
                return verb(*args, **kwargs)
            store, rank = job
            with _calls_lock:
                count = _calls[f"{what}\0{dst}"] = _calls.get(f"{what}\0{dst}", 0) + 1
            base = f"zeroio/{what}/{hashlib.sha256(dst.encode()).hexdigest()[:32]}/{count}"
            fingerprint = ", ".join(f"{k}={bound.arguments[k]!r}" for k in compared if k in bound.arguments)
            try:
                claimed = int(store.add(f"{base}/claim", 1))
            except RuntimeError as exc:  # DistStoreError, DistNetworkError: the store's host (rank 0) is gone
                raise _lost(what, dst, None, f"the job's store does not answer ({str(exc).splitlines()[0]})") from exc
            if claimed == 1:
                return _write(store, base, rank, fingerprint, lambda: verb(*args, **kwargs))
            logger.info("rank %d: another rank writes %s for every rank; waiting for it", rank, dst)
            return _wait(store, base, what, dst, fingerprint, result_type)

        return wrapper

    return decorate
