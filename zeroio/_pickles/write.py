"""Writing the pickle world back: DeepSpeed-class records by name, and torch zip archives filled chunk by chunk."""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import secrets
import struct
import tempfile
import types
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from .._io.fileio import pwrite_all, tensor_bytes
from .._messages import get_logger
from ..errors import CheckpointFormatError, OutputError, PartitionMismatchError, UnsupportedCheckpointError
from .archive import TensorRef
from .archive_layout import ArchiveLayout, StoredRecord
from .plain_tree import TensorRule, Walk, Where, to_plain
from .read import load_pickle
from .standins import ZERO_STAGE_ENUM, Inert, ZeroStageEnum, global_name, inert_parts

if TYPE_CHECKING:
    import torch

__all__ = [
    "Chunks",
    "DeepSpeedPickler",
    "RankFileBuilder",
    "Template",
    "ds_class",
    "ds_object",
    "ds_value",
    "walk_path",
    "writable",
]

logger = get_logger(__name__)

Chunks: TypeAlias = "Callable[[], Iterator[torch.Tensor]]"
"""Produces a tensor's bytes in order, as bounded 1-D chunks (each valid until the next is asked for)."""


# --------------------------------------------------------------------------- pickling DeepSpeed's classes


_DS_CLASSES: dict[str, type] = {}


_MARKER_PREFIX = f"_zeroio_ds_{secrets.token_hex(8)}_"
"""Names of the stand-in classes in this module: random per process, so no string a checkpoint carries matches
one (see :class:`DeepSpeedPickler`)."""


def ds_class(qualified: str) -> type:
    """A local class that pickles as the global ``qualified`` (e.g. DeepSpeed's ``LossScaler``).

    zeroio never imports DeepSpeed: the pickle names the class and DeepSpeed's unpickler resolves it. The class
    lives in this module under a marker name (the C pickler finds it there), which :class:`DeepSpeedPickler` rewrites.
    """
    cls = _DS_CLASSES.get(qualified)
    if cls is None:
        marker = f"{_MARKER_PREFIX}{len(_DS_CLASSES)}"
        attrs = {"_zeroio_writes_as": qualified, "__module__": __name__, "__qualname__": marker}
        cls = _DS_CLASSES[qualified] = type(qualified.rsplit(".", 1)[1], (), attrs)
        globals()[marker] = cls
    return cls


class _Call:
    """Pickles as ``cls(*args)`` (how ``ZeroStageEnum.weights`` pickles: ``ZeroStageEnum(3)``)."""

    def __init__(self, cls: type, args: tuple[Any, ...]) -> None:
        self.cls = cls
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.cls, self.args)


def ds_object(qualified: str, state: dict[str, Any]) -> Any:
    """An object that pickles like an instance of ``qualified`` with ``__dict__`` ``state`` (NEWOBJ + BUILD)."""
    obj: Any = object.__new__(ds_class(qualified))
    obj.__dict__.update(state)
    return obj


def ds_value(obj: Any, where: Where, walk: Walk, *, source: Path) -> Any:
    """A parsed stand-in as an object that pickles as the class it stood for (a :data:`StandinRule`).

    Raises:
        UnsupportedCheckpointError: the object was built from constructor arguments (or an opaque state),
            which cannot be written back as attributes.
    """
    if isinstance(obj, ZeroStageEnum):
        return _Call(ds_class(ZERO_STAGE_ENUM), (int(obj),))
    if not isinstance(obj, Inert) or global_name(obj) == "object":
        return obj
    parts = inert_parts(obj)
    if parts.args or parts.kwargs or parts.opaque_state:
        raise UnsupportedCheckpointError(
            f"'{source}': '{'.'.join(map(str, where))}' holds a {parts.name} built from constructor arguments, "
            "which zeroio cannot write back yet. Remove it from the client state before resharding.",
            path=source,
        )
    return ds_object(parts.name, {k: walk(v, (*where, k)) for k, v in parts.state.items()})


def writable(value: Any, where: Where, *, tensor: TensorRule, source: Path) -> Any:
    """A value parsed by zeroio's unpickler, made picklable again for a DeepSpeed rank file.

    Tensors become what ``tensor`` returns; DeepSpeed objects pickle under their own class names; dict subclasses
    (Lightning's ``AttributeDict``) are written as plain dicts, with a warning.
    """

    def retyped(node: dict[Any, Any], path: Where) -> None:
        logger.warning(
            "%s: '%s' (a %s) is written as a plain dict", source, ".".join(map(str, path)), type(node).__name__
        )

    def standin(obj: Any, path: Where, walk: Walk) -> Any:
        return ds_value(obj, path, walk, source=source)

    return to_plain(value, where, tensor=tensor, standin=standin, retyped=retyped)


class DeepSpeedPickler(pickle.Pickler):
    """The C pickler, with each :func:`ds_class` written as the global it stands for, without importing it.

    The C pickler writes a class by name only once importing the name gives the class back, so each stand-in is
    pickled under its marker name in this module (protocol 2, torch's: the text opcode ``c<module>\\n<name>\\n``),
    then :meth:`dump` rewrites those opcodes to DeepSpeed's names in the finished bytes. Protocol 2 has no frames or
    offsets, so the rewrite moves nothing else. (The pure-Python pickler, whose ``save_global`` can be overridden,
    took 4 of every 10 seconds of a reshard to 64 ranks.)
    """

    def __init__(self, file: Any, protocol: int | None = None, **kwargs: Any) -> None:
        if protocol is None or protocol > 3:
            raise ValueError(f"rank files are written with pickle protocol 2 (torch's), got {protocol}")
        self._target = file
        self._buffer = io.BytesIO()
        super().__init__(self._buffer, protocol, **kwargs)

    def dump(self, obj: Any) -> None:
        self._target.write(self.pickled(obj))

    def pickled(self, obj: Any) -> bytes:
        """``obj``'s pickle, DeepSpeed's names written in."""
        super().dump(obj)
        data = self._buffer.getvalue()
        if _MARKER_PREFIX.encode() in data:
            for qualified, cls in _DS_CLASSES.items():
                module, _, qualname = qualified.rpartition(".")
                marker = f"c{__name__}\n{cls.__qualname__}\n".encode()
                data = data.replace(marker, f"c{module}\n{qualname}\n".encode())
        return data


class Template(Protocol):
    """A pickle reused across trees of one shape (``pickle_template.PickleTemplate``), and the archive written
    around it (``archive_layout.ArchiveLayout``)."""

    def pickle_module(self) -> types.ModuleType: ...

    def storage_keys(self, paths: list[Where]) -> dict[Where, tuple[str, int]] | None: ...

    def layout_for(self, tree: Any) -> ArchiveLayout | None: ...

    def keep_layout(self, layout: ArchiveLayout) -> None: ...


_PICKLE_MODULE = types.ModuleType("zeroio._reshard_pickle")
_PICKLE_MODULE.Pickler = DeepSpeedPickler  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- rank files: tree, then bytes


@dataclass(frozen=True, slots=True)
class _Fill:
    """One tensor of a file being written: where it sits in the object tree and how to produce its bytes."""

    path: Where
    numel: int
    dtype: torch.dtype
    chunks: Chunks


class _Placeholders:
    """CPU tensors that hold no memory: each maps a sparse temporary file (``MAP_SHARED``, never read nor written),
    so ``torch.save`` under ``skip_data`` records their storages as it records any CPU tensor's, at no cost.

    torch's ``FakeTensorMode`` does the same but costs ~1 s to create (it imports ``torch._dynamo``), and pickles
    each storage's location as its own string where ``torch.save`` of real tensors (DeepSpeed's files) memoizes
    one. Anonymous memory (``torch.empty``) would be committed page by page only when touched, but counts in full
    against a strict overcommit limit; a file's shared mapping does not.
    """

    def __init__(self) -> None:
        try:
            fd, name = tempfile.mkstemp(prefix="zeroio-placeholder-")
        except OSError as exc:
            where = tempfile.gettempdir()
            raise OutputError(
                f"Cannot create a placeholder file in '{where}' ({exc.strerror or exc}): zeroio builds each rank "
                "file around an empty sparse file there. Set TMPDIR to a writable folder and run again.",
                path=where,
            ) from exc
        os.close(fd)
        self._path: str | None = name
        self._size = 0
        self._finalizer = weakref.finalize(self, _unlink, name)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        assert self._path is not None, "placeholders used after close()"
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        try:
            if nbytes > self._size:  # sparse: the file grows without taking disk space
                os.truncate(self._path, nbytes)
                self._size = nbytes
            return torch.from_file(self._path, shared=True, size=numel, dtype=dtype).view(shape)
        except (OSError, RuntimeError, OverflowError) as exc:  # a size the file system refuses, mappings exhausted
            raise OutputError(
                f"Cannot map a placeholder of {nbytes} bytes for a tensor of shape {list(shape)} in "
                f"'{self._path}' ({exc}). Set TMPDIR to a local file system that allows sparse files.",
                path=self._path,
            ) from exc

    def close(self) -> None:
        """Remove the file (the mappings made stay valid until their tensors are freed)."""
        self._finalizer()
        self._path = None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class RankFileBuilder:
    """One rank file: an object tree with data-less tensors (:class:`_Placeholders`), then :meth:`save` streams
    their bytes."""

    def __init__(self) -> None:
        self._placeholders = _Placeholders()
        self._fills: list[_Fill] = []

    def tensor(self, path: Where, shape: Sequence[int], dtype: torch.dtype, chunks: Chunks) -> torch.Tensor:
        """A tensor to place at ``path`` of the tree, whose bytes ``chunks`` produces when the file is saved."""
        import torch

        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        self._fills.append(_Fill(path, numel, dtype, chunks))
        return self._placeholders.tensor(tuple(shape), dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the file will hold."""
        return sum(f.numel * f.dtype.itemsize for f in self._fills)

    def save(self, tree: Any, path: Path, on_bytes: Callable[[int], None], template: Template | None = None) -> None:
        """``torch.save`` the tree without tensor bytes, then stream each tensor's bytes into its record.

        ``torch.serialization.skip_data`` writes the archive with every storage record reserved but not filled;
        each record is then written with ``pwrite`` from bounded chunks, and its CRC-32 set in the data
        descriptor and the central directory, so the result is the archive ``torch.save`` would have written (but
        for ``.data/serialization_id``, which torch derives from the CRCs it wrote: those of the unfilled records).
        ``template`` pickles the tree once for all the trees of its shape (``pickle_template.py``), and writes the
        later ones' archives from the first one's layout without ``torch.save`` (``archive_layout.py``).
        """
        # 1. The archive, storage bytes left empty (no tensor is ever materialised): the layout of the first file
        #    of its kind where the template has one (no torch.save), else torch.save's.
        import torch

        layout = None if template is None else template.layout_for(tree)
        if layout is not None:
            layout.write(path)
        else:
            with open(path, "xb") as fh, torch.serialization.skip_data():
                torch.save(tree, fh, pickle_module=_PICKLE_MODULE if template is None else template.pickle_module())
        self._placeholders.close()
        # 2. Which record holds which tensor: known to the template, else read back with zeroio's own parser.
        keys = self._keys(path, template) if self._fills else []
        if layout is None and (keys or template is not None):
            layout = ArchiveLayout.read(path, set(keys))
            if template is not None:
                template.keep_layout(layout)  # kept where the tree was the template's first: for the next ones
        records = {} if layout is None else layout.records
        # 3. The bytes, then the CRCs.
        fd = os.open(path, os.O_RDWR)
        try:
            for fill, key in zip(self._fills, keys):
                _fill_record(fd, path, records[key], fill, on_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _keys(self, path: Path, template: Template | None) -> list[str]:
        """The storage key of each fill's tensor in the file just written."""
        found = None if template is None else template.storage_keys([fill.path for fill in self._fills])
        if found is None:
            parsed, rank_file = load_pickle(path)
            rank_file.close()
            found = {}
            for fill in self._fills:
                ref = walk_path(parsed, fill.path)
                if isinstance(ref, TensorRef) and ref.storage_offset == 0:
                    found[fill.path] = (ref.storage.key, ref.numel)
        keys = []
        for fill in self._fills:
            key, numel = found.get(fill.path, ("", -1))
            if numel != fill.numel:  # a storage of the tensor's own elements, at offset 0 (a template checks that)
                raise CheckpointFormatError(f"'{path}': tensor at {fill.path} was not written as planned.", path=path)
            keys.append(key)
        return keys


def _fill_record(fd: int, path: Path, record: StoredRecord, fill: _Fill, on_bytes: Callable[[int], None]) -> None:
    """Write one storage record's bytes and set its CRC-32 where the zip format keeps it."""
    offset, crc = record.begin, 0
    for chunk in fill.chunks():
        view = tensor_bytes(chunk)
        pwrite_all(fd, view, offset)
        crc = zlib.crc32(view, crc)
        offset += len(view)
        on_bytes(len(view))
    if offset - record.begin != record.size:
        raise PartitionMismatchError(
            f"'{path}': record {record.name} holds {record.size} bytes, {offset - record.begin} were produced.",
            path=path,
        )
    packed = struct.pack("<I", crc)
    pwrite_all(fd, packed, record.header_offset + 14 if record.descriptor is None else record.descriptor)
    pwrite_all(fd, packed, record.central + 16)


def walk_path(tree: Any, path: Where) -> Any:
    """The node at ``path`` of a tree (dict keys, list indices, attributes)."""
    node = tree
    for key in path:
        node = node[key] if isinstance(node, (dict, list, tuple)) else node.__dict__[key]
    return node
