"""All-or-nothing output folders: build beside the destination, fsync, rename into place; clean up on any failure.

A temporary folder's writer holds an ``flock`` on a file inside it (:data:`~zeroio._write.own_files.LOCK_NAME`) for
the folder's whole life; another conversion removes a leftover temporary folder only when it can take that lock,
so a live conversion is never removed, even one in another PID namespace (containers sharing a filesystem).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, NoReturn

from .._messages import get_logger, listing
from ..errors import OutputError, ZeroIOError
from .overlap import refuse_overlap
from .own_files import LOCK_NAME, foreign_entries

try:
    import fcntl
except ImportError:  # Windows: no flock; the process id in the name decides alone
    fcntl = None  # type: ignore[assignment]

__all__ = ["AtomicDir", "clean_stale", "fsync_dir", "hold_lock", "temp_name", "try_lock", "write_file_atomically"]

logger = get_logger(__name__)

# `.<dst name>.zeroio-tmp-<pid>-<8 hex>` (being built) and `.<dst name>.zeroio-old-<pid>-<8 hex>` (being replaced).
_TEMP = re.compile(r"^\.(?P<target>.+)\.zeroio-(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")

_RENAME_EXCHANGE = 2  # linux/fs.h


def temp_name(dst: Path, kind: str = "tmp") -> Path:
    """A fresh sibling of ``dst`` named after this process: ``.<name>.zeroio-<kind>-<pid>-<random>``."""
    return dst.with_name(f".{dst.name}.zeroio-{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def try_lock(fd: int) -> bool | None:
    """``flock`` ``fd`` without waiting: True if taken, False if another process holds it, None if unsupported."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EINVAL, EOPNOTSUPP...: a filesystem without locks (e.g. Lustre without -o flock)
    return True


def hold_lock(path: Path) -> int:
    """Open (creating) ``path`` and ``flock`` it for this process; closing the returned descriptor releases it.

    Where the filesystem has no locks the file is still created; clean-up then falls back to the process id.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try_lock(fd)
    return fd


_BUSY = -1


def _lock_if_free(path: Path) -> int | None:
    """Take ``path``'s lock if free and return its descriptor; :data:`_BUSY` if a live writer holds it; None if
    there is no lock to ask (no such file: an older zeroio's folder; or a filesystem without locks)."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    taken = try_lock(fd)
    if taken:
        return fd
    os.close(fd)
    return None if taken is None else _BUSY


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _lock_of(entry: Path) -> Path:
    """Where a temporary output's writer holds its lock: the lock file in a folder, the file itself otherwise."""
    return entry / LOCK_NAME if entry.is_dir() and not entry.is_symlink() else entry


def _writer_gone(parent: Path, entry: Path, match: re.Match[str]) -> tuple[bool, int | None]:
    """Whether ``entry``'s writer is gone, and the lock descriptor held meanwhile (so nobody else takes it).

    The lock decides; without one (an older zeroio's folder, a filesystem without locks) the process id does.
    A ``-old-`` folder (the previous output, moved aside during an overwrite) has no lock of its own: its
    writer's lock is in the new folder, still at its temporary name or already renamed to the target.
    """
    if match["kind"] == "old":
        target = match["target"]
        locks = [parent / target / LOCK_NAME]
        locks += [p / LOCK_NAME for p in parent.glob(f".{glob.escape(target)}.zeroio-tmp-{match['pid']}-*")]
        asked = False
        for lock in locks:
            fd = _lock_if_free(lock)
            if fd == _BUSY:
                return False, None
            if fd is not None:
                os.close(fd)
                asked = True
        if asked:
            return True, None
    else:
        fd = _lock_if_free(_lock_of(entry))
        if fd == _BUSY:
            return False, None
        if fd is not None:
            return True, fd
    return not _pid_alive(int(match["pid"])), None


def clean_stale(parent: Path) -> list[Path]:
    """Remove temporary folders left in ``parent`` by zeroio processes that died (e.g. SIGKILL, power loss).

    Only names zeroio creates (``.<name>.zeroio-tmp-<pid>-<hex>``, ``...-old-...``) are candidates, and only
    when no process holds their lock (:func:`hold_lock`), whatever PID namespace it runs in; one without a lock
    (written by an older zeroio) is removed when its process id no longer exists. Returns what was removed.
    """
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP.match(entry.name)
        if match is None:
            continue
        gone, lock = _writer_gone(parent, entry, match)
        try:
            if not gone:
                continue
            if match["kind"] == "old" and not (parent / match["target"]).exists():
                # Killed between moving the old output aside and moving the new one in: put the old one back.
                try:
                    os.rename(entry, parent / match["target"])
                    logger.warning(
                        "restored %s from an interrupted overwrite (%s)", parent / match["target"], entry.name
                    )
                    continue
                except OSError:
                    pass
            logger.info("removing stale temporary output %s (its process %s is gone)", entry, match["pid"])
            _remove(entry)
            removed.append(entry)
        finally:
            if lock is not None:
                os.close(lock)
    return removed


def fsync_dir(path: Path) -> None:
    """fsync a directory so the names in it (new files, renames) survive a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync directories
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _cause(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (KeyboardInterrupt)"
    if isinstance(exc, OSError):
        where = f" ('{exc.filename}')" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    return f"{type(exc).__name__}: {exc}"


def _fix(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "Free disk space or choose another destination."
    if code == errno.EFBIG:
        return "Raise the file size limit (ulimit -f) or use a smaller max_shard_size."
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "Check the permissions of the destination's folder or choose another destination."
    if isinstance(exc, KeyboardInterrupt):
        return "Run the conversion again."
    return "Fix the cause and run the conversion again."


def _refusal(dst: Path, foreign: list[str]) -> str:
    """Why ``overwrite`` refuses ``dst``: files zeroio did not write, and/or folders that are earlier zeroio
    outputs (``out/`` holding ``out/model/`` and ``out/model-bf16/``: a folder of outputs, not one output)."""

    def is_output(entry: str) -> bool:
        try:
            return entry.endswith("/") and not foreign_entries(dst / entry.rstrip("/"))
        except OSError:
            return False

    outputs = [e for e in foreign if is_output(e)]
    others = [e for e in foreign if e not in outputs]
    if not outputs:
        return (
            f"Refusing to overwrite '{dst}': it holds files zeroio did not write ({listing(others)}), and overwrite "
            "replaces only a folder of zeroio's outputs. Move them away or choose another destination."
        )
    held = f"files zeroio did not write ({listing(others)}) and " if others else ""
    return (
        f"Refusing to overwrite '{dst}': it holds {held}earlier zeroio outputs in folders of their own "
        f"({listing(outputs)}), and overwrite replaces one output, not a folder of outputs. Give this output a "
        f"folder of its own (e.g. '{dst / 'new'}'), or move them away."
    )


class AtomicDir:
    """A destination folder that appears complete or not at all.

    ``with AtomicDir(dst) as tmp:`` yields an empty temporary folder beside ``dst``
    (``.<name>.zeroio-tmp-<pid>-<hex>``). Write files there and fsync them; on a clean exit the folder is fsynced
    and renamed to ``dst``. On any exception, KeyboardInterrupt included, the temporary folder is removed
    and :class:`~zeroio.errors.OutputError` is raised naming ``dst`` and the cause (zeroio's own errors
    about the *source* propagate unchanged). A process killed mid-way leaves only the temporary folder,
    which the next ``AtomicDir`` in the same parent folder removes (only once this process's lock on it is free).

    Args:
        dst: the folder to create.
        source: what the writer reads (path, URL or ``RemotePath``); :meth:`check` refuses a ``dst`` that is it,
            lies inside it or holds it (:func:`~zeroio._write.overlap.refuse_overlap`), whatever ``overwrite``.
        overwrite: replace an existing ``dst`` (an existing *empty* folder is replaced without it) (swapped atomically where the OS supports it; otherwise there
            is a moment between two renames when ``dst`` is absent): a file, a link, or a folder holding only
            zeroio's outputs (:func:`~zeroio._write.own_files.foreign_entries`); any other folder is refused.
    """

    def __init__(self, dst: Path, *, source: object, overwrite: bool = False) -> None:
        self.dst = Path(os.path.abspath(dst))
        self.source = source
        self.overwrite = overwrite
        self.tmp: Path | None = None
        self._lock: int | None = None

    def check(self) -> None:
        """Refuse a ``dst`` overlapping the source, clean stale temporary folders, then refuse an existing ``dst``
        unless ``overwrite``.

        Call it before any expensive work; entering the context calls it again.
        """
        refuse_overlap(self.source, self.dst)
        ancestor = self.dst.parent
        while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise OutputError(
                f"Cannot write '{self.dst}': '{ancestor}' is a file, not a folder. Choose another destination.",
                path=self.dst,
            )
        if self.dst.parent.is_dir():
            clean_stale(self.dst.parent)
        self._refuse_existing()

    def _refuse_existing(self) -> None:
        if not os.path.lexists(self.dst):
            return
        is_folder = self.dst.is_dir() and not self.dst.is_symlink()  # a link or a file: only it is replaced
        if is_folder and not self.overwrite and not os.listdir(self.dst):
            # `mkdir out && zeroio convert ckpt out`: an empty folder holds nothing to lose; it is replaced as an
            # overwrite would replace it (the folder is checked again just before the swap).
            self.overwrite = True
            return
        if not self.overwrite:
            kind = "folder" if self.dst.is_dir() else "file"
            raise OutputError(
                f"Output {kind} '{self.dst}' already exists. Pass overwrite=True (--overwrite) to replace it, "
                "or choose another destination.",
                path=self.dst,
            )
        if is_folder:
            try:
                foreign = foreign_entries(self.dst)
            except OSError as exc:
                raise self.error(exc) from exc
            if foreign:
                raise OutputError(_refusal(self.dst, foreign), path=self.dst)

    def create(self) -> Path:
        """Check again, then create the empty temporary folder beside ``dst`` (what entering the context does).

        The write engine calls it on one process and :meth:`adopt` on the others, then :meth:`commit` or
        :meth:`discard` once every process has reported, as a ``with`` block does on one process.
        """
        self.check()
        tmp = temp_name(self.dst)
        try:
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            self._lock = hold_lock(tmp / LOCK_NAME)  # held until the folder is committed or removed
        except OSError as exc:
            if tmp.is_dir():  # created, but its lock file could not be
                _remove(tmp)
            # Name the folder we could not write in, not the random temporary name.
            where = OSError(exc.errno, exc.strerror, str(self.dst.parent))
            raise self.error(where) from exc
        except BaseException as exc:  # KeyboardInterrupt right after mkdir: __exit__ will not run
            _remove(tmp)
            self.release()
            self.tmp = tmp
            raise self.error(exc) from exc
        self.tmp = tmp
        return tmp

    def adopt(self, tmp: Path) -> None:
        """Take ``tmp``, the temporary folder another process created for the same ``dst``, as this one's: a
        failure here then says the partial output was removed (the creating process removes or commits it)."""
        self.tmp = tmp

    def commit(self) -> None:
        """fsync the temporary folder and rename it to ``dst`` (a clean exit of the context); on failure remove
        it and raise :class:`~zeroio.errors.OutputError`."""
        self._finish(None)

    def discard(self, exc: BaseException) -> NoReturn:
        """Remove the temporary folder and raise for ``exc`` (an exit of the context by ``exc``): OutputError
        naming ``dst``, or ``exc`` itself when it is a zeroio error about the source (or nothing was created)."""
        self._finish(exc)
        raise exc

    def __enter__(self) -> Path:
        return self.create()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._finish(exc)

    def _finish(self, exc: BaseException | None) -> None:
        if self.tmp is None:  # create() failed
            return
        try:
            if exc is None:
                try:
                    self._commit(self.tmp)
                    return
                except BaseException as failure:  # noqa: BLE001 - KeyboardInterrupt during commit too
                    exc = failure
            _remove(self.tmp)
        finally:
            self.release()
        from ..errors import ZeroIOError

        if isinstance(exc, ZeroIOError):
            # OutputError already names dst; any other ZeroIOError is about the source and says what to do.
            raise exc
        raise self.error(exc) from exc

    def release(self) -> None:
        """Release this process's lock on the temporary folder (after committing or removing it)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def error(self, exc: BaseException) -> OutputError:
        """The OutputError naming ``dst`` for a failure ``exc`` (says whether the partial output was removed)."""
        partial = " Removed the partial output." if self.tmp is not None else ""
        return OutputError(f"Cannot write '{self.dst}': {_cause(exc)}.{partial} {_fix(exc)}", path=self.dst)

    def _commit(self, tmp: Path) -> None:
        fsync_dir(tmp)
        if os.path.lexists(self.dst):
            self._refuse_existing()  # someone created it (or put files in it) meanwhile
            if _exchange(tmp, self.dst):
                # tmp now holds the old output.
                _remove(tmp)
            else:
                old = temp_name(self.dst, "old")
                os.rename(self.dst, old)
                try:
                    os.rename(tmp, self.dst)
                except BaseException:
                    os.rename(old, self.dst)
                    raise
                _remove(old)
        else:
            # rename(2) onto a missing name; if another process created dst meanwhile, rename of a folder onto
            # a non-empty folder fails rather than merging.
            os.rename(tmp, self.dst)
        # The lock travelled with the folder (so a clean-up never takes the folder being renamed); drop its file.
        try:
            os.unlink(self.dst / LOCK_NAME)
        except FileNotFoundError:
            pass
        fsync_dir(self.dst)
        fsync_dir(self.dst.parent)


def write_file_atomically(dst: Path, write: Callable[[BinaryIO], None]) -> None:
    """:class:`AtomicDir` for one file: ``write`` fills a temporary file beside ``dst``, locked while written (so no
    clean-up takes it), which is then fsynced and renamed over ``dst``; on failure it is removed."""
    tmp = temp_name(dst)
    try:
        with open(tmp, "wb") as fh:
            try_lock(fh.fileno())
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
            os.replace(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException as exc:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        if isinstance(exc, ZeroIOError):
            raise
        cause = f"{exc.strerror or exc}" if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        raise OutputError(
            f"Cannot write '{dst}': {cause}. Removed the partial output. Fix the cause and run the conversion again.",
            path=dst,
        ) from exc
