"""The one place a torch ``.pt`` file is opened: a restricted, lazy unpickler.

``torch.save`` writes a zip archive: ``<root>/data.pkl`` (the object tree, a
pickle) plus one uncompressed record ``<root>/data/<key>`` per storage. We read
the pickle with an allowlist of globals, so nothing in the file can run code,
and every tensor comes back as a :class:`TensorRef`: where its bytes are, not
the bytes. DeepSpeed's own classes (``ZeroStageEnum``, ``LossScaler``, ...)
become inert local stand-ins, so DeepSpeed need not be installed. Storage
locations (``cuda:0`` in GPU-written files) are ignored: bytes are bytes.
"""

from __future__ import annotations

import collections
import enum
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Self

from ._storage import ByteRange, LocalFile
from .errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafePickleError,
    UnsupportedCheckpointError,
    ZeroIOError,
)

__all__ = ["RankFile", "TensorRef", "load_pickle"]

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = 0x04034B50


# --------------------------------------------------------------------------- stand-ins for DeepSpeed classes


class ZeroStageEnum(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as ``ZeroStageEnum(n)``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _Inert:
    """An object rebuilt from a pickle's state dict only; it has no behaviour."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Reached when a pickle "calls" (REDUCE) or instantiates (NEWOBJ) an allowed global: record the
        # arguments, run nothing.
        self = object.__new__(cls)
        if args or kwargs:
            self.__dict__["_args"] = args
            self.__dict__["_kwargs"] = kwargs
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict_state, slots_state)
            merged: dict[str, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            state = merged
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __repr__(self) -> str:
        return f"<{self._zeroio_global} {self.__dict__}>"

    _zeroio_global = "object"


def _inert(qualified_name: str) -> type:
    """A distinct inert class per pickled DeepSpeed class, so the tree keeps its type name."""
    cls = type(qualified_name.rsplit(".", 1)[1], (_Inert,), {"_zeroio_global": qualified_name})
    return cls


class _InertDict(dict):  # type: ignore[type-arg]
    """Stand-in for dict subclasses that carry no behaviour we need (e.g. Lightning's AttributeDict)."""


# --------------------------------------------------------------------------- lazy tensors


@dataclass(frozen=True, slots=True)
class _Storage:
    """One storage record of the archive (``data/<key>``), not yet read."""

    key: str
    dtype: torch.dtype
    numel: int
    location: str


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor's bytes live in a rank file; reading them is :meth:`RankFile.read`.

    The tensor is ``as_strided(size, stride, storage_offset)`` of its storage,
    exactly as torch rebuilds it.
    """

    file: RankFile
    storage: _Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the tensor."""
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
        itemsize = _itemsize(self.dtype)
        offset = self.file.data_offset(self.storage.key) + (self.storage_offset + start) * itemsize
        return self.file.source, offset, count * itemsize

    def materialize(self) -> torch.Tensor:
        """The whole tensor, owned and with its shape."""
        if self.is_contiguous:
            return self.read().view(self.shape)
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if self.numel else 0
        flat = self.file.read_storage(self.storage, self.storage_offset, extent)
        return flat.as_strided(self.shape, self.stride).contiguous()


# --------------------------------------------------------------------------- the allowlist


def _rebuild_tensor_v2(
    storage: _Storage,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _PendingTensor:
    return _PendingTensor(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_tensor_v3(
    storage: _Storage,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    backward_hooks: Any,
    dtype: torch.dtype,
    metadata: Any = None,
) -> _PendingTensor:
    # v3 stores an untyped storage plus the dtype (used for dtypes without a legacy storage class).
    typed = _Storage(storage.key, dtype, storage.numel // max(1, _itemsize(dtype)), storage.location)
    return _PendingTensor(typed, storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data: Any, requires_grad: bool = False, backward_hooks: Any = None, *rest: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: tuple[Any, ...], state: Any) -> Any:
    # torch uses this for tensors carrying Python attributes; `func` is itself an allowlisted rebuild function.
    return func(*args)


@dataclass(frozen=True, slots=True)
class _PendingTensor:
    """A tensor seen in the pickle before its file is known (bound to a RankFile after unpickling)."""

    storage: _Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    """Marker returned for ``torch.FloatStorage`` & co.: only its dtype matters."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _build_allowlist() -> dict[str, Any]:
    allowed: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "collections.defaultdict": collections.defaultdict,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "builtins.complex": complex,
        "builtins.bytearray": bytearray,
        "builtins.slice": slice,
        "_codecs.encode": lambda s, enc="latin1": s.encode(enc),  # how pickle protocol 2 spells bytes
        "torch.Size": torch.Size,
        "torch.device": torch.device,
        "torch.Tensor": torch.Tensor,
        "torch.nn.parameter.Parameter": torch.nn.Parameter,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.storage.UntypedStorage": _StorageType(torch.uint8),
        "torch.torch_version.TorchVersion": str,  # a str subclass: rebuilt as the plain string
        # DeepSpeed's classes, as inert stand-ins (checked with DeepSpeed 0.19.8 checkpoints).
        "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
        "deepspeed.runtime.fp16.loss_scaler.LossScaler": _inert("deepspeed.runtime.fp16.loss_scaler.LossScaler"),
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _inert(
            "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
        ),
        "deepspeed.utils.tensor_fragment.fragment_address": _inert("deepspeed.utils.tensor_fragment.fragment_address"),
        # Lightning's client state (hyper_parameters) in framework-written checkpoints.
        "lightning.fabric.utilities.data.AttributeDict": _InertDict,
        "pytorch_lightning.utilities.parsing.AttributeDict": _InertDict,
        "lightning_fabric.utilities.data.AttributeDict": _InertDict,
    }
    # Plain-data classes that training scripts put into client state (hyper-parameters, run arguments).
    # They are rebuilt as inert records: their constructors are never called.
    for qualified in (
        "argparse.Namespace",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
        "datetime.datetime",
        "datetime.date",
        "datetime.timedelta",
    ):
        allowed[qualified] = _inert(qualified)
    for dtype, storage_name in torch.storage._dtype_to_storage_type_map().items():
        allowed[f"torch.{storage_name}"] = _StorageType(dtype)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[f"torch.{name}"] = value
    return allowed


_ALLOWED = _build_allowlist()


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only allowlisted globals; tensors become ``_PendingTensor`` records."""

    def __init__(self, data: bytes, path: Path, trusted: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._path = path
        self._trusted = trusted
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified in _ALLOWED:
            return _ALLOWED[qualified]
        if qualified in self._trusted:
            return _inert(qualified)
        raise UnsafePickleError(
            f"Refusing to unpickle global '{qualified}' from '{self._path}': it is not on zeroio's allowlist. "
            f"If you trust this file, pass trusted_globals=['{qualified}'] (it is rebuilt as inert data, never called).",
            path=self._path,
            name=qualified,
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointFormatError(
                f"Unexpected persistent id {pid!r:.80} in '{self._path}': not a torch zip checkpoint storage. "
                "Re-save the file with torch.save.",
                path=self._path,
            )
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise UnsafePickleError(
                f"Unexpected storage type {storage_type!r:.80} in '{self._path}'. Re-save the file with torch.save.",
                path=self._path,
            )
        key = str(key)
        if key not in self.storages:
            self.storages[key] = _Storage(key, storage_type.dtype, int(numel), str(location))
        return self.storages[key]


# --------------------------------------------------------------------------- the file


@dataclass(eq=False)
class RankFile:
    """One ``.pt`` archive: its parsed object tree and lazy access to its storages' bytes.

    The file descriptor is opened on first read and released by :meth:`close`.
    """

    path: Path
    _records: dict[str, zipfile.ZipInfo] = field(default_factory=dict, repr=False)
    _data_offsets: dict[str, int] = field(default_factory=dict, repr=False)
    size: int = 0
    source: LocalFile = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.source = LocalFile(self.path, self.size or None)

    def close(self) -> None:
        """Release the file descriptor; idempotent."""
        self.source.close()

    @property
    def read_offsets(self) -> dict[str, int]:
        """Storage records whose data offset has been looked up (i.e. that were read), by key."""
        return dict(self._data_offsets)

    def data_offset(self, key: str) -> int:
        """Byte offset in the file of storage record ``key``'s data."""
        offset = self._data_offsets.get(key)
        if offset is not None:
            return offset
        info = self._records.get(key)
        if info is None:
            raise CheckpointFormatError(
                f"'{self.path}' has no record for storage '{key}': the file is truncated or corrupted. "
                "Copy the rank file again from where it was saved.",
                path=self.path,
            )
        header = self.source.read_bytes(info.header_offset, _LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != _LOCAL_HEADER_MAGIC:
            raise CheckpointFormatError(
                f"Corrupted zip entry for storage '{key}' in '{self.path}'. Copy the rank file again.",
                path=self.path,
            )
        fields = _LOCAL_HEADER.unpack(header)
        offset = int(info.header_offset) + _LOCAL_HEADER.size + int(fields[9]) + int(fields[10])
        self._data_offsets[key] = offset
        return offset

    def read_storage(self, storage: _Storage, start: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start+count)`` of a storage, read with ``preadv`` straight into ``out``.

        ``out`` (1-D, contiguous, ``storage.dtype``, ``count`` elements) is allocated when not given.
        """
        if out is None:
            out = torch.empty(count, dtype=storage.dtype)
        if count <= 0:
            return out
        if start < 0 or start + count > storage.numel:
            raise CheckpointFormatError(
                f"Tensor view [{start}, {start + count}) lies outside its storage of {storage.numel} elements in "
                f"'{self.path}'. The file is corrupted; copy it again.",
                path=self.path,
            )
        itemsize = out.element_size()
        offset = self.data_offset(storage.key) + start * itemsize
        self.source.read_into(offset, out, f"storage '{storage.key}'")
        return out


def _check_view(t: _PendingTensor, path: Path) -> None:
    """A tensor's size/stride/offset must be non-negative ints that stay inside its storage."""
    values = (t.storage_offset, *t.shape, *t.stride)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values) or len(t.shape) != len(
        t.stride
    ):
        raise CheckpointFormatError(
            f"'{path}' describes a tensor with an invalid view (size {t.shape!r:.60}, stride {t.stride!r:.60}, "
            f"offset {t.storage_offset!r:.20}). The file is corrupted; copy it again.",
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


def _bind(obj: Any, file: RankFile) -> Any:
    """Replace every ``_PendingTensor`` in the tree by a ``TensorRef`` into ``file``."""
    if isinstance(obj, _PendingTensor):
        _check_view(obj, file.path)
        return TensorRef(file, obj.storage, obj.storage_offset, obj.shape, obj.stride)
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _bind(value, file)
        return obj
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            obj[i] = _bind(value, file)
        return obj
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return type(obj)(_bind(v, file) for v in obj) if not hasattr(obj, "_fields") else type(obj)(
            *(_bind(v, file) for v in obj)
        )
    if isinstance(obj, _Inert):
        for key, value in list(obj.__dict__.items()):
            obj.__dict__[key] = _bind(value, file)
    return obj


def load_pickle(path: str | os.PathLike[str], *, trusted_globals: frozenset[str] = frozenset()) -> tuple[Any, RankFile]:
    """Parse a torch zip checkpoint without reading any tensor bytes.

    Returns the object tree (tensors as :class:`TensorRef`) and the :class:`RankFile`
    that reads them. Raises a :mod:`zeroio.errors` exception for anything that is
    not a well-formed torch zip archive or asks for a global outside the allowlist.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            magic = fh.read(4)
            if magic[:2] != b"PK":
                if magic[:1] == b"\x80":
                    raise UnsupportedCheckpointError(
                        f"'{path}' uses torch's legacy (pre-1.6) serialization, which zeroio does not read. "
                        "Re-save it with torch.save (zip format).",
                        path=path,
                    )
                raise CheckpointFormatError(
                    f"'{path}' is not a torch checkpoint (no zip signature; {size} bytes). "
                    "Point zeroio at a DeepSpeed checkpoint folder or a file written by torch.save.",
                    path=path,
                )
            fh.seek(0)
            archive = zipfile.ZipFile(fh)
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pickles) != 1:
                raise CheckpointFormatError(
                    f"'{path}' is a zip file but not a torch checkpoint (found {len(pickles)} data.pkl records). "
                    "Point zeroio at files written by torch.save.",
                    path=path,
                )
            root = pickles[0].filename[: -len("data.pkl")]
            records: dict[str, zipfile.ZipInfo] = {}
            for info in infos:
                if info.filename.startswith(root + "data/"):
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise UnsupportedCheckpointError(
                            f"'{path}' stores tensor data compressed ({info.filename}); torch.save never does. "
                            "Re-save the file with torch.save.",
                            path=path,
                        )
                    records[info.filename[len(root) + len("data/") :]] = info
            data = archive.read(pickles[0])
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

    unpickler = _RestrictedUnpickler(data, path, trusted_globals)
    try:
        tree = unpickler.load()
    except (UnsafePickleError, CheckpointFormatError):
        raise
    except Exception as exc:  # any malformed pickle: never let a raw pickle traceback escape
        raise CheckpointFormatError(
            f"Cannot parse the pickle in '{path}' ({type(exc).__name__}: {exc}). The file is corrupted or was "
            "not written by torch.save; copy it again.",
            path=path,
        ) from exc
    file = RankFile(path, records, size=size)
    for storage in unpickler.storages.values():
        record = records.get(storage.key)
        needed = storage.numel * _itemsize(storage.dtype)
        if record is None or record.file_size < needed:
            raise CheckpointFormatError(
                f"'{path}' is truncated or corrupted: storage '{storage.key}' needs {needed} bytes, "
                f"the archive holds {0 if record is None else record.file_size}. Copy the file again.",
                path=path,
            )
    return _bind(tree, file), file
