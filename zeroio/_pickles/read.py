"""The restricted unpickler: a ``.pt`` file's object tree, with nothing in it able to run code.

Globals resolve only through an allowlist, and every tensor comes back as a :class:`TensorRef` (where its bytes
are, not the bytes). DeepSpeed's own classes (``ZeroStageEnum``, ``LossScaler``, ...) become inert stand-ins
(:mod:`.standins`), so DeepSpeed need not be installed.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointFormatError, UnsafePickleError
from .archive import RankFile, Storage, TensorRef, itemsize, read_archive
from .standins import ZERO_STAGE_ENUM, Inert, ZeroStageEnum, inert_class, inert_dict_class

__all__ = ["load_pickle"]


def _rebuild_tensor_v2(
    storage: Storage,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _PendingTensor:
    return _PendingTensor(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_tensor_v3(
    storage: Storage,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    backward_hooks: Any,
    dtype: torch.dtype,
    metadata: Any = None,
) -> _PendingTensor:
    # v3 stores an untyped storage plus the dtype (used for dtypes without a legacy storage class).
    typed = Storage(storage.key, dtype, storage.numel // max(1, itemsize(dtype)), storage.location)
    return _PendingTensor(typed, storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data: Any, requires_grad: bool = False, backward_hooks: Any = None, *rest: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: tuple[Any, ...], state: Any) -> Any:
    # torch uses this for tensors carrying Python attributes; `func` is itself an allowlisted rebuild function.
    return func(*args)


@dataclass(frozen=True, slots=True)
class _PendingTensor:
    """A tensor seen in the pickle before its file is known (bound to a RankFile after unpickling)."""

    storage: Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    """Marker returned for ``torch.FloatStorage`` & co.: only its dtype matters."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


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
        ZERO_STAGE_ENUM: ZeroStageEnum,
    }
    # DeepSpeed's classes, as inert stand-ins (checked with DeepSpeed 0.19.8 checkpoints), and plain-data classes
    # that training scripts put into client state (hyper-parameters, run arguments). They are rebuilt as inert
    # records: their constructors are never called.
    for qualified in (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "argparse.Namespace",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
        "datetime.datetime",
        "datetime.date",
        "datetime.timedelta",
    ):
        allowed[qualified] = inert_class(qualified)
    # Lightning's client state (hyper_parameters) in framework-written checkpoints.
    for qualified in (
        "lightning.fabric.utilities.data.AttributeDict",
        "pytorch_lightning.utilities.parsing.AttributeDict",
        "lightning_fabric.utilities.data.AttributeDict",
    ):
        allowed[qualified] = inert_dict_class(qualified)
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
        self.storages: dict[str, Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified in _ALLOWED:
            return _ALLOWED[qualified]
        if qualified in self._trusted:
            return inert_class(qualified)
        raise UnsafePickleError(
            f"Refusing to unpickle global '{qualified}' from '{self._path}': it is not on zeroio's allowlist. "
            f"If you trust this file, pass trusted_globals=['{qualified}'] (it is rebuilt as inert data, never called).",
            path=self._path,
            name=qualified,
        )

    def persistent_load(self, pid: Any) -> Storage:
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
            self.storages[key] = Storage(key, storage_type.dtype, int(numel), str(location))
        return self.storages[key]


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
        items = [_bind(v, file) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Inert):
        for key, value in list(obj.__dict__.items()):
            obj.__dict__[key] = _bind(value, file)
    return obj


def load_pickle(path: str | os.PathLike[str], *, trusted_globals: frozenset[str] = frozenset()) -> tuple[Any, RankFile]:
    """Parse a torch zip checkpoint without reading any tensor bytes.

    Returns the object tree (tensors as :class:`TensorRef`) and the :class:`RankFile`
    that reads them. Raises a :mod:`zeroio.errors` exception for anything that is
    not a well-formed torch zip archive or asks for a global outside the allowlist.
    """
    archive = read_archive(Path(path))
    path, records = archive.path, archive.records
    unpickler = _RestrictedUnpickler(archive.pickle, path, trusted_globals)
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
    file = RankFile(path, records, size=archive.size)
    for storage in unpickler.storages.values():
        record = records.get(storage.key)
        needed = storage.numel * itemsize(storage.dtype)
        if record is None or record.file_size < needed:
            raise CheckpointFormatError(
                f"'{path}' is truncated or corrupted: storage '{storage.key}' needs {needed} bytes, "
                f"the archive holds {0 if record is None else record.file_size}. Copy the file again.",
                path=path,
            )
    return _bind(tree, file), file
