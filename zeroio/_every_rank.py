"""``convert`` / ``push_to_hub`` called on every rank of a torch.distributed job: one rank writes, the others wait.

Code written for DeepSpeed calls the converter on every rank at the end of training, into one output folder
(DeepSpeed's ``zero_to_fp32`` overwrites with ``exist_ok=True``). When a process group is initialised, the first
rank to call with a destination claims it in the job's key-value store (``store.add``: atomic, no collective, so
ranks that never call are not waited for); it writes and publishes its result or its error; the other callers wait
for that and return the same result or raise the same error. While the writer works it beats a heartbeat into the
store; a waiter whose writer stops beating (killed, hung) for :func:`stale_seconds` raises OutputError, and one
that loses the store (rank 0, its host, died) raises at once: the store half of :mod:`zeroio._ranks`, zeroio's one
cross-rank outcome exchange. ``distributed=True`` is another thing: every process
writes a share (``_distributed.py``), and is not routed here.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from . import _ranks, errors
from ._io.remote_path import as_path
from ._messages import get_logger

__all__ = ["STALE_ENV", "convert_destination", "once_per_job", "push_destination", "stale_seconds"]

logger = get_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

STALE_ENV = _ranks.TIMEOUT_ENV
"""The same variable as ``distributed=True``'s timeout: seconds without a heartbeat before a waiter gives up."""

_DEFAULT_STALE = 120.0

_calls: dict[str, int] = {}  # (verb, destination) -> calls made by this process: one claim per call, on every rank
_calls_lock = threading.Lock()


def stale_seconds() -> float:
    """How long a waiter accepts silence from the writer: ``ZEROIO_DISTRIBUTED_TIMEOUT`` seconds, at most 120."""
    return min(_ranks.timeout_seconds(_DEFAULT_STALE), _DEFAULT_STALE)


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


def _lost(what: str, dst: str, rank: int | None, detail: str) -> errors.OutputError:
    return errors.OutputError(
        f"Waiting for rank {'?' if rank is None else rank} to write '{dst}' for every rank: {detail}. Check that "
        f"rank's log and run again ({what} is written once per job when a process group is initialised).",
        path=dst,
        rank=rank,
    )


def _check_claim(store: Any, base: str, what: str, dst: str, args: str) -> int | None:
    """The writer's rank once it published its claim, its arguments checked against this rank's (None: not yet)."""
    if not store.check([f"{base}/writer"]):
        return None
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
    """Another rank claimed the destination: wait for its outcome (:func:`zeroio._ranks.await_worker`)."""
    result, failure = _ranks.await_worker(
        store,
        base,
        stale_seconds(),
        lambda: _check_claim(store, base, what, dst, args),
        lambda rank, detail: _lost(what, dst, rank, detail),
    )
    if failure is None:
        return result_type(**_decode(result))
    error = failure.rebuilt()
    if error is None:  # not a ZeroIOError: an OutputError that says so
        happened = "was interrupted" if failure.kind == "KeyboardInterrupt" else f"failed: {failure.line}"
        error = _lost(what, dst, failure.rank, f"it {happened}")
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
            job = _ranks.job_store()
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
                store.set(f"{base}/writer", json.dumps({"rank": rank, "args": fingerprint}))
                work = lambda: verb(*args, **kwargs)
                return _ranks.work_for_all(store, base, stale_seconds(), work, lambda r: _encode(_result_fields(r)))
            logger.info("rank %d: another rank writes %s for every rank; waiting for it", rank, dst)
            return _wait(store, base, what, dst, fingerprint, result_type)

        return wrapper

    return decorate
