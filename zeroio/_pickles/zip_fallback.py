"""The checks a torch zip archive read with :mod:`zipfile` (anything not in ``torch.save``'s plain layout, and
remote files) passes before zeroio reads it: the same rules as :mod:`.zip_directory`'s own reading, raised as
typed errors, so zeroio reads a record only where zipfile and torch's reader (miniz) would read the same bytes."""

from __future__ import annotations

import itertools
import zipfile
from pathlib import Path
from typing import IO

from ..errors import CheckpointFormatError, UnsupportedCheckpointError
from .zip_directory import (
    MAX_ZIPFILE_DIRECTORY,
    EndRecords,
    ZipRecord,
    end_records,
    read_stored,
    record_problem,
    sizes_problem,
    with_limits,
)

__all__ = ["check_directory_size", "read_pickle", "records_of", "refuse_zipfile_layout"]

_UTF8 = 0x800


def _quoted(path: Path) -> str:
    return f"'{path}'"


def refuse_zipfile_layout(
    infos: list[zipfile.ZipInfo], pickle: str, ends: EndRecords | str | None, path: Path, what: str = ""
) -> None:
    """Refuse an archive :mod:`zipfile` reads but torch's reader would read otherwise (or not at all): see
    :func:`.zip_directory.end_records` and :func:`.zip_directory.record_problem`; a name listed twice (zipfile
    keeps the last, torch one of them); a first record outside the pickle's folder (torch's root). ``what`` names
    the archive in the message (default: the file)."""
    problem = ends if isinstance(ends, str) else "no end of central directory record" if ends is None else None
    if isinstance(ends, EndRecords) and ends.entries != len(infos):
        problem = f"a directory of {len(infos)} records whose end record counts {ends.entries}"
    names: set[bytes | str] = set()  # each name's bytes (torch compares them) and text (zipfile's keys)
    for info in infos:
        raw = info.orig_filename.encode("utf-8" if info.flag_bits & _UTF8 else "cp437")
        problem = problem or record_problem(raw, info.flag_bits, info.extract_version, info.extra)
        problem = problem or sizes_problem(
            info.volume, info.compress_type, info.compress_size, info.file_size, info.external_attr
        )
        if raw in names or info.filename in names:
            problem = problem or f"the record '{info.filename}' listed twice"
        names.update((raw, info.filename))
    offsets = sorted(info.header_offset for info in infos)
    if any(a == b for a, b in itertools.pairwise(offsets)):
        problem = problem or "two records sharing one local header"
    first = infos[0].filename if infos else ""
    if problem is None and pickle != f"{first.partition('/')[0]}/data.pkl":
        problem = f"its pickle '{pickle}' outside the folder of its first record '{first}', where torch looks"
    if problem is not None:
        raise CheckpointFormatError(
            f"{what or _quoted(path)} is a zip archive with {problem}: torch.save never writes one, and zipfile "
            "and torch would "
            "not read the same bytes from it. Re-save the file with torch.save, or copy it again.",
            path=path,
        )


def records_of(infos: list[zipfile.ZipInfo], start_dir: int) -> list[ZipRecord]:
    """Every record as a :class:`ZipRecord`, with its limit (the next local header, or the directory)."""
    records = [
        ZipRecord(i.filename, i.header_offset, i.compress_type, i.compress_size, i.file_size, i.CRC, i.flag_bits)
        for i in infos
    ]
    return with_limits(records, sorted(r.header_offset for r in records), start_dir)


def read_pickle(fh: IO[bytes], archive: zipfile.ZipFile, record: ZipRecord, path: Path, what: str = "") -> bytes:
    """The pickle record's bytes, checked as :func:`.zip_directory.read_stored` checks them; zipfile names what is
    wrong when it can, else the record overlaps the next one."""
    data = read_stored(fh, record)
    if data is None:
        archive.read(record.filename)  # raises, naming the problem, unless the record overlaps another
        raise CheckpointFormatError(
            f"{what or _quoted(path)}: its pickle record '{record.filename}' reaches into the next record or the "
            "zip directory; "
            "torch.save never overlaps records. The file is corrupted or hostile; copy it again.",
            path=path,
        )
    return data


def check_directory_size(fh: IO[bytes], path: Path, size: int, what: str = "") -> EndRecords | str | None:
    """The end records of an archive read by :mod:`zipfile`, whose directory must be at most
    :data:`~.zip_directory.MAX_ZIPFILE_DIRECTORY` (zipfile makes an object per record)."""
    ends = end_records(fh, size)
    if isinstance(ends, EndRecords) and ends.size > MAX_ZIPFILE_DIRECTORY:
        raise UnsupportedCheckpointError(
            f"{what or _quoted(path)} has a {ends.size}-byte zip directory in a layout torch.save does not write; "
            "zeroio reads "
            f"such directories up to {MAX_ZIPFILE_DIRECTORY} bytes. Re-save the file with torch.save.",
            path=path,
        )
    return ends
