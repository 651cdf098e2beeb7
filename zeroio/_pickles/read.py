"""The restricted unpickler: a ``.pt`` file's object tree, with nothing in it able to run code.

Globals resolve only through an allowlist, and every tensor comes back as a :class:`TensorRef` (where its bytes
are, not the bytes). DeepSpeed's own classes (``ZeroStageEnum``, ``LossScaler``, ...) become inert stand-ins
(:mod:`.standins`), so DeepSpeed need not be installed.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._dtypes import DType
from .._io.remote_path import as_path
from .._io.sources import Fenced, LocalFile, open_source
from ..errors import CheckpointFormatError, UnsafePickleError, UnsupportedCheckpointError, ZeroIOError
from .allowed import ALLOWED, PendingTensor, StorageType, short_repr
from .archive import Archive, RankFile, Storage, TensorRef, read_archive
from .embedded import EmbeddedTensor, PRead, read_embedded_archive
from .global_names import python2_name
from .hash_work import check_hash_work, check_stream
from .legacy import PickleWindow, index_storages, read_legacy_header, read_storage_keys
from .limits import MAX_DEPTH, too_large
from .standins import Device, Inert, Size, inert_class

__all__ = ["check_records", "load_embedded", "load_pickle", "parse_archive", "parse_archive_storages"]


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only allowlisted globals; tensors become ``PendingTensor`` records."""

    def __init__(self, data: bytes | PickleWindow, path: Path, trusted: frozenset[str], legacy: bool = False) -> None:
        if isinstance(data, bytes):  # before any object is built: tuples hashed over and over never return
            check_hash_work(data, path)
        else:
            check_stream(data, path)
        super().__init__(io.BytesIO(data) if isinstance(data, bytes) else data, encoding="utf-8")
        self._path = path
        self._trusted = trusted
        self._legacy = legacy
        """A legacy stream's persistent ids carry a sixth field, view metadata, always None."""
        self.storages: dict[str, Storage] = {}
        self.created: dict[str, tuple[Any, ...]] = {}
        """Each storage's fields as created: a BUILD on a storage record must not change them unseen."""

    def find_class(self, module: str, name: str) -> Any:
        spelled = f"{module}.{name}"  # as the file spells it: trusted under this name too
        module, name = python2_name(module, name)
        qualified = f"{module}.{name}"
        if qualified in ALLOWED:
            return ALLOWED[qualified]
        if qualified in self._trusted or spelled in self._trusted:
            return inert_class(qualified)
        raise UnsafePickleError(
            f"Refusing to unpickle global '{qualified}' from '{self._path}': it is not on zeroio's allowlist. "
            f"If you trust this file, pass trusted_globals=['{qualified}'] (it is rebuilt as inert data, never called).",
            path=self._path,
            name=qualified,
        )

    def persistent_load(self, pid: Any) -> Storage:
        if self._legacy and isinstance(pid, tuple) and len(pid) == 6 and pid[5] is None:
            pid = pid[:5]
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointFormatError(
                f"Unexpected persistent id {short_repr(pid)} in '{self._path}': not a torch checkpoint storage. "
                "Re-save the file with torch.save.",
                path=self._path,
            )
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, StorageType):
            raise UnsafePickleError(
                f"Unexpected storage type {short_repr(storage_type)} in '{self._path}'. Re-save the file with "
                "torch.save.",
                path=self._path,
            )
        if not isinstance(key, str) or not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise CheckpointFormatError(
                f"Storage {short_repr(key)} in '{self._path}' has an invalid key or size {short_repr(numel)}. The "
                "file is corrupted; copy it again.",
                path=self._path,
            )
        if key not in self.storages:
            self.storages[key] = Storage(key, storage_type.dtype, numel, str(location))
            self.created[key] = (key, storage_type.dtype, numel)
        return self.storages[key]


def _check_view(t: PendingTensor, path: Path) -> None:
    """A tensor's size/stride/offset must be non-negative ints that stay inside its storage.

    Its element count must fit in the storage too: a stride-0 view repeating one stored element 2**40 times
    would make a read allocate what the file cannot back. (torch.save keeps such broadcast views, but state dicts
    never hold them.)
    """
    values = (t.storage_offset, *t.shape, *t.stride)
    if (
        not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
        or len(t.shape) != len(t.stride)
        or too_large(t.shape)  # an empty (0, 2**64) names no bytes, yet no tensor or safetensors file can hold it
    ):
        raise CheckpointFormatError(
            f"'{path}' describes a tensor with an invalid view (size {short_repr(t.shape)}, stride "
            f"{short_repr(t.stride)}, offset {short_repr(t.storage_offset)}). The file is corrupted; copy it again.",
            path=path,
        )
    numel = 1
    for s in t.shape:
        numel *= s
    extent = 0 if numel == 0 else 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride))
    if numel and t.storage_offset + extent > t.storage.numel:
        raise CheckpointFormatError(
            f"'{path}' describes a tensor of shape {t.shape} that reaches past its storage of {t.storage.numel} "
            "elements. The file is corrupted; copy it again.",
            path=path,
        )
    if numel > t.storage.numel:
        raise CheckpointFormatError(
            f"'{path}' describes a tensor of {numel} elements over a storage of {t.storage.numel}: reading it would "
            "allocate more than the file holds. The file is corrupted or hostile; copy it again from where it was "
            "saved.",
            path=path,
        )


def _bind(tree: Any, file: RankFile) -> Any:
    """Replace every ``PendingTensor`` in the tree by a ``TensorRef`` into ``file``.

    Each object is visited once (a pickle may reference one list from many places: 40 levels of "this list, twice"
    are 2**40 paths), cycles and nesting deeper than :data:`MAX_DEPTH` are refused.
    """
    done: dict[int, tuple[Any, Any]] = {}  # id -> (object, result): the object kept alive so its id stays unique
    active: set[int] = set()

    def bind(obj: Any, depth: int) -> Any:
        if isinstance(obj, (str, bytes, int, float, bool, type(None), DType, Size, Device)):
            return obj
        key = id(obj)
        if key in done:
            return done[key][1]
        if key in active:
            raise CheckpointFormatError(
                f"'{file.path}' holds a {type(obj).__name__} that contains itself; torch.save never writes one "
                "into a checkpoint. The file is corrupted or hostile.",
                path=file.path,
            )
        if depth > MAX_DEPTH:
            raise CheckpointFormatError(
                f"'{file.path}' nests containers more than {MAX_DEPTH} levels deep; zeroio reads checkpoints up to "
                "that depth. The file is corrupted or hostile.",
                path=file.path,
            )
        active.add(key)
        result = _bind_one(obj, file, lambda child: bind(child, depth + 1))
        active.discard(key)
        done[key] = (obj, result)
        return result

    return bind(tree, 0)


def _bind_one(obj: Any, file: RankFile, bind: Any) -> Any:
    if isinstance(obj, PendingTensor):
        _check_view(obj, file.path)
        return TensorRef(file, obj.storage, obj.storage_offset, obj.shape, obj.stride)
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = bind(value)
        return obj
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            obj[i] = bind(value)
        return obj
    if isinstance(obj, tuple):
        items = [bind(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Inert):
        for key, value in list(obj.__dict__.items()):
            obj.__dict__[key] = bind(value)
    return obj


def _unpickle(unpickler: _RestrictedUnpickler, path: Path) -> Any:
    try:
        return unpickler.load()
    except ZeroIOError as exc:
        if exc.path is not None:
            raise
        # Raised by an allowlisted global, which does not know the file: name it.
        raise type(exc)(f"Refusing '{path}': {exc}", path=path, name=exc.name) from None
    except Exception as exc:  # any malformed pickle: never let a raw pickle traceback escape
        raise CheckpointFormatError(
            f"Cannot parse the pickle in '{path}' ({type(exc).__name__}: {exc}). The file is corrupted or was "
            "not written by torch.save; copy it again.",
            path=path,
        ) from exc


def _check_unchanged(unpickler: _RestrictedUnpickler, path: Path) -> None:
    for key, storage in unpickler.storages.items():
        if (storage.key, storage.dtype, storage.numel) != unpickler.created[key]:
            raise UnsafePickleError(
                f"Refusing '{path}': the pickle changes storage record '{key}' after naming it. The file is hostile "
                "or corrupted; do not use it.",
                path=path,
            )


LEGACY_REMOTE_CHUNK = 2**20
"""A remote legacy stream's pickles are read in pieces this large: one request each instead of one per pickle
opcode (a file this small in one request; the piece past the pickles is the start of the storages)."""


def _load_legacy(path: Path, trusted: frozenset[str]) -> tuple[Any, RankFile]:
    """A legacy stream: header, object tree and key list read through a window; storages indexed by offset."""
    size = path.stat().st_size
    source = open_source(path, size)
    try:
        window = PickleWindow(source, path, size, chunk=0 if isinstance(path, Path) else LEGACY_REMOTE_CHUNK)
        read_legacy_header(window, path)
        unpickler = _RestrictedUnpickler(window, path, trusted, legacy=True)
        tree = _unpickle(unpickler, path)
        _check_unchanged(unpickler, path)
        keys = read_storage_keys(window, path)
        declared = {k: (s.numel, s.dtype.itemsize) for k, s in unpickler.storages.items()}
        offsets = index_storages(window.pread, path, size, window.position, keys, declared)
    finally:
        if isinstance(source, LocalFile):
            source.close()  # a remote file is shared with the RankFile below: what it fetched stays cached
    identity = source.identity if isinstance(source, LocalFile) else None  # the file read: later reads must find it
    file = RankFile(path, size=size, legacy_offsets=offsets, identity=identity)
    if isinstance(file.source.source, Fenced):  # never read ahead from one storage into the next (the moments)
        for key, offset in offsets.items():
            numel, each = declared[key]
            file.source.source.fence(offset + numel * each)
    return _bind(tree, file), file


def load_pickle(
    path: str | os.PathLike[str], *, trusted_globals: frozenset[str] = frozenset(), legacy: bool = False
) -> tuple[Any, RankFile]:
    """Parse a torch checkpoint without reading any tensor bytes.

    ``legacy=True`` also reads torch's legacy non-zip stream (DeepSpeed's ``checkpoint_serialization: false``
    rank files); otherwise such a file is refused with a re-save hint, as for consolidated files.

    Returns the object tree (tensors as :class:`TensorRef`) and the :class:`RankFile`
    that reads them. Raises a :mod:`zeroio.errors` exception for anything that is
    not a well-formed torch checkpoint or asks for a global outside the allowlist.
    """
    path = as_path(path)
    archive = read_archive(path)
    if archive is None:
        if legacy:
            return _load_legacy(path, trusted_globals)
        raise UnsupportedCheckpointError(
            f"'{path}' uses torch's legacy (pre-1.6) serialization, which zeroio does not read. "
            "Re-save it with torch.save (zip format).",
            path=path,
        )
    return parse_archive(archive, trusted_globals)


def parse_archive(archive: Archive, trusted_globals: frozenset[str]) -> tuple[Any, RankFile]:
    """The object tree of a read zip archive (tensors bound to a :class:`RankFile` of it), as :func:`load_pickle`."""
    tree, file, _ = parse_archive_storages(archive, trusted_globals)
    return tree, file


def parse_archive_storages(
    archive: Archive, trusted_globals: frozenset[str]
) -> tuple[Any, RankFile, tuple[Storage, ...]]:
    """:func:`parse_archive`, and every storage the pickle named."""
    path, records = archive.path, archive.records
    unpickler = _RestrictedUnpickler(archive.pickle, path, trusted_globals)
    tree = _unpickle(unpickler, path)
    file = RankFile(
        path, records, size=archive.size, identity=archive.identity, root=archive.root, empty_keys=archive.empty_keys
    )
    _check_unchanged(unpickler, path)
    check_records(unpickler.storages.values(), archive)
    return _bind(tree, file), file, tuple(unpickler.storages.values())


def check_records(storages: Iterable[Storage], archive: Archive) -> None:
    """Every storage the pickle names has a record in the archive holding its bytes."""
    for storage in storages:
        needed = storage.numel * storage.dtype.itemsize
        if archive.has_record(storage.key, needed) is None:
            record = archive.records.get(storage.key)
            raise CheckpointFormatError(
                f"'{archive.path}' is truncated or corrupted: storage '{storage.key}' needs {needed} bytes, "
                f"the archive holds {0 if record is None else record.file_size}. Copy the file again.",
                path=archive.path,
            )


def load_embedded(pread: PRead, path: Path, offset: int, length: int, trusted: frozenset[str] = frozenset()) -> Any:
    """Parse the ``torch.save`` archive at ``[offset, offset + length)`` of ``path`` (a DCP chunk), reading no
    tensor bytes: a tensor at the top of its tree comes back as an :class:`EmbeddedTensor` (contiguous, filling its
    storage from element 0, as DCP writes chunks); any other tree comes back as parsed."""
    archive = read_embedded_archive(pread, path, offset, length)
    unpickler = _RestrictedUnpickler(archive.pickle, path, trusted)
    tree = _unpickle(unpickler, path)
    _check_unchanged(unpickler, path)
    if not isinstance(tree, PendingTensor):
        return tree
    _check_view(tree, path)
    numel = 1
    for s in tree.shape:
        numel *= s
    strides, expected = [], 1
    for s in reversed(tree.shape):
        strides.append(expected)
        expected *= s
    if numel > 1 and tuple(reversed(strides)) != tuple(tree.stride):
        raise UnsupportedCheckpointError(
            f"The chunk at byte {offset} of '{path}' holds a non-contiguous tensor view (stride {tree.stride}); DCP "
            "writes chunks contiguous. Re-save it with dcp.save.",
            path=path,
        )
    start, size, crc = archive.record_data(pread, tree.storage.key)
    each = tree.storage.dtype.itemsize
    named = unpickler.storages[tree.storage.key]
    if named.numel * named.dtype.itemsize != size:  # torch's reader refuses a record of another size
        raise CheckpointFormatError(
            f"The chunk at byte {offset} of '{path}' names storage '{named.key}' of {named.numel * named.dtype.itemsize} "
            f"bytes over a record of {size}. The file is corrupted or hostile; copy it again.",
            path=path,
        )
    if (tree.storage_offset + numel) * each > size:
        raise CheckpointFormatError(
            f"The chunk at byte {offset} of '{path}' claims elements [{tree.storage_offset}, "
            f"{tree.storage_offset + numel}) of a record of {size} bytes. The file is truncated or hostile.",
            path=path,
        )
    return EmbeddedTensor(tree.storage.dtype, tuple(tree.shape), start + tree.storage_offset * each, (start, size, crc))
