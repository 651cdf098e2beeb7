"""All-or-nothing output folders: build beside the destination, fsync, rename into place; clean up on any failure."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from types import TracebackType

from .errors import OutputError

__all__ = ["AtomicDir", "clean_stale", "fsync_dir", "temp_name"]

logger = logging.getLogger(__name__)

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


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def clean_stale(parent: Path) -> list[Path]:
    """Remove temporary folders left in ``parent`` by zeroio processes that died (e.g. SIGKILL, power loss).

    Only names zeroio creates (``.<name>.zeroio-tmp-<pid>-<hex>``, ``...-old-...``) whose process no longer
    exists are removed. Returns what was removed.
    """
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP.match(entry.name)
        if match is None or _pid_alive(int(match["pid"])):
            continue
        if match["kind"] == "old" and not (parent / match["target"]).exists():
            # Killed between moving the old output aside and moving the new one in: put the old one back.
            try:
                os.rename(entry, parent / match["target"])
                logger.warning("restored %s from an interrupted overwrite (%s)", parent / match["target"], entry.name)
                continue
            except OSError:
                pass
        logger.info("removing stale temporary output %s (process %s is gone)", entry, match["pid"])
        _remove(entry)
        removed.append(entry)
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


class AtomicDir:
    """A destination folder that appears complete or not at all.

    ``with AtomicDir(dst) as tmp:`` yields an empty temporary folder beside ``dst``
    (``.<name>.zeroio-tmp-<pid>-<hex>``). Write files there and fsync them; on a clean exit the folder is fsynced
    and renamed to ``dst``. On any exception, KeyboardInterrupt included, the temporary folder is removed
    and :class:`~zeroio.errors.OutputError` is raised naming ``dst`` and the cause (zeroio's own errors
    about the *source* propagate unchanged). A process killed mid-way leaves only the temporary folder,
    which the next ``AtomicDir`` in the same parent folder removes.

    Args:
        dst: the folder to create.
        overwrite: replace an existing ``dst`` (swapped atomically where the OS supports it; otherwise there
            is a moment between two renames when ``dst`` is absent).
    """

    def __init__(self, dst: Path, *, overwrite: bool = False) -> None:
        self.dst = Path(os.path.abspath(dst))
        self.overwrite = overwrite
        self.tmp: Path | None = None

    def check(self) -> None:
        """Clean stale temporary folders, then refuse an existing ``dst`` unless ``overwrite``.

        Call it before any expensive work; entering the context calls it again.
        """
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
        if os.path.lexists(self.dst) and not self.overwrite:
            kind = "folder" if self.dst.is_dir() else "file"
            raise OutputError(
                f"Output {kind} '{self.dst}' already exists. Pass overwrite=True (--overwrite) to replace it, "
                "or choose another destination.",
                path=self.dst,
            )

    def __enter__(self) -> Path:
        self.check()
        tmp = temp_name(self.dst)
        try:
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as exc:
            # Name the folder we could not write in, not the random temporary name.
            where = OSError(exc.errno, exc.strerror, str(self.dst.parent))
            raise self.error(where) from exc
        except BaseException as exc:  # KeyboardInterrupt right after mkdir: __exit__ will not run
            _remove(tmp)
            self.tmp = tmp
            raise self.error(exc) from exc
        self.tmp = tmp
        return tmp

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.tmp is None:  # __enter__ failed
            return
        if exc is None:
            try:
                self._commit(self.tmp)
                return
            except BaseException as failure:  # noqa: BLE001 - KeyboardInterrupt during commit too
                exc = failure
        _remove(self.tmp)
        from .errors import ZeroIOError

        if isinstance(exc, ZeroIOError):
            # OutputError already names dst; any other ZeroIOError is about the source and says what to do.
            raise exc
        raise self.error(exc) from exc

    def error(self, exc: BaseException) -> OutputError:
        """The OutputError naming ``dst`` for a failure ``exc`` (says whether the partial output was removed)."""
        partial = " Removed the partial output." if self.tmp is not None else ""
        return OutputError(f"Cannot write '{self.dst}': {_cause(exc)}.{partial} {_fix(exc)}", path=self.dst)

    def _commit(self, tmp: Path) -> None:
        fsync_dir(tmp)
        if os.path.lexists(self.dst):
            self._refuse_existing()  # someone created it meanwhile
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
        fsync_dir(self.dst.parent)
