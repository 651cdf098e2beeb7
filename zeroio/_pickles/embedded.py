"""A ``torch.save`` zip archive stored inside a bigger file, at ``[offset, offset + length)``: a DCP chunk.

PyTorch Distributed Checkpoint appends each tensor chunk (and each pickled non-tensor value) to its ``.distcp``
file as a complete ``torch.save`` archive. Only the archive's zip directory and pickle are read here; a tensor's
bytes stay where they are, found by their record's local header, and are read later by byte range.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

from .._dtypes import DType
from ..errors import CheckpointFormatError, UnsupportedCheckpointError, ZeroIOError
from .archive import check_pickle_record
from .zip_directory import ZipRecord, local_name_matches
from .zip_fallback import check_directory_size, read_pickle, records_of, refuse_zipfile_layout

__all__ = ["EmbeddedArchive", "EmbeddedTensor", "read_embedded_archive"]

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = 0x04034B50

PRead = Callable[[int, int], bytes]
"""``pread(offset, nbytes)`` of the outer file (may return fewer bytes at its end)."""


class _Window(io.RawIOBase):
    """A seekable read-only view of ``[offset, offset + length)`` of a file, for :class:`zipfile.ZipFile`."""

    def __init__(self, pread: PRead, offset: int, length: int) -> None:
        super().__init__()
        self._pread, self._offset, self._length, self._pos = pread, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        data = self._pread(self._offset + self._pos, n)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True, slots=True)
class EmbeddedTensor:
    """A tensor of an embedded archive: where its elements lie in the outer file (contiguous, offset 0)."""

    dtype: DType
    shape: tuple[int, ...]
    data_offset: int
    """Absolute offset in the outer file of the tensor's first element."""
    record: tuple[int, int, int]
    """``(absolute start, size, crc32)`` of the storage record holding it, for CRC checks."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class EmbeddedArchive:
    """An embedded archive's pickle and storage records (offsets relative to the archive)."""

    path: Path
    offset: int
    length: int
    pickle: bytes
    records: dict[str, ZipRecord]

    def record_data(self, pread: PRead, key: str) -> tuple[int, int, int]:
        """``(absolute data offset, size, crc32)`` of storage record ``key``, its local header checked."""
        info = self.records.get(key)
        if info is None:
            raise CheckpointFormatError(
                f"The archive at byte {self.offset} of '{self.path}' has no record for storage '{key}': the file is "
                "truncated or corrupted. Copy it again.",
                path=self.path,
            )
        if not 0 <= info.header_offset <= self.length - _LOCAL_HEADER.size:
            raise CheckpointFormatError(
                f"The zip directory of the archive at byte {self.offset} of '{self.path}' places storage '{key}' at "
                f"{info.header_offset}, outside the archive's {self.length} bytes. The file is corrupted or hostile.",
                path=self.path,
            )
        raw_name = info.filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
        header = pread(self.offset + info.header_offset, _LOCAL_HEADER.size + len(raw_name))
        if (
            len(header) != _LOCAL_HEADER.size + len(raw_name)
            or _LOCAL_HEADER.unpack_from(header)[0] != _LOCAL_HEADER_MAGIC
        ):
            raise CheckpointFormatError(
                f"Corrupted zip entry for storage '{key}' in the archive at byte {self.offset} of '{self.path}'. "
                "Copy the file again.",
                path=self.path,
            )
        fields = _LOCAL_HEADER.unpack_from(header)
        if fields[9] != len(raw_name) or not local_name_matches(header[_LOCAL_HEADER.size :], fields[2], info.filename):
            raise CheckpointFormatError(
                f"The local header of storage '{key}' in the archive at byte {self.offset} of '{self.path}' names "
                f"another record than its directory entry '{info.filename}'. The file is corrupted or hostile.",
                path=self.path,
            )
        start = info.header_offset + _LOCAL_HEADER.size + int(fields[9]) + int(fields[10])
        if start + info.file_size > info.limit:
            raise CheckpointFormatError(
                f"Storage '{key}' of the archive at byte {self.offset} of '{self.path}' reaches into the next "
                "record or the archive's zip directory. The file is truncated or hostile.",
                path=self.path,
            )
        return self.offset + start, int(info.file_size), int(info.CRC)


def read_embedded_archive(pread: PRead, path: Path, offset: int, length: int) -> EmbeddedArchive:
    """Read the zip directory and pickle of the archive at ``[offset, offset + length)`` of ``path``."""
    try:
        what = f"The archive at byte {offset} of '{path}'"
        window = cast(IO[bytes], _Window(pread, offset, length))  # seek and read: all the zip readers use
        ends = check_directory_size(window, path, length, what)
        with zipfile.ZipFile(window) as archive:
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pickles) != 1:
                raise CheckpointFormatError(
                    f"The archive at byte {offset} of '{path}' is not a torch.save archive (found {len(pickles)} "
                    "data.pkl records). The file is corrupted.",
                    path=path,
                )
            refuse_zipfile_layout(infos, pickles[0].filename, ends, path, what)
            check_pickle_record(pickles[0], path)
            root = pickles[0].filename[: -len("data.pkl")]
            all_records = records_of(infos, archive.start_dir)
            records: dict[str, ZipRecord] = {}
            for info in all_records:
                if info.filename.startswith(root + "data/"):
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise UnsupportedCheckpointError(
                            f"'{path}' stores tensor data compressed ({info.filename}); torch.save never does.",
                            path=path,
                        )
                    records[info.filename[len(root) + len("data/") :]] = info
            data = read_pickle(window, archive, all_records[infos.index(pickles[0])], path, what)
    except ZeroIOError:
        raise
    except Exception as exc:  # zipfile raises many types on damaged archives
        raise CheckpointFormatError(
            f"The chunk at bytes [{offset}, {offset + length}) of '{path}' is not a readable torch.save archive "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}). The file is truncated or corrupted; copy it again.",
            path=path,
        ) from exc
    return EmbeddedArchive(path, offset, length, data, records)
