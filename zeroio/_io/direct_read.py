"""Reading a local file's bytes that are not in the page cache with ``O_DIRECT``, into page-aligned buffers.

A buffered read of a cold file moves through the kernel's read-ahead window (``read_ahead_kb``, 128 KiB by
default), so even 16 reader threads keep only a few MiB in flight; an ``O_DIRECT`` read sends its whole request to
the device at once. On the H100 host fastsafetensors, which reads with ``O_DIRECT``, loaded the 2.63 GB bf16
checkpoint in 1.10 s, faster than 16 threads of buffered reads could read it (1.25-1.31 s). But ``O_DIRECT`` reads
bytes already cached from the disk again (fastsafetensors' warm load: 1.42 s against zeroio's 0.52 s), so a read
first takes what the page cache holds without waiting (``RWF_NOWAIT``) and goes to the disk directly only when the
cache has none of it. Only on local block-device file systems: network file systems read ahead better than a
client's direct reads.
"""

from __future__ import annotations

import errno
import os
from functools import lru_cache
from pathlib import Path

__all__ = [
    "ALIGN",
    "DIRECT_READS",
    "aligned_parts",
    "aligned_read",
    "cached_read",
    "direct_reads_enabled",
    "on_local_file_system",
    "supports_direct",
]

ALIGN = 4096
"""Offset, length and memory alignment of ``O_DIRECT`` reads (a page: every block device's logical block divides it)."""

DIRECT_READS = False
"""Whether a load to CUDA reads what the page cache lacks with ``O_DIRECT`` (``ZEROIO_DIRECT_READS``: 1 or 0).
Off: on the H100 host (read-ahead 8 MiB) buffered reads were faster, cold 1.18 s against 1.37 s and warm 0.37 s
against 0.47 s for a 2.6 GB bf16 checkpoint (docs/benchmarks.md, "Direct reads")."""

LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs"})
"""File systems on a local block device, where ``O_DIRECT`` reads go straight to it."""


PAGE_CACHE_FILE_SYSTEMS = LOCAL_FILE_SYSTEMS | {"tmpfs"}
"""File systems whose bytes a read brings into this machine's page cache, with no server to copy them for us:
``copy_file_range`` after a read there copies them once more in the kernel (``zeroio._io.integrity``)."""


def _mount_types() -> list[tuple[str, str]]:
    """``(mount point, file system type)`` of every mount, longest mount point first."""
    mounts = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                dash = fields.index("-")
                mounts.append((fields[4].replace("\\040", " "), fields[dash + 1]))
    except (OSError, ValueError, IndexError):
        return []
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


@lru_cache(maxsize=64)
def _fs_type(folder: str) -> str:
    for point, kind in _mount_types():
        if folder == point or folder.startswith(point.rstrip("/") + "/"):
            return kind
    return ""


def direct_reads_enabled() -> bool:
    """:data:`DIRECT_READS`, or ``ZEROIO_DIRECT_READS`` (``1``: on, ``0``: buffered reads only)."""
    value = os.environ.get("ZEROIO_DIRECT_READS", "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"ZEROIO_DIRECT_READS={value!r} is not 0 or 1: set 1 to read what the page cache lacks with O_DIRECT, "
            "0 for buffered reads only, or leave it unset."
        )
    return DIRECT_READS if not value else value == "1"


def supports_direct(path: Path) -> bool:
    """Whether ``path`` lies on a local block-device file system (and the platform has ``O_DIRECT``)."""
    if not hasattr(os, "O_DIRECT") or not hasattr(os, "RWF_NOWAIT"):
        return False
    return _fs_type(os.path.realpath(path.parent)) in LOCAL_FILE_SYSTEMS


def on_local_file_system(path: Path) -> bool:
    """Whether ``path`` lies on a local file system (:data:`PAGE_CACHE_FILE_SYSTEMS`; unknown types are not)."""
    return _fs_type(os.path.realpath(path.parent)) in PAGE_CACHE_FILE_SYSTEMS


def cached_read(fd: int, offset: int, view: memoryview) -> int:
    """Fill ``view`` from ``offset`` with what the page cache holds, without waiting for the disk: the bytes read
    (fewer than asked from the first byte not cached on), or -1 where the kernel cannot tell (no ``RWF_NOWAIT``)."""
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done, os.RWF_NOWAIT)
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return -1
            raise
        if got <= 0:
            break
        done += got
    return done


def aligned_parts(offset: int, nbytes: int, block: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` parts of the byte range, cut at multiples of ``block`` (a multiple of :data:`ALIGN`) from
    the range's first aligned block: every cut is page-aligned, so the aligned blocks of two parts never overlap."""
    start = offset - offset % ALIGN
    parts, at = [], offset
    while at < offset + nbytes:
        cut = min(offset + nbytes, start + (at - start) // block * block + block)
        parts.append((at, cut - at))
        at = cut
    return parts


def aligned_read(fd: int, offset: int, nbytes: int, window: memoryview, at: int) -> bool:
    """Fill ``window[at : at + nbytes]`` with the bytes at ``offset`` through the ``O_DIRECT`` descriptor ``fd``,
    reading the aligned blocks around them into the window around ``at`` (whose address must be congruent to
    ``offset`` modulo :data:`ALIGN`). False when it could not be done that way (no room, the file system refused,
    the file ends early): read them buffered then."""
    start = offset - offset % ALIGN
    lo = at - (offset - start)
    end = -(-(offset + nbytes) // ALIGN) * ALIGN
    if lo < 0 or lo + end - start > len(window):
        return False
    view = window[lo : lo + end - start]
    wanted = offset + nbytes - start
    done = 0
    while done < wanted:
        try:
            got = os.preadv(fd, [view[done:]], start + done)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        if got <= 0 or (done + got < wanted and (done + got) % ALIGN):
            return False  # the end of the file, or a short read off the block grid
        done += got
    return True
