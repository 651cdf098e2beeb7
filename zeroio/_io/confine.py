"""Paths built from checkpoint content: kept inside the checkpoint, and only regular files are read.

A checkpoint names some of its own files: a universal checkpoint's parameter names become ``zero/<name>/`` folders,
an NVMe optimizer state's keys become swap file names, an index's ``weight_map`` names its shards. Whoever wrote
the checkpoint chose those strings, and the links in its folders: without these checks ``../../victim/x`` or a
link to ``~/.ssh/id_rsa`` would make zeroio read (and ``convert``/``push`` publish) a file outside it.
"""

from __future__ import annotations

import stat
from pathlib import Path

from ..errors import CheckpointFormatError

__all__ = ["confined_path", "hub_cache_blobs", "require_regular_file"]

_HUB_REPO_FOLDERS = ("models--", "datasets--", "spaces--")
"""How huggingface_hub names a repository's folder in its cache (``repo_folder_name``)."""

_FIX = "The checkpoint is corrupted or hostile; zeroio reads only files inside the checkpoint folder."


def require_regular_file(path: Path) -> None:
    """Refuse a path that is not a regular file (a FIFO would block the read forever, ``/dev/zero`` never ends)."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise CheckpointFormatError(
            f"'{path}' is not a regular file (it is a {_file_kind(mode)}). Point zeroio at a checkpoint file or folder.",
            path=path,
        )


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
    if _is_remote(path):
        return path
    real = path.resolve()
    if not real.is_relative_to(root.resolve()) and not (links_into and real.is_relative_to(links_into.resolve())):
        raise CheckpointFormatError(
            f"'{path}' (the {what} {_short(names[-1])} of '{source}') is a link leading outside '{root}'. {_FIX}",
            path=source,
            name=str(names[-1]),
        )
    return path
