"""The globals a checkpoint's pickle may name, each sealed so that no pickle can change it for later reads.

Everything ``find_class`` hands out is shared by every load in the process. A pickle's BUILD opcode sets the state
of whatever object is on its stack, globals included: were ``torch.FloatStorage``'s stand-in an ordinary object, one
crafted file could make every later file read its floats as fp16. So each allowed global is one of:

* a C type or value Python itself keeps immutable (``collections.OrderedDict``, ``torch.Size``'s type, dtypes);
* a :class:`Sealed` callable: calls go through, attribute writes and BUILD raise :class:`UnsafePickleError`;
* a stand-in class (:mod:`.standins`) whose ``__setstate__`` makes a BUILD on the class itself fail.

The callables also check their arguments, so that a few pickle bytes cannot ask for gigabytes (``bytearray(2**32)``)
or hand a non-storage where a tensor's storage belongs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from .._dtypes import BY_NAME, BY_STORAGE, QUANTIZED, DType
from ..errors import CheckpointFormatError, UnsafePickleError
from .archive import Storage
from .dtensor import DTENSOR_CLASSES, DTENSOR_TYPES, get_layout, rebuild_wrapper_subclass
from .limits import MAX_DIMS, short_repr
from .standins import ZERO_STAGE_ENUM, Device, Inert, Size, ZeroStageEnum, inert_class, inert_dict_class, refuse_build

__all__ = ["ALLOWED", "PendingTensor", "Sealed", "StorageType", "short_repr"]


class _Frozen:
    """A shared allowlisted object that no pickle can change: BUILD, setattr and delattr raise, naming it."""

    __slots__ = ()
    name: str

    def __setattr__(self, key: str, value: Any) -> None:
        raise refuse_build(self.name)

    def __delattr__(self, key: str) -> None:
        raise refuse_build(self.name)

    def __setstate__(self, state: Any) -> None:
        raise refuse_build(self.name)


class Sealed(_Frozen):
    """An allowlisted callable as a pickle sees it: calling works, changing it (BUILD, setattr) raises."""

    __slots__ = ("_call", "name")
    _call: Callable[..., Any]
    name: str

    def __init__(self, name: str, call: Callable[..., Any]) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_call", call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<allowlisted {self.name}>"


class StorageType(_Frozen):
    """What ``torch.FloatStorage`` & co. resolve to: only its dtype matters, and no pickle can change it."""

    __slots__ = ("dtype", "name")
    dtype: DType
    name: str

    def __init__(self, name: str, dtype: DType) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", dtype)

    def __repr__(self) -> str:
        return f"<{self.name}>"


class PendingTensor:
    """A tensor seen in the pickle before its file is known (bound to a RankFile after unpickling)."""

    __slots__ = ("shape", "storage", "storage_offset", "stride")
    storage: Storage
    storage_offset: Any
    shape: tuple[Any, ...]
    stride: tuple[Any, ...]

    def __init__(self, storage: Storage, storage_offset: int, shape: tuple[Any, ...], stride: tuple[Any, ...]) -> None:
        object.__setattr__(self, "storage", storage)
        object.__setattr__(self, "storage_offset", storage_offset)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "stride", stride)

    def __setattr__(self, key: str, value: Any) -> None:
        raise refuse_build("torch._utils._rebuild_tensor_v2")

    def __setstate__(self, state: Any) -> None:
        raise refuse_build("torch._utils._rebuild_tensor_v2")


def _sequence(value: Any, what: str) -> tuple[Any, ...]:
    if not isinstance(value, (tuple, list)):
        raise CheckpointFormatError(f"a tensor's {what} is a {type(value).__name__}, not a sequence of ints.")
    if len(value) > MAX_DIMS:
        raise CheckpointFormatError(
            f"a tensor's {what} has {len(value)} dimensions; zeroio reads at most {MAX_DIMS}. The file is corrupted "
            "or hostile."
        )
    return tuple(value)


def _pending(storage: Any, storage_offset: Any, size: Any, stride: Any) -> PendingTensor:
    if not isinstance(storage, Storage):
        raise CheckpointFormatError(
            f"a tensor is rebuilt from a value of type {type(storage).__name__} where its storage belongs. The file is "
            "corrupted or was not written by torch.save."
        )
    return PendingTensor(storage, storage_offset, _sequence(size, "size"), _sequence(stride, "stride"))


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> PendingTensor:
    return _pending(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> PendingTensor:
    # v3 stores an untyped storage plus the dtype (used for dtypes without a legacy storage class).
    if not isinstance(storage, Storage) or not isinstance(dtype, DType) or dtype not in _READABLE_DTYPES:
        raise CheckpointFormatError(
            f"a tensor is rebuilt from a {type(storage).__name__} of dtype {short_repr(dtype)}, which zeroio "
            "does not read. The file is corrupted or was not written by torch.save."
        )
    typed = Storage(storage.key, dtype, storage.numel // max(1, dtype.itemsize), storage.location)
    return _pending(typed, storage_offset, size, stride)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None, *rest: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # torch uses this for tensors carrying Python attributes; `func` is itself an allowlisted rebuild function.
    if not isinstance(func, Sealed) or not isinstance(args, tuple):
        raise CheckpointFormatError(
            f"_rebuild_from_type_v2 is given {short_repr(func)}, not one of torch's rebuild functions. The file is "
            "corrupted or was not written by torch.save."
        )
    result = func(*args)
    if isinstance(result, Inert):  # a wrapper subclass (DTensor): torch sets its state next (_local_tensor, _spec)
        result.__setstate__(state)
    return result


def _encode(text: Any, encoding: Any = "latin1") -> bytes:
    # How pickle protocol 2 spells bytes: _codecs.encode('<latin-1 text>', 'latin1').
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CheckpointFormatError(
            f"_codecs.encode is asked to encode a {type(text).__name__} as {short_repr(encoding)}; torch.save "
            "only encodes text as latin1."
        )
    return text.encode("latin1")


def _bytearray(source: Any = b"", *rest: Any) -> bytearray:
    # Pickle spells a bytearray as bytearray(<bytes>) (or text plus an encoding): never a length to allocate.
    if isinstance(source, (bytes, bytearray)) and not rest:
        return bytearray(source)
    if isinstance(source, str) and len(rest) == 1 and rest[0] in ("latin1", "latin-1"):
        return bytearray(source, "latin1")
    raise CheckpointFormatError(
        f"bytearray is called with a value of type {type(source).__name__}; a pickle only ever passes bytes (a length would make "
        "zeroio allocate memory the file does not hold)."
    )


def _size(dims: Any = ()) -> Size:
    dims = _sequence(dims, "size")
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise CheckpointFormatError(f"torch.Size is given {short_repr(dims)}, not a sequence of ints.")
    return Size(dims)


def _device(*args: Any) -> Device:
    # torch.device pickles as torch.device("cuda", 0) or torch.device("cpu"): a type name and an optional index.
    if not (1 <= len(args) <= 2 and isinstance(args[0], str) and all(isinstance(a, int) for a in args[1:])):
        raise CheckpointFormatError(f"torch.device is given {short_repr(args)}, not a device type and index.")
    return Device(tuple(args))


class _TorchVersion(str):
    """``torch.torch_version.TorchVersion`` (a str subclass pickled by NEWOBJ): rebuilt as the plain string."""

    def __new__(cls, value: Any = "") -> str:  # type: ignore[misc]
        if not isinstance(value, str):
            raise CheckpointFormatError(f"a torch version is a {type(value).__name__}, not a string.")
        return str(value)

    def __setstate__(self, state: Any) -> None:
        raise refuse_build("torch.torch_version.TorchVersion")


def _never_called(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnsafePickleError(
            f"the pickle calls '{name}', which torch.save never does (zeroio only accepts it as a type name).",
            name=name,
        )

    return refuse


_QUANTIZED = frozenset(QUANTIZED.values())
_READABLE_DTYPES = frozenset(BY_NAME.values())
"""Element types a storage may have. Quantized tensors are pickled with ``_rebuild_qtensor`` (refused): a quantized
storage under ``_rebuild_tensor_v2`` has no scale and cannot be read, so its storage type is not allowlisted."""


def _build_allowlist() -> dict[str, Any]:
    sealed: dict[str, Callable[..., Any]] = {
        "_codecs.encode": _encode,
        "builtins.bytearray": _bytearray,
        "torch.Size": _size,
        "torch.device": _device,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        # Named only as _rebuild_from_type_v2's `new_type`; calling them would allocate (torch.Tensor(2**40)).
        "torch.Tensor": _never_called("torch.Tensor"),
        "torch.nn.parameter.Parameter": _never_called("torch.nn.parameter.Parameter"),
        # FSDP2 state dicts (verl's rank files): DTensors rebuilt as inert records (.dtensor).
        "torch._utils._rebuild_wrapper_subclass": rebuild_wrapper_subclass,
        "torch.serialization._get_layout": get_layout,
        **{name: _never_called(name) for name in DTENSOR_TYPES},
    }
    allowed: dict[str, Any] = {name: Sealed(name, call) for name, call in sealed.items()}
    # C types: Python refuses to set their attributes, and what calling them builds is fresh per call.
    allowed.update(
        {
            "collections.OrderedDict": collections.OrderedDict,
            "collections.defaultdict": collections.defaultdict,
            "builtins.set": set,
            "builtins.frozenset": frozenset,
            "builtins.complex": complex,
            "builtins.slice": slice,
            "torch.torch_version.TorchVersion": _TorchVersion,
            "torch.storage.UntypedStorage": StorageType("torch.storage.UntypedStorage", BY_NAME["uint8"]),
            ZERO_STAGE_ENUM: ZeroStageEnum,
        }
    )
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
        *DTENSOR_CLASSES,
    ):
        allowed[qualified] = inert_class(qualified)
    # Lightning's client state (hyper_parameters) in framework-written checkpoints.
    for qualified in (
        "lightning.fabric.utilities.data.AttributeDict",
        "pytorch_lightning.utilities.parsing.AttributeDict",
        "lightning_fabric.utilities.data.AttributeDict",
    ):
        allowed[qualified] = inert_dict_class(qualified)
    for storage_name, dtype in BY_STORAGE.items():
        allowed[f"torch.{storage_name}"] = StorageType(f"torch.{storage_name}", dtype)
    for name, value in [*BY_NAME.items(), *QUANTIZED.items()]:  # values no pickle can change (slots, no BUILD)
        allowed[f"torch.{name}"] = value
    return allowed


ALLOWED: dict[str, Any] = _build_allowlist()
"""Every global a pickle may name, by qualified name, mapped to the sealed object it resolves to."""
