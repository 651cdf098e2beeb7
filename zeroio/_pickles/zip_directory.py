"""A torch zip archive's central directory, parsed in one pass without :mod:`zipfile`'s per-entry objects.

A ZeRO-3 model-states file holds one record per parameter (its empty placeholder), so a 1,024-rank checkpoint of
2,000 tensors has 2 million records: :class:`zipfile.ZipFile` spent ~10 ms building each file's ``ZipInfo``
objects, this reader ~2 ms. It reads what ``torch.save`` writes (one disk, no comment, no prefix, zip64 records
where sizes need them) and returns None for anything else, which :func:`~.archive.read_archive` then reads with
:mod:`zipfile` as before: every file still gets zipfile's full treatment unless it is plainly torch's layout.
"""

from __future__ import annotations

import struct
import zlib
from typing import IO, Any, NamedTuple

__all__ = ["Directory", "ZipRecord", "read_directory", "read_stored"]

_EOCD = struct.Struct("<IHHHHIIH")
_EOCD_SIG = 0x06054B50
_LOCATOR = struct.Struct("<IIQI")
_LOCATOR_SIG = 0x07064B50
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_EOCD64_SIG = 0x06064B50
_ENTRY = struct.Struct("<IHHHHHHIIIHHHHHII")
_ENTRY_SIG = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_FULL32, _FULL16 = 0xFFFFFFFF, 0xFFFF
_STORED = 0
_MAX_DIRECTORY = 1 << 30
"""Largest central directory read (1 GiB: 10 million records)."""


class ZipRecord(NamedTuple):
    """One central-directory entry: the fields of :class:`zipfile.ZipInfo` that zeroio reads, by the same names
    (a named tuple: made in a quarter of a dataclass's time, 2,000 of them a model-states file)."""

    filename: str
    header_offset: int
    compress_type: int
    compress_size: int
    file_size: int
    CRC: int
    flag_bits: int


def _zip64(extra: bytes, size: int, csize: int, offset: int) -> tuple[int, int, int] | None:
    """The zip64 extra field's values for the fields saturated at 0xFFFFFFFF (in the order the format puts them)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4)) if length % 8 == 0 else None
            if values is None:
                return None
            if size == _FULL32:
                if not values:
                    return None
                size = values.pop(0)
            if csize == _FULL32:
                if not values:
                    return None
                csize = values.pop(0)
            if offset == _FULL32:
                if not values:
                    return None
                offset = values.pop(0)
            return size, csize, offset
        pos += 4 + length
    return None


class Directory(NamedTuple):
    """What :func:`read_directory` found."""

    records: list[ZipRecord]
    """Every record but the empty storage records."""
    empty_keys: frozenset[str]
    """Keys of the empty storage records (``<root>/data/<key>``, no bytes: a model-states file's placeholders)."""
    start: int
    """Where the central directory starts."""


def read_directory(fh: IO[bytes], size: int) -> Directory | None:
    """The archive's central directory, or None where the file is not in ``torch.save``'s plain layout (a comment,
    several disks, data before the archive, ``data.pkl`` not first, a name listed twice, inconsistent counts)."""
    if size < _EOCD.size:
        return None
    fh.seek(size - _EOCD.size)
    tail = fh.read(_EOCD.size)
    sig, disk, cd_disk, n_disk, count, cd_size, cd_offset, comment = _EOCD.unpack(tail)
    end = size - _EOCD.size
    if sig != _EOCD_SIG or comment or disk or cd_disk:
        return None
    locator = b""
    if end >= _LOCATOR.size:  # torch writes zip64 end records whether or not sizes need them
        fh.seek(end - _LOCATOR.size)
        locator = fh.read(_LOCATOR.size)
    if len(locator) == _LOCATOR.size and _LOCATOR.unpack(locator)[0] == _LOCATOR_SIG:
        _, _, eocd64, disks = _LOCATOR.unpack(locator)
        if disks != 1 or eocd64 + _EOCD64.size > end - _LOCATOR.size:
            return None
        fh.seek(eocd64)
        record = _EOCD64.unpack(fh.read(_EOCD64.size))
        if record[0] != _EOCD64_SIG or record[4] or record[5]:
            return None
        n_disk, count, cd_size, cd_offset = record[6], record[7], record[8], record[9]
        end = eocd64
    elif _FULL16 in (count, n_disk) or _FULL32 in (cd_size, cd_offset):
        return None
    if n_disk != count or cd_size > _MAX_DIRECTORY or cd_offset + cd_size != end:
        return None  # not one disk, or bytes between directory and end record, or a prefix before the archive
    fh.seek(cd_offset)
    data = fh.read(cd_size)
    if len(data) != cd_size or count == 0:
        return None
    return _entries(data, count, cd_offset)


_VECTORIZE = 512
"""Directories of this many entries or more are parsed with numpy (:func:`_entries_at_once`)."""


def _entries(data: bytes, count: int, cd_offset: int) -> Directory | None:
    """Parse the ``count`` entries of ``data``: at once with numpy when they are many and the layout allows it,
    else one by one."""
    if count >= _VECTORIZE:
        found = _entries_at_once(data, count, cd_offset)
        if found is not None:
            return found
    return _entries_one_by_one(data, count, cd_offset)


def _record(data: bytes, pos: int, cd_offset: int) -> tuple[ZipRecord, int] | None:
    """The entry at ``pos`` and where the next one starts; None for one outside torch's layout."""
    if pos + _ENTRY.size > len(data):
        return None
    f = _ENTRY.unpack_from(data, pos)
    if f[0] != _ENTRY_SIG or f[13] or f[16] >= cd_offset:  # signature, disk number start, local header offset
        return None
    name_end = pos + _ENTRY.size + f[10]
    extra_end = name_end + f[11]
    next_pos = extra_end + f[12]
    if next_pos > len(data):
        return None
    try:
        name = data[pos + _ENTRY.size : name_end].decode("utf-8" if f[3] & 0x800 else "cp437")
    except UnicodeDecodeError:
        return None
    file_size, csize, offset = f[9], f[8], f[16]
    if _FULL32 in (file_size, csize, offset):
        found = _zip64(data[name_end:extra_end], file_size, csize, offset)
        if found is None or found[2] >= cd_offset:
            return None
        file_size, csize, offset = found
    return ZipRecord(name, offset, f[4], csize, file_size, f[7], f[3]), next_pos


def _entries_one_by_one(data: bytes, count: int, cd_offset: int) -> Directory | None:
    records: list[ZipRecord] = []
    pos = 0
    for _ in range(count):
        found = _record(data, pos, cd_offset)
        if found is None:
            return None
        records.append(found[0])
        pos = found[1]
    if pos != len(data) or not records or not records[0].filename.endswith("data.pkl"):
        return None
    prefix = records[0].filename[: -len("data.pkl")] + "data/"
    empty = [r for r in records if r.file_size == 0 and r.compress_size == 0 and r.compress_type == _STORED]
    empty = [r for r in empty if r.filename.startswith(prefix)]
    keys = frozenset(r.filename[len(prefix) :] for r in empty)
    empty_ids = {id(r) for r in empty}
    kept = [r for r in records if id(r) not in empty_ids]
    return _directory(kept, keys, len(empty), prefix, cd_offset)


def _directory(
    records: list[ZipRecord], keys: frozenset[str], n_empty: int, prefix: str, cd_offset: int
) -> Directory | None:
    """The :class:`Directory`, unless a name is listed twice (zipfile then reads the file and keeps the last)."""
    names = {r.filename for r in records}
    full = {n[len(prefix) :] for n in names if n.startswith(prefix)}
    if len(keys) != n_empty or len(names) != len(records) or keys & full:
        return None
    return Directory(records, keys, cd_offset)


def _entries_at_once(data: bytes, count: int, cd_offset: int) -> Directory | None:
    """:func:`_entries_one_by_one` for thousands of entries, with numpy: every entry's fixed fields gathered at
    once, the chain of entries checked at once, and the keys of the empty storage records decoded in one call; the
    few other records are parsed one by one. None where that does not apply (a signature inside a name, say)."""
    import numpy as np

    buf = np.frombuffer(data, dtype=np.uint8)
    if len(buf) < _ENTRY.size:
        return None
    starts = np.flatnonzero((buf[:-3] == 0x50) & (buf[1:-2] == 0x4B) & (buf[2:-1] == 1) & (buf[3:] == 2))
    if len(starts) != count or starts[0] != 0 or starts[-1] + _ENTRY.size > len(buf):
        return None

    def u(offset: int, width: int) -> Any:
        value = buf[starts + offset].astype(np.int64)
        for i in range(1, width):
            value |= buf[starts + offset + i].astype(np.int64) << (8 * i)
        return value

    n, m, k = u(28, 2), u(30, 2), u(32, 2)
    ends = starts + _ENTRY.size + n + m + k
    if ends[-1] != len(buf) or (ends[:-1] != starts[1:]).any() or u(34, 2).any() or (u(42, 4) >= cd_offset).any():
        return None  # entries not back to back, several disks, a local header inside the directory
    first = _record(data, 0, cd_offset)
    if first is None or not first[0].filename.endswith("data.pkl"):
        return None
    prefix = first[0].filename[: -len("data.pkl")] + "data/"
    raw = prefix.encode()
    empty = (u(10, 2) == _STORED) & (u(20, 4) == 0) & (u(24, 4) == 0) & (n > len(raw))
    for i, byte in enumerate(raw):
        empty &= buf[np.minimum(starts + _ENTRY.size + i, len(buf) - 1)] == byte
    records = []
    for pos in starts[~empty].tolist():
        found = _record(data, pos, cd_offset)
        if found is None:
            return None
        records.append(found[0])
    # The empty records' keys, each followed by a newline, gathered into one buffer and decoded at once.
    key_starts, key_lens = starts[empty] + _ENTRY.size + len(raw), n[empty] - len(raw)
    spans = key_lens + 1
    offsets = np.repeat(key_starts - np.cumsum(spans) + spans, spans) + np.arange(int(spans.sum()))
    keys_buf = buf[np.minimum(offsets, len(buf) - 1)].copy()
    keys_buf[np.cumsum(spans) - 1] = 0x0A
    text = keys_buf.tobytes()
    if not text.isascii() or text.count(b"\n") != len(key_lens):
        return None  # a key with a newline or a byte whose meaning depends on the name's encoding flag
    keys = text.decode().split("\n")[:-1] if len(key_lens) else []
    return _directory(records, frozenset(keys), len(keys), prefix, cd_offset)


def read_stored(fh: IO[bytes], record: ZipRecord, start_dir: int) -> bytes | None:
    """An uncompressed record's bytes, its local header and CRC-32 checked as :mod:`zipfile` checks them; None
    where the local header disagrees with the directory (the caller then lets zipfile say why)."""
    fh.seek(record.header_offset)
    header = fh.read(_LOCAL.size)
    if len(header) != _LOCAL.size:
        return None
    fields = _LOCAL.unpack(header)
    if fields[0] != _LOCAL_SIG or record.compress_type != _STORED or record.compress_size != record.file_size:
        return None
    name = fh.read(fields[9])
    try:
        if name.decode("utf-8" if fields[2] & 0x800 else "cp437") != record.filename:
            return None
    except UnicodeDecodeError:
        return None
    start = record.header_offset + _LOCAL.size + fields[9] + fields[10]
    if start + record.file_size > start_dir:
        return None
    fh.seek(start)
    data = fh.read(record.file_size)
    if len(data) != record.file_size or zlib.crc32(data) != record.CRC:
        return None
    return data
