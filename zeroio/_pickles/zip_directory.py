"""A torch zip archive's central directory, parsed in one pass without :mod:`zipfile`'s per-entry objects.

A ZeRO-3 model-states file holds one record per parameter (its empty placeholder), so a 1,024-rank checkpoint of
2,000 tensors has 2 million records: :class:`zipfile.ZipFile` spent ~10 ms building each file's ``ZipInfo``
objects, this reader ~2 ms. It reads what ``torch.save`` writes (one disk, no comment, no prefix, zip64 records
where sizes need them) and returns None for anything else, which :func:`~.archive.read_archive` then reads with
:mod:`zipfile` as before: every file still gets zipfile's full treatment unless it is plainly torch's layout.

Both ways, a record is read only where :mod:`zipfile` and torch's own reader (miniz) would read the same bytes:
:func:`end_records` and :func:`record_problem` name what would make them differ (a zip64 end record away from its
locator, bytes before the archive, a name listed twice, a NUL in a name, an encrypted record), and every record's
``limit`` (the next local header or the directory) bounds its bytes, so no two records share any.
"""

from __future__ import annotations

import bisect
import itertools
import struct
import zlib
from typing import IO, Any, NamedTuple

__all__ = [
    "MAX_DIRECTORY",
    "MAX_ZIPFILE_DIRECTORY",
    "Directory",
    "EndRecords",
    "ZipRecord",
    "end_records",
    "local_name_matches",
    "read_directory",
    "read_stored",
    "record_problem",
    "sizes_problem",
    "with_limits",
]

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
_UTF8 = 0x800
_BAD_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000
"""Encrypted, patched, strongly encrypted, masked local headers: zipfile and torch refuse to read such a record
(``torch.save`` sets only 0x0008, sizes after the data, and 0x0800, UTF-8 names)."""
_MAX_VERSION = 63
_DOS_FOLDER = 0x10
"""Highest zip version needed to extract that :mod:`zipfile` reads (its ``MAX_EXTRACT_VERSION``)."""
MAX_DIRECTORY = 1 << 28
"""Largest central directory read this way (256 MiB: 2.5 million records of 100 bytes; a ZeRO-3 model-states
file of 2,000 parameters has 200 KB). Its parse peaks at about 3 times its size."""
MAX_ZIPFILE_DIRECTORY = 1 << 25
"""Largest central directory handed to :mod:`zipfile` (32 MiB): its per-record objects cost ~600 bytes each, so
700,000 minimal records would take 400 MB. ``torch.save``'s files never go there."""


class ZipRecord(NamedTuple):
    """One central-directory entry: the fields of :class:`zipfile.ZipInfo` that zeroio reads, by the same names
    (a named tuple: made in a quarter of a dataclass's time, 2,000 of them a model-states file), and ``limit``."""

    filename: str
    header_offset: int
    compress_type: int
    compress_size: int
    file_size: int
    CRC: int
    flag_bits: int
    limit: int = 0
    """Where the record's bytes must end: the next record's local header, or the central directory."""


def _extra_blocks(extra: bytes) -> list[tuple[int, bytes]] | None:
    """The ``(tag, data)`` blocks of an extra field; None where one runs past the field (zipfile refuses it)."""
    blocks, pos = [], 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + length > len(extra):
            return None
        blocks.append((tag, extra[pos + 4 : pos + 4 + length]))
        pos += 4 + length
    return blocks


def _zip64(extra: bytes, size: int, csize: int, offset: int) -> tuple[int, int, int] | None:
    """The zip64 extra field's values for the fields saturated at 0xFFFFFFFF (in the order the format puts them);
    None for a malformed extra field or several zip64 blocks (zipfile applies each in turn, torch the first)."""
    blocks = _extra_blocks(extra)
    found = [data for tag, data in blocks or () if tag == 1]
    if blocks is None or len(found) > 1:
        return None
    if _FULL32 not in (size, csize, offset):
        return size, csize, offset
    if not found or len(found[0]) % 8:
        return None
    values = list(struct.unpack(f"<{len(found[0]) // 8}Q", found[0]))
    out = []
    for field in (size, csize, offset):
        if field == _FULL32:
            if not values:
                return None
            field = values.pop(0)
        out.append(field)
    return out[0], out[1], out[2]


def record_problem(name: bytes, flags: int, version: int, extra: bytes) -> str | None:
    """Why zeroio does not read a record that zipfile and torch's reader might read differently, or None: a NUL
    in its name (zipfile cuts the name there, torch does not), an encrypted or patched record, a version zipfile
    refuses, a malformed extra field or several zip64 blocks."""
    if b"\x00" in name:
        return "a record name holding a NUL byte"
    if name.endswith(b"/"):
        return "a folder record"
    if flags & _BAD_FLAGS:
        return f"an encrypted or patched record (flags {flags:#06x})"
    if version & 0xFF > _MAX_VERSION:
        return f"a record needing zip version {(version & 0xFF) / 10}"
    blocks = _extra_blocks(extra)
    if blocks is None or sum(tag == 1 for tag, _ in blocks) > 1:
        return "a malformed extra field"
    return None


def sizes_problem(disk: int, method: int, csize: int, size: int, external: int) -> str | None:
    """Why torch's reader would not read a record whose name and flags are fine, or None: on another disk (miniz
    refuses, zipfile reads it), stored with two sizes (miniz refuses, zipfile reads the compressed size), or marked
    as a folder by its DOS attributes (miniz extracts nothing: torch.load returned uninitialised memory, zipfile
    the bytes)."""
    if disk:
        return "a record on another disk"
    if external & _DOS_FOLDER:
        return "a record marked as a folder"
    if method == _STORED and csize != size:
        return f"a stored record of {size} bytes whose compressed size says {csize}"
    return None


class EndRecords(NamedTuple):
    """The end-of-central-directory records, as both :mod:`zipfile` and torch's reader read them."""

    entries: int
    """Records in the central directory."""
    start: int
    """Where the central directory starts."""
    size: int
    """Its bytes."""
    comment: int
    """Bytes of the archive's comment."""


def _tail_end_record(fh: IO[bytes], size: int) -> tuple[int, bytes] | None:
    """Where the end record lies and its bytes, found as zipfile finds it: at the very end when it has no comment,
    else the last signature in the last 64 KiB."""
    fh.seek(size - _EOCD.size)
    tail = fh.read(_EOCD.size)
    if tail[:4] == b"PK\x05\x06" and tail[-2:] == b"\x00\x00":
        return size - _EOCD.size, tail
    first = max(0, size - _EOCD.size - _FULL16)
    fh.seek(first)
    tail = fh.read(size - first)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        return None
    return first + at, tail[at : at + _EOCD.size]


def end_records(fh: IO[bytes], size: int) -> EndRecords | str | None:
    """The archive's end records; None where there are none (not a zip), a reason (a phrase) where zipfile and
    torch's reader would read different directories, or the file is not one archive on one disk."""
    if size < _EOCD.size:
        return None
    found = _tail_end_record(fh, size)
    if found is None:
        return None
    end, raw = found
    _, disk, cd_disk, n_disk, count, cd_size, cd_offset, comment = _EOCD.unpack(raw)
    if end + _EOCD.size + comment != size:
        return "bytes after its end record's comment"
    if disk or cd_disk:
        return "an archive spanning several disks"
    directory_end = end
    if end >= _LOCATOR.size:
        fh.seek(end - _LOCATOR.size)
        locator = fh.read(_LOCATOR.size)
        if locator[:4] == b"PK\x06\x07":
            _, locator_disk, eocd64, disks = _LOCATOR.unpack(locator)
            if locator_disk or disks != 1:
                return "an archive spanning several disks"
            if eocd64 != end - _LOCATOR.size - _EOCD64.size:  # zipfile reads the record before the locator
                return "a zip64 end record away from where its locator points"
            fh.seek(eocd64)
            record = fh.read(_EOCD64.size)
            fields = _EOCD64.unpack(record) if len(record) == _EOCD64.size else (0,) * 10
            if fields[0] != _EOCD64_SIG or fields[4] or fields[5]:
                return "a zip64 locator without its end record"
            wide = fields[6:10]
            for narrow, value, full in zip(
                (n_disk, count, cd_size, cd_offset), wide, (_FULL16, _FULL16, _FULL32, _FULL32)
            ):
                if narrow not in (full, value):
                    return "end records that disagree on the directory"
            n_disk, count, cd_size, cd_offset = wide
            directory_end = eocd64
    if n_disk != count:
        return "end records that disagree on the directory"
    if cd_offset + cd_size != directory_end:  # zipfile shifts every offset by the difference, torch does not
        return "bytes before the archive or between its directory and its end record"
    return EndRecords(count, cd_offset, cd_size, comment)


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
    several disks, data before the archive, ``data.pkl`` not first, a name listed twice, inconsistent counts, a
    record :func:`record_problem` names)."""
    ends = end_records(fh, size)
    if not isinstance(ends, EndRecords) or ends.comment or ends.size > MAX_DIRECTORY or ends.entries == 0:
        return None
    fh.seek(ends.start)
    data = fh.read(ends.size)
    if len(data) != ends.size:
        return None
    return _entries(data, ends.entries, ends.start)


def with_limits(records: list[ZipRecord], header_offsets: Any, directory: int) -> list[ZipRecord]:
    """``records`` with their ``limit``: the first local header after theirs among ``header_offsets`` (every
    record's, sorted: a list, or a numpy array), or the directory."""
    if isinstance(header_offsets, list):
        at = [bisect.bisect_right(header_offsets, r.header_offset) for r in records]
    else:
        at = header_offsets.searchsorted([r.header_offset for r in records], side="right").tolist()
    n = len(header_offsets)
    return [
        r._replace(limit=directory if i >= n else min(int(header_offsets[i]), directory)) for r, i in zip(records, at)
    ]


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
    raw, extra = data[pos + _ENTRY.size : name_end], data[name_end:extra_end]
    if record_problem(raw, f[3], f[2], extra) is not None or not (f[3] & _UTF8 or raw.isascii()):
        return None  # a cp437 name: zipfile's reading compares names as torch does, by their bytes
    found = _zip64(extra, f[9], f[8], f[16])
    if found is None or found[2] >= cd_offset or sizes_problem(f[13], f[4], found[1], found[0], f[15]) is not None:
        return None
    try:
        name = raw.decode("utf-8" if f[3] & _UTF8 else "ascii")
    except UnicodeDecodeError:
        return None
    file_size, csize, offset = found
    return ZipRecord(name, offset, f[4], csize, file_size, f[7], f[3]), next_pos


def _is_pickle_name(name: str) -> bool:
    """``<root>/data.pkl`` with a root of one folder: torch's reader takes the first record's first folder as the
    root."""
    root, _, rest = name.partition("/")
    return bool(root) and rest == "data.pkl"


def _entries_one_by_one(data: bytes, count: int, cd_offset: int) -> Directory | None:
    records: list[ZipRecord] = []
    pos = 0
    for _ in range(count):
        found = _record(data, pos, cd_offset)
        if found is None:
            return None
        records.append(found[0])
        pos = found[1]
    if pos != len(data) or not records or not _is_pickle_name(records[0].filename):
        return None
    prefix = records[0].filename[: -len("data.pkl")] + "data/"
    empty = [r for r in records if r.file_size == 0 and r.compress_size == 0 and r.compress_type == _STORED]
    empty = [r for r in empty if r.filename.startswith(prefix)]
    keys = frozenset(r.filename[len(prefix) :] for r in empty)
    empty_ids = {id(r) for r in empty}
    kept = [r for r in records if id(r) not in empty_ids]
    starts = sorted(r.header_offset for r in records)
    if any(a == b for a, b in itertools.pairwise(starts)):
        return None  # two entries sharing one local header: zipfile's reading names it
    kept = with_limits(kept, starts, cd_offset)
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


def _signatures(data: bytes, count: int) -> Any:
    """Where the entry signature occurs in ``data``, sorted (None past ``count`` of them): four passes over 32-bit
    words, one per alignment, so the scan holds a quarter of the directory's size at a time."""
    import numpy as np

    found = []
    for shift in range(4):
        words = np.frombuffer(data, dtype="<u4", count=(len(data) - shift) // 4, offset=shift)
        hits = np.flatnonzero(words == _ENTRY_SIG)
        if len(hits) > count:
            return None
        found.append(hits * 4 + shift)
    return np.sort(np.concatenate(found))


def _entries_at_once(data: bytes, count: int, cd_offset: int) -> Directory | None:
    """:func:`_entries_one_by_one` for thousands of entries, with numpy: every entry's fixed fields gathered at
    once, the chain of entries checked at once, and the keys of the empty storage records decoded in one call; the
    few other records are parsed one by one. None where that does not apply (a signature inside a name, say)."""
    import numpy as np

    buf = np.frombuffer(data, dtype=np.uint8)
    if len(buf) < _ENTRY.size:
        return None
    starts = _signatures(data, count)
    if starts is None or len(starts) != count or starts[0] != 0 or starts[-1] + _ENTRY.size > len(buf):
        return None

    def u(offset: int, width: int) -> Any:
        value = buf[starts + offset].astype(np.int64)
        for i in range(1, width):
            value |= buf[starts + offset + i].astype(np.int64) << (8 * i)
        return value

    n, m, k = u(28, 2), u(30, 2), u(32, 2)
    ends = starts + _ENTRY.size + n + m + k
    offsets = u(42, 4)
    if ends[-1] != len(buf) or (ends[:-1] != starts[1:]).any() or u(34, 2).any() or (offsets >= cd_offset).any():
        return None  # entries not back to back, several disks, a local header inside the directory
    if (u(8, 2) & _BAD_FLAGS).any() or (buf[starts + 6] > _MAX_VERSION).any() or (offsets == _FULL32).any():
        return None  # records zipfile or torch refuse, or zip64 offsets: one by one (then zipfile names them)
    if (buf[starts + 38] & _DOS_FOLDER).any() or ((buf[starts + _ENTRY.size + n - 1] == ord("/")) & (n > 0)).any():
        return None  # folder records
    first = _record(data, 0, cd_offset)
    if first is None or not _is_pickle_name(first[0].filename):
        return None
    prefix = first[0].filename[: -len("data.pkl")] + "data/"
    raw = prefix.encode()
    empty = (u(10, 2) == _STORED) & (u(20, 4) == 0) & (u(24, 4) == 0) & (n > len(raw)) & (m == 0)
    for i, byte in enumerate(raw):
        empty &= buf[np.minimum(starts + _ENTRY.size + i, len(buf) - 1)] == byte
    records = []
    for pos in starts[~empty].tolist():
        found = _record(data, pos, cd_offset)
        if found is None:
            return None
        records.append(found[0])
    # The empty records' keys, each followed by a newline, gathered into one buffer and decoded at once.
    key_starts = (starts[empty] + _ENTRY.size + len(raw)).astype(np.int32)  # the directory is under 2 GiB
    key_lens = (n[empty] - len(raw)).astype(np.int32)
    spans = key_lens + 1
    gather = np.repeat(key_starts - np.cumsum(spans, dtype=np.int32) + spans, spans)
    gather += np.arange(len(gather), dtype=np.int32)
    keys_buf = buf[np.minimum(gather, len(buf) - 1)].copy()
    del gather
    keys_buf[np.cumsum(spans) - 1] = 0x0A
    text = keys_buf.tobytes()
    if not text.isascii() or text.count(b"\n") != len(key_lens) or b"\x00" in text:
        return None  # a key with a newline or a NUL, or a byte whose meaning depends on the name's encoding flag
    keys = text.decode().split("\n")[:-1] if len(key_lens) else []
    sorted_offsets = np.sort(offsets)
    if (sorted_offsets[1:] == sorted_offsets[:-1]).any():
        return None  # two entries sharing one local header: zipfile's reading names it
    records = with_limits(records, sorted_offsets, cd_offset)
    return _directory(records, frozenset(keys), len(keys), prefix, cd_offset)


def read_stored(fh: IO[bytes], record: ZipRecord) -> bytes | None:
    """An uncompressed record's bytes, its local header and CRC-32 checked as :mod:`zipfile` checks them and its
    bytes ending by its ``limit``; None where the record is not that (the caller then names why)."""
    fh.seek(record.header_offset)
    header = fh.read(_LOCAL.size)
    if len(header) != _LOCAL.size:
        return None
    fields = _LOCAL.unpack(header)
    if fields[0] != _LOCAL_SIG or record.compress_type != _STORED or record.compress_size != record.file_size:
        return None
    if record.flag_bits & _BAD_FLAGS or not local_name_matches(fh.read(fields[9]), fields[2], record.filename):
        return None
    start = record.header_offset + _LOCAL.size + fields[9] + fields[10]
    if start + record.file_size > record.limit:
        return None
    fh.seek(start)
    data = fh.read(record.file_size)
    if len(data) != record.file_size or zlib.crc32(data) != record.CRC:
        return None
    return data


def local_name_matches(name: bytes, flags: int, filename: str) -> bool:
    """A local header's name is its directory entry's, each decoded by its own flags (as zipfile compares them)."""
    try:
        return name.decode("utf-8" if flags & _UTF8 else "cp437") == filename
    except UnicodeDecodeError:
        return False
