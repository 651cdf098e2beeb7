"""Paths built from checkpoint content: kept inside the checkpoint, and only regular files are read.

A checkpoint names some of its own files: a universal checkpoint's parameter names become ``zero/<name>/`` folders,
an NVMe optimizer state's keys become swap file names, an index's ``weight_map`` names its shards. Whoever wrote
the checkpoint chose those strings, and the links in its folders: without these checks ``../../victim/x`` or a
link to ``~/.ssh/id_rsa`` would make zeroio read (and ``convert``/``push`` publish) a file outside it. A file
checked at open keeps its identity (:func:`open_regular`): one swapped afterwards for a link or a FIFO is refused.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import CheckpointFormatError

__all__ = ["FileIdentity", "confined_path", "file_identity", "hub_cache_blobs", "open_regular", "require_regular_file"]

_HUB_REPO_FOLDERS = ("models--", "datasets--", "spaces--")
"""How huggingface_hub names a repository's folder in its cache (``repo_folder_name``)."""

_FIX = "The checkpoint is corrupted or hostile; zeroio reads only files inside the checkpoint folder."


_BAD_NAME = (errno.ENAMETOOLONG, errno.ELOOP)
"""Errors of ``stat`` that only a name or a link can cause: a checkpoint's fault, not the machine's."""


def require_regular_file(path: Path, *, source: Path | None = None) -> None:
    """Refuse a path that is not a regular file (a FIFO would block the read forever, ``/dev/zero`` never ends), or
    whose name the file system refuses (too long, a loop of links). ``source`` is the file that named ``path``
    (a refusal names it as ``.path``). A missing file raises FileNotFoundError, for the caller to word."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno not in _BAD_NAME:
            raise
        named = f", named by '{source}'," if source is not None else ""
        raise CheckpointFormatError(
            f"{_short(str(path))}{named} cannot be opened: {exc.strerror}. The checkpoint is corrupted or hostile; "
            "copy it again from where it was saved.",
            path=source or path,
            name=path.name,
        ) from None
    if not stat.S_ISREG(mode):
        raise CheckpointFormatError(
            f"'{path}' is not a regular file (it is a {_file_kind(mode)}). Point zeroio at a checkpoint file or folder.",
            path=path,
        )


# --------------------------------------------------------------------------- the file a checked path opened

FileIdentity = tuple[int, int, int, int]
"""``(st_dev, st_ino, st_size, st_mtime_ns)`` of a file when it was first opened."""


def file_identity(st: os.stat_result) -> FileIdentity:
    """What a file must still be when read: its ``stat`` at open (links followed), compared at every open."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_regular(path: Path, identity: FileIdentity | None = None, flags: int = 0) -> tuple[int, FileIdentity]:
    """A read-only descriptor of ``path`` and the identity of the file it opened, refused unless that file is
    regular and, when ``identity`` is given, the very file recorded then (a file swapped since, for a link to
    elsewhere or a FIFO, is refused). ``O_NONBLOCK``: opening a FIFO swapped in never blocks (no effect on files).
    ``flags``: more open flags (``O_DIRECT`` for :meth:`~zeroio._io.sources.LocalFile.read_congruent`).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | flags)
    st = os.fstat(fd)
    found = file_identity(st)
    if identity is not None and found != identity:
        os.close(fd)
        raise CheckpointFormatError(_changed(path, identity, found), path=path)
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device: positional reads fail (ESPIPE) or never end
        os.close(fd)
        raise CheckpointFormatError(
            f"'{path}' is not a regular file (it was replaced by a FIFO, device or folder). Point zeroio at a "
            "checkpoint of regular files.",
            path=path,
        )
    return fd, found


_IDENTITY_PARTS = ("device", "inode", "size", "modification time")


def _changed(path: Path, before: FileIdentity, now: FileIdentity) -> str:
    """The refusal of a file that is not the one checked, naming what differs. Only a new device or inode number is
    also what a FUSE file system that numbers inodes anew shows for an unchanged file: it is refused all the same (a
    link swapped in for a file whose size and time were set to match looks alike), and the message says how to
    avoid the reopen."""
    parts = [name for name, a, b in zip(_IDENTITY_PARTS, before, now, strict=True) if a != b]
    what = f"{', '.join(parts[:-1])} and {parts[-1]} differ" if len(parts) > 1 else f"{parts[0]} differs"
    message = (
        f"'{path}' changed while zeroio was reading it ({what} from when it was opened). Let the writer finish, "
        "then run zeroio again."
    )
    if before[2:] == now[2:]:
        message += (
            " Its size and modification time are the same: on a FUSE file system that numbers inodes anew "
            "(libfuse without -o use_ino or -o noforget), mount it with one of those, or raise `ulimit -n` so "
            "zeroio need not reopen files (it keeps up to min(4096, the limit / 4) open)."
        )
    return message


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):  # fmt: skip
        if test(mode):
            return kind
    return "special file"


def _short(name: str) -> str:
    """``repr`` of a recorded name, cut to 200 characters (a hostile name may be megabytes long)."""
    text = repr(str(name))
    return text if len(text) <= 200 else text[:180] + f"... ({len(str(name))} characters)"


def _is_remote(path: Path) -> bool:
    return hasattr(path, "byte_source")  # a RemotePath (remote_path.py): object stores have no links


def hub_cache_blobs(folder: Path) -> Path | None:
    """The ``blobs/`` folder a Hugging Face cache's files link into, when ``folder`` lies in one of its snapshots
    (``models--org--name/snapshots/<rev>/``, or a subfolder of it; ``datasets--``/``spaces--`` alike), else None:
    the one place a checkpoint's links may lead outside its folder (a snapshot's files link to
    ``../../blobs/<sha>``)."""
    if _is_remote(folder):
        return None
    snapshots = next((p for p in Path(folder).parents if p.name == "snapshots"), None)
    if snapshots is None or not snapshots.parent.name.startswith(_HUB_REPO_FOLDERS):
        return None
    return snapshots.parent / "blobs"


def _name_max(folder: Path) -> int:
    """The longest file name (in bytes) the file system of ``folder`` takes (255 on Linux's usual ones)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows), or the folder is gone: the usual value
        return 255


def _refuse_linked_blobs(blobs: Path, source: Path) -> None:
    """A Hub cache's ``blobs/`` must be a folder of its repository folder, not a link leading elsewhere: links into
    it are followed, so a ``blobs`` that is itself a link to ``~/.ssh`` would let a snapshot read anything."""
    repo = blobs.parent
    if not blobs.resolve().is_relative_to(repo.resolve()):
        raise CheckpointFormatError(
            f"'{blobs}' (the Hugging Face cache folder the files of '{source.parent}' link into) is a link leading "
            f"outside '{repo}'. The cache is corrupted or hostile; download the model again (hf download) "
            "into a cache whose blobs folder is a real folder.",
            path=source,
            name=blobs.name,
        )


def confined_path(root: Path, *names: str, source: Path, what: str, links_into: Path | None = None) -> Path:
    """``root / names[0] / names[1] ...``, refused unless it stays inside ``root``.

    Each name is split at ``/`` and ``\\``; every component must be a plain, non-empty file name (no ``..``, no
    ``.``, no NUL), so an absolute name (an empty first component) is refused too. That alone confines a URL
    root. A local path must also stay inside ``root`` once its links are followed (or into ``links_into``:
    a Hugging Face cache snapshot's files link to ``../../blobs/``).

    Args:
        root: the folder the names are relative to (itself may be a link).
        names: the strings taken from the checkpoint, in path order.
        source: the file that recorded the names, for the message.
        what: what the names are ("parameter", "optimizer state key"), for the message.

    Raises:
        CheckpointFormatError: a name leaves ``root`` or a link leads out of it (``.path`` is ``source``,
            ``.name`` the offending name).
    """
    path = root
    longest = 0
    for name in names:
        parts = str(name).replace("\\", "/").split("/")
        if any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise CheckpointFormatError(
                f"'{source}' names a {what} {_short(name)}, which is not a plain file name inside '{root}'. {_FIX}",
                path=source,
                name=str(name),
            )
        for part in parts:
            path = path / part
            longest = max(longest, len(os.fsencode(part)))
    if _is_remote(path):
        return path
    if longest > _name_max(root):  # the file system would refuse it (ENAMETOOLONG): say so, naming the recorder
        raise CheckpointFormatError(
            f"'{source}' names a {what} {_short(names[-1])} with a component of {longest} bytes, longer than the "
            f"file system allows ({_name_max(root)}). The checkpoint is corrupted or hostile; copy it again from "
            "where it was saved.",
            path=source,
            name=str(names[-1]),
        )
    try:
        real = path.resolve()
    except (RuntimeError, OSError) as exc:  # a loop of links (RuntimeError before Python 3.13, OSError after)
        raise CheckpointFormatError(
            f"'{path}' (the {what} {_short(names[-1])} of '{source}') is a loop of links. {_FIX}",
            path=source,
            name=str(names[-1]),
        ) from exc
    if not real.is_relative_to(root.resolve()) and not (links_into and real.is_relative_to(links_into.resolve())):
        raise CheckpointFormatError(
            f"'{path}' (the {what} {_short(names[-1])} of '{source}') is a link leading outside '{root}'. {_FIX}",
            path=source,
            name=str(names[-1]),
        )
    if links_into and not real.is_relative_to(root.resolve()):
        _refuse_linked_blobs(links_into, source)
    return path
