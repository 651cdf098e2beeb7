"""The steps of a sharded load at which its ranks meet, each a :func:`zeroio._ranks.settle`: every failure, on any
rank and at any step, reaches every rank as a ``ZeroIOError``, and the ranks agree on one checkpoint (resolved tag
and its files' names, sizes and times; where only times differ, as in copies made without ``rsync -t``, a hash of
each such file's first and last bytes) before anything is read.

The steps, in order, reached by every rank whatever happened before: the plan (:func:`agree` after matching keys,
with each rank's fingerprint of the checkpoint), one per ``broadcast_from_rank0`` chunk (:func:`broadcast_checked`:
rank 0's read, then the chunk's broadcast only once every rank passed), and the last (:meth:`LoadSteps.last`, after
filling). A rank that fails between two steps sends its error in the next one (:class:`LoadSteps`), so the others,
waiting there, raise at once instead of waiting in a later collective: a failure of any rank in the middle of a
broadcast, an open failure before the plan. A rank whose open failed still runs the init hook first (in a process
group of several ranks): the others may meet in its collectives (a ``DeviceMesh``), and only then does this rank
know whether its model is sharded, that is whether the others wait for it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch

from .._io.confine import confined_path, hub_cache_blobs, open_regular
from .._messages import get_logger, listing
from .._ranks import Alarm, Failure, RanksLost, default_group, gloo_detail, in_job, settle
from ..errors import ShardedModelError, ZeroIOError

if TYPE_CHECKING:
    from .._formats import TensorReader

__all__ = ["MAX_FINGERPRINT_FILES", "LoadSteps", "agree", "broadcast_checked", "fingerprint", "in_process_group"]

logger = get_logger(__name__)

MAX_FINGERPRINT_FILES = 100_000
"""Files listed for a checkpoint's fingerprint (a universal checkpoint has a few per parameter); more are refused."""

EDGE_BYTES = 4096
"""Bytes hashed at each end of a file whose modification time differs between ranks: where formats keep what tells
one save from another (a safetensors header, a torch zip's central directory with every record's CRC-32 and the
save's ``serialization_id``, a DCP data file's first and last chunks)."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What this rank opened: ``sent`` to the others (format, resolved tag, ``(name, size, mtime_ns)`` of every
    file under ``root``), and ``root``, where the files whose times differ are hashed."""

    root: Path
    sent: tuple[str, str, tuple[tuple[str, int, int], ...]]


_plans_passed = [0]  # plan steps this process passed: alike on every rank of a load, so it names that load's fill
E = TypeVar("E", bound=BaseException)


def in_process_group() -> bool:
    """Whether a torch.distributed process group of more than one process is initialised (collectives needed)."""
    return in_job()


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
    relative to it, sizes, modification times), so a save landing meanwhile or a file replaced is noticed; files
    whose times alone differ are compared by content (:func:`agree`)."""
    meta = ckpt.metadata
    return Fingerprint(meta.path, (meta.format, str(meta.tag), tuple(_files(meta.path))))


def _times_only(gathered: list[Any]) -> list[str]:
    """The files whose modification times differ between ranks, when nothing else does (the same format, tag, names
    and sizes everywhere: copies made without ``rsync -t``), else []. Alike on every rank: it reads the gathered."""
    if any(seen is None for seen in gathered):
        return []
    first = gathered[0]
    if any(seen[:2] != first[:2] or [f[:2] for f in seen[2]] != [f[:2] for f in first[2]] for seen in gathered):
        return []
    return [f[0] for i, f in enumerate(first[2]) if any(seen[2][i][2] != f[2] for seen in gathered)]


def _edges(root: Path, names: list[str]) -> list[str]:
    """A hash of the first and last :data:`EDGE_BYTES` of each named file under ``root`` (all of it when smaller);
    "" for what is not a regular file (opened as the readers open files: a FIFO never blocks), cannot be read, or
    is a link leading out of the checkpoint (and out of a Hub cache's blobs): its bytes are not read."""
    blobs = hub_cache_blobs(root)
    hashes = []
    for name in names:
        try:
            path = confined_path(root, name, source=root, what="file", links_into=blobs) if root.is_dir() else root
            fd, (_, _, size, _) = open_regular(path)
        except (OSError, ZeroIOError):
            hashes.append("")
            continue
        try:
            digest = hashlib.blake2b(os.pread(fd, EDGE_BYTES, 0), digest_size=8)
            if size > EDGE_BYTES:
                digest.update(os.pread(fd, EDGE_BYTES, max(EDGE_BYTES, size - EDGE_BYTES)))
            hashes.append(digest.hexdigest())
        except OSError:
            hashes.append("")
        finally:
            os.close(fd)
    return hashes


def _differences(mine: Any, other: Any) -> str:
    if isinstance(mine, dict):  # the second round: the files whose times differ, by content
        return f"files that differ: {listing([n for n in mine if mine[n] != other[n]])}"
    if list(mine[:2]) != list(other[:2]):
        return f"tag {mine[1]!r} vs {other[1]!r}"
    a, b = {n: (s, t) for n, s, t in mine[2]}, {n: (s, t) for n, s, t in other[2]}
    names = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
    return f"files that differ: {listing(names)}"


def _agreed(error: E) -> E:
    """``error``, marked as known to every rank (:class:`LoadSteps` sends no error twice)."""
    error.__dict__["zeroio_agreed"] = True
    return error


def _told(where: str, filling: bool, failed: list[Failure]) -> BaseException:
    """The error a rank raises when another rank failed: named after the first one, as this rank's step sees it."""
    first = failed[0]
    reading = first.data.get("reading") if isinstance(first.data, dict) else None
    if reading is not None:
        return _agreed(
            ShardedModelError(
                f"Rank {first.rank} could not read '{reading}' from '{where}' for broadcast_from_rank0, so this "
                f"rank's load stopped: {first.line}",
                path=where,
                name=reading,
                rank=first.rank,
            )
        )
    stopped = (
        "so the load stopped on every rank and the model is partly filled (load it again)"
        if filling
        else "so no rank loaded anything"
    )
    return _agreed(
        ShardedModelError(
            f"Rank {first.rank} could not load '{where}' ({first.kind}), {stopped}: {first.message}",
            path=where,
            rank=first.rank,
        )
    )


def _lost(where: str, detail: str) -> ShardedModelError:
    error = ShardedModelError(
        f"Cannot load '{where}': lost contact with the other ranks ({detail}). A rank died or stopped answering for "
        "the process group's timeout; check the other ranks' logs.",
        path=where,
    )
    return _agreed(error)


def _own(error: BaseException) -> NoReturn:
    raise _agreed(error)


def agree(error: BaseException | None, where: str, print_: Fingerprint | None = None, *, filling: bool = False) -> None:
    """A step every rank reaches: raise on every rank if any rank failed (the failing rank its own error, the
    others :class:`ShardedModelError` naming it), or if ranks saw different checkpoints (``print_``).

    Without a process group of several ranks, ``error`` is simply raised.
    """
    ranks = default_group()
    if ranks is None:
        if error is not None:
            raise error
        return
    told = partial(_told, where, filling)
    try:
        gathered = settle(ranks, error, None if print_ is None else list(print_.sent), told=told, own=_own)
        redo = _times_only(gathered)
        if redo:  # every rank sees the same list, so all of them meet in this second round or none
            assert print_ is not None
            logger.debug("%s: %d files differ in modification time alone; comparing their bytes", where, len(redo))
            mine = dict(zip(redo, _edges(print_.root, redo), strict=True))
            gathered = settle(ranks, None, mine, told=told, own=_own)
    except RanksLost as lost:
        raise _lost(where, str(lost)) from lost.__cause__
    first = gathered[0]
    differ = next((rank for rank, seen in enumerate(gathered) if seen != first), None)
    if differ is not None:
        raise _agreed(
            ShardedModelError(
                f"Ranks 0 and {differ} opened different checkpoints at '{where}' "
                f"({_differences(first, gathered[differ])}): a save landed or a file changed while they opened it, or "
                "the ranks see different copies. Nothing was loaded; pass tag= to name one step, and load when no "
                "save is running (copies on several hosts must be identical).",
                path=where,
                rank=differ,
            )
        )
    if not filling:
        _plans_passed[0] += 1


def broadcast_checked(read: Callable[[], None], buffer: torch.Tensor, where: str, name: str) -> None:
    """Rank 0 runs ``read`` (filling ``buffer``); every rank settles the step; only then is ``buffer`` broadcast.
    A read error on rank 0, or any failure another rank sends in this step, is raised on every rank."""
    import torch.distributed as dist

    ranks = default_group()  # None: a group of one process, which reads and keeps the chunk
    failure: BaseException | None = None
    line = None
    if ranks is None or ranks.rank == 0:
        try:
            read()
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
            line = str(exc) if isinstance(exc, ZeroIOError) else f"{type(exc).__name__}: {exc}"
            failure = exc
            if not isinstance(exc, ZeroIOError):
                failure = ShardedModelError(f"Rank 0 could not read '{name}' from '{where}': {line}", path=where)
                failure.__cause__ = exc
    if ranks is None:
        if failure is not None:
            raise failure
        return
    sent = {"reading": name} if failure is not None else None
    try:
        settle(ranks, failure, sent, told=partial(_told, where, True), line=line, own=_own)
    except RanksLost as lost:
        raise _lost(where, str(lost)) from lost.__cause__
    try:
        dist.broadcast(buffer, src=0)
    except RuntimeError as exc:  # every rank passed the step: a peer died or timed out in the broadcast itself
        raise _lost(where, gloo_detail(exc)) from exc


class LoadSteps:
    """``with LoadSteps(...)`` around a whole load: an error raised on this rank that the other ranks do not know
    yet (not raised by a step) is sent in the next step every other rank reaches, so they raise too instead of
    waiting; after :meth:`last`, nothing is sent (the others have left).

    ``sharded()`` says, when an error needs sending, whether this load takes part in collectives (a sharded model
    or ``broadcast_from_rank0``); ``init_hooks(where)`` runs the model's init hooks, through :meth:`init_hooks`.
    """

    def __init__(self, where: str, sharded: Callable[[], bool], init_hooks: Callable[[str], tuple[str, ...]]) -> None:
        self.where = where
        self.sharded = sharded
        self._init_hooks = init_hooks
        self._hooks_ran = False
        self._done = False
        self._plans_before = _plans_passed[0]
        self._alarm: Alarm | None = None

    def init_hooks(self, where: str) -> tuple[str, ...]:
        """Run the init hooks (once): the names of those run."""
        self._hooks_ran = True
        return self._init_hooks(where)

    def _filling_alarm(self) -> Alarm | None:
        """The alarm of this load's fill, once its plan step passed (None before, and after the last step)."""
        if self._done or _plans_passed[0] == self._plans_before:
            return None
        if self._alarm is None:
            self._alarm = Alarm(f"zeroio/load/{_plans_passed[0]}/failed")
        return self._alarm

    def check(self, where: str) -> None:
        """Between two tensors of the fill: if another rank failed (its alarm rang), meet it in its step now and
        raise its error here, rather than after reading this rank's whole share."""
        alarm = self._filling_alarm()
        if alarm is not None and alarm.rung():
            agree(None, where, filling=True)  # raises: the failing rank sends its error in this step
            raise _agreed(ShardedModelError(f"Another rank stopped loading '{where}' without saying why.", path=where))

    def last(self, where: str, in_collectives: bool) -> None:
        """The last step, after filling: no rank returns while another failed."""
        if in_collectives:
            agree(None, where, filling=True)
        self._done = True

    def __enter__(self) -> LoadSteps:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if not isinstance(error, Exception) or error.__dict__.get("zeroio_agreed") or self._done:
            return
        if not in_process_group():
            return
        if not self._hooks_ran:  # the others run them, maybe meeting in collectives; then the model may be sharded
            try:
                self.init_hooks(self.where)
            except Exception as exc:  # noqa: BLE001 - this rank's own error is the one raised
                logger.debug("init hook after a failed open: %s", exc)
        if not self.sharded():
            return
        ranks = default_group()
        assert ranks is not None
        alarm = self._filling_alarm()
        if alarm is not None:  # the others may be reading a long share before their next step
            alarm.ring()
        try:  # the next step the other ranks reach: they raise, naming this rank; settle raises this rank's error
            settle(ranks, error, told=partial(_told, self.where, False), own=_own)
        except RanksLost as lost:
            logger.debug("could not tell the other ranks of %s: %s", error, lost)
        except Exception as exc:
            if exc is not error:
                raise
