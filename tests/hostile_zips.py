"""Crafted torch zip archives whose zip structure lies (tests/test_trust_zip_replica.py): every record written by
hand, so each attack is exactly one lie in the central directory, a local header or the end records.

The tree is ``{"a": 4 floats (storage '0'), "b": 6 floats (storage '1')}`` plus ``empties`` tensors of no bytes
(storages '2'..), as a ZeRO-3 model-states file holds its placeholders: 0 empties is read entry by entry, 600 at once
(numpy). Each builder returns the archive's bytes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

from hostile_files import Ops

LOCAL = struct.Struct("<IHHHHHIIIHH")
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
A_BYTES = struct.pack("<4f", 0, 1, 2, 3)
B_BYTES = struct.pack("<6f", 10, 11, 12, 13, 14, 15)
EVIL = struct.pack("<4f", 100, 101, 102, 103)
"""What an attack would have zeroio read as 'a' where torch reads A_BYTES."""


@dataclass
class Entry:
    """One record: what its local header and its directory entry say (``None``: the true value)."""

    name: bytes
    data: bytes
    flags: int = 0x808  # torch.save: sizes after the data, UTF-8 names
    method: int = 0
    version: int = 0
    crc: int | None = None
    size: int | None = None
    csize: int | None = None
    offset: int | None = None
    disk: int = 0
    external: int = 0
    local_name: bytes | None = None
    central_extra: bytes = b""
    comment: bytes = b""


def tree(empties: int, b_numel: int = 6, a_key: str = "0") -> bytes:
    """The pickle: ``a`` (storage ``a_key``), ``b`` (``b_numel`` floats claimed) and the empty tensors."""
    ops = Ops().dict().text("a").tensor((4,), (1,), numel=4, key=a_key).setitem()
    ops.text("b").tensor((b_numel,), (1,), numel=b_numel, key="1").setitem()
    for i in range(empties):
        ops.text(f"p{i}").tensor((0,), (1,), numel=0, key=str(i + 2)).setitem()
    return ops.stop()


def entries(empties: int = 0, *, b_numel: int = 6) -> list[Entry]:
    """The records in torch.save's order: pickle, storages, version."""
    found = [Entry(b"archive/data.pkl", tree(empties, b_numel)), Entry(b"archive/data/0", A_BYTES)]
    found.append(Entry(b"archive/data/1", B_BYTES))
    found += [Entry(b"archive/data/%d" % (i + 2), b"", flags=0x800) for i in range(empties)]
    return [*found, Entry(b"archive/version", b"3\n")]


def build(records: list[Entry], *, comment: bytes = b"") -> bytes:
    """The archive with torch's zip64 end records; a ``comment`` makes zeroio read it with zipfile."""
    out, offsets = bytearray(), []
    for e in records:
        offsets.append(len(out))
        crc = zlib.crc32(e.data) if e.crc is None else e.crc
        size = len(e.data) if e.size is None else e.size
        name = e.name if e.local_name is None else e.local_name
        out += LOCAL.pack(0x04034B50, e.version, e.flags, e.method, 0, 0, crc, size, size, len(name), 0) + name + e.data
    start = len(out)
    for e, at in zip(records, offsets):
        crc = zlib.crc32(e.data) if e.crc is None else e.crc
        size = len(e.data) if e.size is None else e.size
        csize = size if e.csize is None else e.csize
        fields = (e.version, e.version, e.flags, e.method, 0, 0, crc, csize, size, len(e.name), len(e.central_extra))
        offset = at if e.offset is None else e.offset
        out += (
            CENTRAL.pack(0x02014B50, *fields, len(e.comment), e.disk, 0, e.external, offset)
            + e.name
            + e.central_extra
            + e.comment
        )
    return bytes(out + _end(len(records), start, len(out) - start, len(out), comment))


def _end(count: int, start: int, size: int, at: int, comment: bytes) -> bytes:
    eocd64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x31E, 45, 0, 0, count, count, size, start)
    locator = struct.pack("<IIQI", 0x07064B50, 0, at, 1)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, size, start, len(comment))
    return eocd64 + locator + eocd + comment


def _at(records: list[Entry], key: str) -> int:
    return next(i for i, e in enumerate(records) if e.name == f"archive/data/{key}".encode())


def edited(empties: int, key: str, **changes: object) -> list[Entry]:
    """The records with ``key``'s entry changed."""
    records = entries(empties)
    records[_at(records, key)] = replace(records[_at(records, key)], **changes)  # type: ignore[arg-type]
    return records


def _offset_of(records: list[Entry], key: str) -> int:
    """Where ``key``'s local header lies once built (no prefix)."""
    return sum(LOCAL.size + len(e.name) + len(e.data) for e in records[: _at(records, key)])


def duplicate_storage(empties: int) -> list[Entry]:
    """'archive/data/0' listed twice: zipfile keeps the last (EVIL), torch's reader the first."""
    records = entries(empties)
    records.insert(_at(records, "0") + 1, Entry(b"archive/data/0", EVIL))
    return records


def overlapping_records(empties: int, *, into_directory: bool = False) -> bytes:
    """Storage '1' (b: 6 floats claimed, 24 bytes) holds 16 bytes and its directory entry claims 24: its last 8
    are the next local header's (or the directory's, when it is the last record), its CRC theirs."""
    records = entries(empties)
    b = _at(records, "1")
    if into_directory:
        records.append(records.pop(b))
    records[_at(records, "1")] = replace(records[_at(records, "1")], data=B_BYTES[:16])
    raw = build(records)
    start = _offset_of(records, "1") + LOCAL.size + len(b"archive/data/1")
    records[_at(records, "1")].size, records[_at(records, "1")].crc = 24, zlib.crc32(raw[start : start + 24])
    return build(records)


def two_zip64_end_records(empties: int, records: list[Entry] | None = None) -> bytes:
    """The locator points at a zip64 end record (and directory) of the true records; zipfile reads the one just
    before the locator instead, whose directory maps 'archive/data/0' to a planted record holding EVIL."""
    records = entries(empties) if records is None else records
    real = build(records)
    true_end = real.rindex(b"PK\x06\x06")  # zip64 end record, then locator and end record
    evil_at = true_end + 56
    planted = LOCAL.pack(0x04034B50, 0, 0x808, 0, 0, 0, zlib.crc32(EVIL), 16, 16, 14, 0) + b"archive/data/0" + EVIL
    offsets, at = [], 0
    for e in records:
        offsets.append(evil_at if e.name == b"archive/data/0" else at)
        at += LOCAL.size + len(e.name) + len(e.data)
    alt = bytearray()
    for e, offset in zip(records, offsets):
        data = EVIL if offset == evil_at else e.data
        fields = (0, 0, e.flags, 0, 0, 0, zlib.crc32(data), len(data), len(data), len(e.name), 0, 0, 0, 0, 0)
        alt += CENTRAL.pack(0x02014B50, *fields, offset) + e.name
    alt_start = evil_at + len(planted)
    n = len(records)
    alt_end = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x31E, 45, 0, 0, n, n, len(alt), alt_start)
    true = real[true_end : true_end + 56]
    tail = struct.pack("<IIQI", 0x07064B50, 0, true_end, 1) + real[-22:]
    return real[:true_end] + true + planted + bytes(alt) + alt_end + tail


def two_encodings(empties: int) -> list[Entry]:
    """Storage 'é': its UTF-8 record holds A_BYTES, a record named 0x82 without the UTF-8 flag (cp437's 'é') EVIL.
    zipfile decodes both to 'é' and keeps the last; torch looks the key's UTF-8 bytes up and finds the first."""
    records = entries(empties)
    records[0] = Entry(b"archive/data.pkl", tree(empties, a_key="\u00e9"))
    at = _at(records, "0")
    records[at] = replace(records[at], name="archive/data/\u00e9".encode())
    records.insert(at + 1, Entry(b"archive/data/\x82", EVIL, flags=0x8))
    return records


def two_entries_one_header(empties: int) -> bytes:
    """Storage '1' (b, 4 floats claimed) pointed at storage '0''s local header, its size and CRC: torch reads a's
    bytes for b, zipfile refuses (the local name is '0')."""
    records = entries(empties, b_numel=4)
    at = _offset_of(records, "0")
    records[_at(records, "1")] = replace(records[_at(records, "1")], offset=at, size=16, crc=zlib.crc32(A_BYTES))
    return build(records)


def _counts(empties: int, count: int) -> bytes:
    """End records counting ``count`` records (zip64), the 32-bit ones saturated."""
    raw = build(entries(empties))
    end = raw.rindex(b"PK\x06\x06")
    eocd64 = bytearray(raw[end : end + 56])
    eocd64[24:40] = struct.pack("<QQ", count, count)
    eocd = bytearray(raw[-22:])
    eocd[8:12] = b"\xff\xff\xff\xff"
    return raw[:end] + bytes(eocd64) + raw[end + 56 : -22] + bytes(eocd)


ZipAttack = Callable[[int], bytes]

_TWO_ZIP64 = struct.pack("<HHQQ", 1, 16, 2**32 - 1, 2**32 - 1) + struct.pack("<HHQQ", 1, 16, 16, 16)
"""Two zip64 blocks: zipfile applies both (the second's 16 bytes win), torch's reader the first."""

ZIP_ATTACKS: dict[str, ZipAttack] = {
    "two_entries_one_header": lambda n: two_entries_one_header(n),
    "encrypted_storage": lambda n: build(edited(n, "0", flags=0x809)),
    "strongly_encrypted_storage": lambda n: build(edited(n, "1", flags=0x848)),
    "patched_storage": lambda n: build(edited(n, "1", flags=0x828)),
    "encrypted_pickle": lambda n: build([replace(entries(n)[0], flags=0x809), *entries(n)[1:]]),
    "duplicate_storage": lambda n: build(duplicate_storage(n)),
    "duplicate_storage_zipfile": lambda n: build(duplicate_storage(n), comment=b"note"),
    "one_name_two_encodings": lambda n: build(two_encodings(n)),
    "nul_in_name": lambda n: build(edited(n, "0", name=b"archive/data/0\x00x", local_name=b"archive/data/0\x00x")),
    "nul_in_name_zipfile": lambda n: build(
        edited(n, "0", name=b"archive/data/0\x00x", local_name=b"archive/data/0\x00x"), comment=b"note"
    ),
    "overlapping_records": lambda n: overlapping_records(n),
    "overlapping_directory": lambda n: overlapping_records(n, into_directory=True),
    "record_longer_than_storage": lambda n: build(entries(n, b_numel=4)),  # b: 4 floats claimed, 6 stored
    "zip64_blocks_twice": lambda n: build(edited(n, "0", size=0xFFFFFFFF, central_extra=_TWO_ZIP64), comment=b"note"),
    "stored_sizes_differ": lambda n: build(edited(n, "0", csize=20), comment=b"note"),  # zipfile reads 20 bytes
    "record_on_another_disk": lambda n: build(edited(n, "0", disk=2)),
    "record_marked_as_a_folder": lambda n: build(edited(n, "1", external=0x10)),  # torch.load: uninitialised b
    "extra_field_overruns": lambda n: build(edited(n, "0", central_extra=b"\x99\x99\x10\x00ab")),
    "version_needed_9_9": lambda n: build(edited(n, "0", version=99)),
    "zip64_locator_elsewhere": lambda n: two_zip64_end_records(n),
    "zip64_locator_elsewhere_zipfile": lambda n: two_zip64_end_records(n)[:-2] + b"\x04\x00note",
    "bytes_before_archive": lambda n: b"PK\x03\x04" + bytes(60) + build(entries(n)),  # offsets as if alone
    "counts_disagree": lambda n: _counts(n, len(entries(n)) + 1),
    "counts_huge": lambda n: _counts(n, 1 << 62),
    "pickle_not_in_a_folder": lambda n: build([replace(e, name=e.name[8:]) for e in entries(n)]),
    "pickle_in_two_folders": lambda n: build([replace(e, name=b"x/" + e.name) for e in entries(n)]),
    "first_record_elsewhere": lambda n: build([Entry(b"xdata.pkl", b""), *entries(n)]),
}
"""Every zip attack, by name: refused as a ``CheckpointFormatError`` or ``UnsupportedCheckpointError`` (the fuzz
corpus in tests/test_errors.py uses them too, with 0 empties)."""


def chunk(*, numel: int = 4, data: bytes = A_BYTES, **changes: object) -> list[Entry]:
    """A DCP chunk's archive (what torch.save writes for one tensor): the tensor ``a`` (4 floats) at the top of its
    tree over storage '0' of ``numel`` floats holding ``data``, its entry changed by ``changes``."""
    pickle = Ops().tensor((4,), (1,), numel=numel, key="0").stop()
    storage = replace(Entry(b"archive/data/0", data), **changes)  # type: ignore[arg-type]
    return [Entry(b"archive/data.pkl", pickle), storage, Entry(b"archive/version", b"3\n")]


def _chunk_overlapping() -> bytes:
    """Storage '0' of 6 floats claimed, 16 bytes stored: its last 8 are the next local header's, CRC theirs."""
    records = chunk(numel=6)
    raw = build(records)
    start = LOCAL.size + len(records[0].name) + len(records[0].data) + LOCAL.size + len(records[1].name)
    return build(chunk(numel=6, size=24, crc=zlib.crc32(raw[start : start + 24])))


CHUNK_ATTACKS: dict[str, tuple[Callable[[], bytes], str]] = {
    "duplicate_storage": (
        lambda: build([*chunk(), Entry(b"archive/data/0", EVIL)]),
        "'archive/data/0' listed twice",
    ),
    "nul_in_name": (lambda: build(chunk(name=b"archive/data/0\x00x", local_name=b"archive/data/0\x00x")), "NUL"),
    "local_name_differs": (lambda: build(chunk(local_name=b"archive/data/9")), "names another record"),
    "encrypted_storage": (lambda: build(chunk(flags=0x809)), "encrypted or patched"),
    "overlapping_records": (_chunk_overlapping, "reaches into the next record"),
    "record_longer_than_storage": (lambda: build(chunk(data=A_BYTES + bytes(8))), "of 16 bytes over a record of 24"),
    "zip64_locator_elsewhere": (
        lambda: two_zip64_end_records(0, chunk()),
        "a zip64 end record away from where its locator points",
    ),
}
"""Zip attacks on a DCP chunk's archive (read through zipfile inside its data file), with what zeroio says."""

__all__ = ["A_BYTES", "B_BYTES", "CHUNK_ATTACKS", "EVIL", "ZIP_ATTACKS", "Entry", "build", "chunk", "edited", "entries"]
