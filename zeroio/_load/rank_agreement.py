"""The one cross-rank error path of a sharded load: every failure, on any rank and at any step, reaches every rank as a
``ZeroIOError``, and the ranks agree on one checkpoint (resolved tag and its files' names, sizes and times) before
anything is read.

A rank that failed alone used to leave the others blocked in a collective (an open failure before the error
exchange: ``all_gather_object``; a read error on rank 0 under ``broadcast_from_rank0``: ``broadcast``), and ranks
that resolved ``latest`` while a save landed read two different steps into one parameter. Three collectives,
each reached by every rank whatever happened before it: :func:`agree` (after planning, and once more after
filling), and :func:`broadcast_checked` (a status before each broadcast chunk).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._messages import listing
from ..errors import ShardedModelError, ZeroIOError

if TYPE_CHECKING:
    from .._formats import TensorReader

__all__ = ["MAX_FINGERPRINT_FILES", "LoadSteps", "agree", "broadcast_checked", "fingerprint", "in_process_group"]

MAX_FINGERPRINT_FILES = 100_000
"""Files listed for a checkpoint's fingerprint (a universal checkpoint has a few per parameter); more are refused."""

Fingerprint = tuple[str, str, tuple[tuple[str, int, int], ...]]


def in_process_group() -> bool:
    """Whether a torch.distributed process group of more than one process is initialised (collectives needed)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _files(root: Path) -> list[tuple[str, int, int]]:
    """``(relative name, size, mtime_ns)`` of every file under ``root`` (a URL: its listing, sizes only)."""
    if not isinstance(root, Path) or type(root).__name__ == "RemotePath":
        found = [(p.name, int(p.stat().st_size), 0) for p in root.iterdir() if p.is_file()]
        return sorted(found)
    if not root.is_dir():
        stat = root.stat()
        return [(root.name, stat.st_size, stat.st_mtime_ns)]
    found = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = Path(folder, name)
            try:
                stat = path.stat()
                seen = (stat.st_size, stat.st_mtime_ns)
            except OSError:  # vanished or a dangling link: its name still counts
                seen = (-1, 0)
            found.append((path.relative_to(root).as_posix(), *seen))
            if len(found) > MAX_FINGERPRINT_FILES:
                raise ShardedModelError(
                    f"'{root}' holds more than {MAX_FINGERPRINT_FILES} files; zeroio lists them to check that every rank "
                    "reads the same checkpoint. Point zeroio at the checkpoint's own folder.",
                    path=root,
                )
    return found


def fingerprint(ckpt: TensorReader) -> Fingerprint:
    """What every rank must see alike: the format, the resolved tag, and the checkpoint folder's files (names
    relative to it, sizes, modification times), so a save landing meanwhile or a file replaced is noticed."""
    meta = ckpt.metadata
    return (meta.format, str(meta.tag), tuple(_files(meta.path)))


def _differences(mine: Fingerprint, other: Fingerprint) -> str:
    if mine[:2] != other[:2]:
        return f"tag {mine[1]!r} vs {other[1]!r}"
    a, b = {n: (s, t) for n, s, t in mine[2]}, {n: (s, t) for n, s, t in other[2]}
    names = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
    return f"files that differ: {listing(names)}"


def agree(error: BaseException | None, where: str, print_: Fingerprint | None = None) -> None:
    """One ``all_gather_object`` that every rank reaches: raise on every rank if any rank failed (the failing rank
    its own error, the others :class:`ShardedModelError` naming it), or if ranks saw different checkpoints.

    Without a process group of several ranks, ``error`` is simply raised.
    """
    if not in_process_group():
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    mine = None if error is None else (type(error).__name__, str(error))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, print_))
    if error is not None:
        raise _agreed(error)
    for rank, (failed, _) in enumerate(gathered):
        if failed is not None:
            kind, message = failed
            raise _agreed(
                ShardedModelError(
                    f"Rank {rank} could not load '{where}' ({kind}), so no rank loaded anything: {message}",
                    path=where,
                    rank=rank,
                )
            )
    first = gathered[0][1]
    for rank, (_, seen) in enumerate(gathered):
        if seen != first:
            raise _agreed(
                ShardedModelError(
                    f"Ranks 0 and {rank} opened different checkpoints at '{where}' ({_differences(first, seen)}): a save "
                    "landed or a file changed while they opened it, or the ranks see different copies. Nothing was "
                    "loaded; pass tag= to name one step, and load when no save is running (copies on several hosts "
                    "must be identical, modification times included: rsync -t).",
                    path=where,
                    rank=rank,
                )
            )


def _agreed(error: BaseException) -> BaseException:
    """``error``, marked as known to every rank (:class:`LoadSteps` sends no error twice)."""
    error.__dict__["zeroio_agreed"] = True
    return error


def broadcast_checked(read: Callable[[], None], buffer: torch.Tensor, where: str, name: str) -> None:
    """Rank 0 runs ``read`` (filling ``buffer``), then broadcasts a status, then ``buffer``: a read error on rank 0
    reaches every rank (as :class:`ShardedModelError` naming it) instead of leaving them in ``broadcast``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    failure: BaseException | None = None
    if rank == 0:
        try:
            read()
        except Exception as exc:  # noqa: BLE001 - told to every rank, then re-raised here
            failure = exc
    status = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=buffer.device)
    dist.broadcast(status, src=0)
    if int(status.item()):
        told: list[Any] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(told, src=0)
        if failure is not None:
            if isinstance(failure, ZeroIOError):
                raise _agreed(failure)
            raise _agreed(
                ShardedModelError(f"Rank 0 could not read '{name}' from '{where}': {told[0]}", path=where)
            ) from failure
        raise _agreed(
            ShardedModelError(
                f"Rank 0 could not read '{name}' from '{where}' for broadcast_from_rank0, so this rank's load stopped: "
                f"{told[0]}",
                path=where,
                name=name,
                rank=0,
            )
        )
    dist.broadcast(buffer, src=0)


class LoadSteps:
    """``with LoadSteps(...)`` around a whole load: an error raised on this rank that the other ranks do not know
    yet (not raised by :func:`agree` or :func:`broadcast_checked`) is sent through :func:`agree`, the next
    collective every other rank reaches (after planning, after filling), so they raise too instead of waiting.

    ``sharded()`` says, when an error needs sending, whether this load takes part in collectives (a process group
    of several ranks, and a sharded model or ``broadcast_from_rank0``).
    """

    def __init__(self, where: str, sharded: Callable[[], bool]) -> None:
        self.where = where
        self.sharded = sharded

    def __enter__(self) -> LoadSteps:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if not isinstance(error, Exception) or error.__dict__.get("zeroio_agreed") or not self.sharded():
            return
        self.pending = 0
        agree(error, self.where)  # the next collective the other ranks reach: they raise, naming this rank
