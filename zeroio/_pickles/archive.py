"""A torch zip archive on disk: its storage records, read lazily, and where each tensor's bytes lie.

``torch.save`` writes a zip archive: ``<root>/data.pkl`` (the object tree, a pickle) plus one uncompressed record
``<root>/data/<key>`` per storage. Storage locations (``cuda:0`` in GPU-written files) are ignored: bytes are bytes.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .._dtypes import DType
from .._io.confine import FileIdentity, open_regular, require_regular_file
from .._io.integrity import CheckedFile
from .._io.sources import ByteRange, open_source
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError, ZeroIOError
from .legacy import is_legacy_head
from .limits import MAX_PICKLE_BYTES
from .zip_directory import ZipRecord, read_directory, read_stored
from .zip_fallback import check_directory_size, read_pickle, records_of, refuse_zipfile_layout

if TYPE_CHECKING:
    import torch

__all__ = [
    "Archive",
    "RankFile",
    "RecordInfo",
    "Storage",
    "TensorRef",
    "check_pickle_record",
    "read_archive",
]

RecordInfo = ZipRecord
"""A zip record's directory entry (read by :mod:`.zip_directory`, or by :mod:`zipfile` and copied), with its
``limit``: where its bytes must end."""

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = 0x04034B50


@dataclass(frozen=True, slots=True)
class Storage:
    """One storage record of the archive (``data/<key>``), not yet read."""

    key: str
    dtype: DType
    numel: int
    location: str


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor's bytes live in a rank file; reading them is :meth:`RankFile.read`.

    The tensor is ``as_strided(size, stride, storage_offset)`` of its storage,
    exactly as torch rebuilds it.
    """

    file: RankFile
    storage: Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the tensor (imports torch: metadata-only code reads :attr:`dtype_spec`)."""
        return self.storage.dtype.torch

    @property
    def dtype_spec(self) -> DType:
        """Element type of the tensor, torch-free."""
        return self.storage.dtype

    @property
    def numel(self) -> int:
        """Number of elements of the tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_contiguous(self) -> bool:
        """True when the tensor's elements are one contiguous run of its storage."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def read(self, start: int = 0, count: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start+count)`` of the flattened tensor into ``out`` (or a new 1-D tensor)."""
        if count is None:
            count = self.numel - start if out is None else out.numel()
        if start < 0 or start + count > self.numel:
            raise CheckpointFormatError(
                f"Read [{start}, {start + count}) is outside a tensor of {self.numel} elements in '{self.file.path}'. "
                "The checkpoint's metadata disagrees with its data; the file is corrupted.",
                path=self.file.path,
            )
        if self.is_contiguous:
            return self.file.read_storage(self.storage, self.storage_offset + start, count, out)
        part = self.materialize().reshape(-1)[start : start + count]
        if out is None:
            return part.clone()
        return out.copy_(part)

    def byte_range(self, start: int, count: int) -> ByteRange | None:
        """``(source, offset, nbytes)`` of flattened elements ``[start, start+count)``, or None if not contiguous."""
        if not self.is_contiguous or start < 0 or start + count > self.numel:
            return None
        each = self.dtype_spec.itemsize
        offset = self.file.data_offset(self.storage.key) + (self.storage_offset + start) * each
        return self.file.source, offset, count * each

    def materialize(self) -> torch.Tensor:
        """The whole tensor, owned and with its shape."""
        if self.is_contiguous:
            return self.read().view(self.shape)
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if self.numel else 0
        flat = self.file.read_storage(self.storage, self.storage_offset, extent)
        return flat.as_strided(self.shape, self.stride).contiguous()


@dataclass(eq=False)
class RankFile:
    """One ``.pt`` archive: its parsed object tree and lazy access to its storages' bytes.

    The file descriptor is opened on first read and released by :meth:`close`.
    """

    path: Path
    _records: dict[str, RecordInfo] = field(default_factory=dict, repr=False)
    _data_offsets: dict[str, int] = field(default_factory=dict, repr=False)
    size: int = 0
    legacy_offsets: dict[str, int] | None = field(default=None, repr=False)
    """For a legacy (non-zip) stream: each storage's data offset, indexed at parse time (see ``.legacy``)."""
    identity: FileIdentity | None = field(default=None, repr=False)
    """The file whose directory was read at open: a file swapped before the first tensor read is refused."""
    root: str | None = None
    """The zip archive's root folder (``torch.save`` names it after the file's stem, or ``archive``)."""
    empty_keys: frozenset[str] = field(default=frozenset(), repr=False)
    """Storages known to hold no bytes whose records are not kept (see ``.replica``): nothing is ever read there."""
    source: CheckedFile = field(init=False, repr=False)
    """The file's bytes; reads of zip storage records are checked against their CRC-32 (``zeroio._io.integrity``).
    A legacy stream has no CRC: no record is registered, so nothing is checked."""

    def __post_init__(self) -> None:
        self.source = CheckedFile(open_source(self.path, self.size or None, self.identity))

    def close(self) -> None:
        """Release the file descriptor; idempotent."""
        self.source.close()

    @property
    def serialization(self) -> str:
        """``zip`` (torch's default, with a CRC-32 per record) or ``legacy`` (the non-zip stream, no checksum)."""
        return "zip" if self.legacy_offsets is None else "legacy"

    @property
    def storage_records(self) -> dict[str, tuple[int, int]]:
        """``{storage key: (CRC-32, bytes)}`` of every storage record."""
        found = dict.fromkeys(self.empty_keys, (0, 0))
        found.update((key, (int(info.CRC), int(info.file_size))) for key, info in self._records.items())
        return found

    @property
    def read_offsets(self) -> dict[str, int]:
        """Storage records whose data offset has been looked up (i.e. that were read), by key."""
        return dict(self._data_offsets)

    def data_offset(self, key: str) -> int:
        """Byte offset in the file of storage record ``key``'s data."""
        offset = self._data_offsets.get(key)
        if offset is not None:
            return offset
        if self.legacy_offsets is not None and key in self.legacy_offsets:
            self._data_offsets[key] = self.legacy_offsets[key]
            return self.legacy_offsets[key]
        info = self._records.get(key)
        if info is None and key in self.empty_keys:
            return 0  # a storage of no bytes: any offset reads nothing
        if info is None:
            raise CheckpointFormatError(
                f"'{self.path}' has no record for storage '{key}': the file is truncated or corrupted. "
                "Copy the rank file again from where it was saved.",
                path=self.path,
            )
        header = self.source.read_header(info.header_offset, _LOCAL_HEADER.size, info.limit)
        if len(header) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != _LOCAL_HEADER_MAGIC:
            raise CheckpointFormatError(
                f"Corrupted zip entry for storage '{key}' in '{self.path}'. Copy the rank file again.",
                path=self.path,
            )
        fields = _LOCAL_HEADER.unpack(header)  # its name is not read: no other entry shares this header
        offset = int(info.header_offset) + _LOCAL_HEADER.size + int(fields[9]) + int(fields[10])
        if offset + int(info.file_size) > info.limit:
            raise CheckpointFormatError(
                f"'{self.path}': the bytes of storage '{key}' ({info.file_size} from byte {offset}) reach into the "
                "next record or the zip directory; torch.save never overlaps records. The file is corrupted or "
                "hostile; copy it again.",
                path=self.path,
            )
        self._expect_crc(info, offset)
        self._data_offsets[key] = offset
        return offset

    def _expect_crc(self, info: RecordInfo, offset: int) -> None:
        """Tell the byte source where record ``info``'s data lies and its stored CRC, before any read of it."""
        self.source.expect(info.filename, offset, int(info.file_size), int(info.CRC))

    def read_storage(self, storage: Storage, start: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start+count)`` of a storage, read with ``preadv`` straight into ``out``.

        ``out`` (1-D, contiguous, ``storage.dtype``, ``count`` elements) is allocated when not given.
        """
        if out is None:
            import torch

            out = torch.empty(count, dtype=storage.dtype.torch)
        if count <= 0:
            return out
        if start < 0 or start + count > storage.numel:
            raise CheckpointFormatError(
                f"Tensor view [{start}, {start + count}) lies outside its storage of {storage.numel} elements in "
                f"'{self.path}'. The file is corrupted; copy it again.",
                path=self.path,
            )
        offset = self.data_offset(storage.key) + start * out.element_size()
        self.source.read_into(offset, out, f"storage '{storage.key}'")
        return out


@dataclass(frozen=True, slots=True)
class Archive:
    """A torch zip archive's pickle and storage records (no tensor bytes read)."""

    path: Path
    """The file."""
    size: int
    """Its size in bytes."""
    pickle: bytes
    """The ``data.pkl`` record: the object tree."""
    records: dict[str, RecordInfo]
    """Storage records by key (``data/<key>``), all stored uncompressed."""
    identity: FileIdentity | None = None
    """The local file read (``fd_pool.file_identity``): later reads must find the same file."""
    root: str | None = None
    """The archive's root folder (``torch.save`` names it after the file's stem, or ``archive``)."""
    empty_keys: frozenset[str] = frozenset()
    """Storage records of no bytes, by key, not in :attr:`records` (read by :mod:`.zip_directory`)."""

    def has_record(self, key: str, nbytes: int) -> int | None:
        """The bytes of storage record ``key`` when it holds exactly ``nbytes`` (as torch's reader requires), else
        None."""
        info = self.records.get(key)
        if info is not None:
            return int(info.file_size) if info.file_size == nbytes else None
        return 0 if nbytes == 0 and key in self.empty_keys else None


def _prefetch(fh: object, record: zipfile.ZipInfo, infos: list[zipfile.ZipInfo], directory: int) -> None:
    """A remote file (``zeroio._io.remote_path``) fetches the pickle's whole record (header, name, padding, ``data.pkl``) in
    one request: from its header to the next record's (or the zip directory), so no tensor byte is fetched."""
    prefetch = getattr(fh, "prefetch", None)
    if prefetch is not None:
        upper = record.header_offset + 30 + 0xFFFF * 2 + record.compress_size  # name and local extra: 64 KiB each
        after = [i.header_offset for i in infos if i.header_offset > record.header_offset]
        prefetch(record.header_offset, min([upper, directory, *after]))


def check_pickle_record(info: RecordInfo | zipfile.ZipInfo, path: Path) -> None:
    """Refuse a ``data.pkl`` record that would unpack to more than the file holds or :data:`MAX_PICKLE_BYTES`.

    torch.save stores every record uncompressed; a compressed pickle is how a 2.6 MB zip bomb becomes 2.5 GiB.
    """
    if info.compress_type != zipfile.ZIP_STORED:
        raise UnsupportedCheckpointError(
            f"'{path}' stores its pickle compressed ({info.filename}); torch.save never does, and zeroio does not "
            "unpack it. Re-save the file with torch.save.",
            path=path,
        )
    if info.file_size > MAX_PICKLE_BYTES:
        raise UnsupportedCheckpointError(
            f"'{path}' has a {info.file_size}-byte pickle; zeroio reads pickles up to {MAX_PICKLE_BYTES} bytes "
            "(tensor data is not part of it). The file is corrupted or hostile.",
            path=path,
        )


def _check_signature(fh: IO[bytes], path: Path, size: int) -> bool:
    """True for a zip signature, False for a legacy torch stream (a pickle); anything else is refused."""
    fh.seek(0)
    magic = fh.read(4)
    if magic[:2] == b"PK":
        return True
    if is_legacy_head(magic):
        return False
    raise CheckpointFormatError(
        f"'{path}' is not a torch checkpoint (no zip signature; {size} bytes). "
        "Point zeroio at a DeepSpeed checkpoint folder or a file written by torch.save.",
        path=path,
    )


def _open_archive(path: Path) -> tuple[IO[bytes], FileIdentity | None]:
    """``path`` opened for the zip reader, with the identity of the local file opened (None for a remote object):
    the descriptor is checked regular again, and opening a FIFO swapped in since the check never blocks."""
    if hasattr(path, "byte_source"):  # a RemotePath: pinned by its ETag instead
        return path.open("rb"), None
    fd, identity = open_regular(path)
    return os.fdopen(fd, "rb"), identity


def _read_plain(
    fh: io.BufferedReader, path: Path, size: int, identity: FileIdentity | None, with_pickle: bool = True
) -> Archive | None:
    """:func:`read_archive` of a local file in ``torch.save``'s plain layout (:mod:`.zip_directory`); None for any
    other file, which :mod:`zipfile` then reads (and names what is wrong with it)."""
    head = fh.read(2)
    if head != b"PK":
        return None
    found = read_directory(fh, size)
    if found is None:
        return None
    infos, empty_keys, _ = found
    pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if len(pickles) != 1:
        return None
    root = pickles[0].filename[: -len("data.pkl")]
    prefix = root + "data/"
    records: dict[str, RecordInfo] = {}
    for info in infos:
        if info.filename.startswith(prefix):
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            records[info.filename[len(prefix) :]] = info
    check_pickle_record(pickles[0], path)
    data = read_stored(fh, pickles[0]) if with_pickle else b""
    if data is None:
        return None
    return Archive(path, size, data, records, identity, root.rstrip("/") or None, empty_keys)


def read_archive(path: Path, *, with_pickle: bool = True) -> Archive | None:
    """Read the zip directory and the pickle of a ``torch.save`` file; None for torch's legacy (non-zip) stream.

    The zip is parsed before the file's first bytes are checked: a remote file then fetches its end records, its
    directory and its pickle record (from byte 0) in three requests, and the signature check reads the cached
    pickle record instead of a fourth. Raises a :mod:`zeroio.errors` exception for anything that is not a
    well-formed torch zip archive. ``with_pickle=False`` reads the directory alone (``pickle`` is then empty).
    """
    try:
        require_regular_file(path)
        fh, identity = _open_archive(path)
        size = path.stat().st_size if identity is None else identity[2]
        with fh:
            if isinstance(fh, io.BufferedReader):  # a local file: torch's plain layout is read without zipfile
                fast = _read_plain(fh, path, size, identity, with_pickle)
                if fast is not None:
                    return fast
            ends = check_directory_size(fh, path, size)
            try:
                archive = zipfile.ZipFile(fh)
            except Exception:  # not a zip: the first bytes say what it is
                if not _check_signature(fh, path, size):
                    return None
                raise
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pickles) == 1 and pickles[0].compress_size <= MAX_PICKLE_BYTES:
                _prefetch(fh, pickles[0], infos, int(getattr(archive, "start_dir", size)))
            if not _check_signature(fh, path, size):
                return None
            if len(pickles) != 1:
                raise CheckpointFormatError(
                    f"'{path}' is a zip file but not a torch checkpoint (found {len(pickles)} data.pkl records). "
                    "Point zeroio at files written by torch.save.",
                    path=path,
                )
            refuse_zipfile_layout(infos, pickles[0].filename, ends, path)
            root = pickles[0].filename[: -len("data.pkl")]
            all_records = records_of(infos, archive.start_dir)
            records: dict[str, RecordInfo] = {}
            for info in all_records:
                if info.filename.startswith(root + "data/"):
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise UnsupportedCheckpointError(
                            f"'{path}' stores tensor data compressed ({info.filename}); torch.save never does. "
                            "Re-save the file with torch.save.",
                            path=path,
                        )
                    records[info.filename[len(root) + len("data/") :]] = info
            pickle = all_records[infos.index(pickles[0])]
            check_pickle_record(pickle, path)
            data = read_pickle(fh, archive, pickle, path) if with_pickle else b""
    except ZeroIOError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"'{path}' does not exist.", path=path) from exc
    except Exception as exc:  # zipfile raises many types on damaged archives; all mean the same to a user
        raise CheckpointFormatError(
            f"'{path}' is truncated or corrupted ({type(exc).__name__}: {exc}). Copy the file again from where it "
            "was saved.",
            path=path,
        ) from exc

    return Archive(path, size, data, records, identity, root.rstrip("/") or None)
