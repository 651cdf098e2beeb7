"""The bytes of a rank file around its tensor data, kept from the first file of a kind and written for the later ones.

A reshard writes each rank file as ``torch.save`` does under ``skip_data`` (every storage record reserved, its bytes
left out), then fills the records (``write.RankFileBuilder``). The rank files of one kind differ only in those bytes
(``pickle_template.py``: the same pickle, the same storages in the same order), so ``torch.save`` wrote the same
archive for each: the same records, names, sizes, alignment padding, ``data.pkl`` and central directory, and the same
``.data/serialization_id`` (torch combines the records' names and CRC-32s, and under ``skip_data`` the CRCs are not
those of the bytes filled later). Calling it for each of 2,048 files at 1,024 ranks cost a ``persistent_id`` call and
a record write per storage (2 million): half a reshard's CPU. An :class:`ArchiveLayout` is the first file's bytes
outside the records it fills, with where those records lie; writing it gives the archive ``torch.save`` would have
written for a later tree, byte for byte (tests/test_reshard.py compares every file with one ``torch.save`` wrote).
"""

from __future__ import annotations

import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .._io.fileio import pwrite_all
from ..errors import OutputError

__all__ = ["ArchiveLayout", "StoredRecord"]

_LOCAL_HEADER = 30
"""Bytes of a zip local file header before its name and extra field."""
_SEGMENT = 1 << 24
"""Largest run of a kept segment read at once while recording a layout."""


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """One record the builder fills: where its bytes go and where the zip format keeps its CRC-32."""

    name: str
    header_offset: int
    begin: int
    """Where its data starts (after the local header, its name and its extra field: torch's alignment padding)."""
    size: int
    descriptor: int | None
    """Where the CRC-32 of its data descriptor lies (torch writes one after the data), or None: in the header."""
    central: int
    """Where its central directory entry starts."""


@dataclass(frozen=True, slots=True)
class ArchiveLayout:
    """A written archive's bytes but its filled records' data, and those records by name."""

    size: int
    segments: tuple[tuple[int, bytes], ...]
    """``(offset, bytes)`` of everything outside the filled records' data, in file order."""
    records: dict[str, StoredRecord]
    """By storage key (``<root>/data/<key>``)."""

    @classmethod
    def read(cls, path: Path, keys: set[str]) -> ArchiveLayout:
        """The layout of the archive at ``path`` (just written by ``torch.save``), ``keys`` naming the storages
        whose data is left out (the rest is read: no data byte of a rank file is read back)."""
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            start_dir = archive.start_dir
        root = next(info.filename[: -len("data.pkl")] for info in infos if info.filename.endswith("data.pkl"))
        by_key = {info.filename[len(root) + 5 :]: info for info in infos if info.filename.startswith(f"{root}data/")}
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            central = _central_directory(fd, start_dir, size)
            records = {}
            for key in keys:
                info = by_key[key]
                header = os.pread(fd, _LOCAL_HEADER, info.header_offset)
                name_len, extra_len = struct.unpack_from("<HH", header, 26)
                begin = info.header_offset + _LOCAL_HEADER + name_len + extra_len
                end = begin + info.file_size
                descriptor = None
                if info.flag_bits & 0x08:  # data descriptor after the data (torch's writer uses one)
                    descriptor = end + 4 if os.pread(fd, 4, end) == b"PK\x07\x08" else end
                records[key] = StoredRecord(
                    info.filename, info.header_offset, begin, info.file_size, descriptor, central[info.filename]
                )
            segments, at = [], 0
            for record in sorted(records.values(), key=lambda r: r.begin):
                segments.extend(_read(fd, path, at, record.begin))
                at = record.begin + record.size
            segments.extend(_read(fd, path, at, size))
        finally:
            os.close(fd)
        return cls(size, tuple(segments), records)

    def write(self, path: Path) -> None:
        """Create ``path`` holding this layout: the filled records' data left as a hole, for the builder to fill."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.ftruncate(fd, self.size)
            for offset, data in self.segments:
                pwrite_all(fd, data, offset)
        finally:
            os.close(fd)


def _read(fd: int, path: Path, start: int, stop: int) -> list[tuple[int, bytes]]:
    """Bytes ``[start, stop)`` of the file, in runs of at most :data:`_SEGMENT`."""
    out = []
    for at in range(start, stop, _SEGMENT):
        data = os.pread(fd, min(_SEGMENT, stop - at), at)
        if len(data) != min(_SEGMENT, stop - at):
            raise OutputError(
                f"'{path}' shrank while being written (read {len(data)} bytes at {at}): another process changed the "
                "output folder. Write to a folder nothing else writes to.",
                path=path,
            )
        out.append((at, data))
    return out


def _central_directory(fd: int, start: int, size: int) -> dict[str, int]:
    """``{record name: offset of its central directory header}``."""
    data = os.pread(fd, size - start, start)
    offsets: dict[str, int] = {}
    pos = 0
    while pos + 46 <= len(data) and struct.unpack_from("<I", data, pos)[0] == 0x02014B50:
        n, m, k = struct.unpack_from("<HHH", data, pos + 28)
        offsets[data[pos + 46 : pos + 46 + n].decode("utf-8")] = start + pos
        pos += 46 + n + m + k
    return offsets
