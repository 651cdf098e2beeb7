"""Tensor element types by name, without importing torch (issue 17: ``inspect`` and ``verify`` stay torch-free).

A :class:`DType` is what the read path carries around: its name, size, whether it is floating, its safetensors code
and its pickle storage-type name. :attr:`DType.torch` gives the ``torch.dtype`` (importing torch then), for the
places that really make tensors. A ``DType`` prints, compares and hashes like the ``torch.dtype`` of the same name,
so messages and equality tests read the same whichever of the two a value is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch as _torch

__all__ = ["BFLOAT16", "BY_NAME", "FLOAT16", "FLOAT32", "DType", "as_dtype", "find_dtype", "to_torch"]


class DType:
    """One element type, named as torch names it (``float32``, ``bfloat16``, ``int64``, ...)."""

    __slots__ = ("is_complex", "is_floating_point", "itemsize", "name", "safetensors", "storage")

    def __init__(
        self, name: str, itemsize: int, kind: str = "", safetensors: str | None = None, storage: str | None = None
    ) -> None:
        fields = {"name": name, "itemsize": itemsize, "is_floating_point": kind == "float"}
        fields |= {"is_complex": kind == "complex", "safetensors": safetensors, "storage": storage}
        for key, value in fields.items():  # safetensors: its code (F32, ...); storage: legacy class (FloatStorage)
            object.__setattr__(self, key, value)

    name: str
    itemsize: int
    is_floating_point: bool
    is_complex: bool
    safetensors: str | None
    storage: str | None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{self} is read-only (a pickle's BUILD cannot change it)")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"{self} is read-only (a pickle's BUILD cannot change it)")

    @property
    def torch(self) -> _torch.dtype:
        """The ``torch.dtype`` of this name (imports torch)."""
        import torch

        value = getattr(torch, self.name)
        assert isinstance(value, torch.dtype)
        return value

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self is other
        return type(other).__name__ == "dtype" and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by name (Python's pickle, e.g. to a worker process): unpickled as the one shared instance."""
        return (as_dtype, (self.name,))


_TABLE: tuple[DType, ...] = (
    # name, itemsize, kind, safetensors code, legacy storage class; safetensors' enum order (see SAFETENSORS_ORDER)
    DType("bool", 1, "", "BOOL", "BoolStorage"),
    DType("uint8", 1, "", "U8", "ByteStorage"),
    DType("int8", 1, "", "I8", "CharStorage"),
    DType("float8_e5m2", 1, "float", "F8_E5M2"),
    DType("float8_e4m3fn", 1, "float", "F8_E4M3"),
    DType("float8_e4m3fnuz", 1, "float", "F8_E4M3FNUZ"),
    DType("float8_e5m2fnuz", 1, "float", "F8_E5M2FNUZ"),
    DType("int16", 2, "", "I16", "ShortStorage"),
    DType("uint16", 2, "", "U16"),
    DType("float16", 2, "float", "F16", "HalfStorage"),
    DType("bfloat16", 2, "float", "BF16", "BFloat16Storage"),
    DType("int32", 4, "", "I32", "IntStorage"),
    DType("uint32", 4, "", "U32"),
    DType("float32", 4, "float", "F32", "FloatStorage"),
    DType("complex64", 8, "complex", "C64", "ComplexFloatStorage"),
    DType("float64", 8, "float", "F64", "DoubleStorage"),
    DType("int64", 8, "", "I64", "LongStorage"),
    DType("uint64", 8, "", "U64"),
    DType("complex128", 16, "complex", None, "ComplexDoubleStorage"),
    DType("complex32", 4, "complex"),
    DType("float8_e8m0fnu", 1, "float"),
    DType("float4_e2m1fn_x2", 1, "float"),
    DType("bits8", 1),
    DType("bits16", 2),
    DType("bits1x8", 1),
    DType("bits2x4", 1),
    DType("bits4x2", 1),
    *(DType(f"uint{n}", 1) for n in range(1, 8)),
    *(DType(f"int{n}", 1) for n in range(1, 8)),
)

_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
    "int": "int32",
    "long": "int64",
    "short": "int16",
    "bit": "uint1",
}

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_NAME.update({alias: BY_NAME[name] for alias, name in _ALIASES.items()})
"""Every element type zeroio reads, by torch's attribute names (``torch.float`` and ``torch.float32`` alike)."""

SAFETENSORS_ORDER: tuple[DType, ...] = tuple(d for d in _TABLE if d.safetensors is not None)
"""safetensors' Dtype enum, in declaration order (its files sort tensors by this rank, descending, then by name)."""

QUANTIZED: dict[str, DType] = {n: DType(n, 4 if n == "qint32" else 1) for n in ("qint8", "qint32", "quint8")}
QUANTIZED |= {n: DType(n, 1) for n in ("quint4x2", "quint2x4")}
"""Quantized element types: pickles may name them as values, but zeroio reads no quantized storage."""

BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in SAFETENSORS_ORDER if d.safetensors is not None}

BY_STORAGE: dict[str, DType] = {d.storage: d for d in _TABLE if d.storage is not None}


def find_dtype(value: Any) -> DType | None:
    """:func:`as_dtype`, or None for an element type zeroio does not know (e.g. one newer than this table)."""
    if isinstance(value, DType):
        return value
    return BY_NAME.get(str(value).removeprefix("torch."))


def as_dtype(value: Any) -> DType:
    """A :class:`DType` from a ``DType``, a ``torch.dtype`` or a name (``"float32"``, ``"torch.float32"``).

    Raises:
        KeyError: an element type zeroio does not know. Internal contract: callers pass dtypes that are known
            (torch's own, or names already checked against :data:`BY_NAME`); where one may not be, they use
            :func:`find_dtype`, and a reader's failure becomes ``zeroio.open``'s CheckpointFormatError.
    """
    found = find_dtype(value)
    if found is None:
        raise KeyError(f"'{value}' is not an element type zeroio knows")
    return found


def to_torch(value: DType | torch.dtype) -> torch.dtype:
    """The ``torch.dtype`` of ``value`` (imports torch when ``value`` is a :class:`DType`)."""
    return value.torch if isinstance(value, DType) else value


FLOAT32 = BY_NAME["float32"]
FLOAT16 = BY_NAME["float16"]
BFLOAT16 = BY_NAME["bfloat16"]
