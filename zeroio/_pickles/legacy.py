"""torch's legacy (non-zip) serialization: where a stream's pickles end and each storage's bytes lie.

``torch.save(..., _use_new_zipfile_serialization=False)`` (DeepSpeed's ``"checkpoint_serialization": false``)
writes one stream: five pickles, then the storages' raw bytes::

    pickle(MAGIC_NUMBER)  pickle(PROTOCOL_VERSION)  pickle(sys_info)
    pickle(object tree)          # tensors as persistent ids ('storage', type, key, location, numel, None)
    pickle(sorted storage keys)
    for key in that list: int64 little-endian element count, then count * itemsize raw bytes

Nothing here runs pickle code: the header and key-list pickles may name no global at all, and the object tree is
read by :mod:`.read`'s restricted unpickler through a :class:`PickleWindow`, which reads exactly the bytes the
pickle asks for (never a tensor's; from a remote file, in pieces of a fixed size instead, one request each) and
no more than :data:`~.limits.MAX_PICKLE_BYTES`. The storages are then
indexed by hopping over their 8-byte counts, so opening a file reads ``8 * storages`` bytes past the pickles.
The format carries no checksum: unlike zip records, nothing can be CRC-checked.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._io.sources import ByteSource
from ..errors import CheckpointFormatError, UnsafePickleError, UnsupportedCheckpointError, ZeroIOError
from .hash_work import check_stream
from .limits import MAX_PICKLE_BYTES

__all__ = [
    "LEGACY_MAGIC_NUMBER",
    "LEGACY_PROTOCOL_VERSION",
    "PickleWindow",
    "index_storages",
    "is_legacy_head",
    "read_legacy_header",
    "read_storage_keys",
]

LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
"""The first pickle of every legacy torch file (``torch.serialization.MAGIC_NUMBER``)."""
LEGACY_PROTOCOL_VERSION = 1001
"""The second (``torch.serialization.PROTOCOL_VERSION``)."""
_COUNT = struct.Struct("<q")
_MAX_LINE = 1 << 16


def is_legacy_head(head: bytes) -> bool:
    """True for the first bytes of a legacy torch stream: a pickle (``PROTO`` opcode), not a zip signature."""
    return head[:1] == b"\x80"


class PickleWindow:
    """A read-only stream over one file for ``pickle.Unpickler``: exact positional reads, bounded in total.

    It has no ``peek``, so the unpickler asks for exactly the bytes each opcode needs and :attr:`position` is where
    the pickle ended. A pickle that asks for more than :data:`MAX_PICKLE_BYTES` in all is refused.
    """

    def __init__(self, source: ByteSource, path: Path, size: int, position: int = 0, chunk: int = 0) -> None:
        self._source = source
        self._path = path
        self._size = size
        self.position = position
        self._limit = position + MAX_PICKLE_BYTES
        self._chunk = chunk
        self._buffer = b""
        self._buffer_at = 0

    def pread(self, at: int, n: int) -> bytes:
        """``n`` bytes at ``at`` (fewer at the end): exact reads, or served from pieces of ``chunk`` bytes when a
        request costs a round trip (a remote file: its pickles then come in one or two requests, not one per
        opcode; the piece may run past the pickles into the storages that follow)."""
        if not self._chunk:
            return self._source.read_bytes(at, n)
        out = bytearray()
        while n > 0 and at < self._size:
            if not self._buffer_at <= at < self._buffer_at + len(self._buffer):
                self._buffer, self._buffer_at = self._source.read_bytes(at, min(self._chunk, self._size - at)), at
                if not self._buffer:
                    break
            piece = self._buffer[at - self._buffer_at : at - self._buffer_at + n]
            out += piece
            at += len(piece)
            n -= len(piece)
        return bytes(out)

    def _take(self, n: int) -> int:
        if n < 0:
            n = self._size - self.position
        if self.position + n > self._limit:
            raise UnsupportedCheckpointError(
                f"'{self._path}' has a pickle longer than {MAX_PICKLE_BYTES} bytes; zeroio reads pickles up to that "
                "size (tensor data is not part of it). The file is corrupted or hostile.",
                path=self._path,
            )
        return min(n, max(0, self._size - self.position))

    def read(self, n: int = -1) -> bytes:
        data = self.pread(self.position, self._take(n)) if n else b""
        self.position += len(data)
        return data

    def readline(self, n: int = -1) -> bytes:
        chunk = self.pread(self.position, self._take(min(_MAX_LINE, n) if n >= 0 else _MAX_LINE))
        end = chunk.find(b"\n")
        line = chunk if end < 0 else chunk[: end + 1]
        self.position += len(line)
        return line


class _NoGlobals(pickle.Unpickler):
    """For the header and key-list pickles: plain ints, strings, dicts and lists only."""

    def __init__(self, window: PickleWindow, path: Path) -> None:
        super().__init__(window, encoding="utf-8")
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(
            f"Refusing '{self._path}': its legacy header names the global '{module}.{name}', which torch never "
            "writes there. The file is corrupted or hostile.",
            path=self._path,
            name=f"{module}.{name}",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(
            f"'{self._path}' has a persistent id in its legacy header; torch never writes one there. The file is "
            "corrupted.",
            path=self._path,
        )


def _plain_pickle(window: PickleWindow, path: Path, what: str) -> Any:
    check_stream(window, path)  # before any object is built: tuples hashed over and over never return
    try:
        return _NoGlobals(window, path).load()
    except ZeroIOError:
        raise
    except Exception as exc:
        raise CheckpointFormatError(
            f"'{path}' is truncated or corrupted: its legacy {what} pickle cannot be read ({type(exc).__name__}: "
            f"{exc}). Copy the file again from where it was saved.",
            path=path,
        ) from exc


def read_legacy_header(window: PickleWindow, path: Path) -> None:
    """Read the magic number, protocol version and system info; refuse what torch's legacy loader refuses."""
    magic = _plain_pickle(window, path, "magic number")
    if magic != LEGACY_MAGIC_NUMBER:
        raise CheckpointFormatError(
            f"'{path}' starts with a pickle but not torch's legacy magic number: it is not a torch checkpoint. "
            "Point zeroio at a DeepSpeed checkpoint folder or a file written by torch.save.",
            path=path,
        )
    version = _plain_pickle(window, path, "protocol version")
    if version != LEGACY_PROTOCOL_VERSION:
        raise UnsupportedCheckpointError(
            f"'{path}' uses legacy torch protocol version {version!r}; zeroio reads version "
            f"{LEGACY_PROTOCOL_VERSION}. Re-save it with torch.save.",
            path=path,
        )
    info = _plain_pickle(window, path, "system info")
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise UnsupportedCheckpointError(
            f"'{path}' was written on a big-endian machine (or records no byte order); zeroio reads little-endian "
            "legacy files only. Re-save it with torch.save on a little-endian machine.",
            path=path,
        )


def read_storage_keys(window: PickleWindow, path: Path) -> list[str]:
    """The storage keys after the object tree, in the order their bytes follow; each named once."""
    keys = _plain_pickle(window, path, "storage-key list")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointFormatError(
            f"'{path}': the legacy storage-key list should be a list of strings, found {type(keys).__name__}. The "
            "file is corrupted.",
            path=path,
        )
    if len(set(keys)) != len(keys):
        raise CheckpointFormatError(
            f"'{path}' lists a storage twice in its legacy storage-key list: two tensors would share bytes torch "
            "wrote once. The file is corrupted or hostile.",
            path=path,
        )
    return keys


def index_storages(
    read: Callable[[int, int], bytes],
    path: Path,
    size: int,
    start: int,
    keys: list[str],
    storages: dict[str, tuple[int, int]],
) -> dict[str, int]:
    """``{key: byte offset of its data}``, hopping over each ``(count, bytes)`` record from ``start``.

    ``storages`` is ``{key: (element count the pickle declared, bytes per element)}``. Every record's count must
    equal the declared one and fit the file; the records must be exactly the declared storages and end the file.
    Reads 8 bytes per storage, with ``read(offset, nbytes)``.
    """
    if set(keys) != set(storages):
        missing = sorted(set(storages) - set(keys))[:3]
        extra = sorted(set(keys) - set(storages))[:3]
        raise CheckpointFormatError(
            f"'{path}': the legacy storage-key list does not match the storages the pickle uses (missing "
            f"{missing}, unused {extra}). The file is corrupted or hostile; copy it again.",
            path=path,
        )
    offsets: dict[str, int] = {}
    at = start
    for key in keys:
        numel, each = storages[key]
        head = read(at, _COUNT.size) if at + _COUNT.size <= size else b""
        if len(head) != _COUNT.size:
            raise CheckpointFormatError(
                f"'{path}' is truncated: it ends at byte {size}, before storage '{key}' (expected at byte {at}). "
                "Copy the file again from where it was saved.",
                path=path,
            )
        (count,) = _COUNT.unpack(head)
        if count != numel:
            raise CheckpointFormatError(
                f"'{path}': storage '{key}' records {count} elements in its data, the pickle declares {numel}. The "
                "file is corrupted or hostile; copy it again.",
                path=path,
            )
        at += _COUNT.size
        if at + count * each > size:
            raise CheckpointFormatError(
                f"'{path}' is truncated: storage '{key}' needs {count * each} bytes from byte {at}, the file has "
                f"{size} bytes. Copy the file again from where it was saved.",
                path=path,
            )
        offsets[key] = at
        at += count * each
    if at != size:
        raise CheckpointFormatError(
            f"'{path}' has {size - at} bytes after its last legacy storage record; torch writes none. The file is "
            "corrupted or two files were joined; copy it again.",
            path=path,
        )
    return offsets
