"""fp32 / bf16 / fp16 casts on raw little-endian bytes with numpy, bit-identical to torch's ``tensor.to()``.

``zeroio convert --dtype bf16`` (and the fp32 upcast of 16-bit buffers) would otherwise import torch (seconds)
only to round numbers (issue 17). numpy is optional: without it :func:`can_cast` is False and the caller casts
with torch, as before. Every cast goes through fp32: widening a 16-bit value to fp32 is exact, and torch casts
between 16-bit types through ``float`` as well. Narrowing rounds to nearest, ties to even, overflowing to
infinity and keeping subnormals, which is what torch does (``bf16``: ``(bits + 0x7FFF + lsb) >> 16``; ``fp16``:
numpy's IEEE conversion). NaN is the exception: torch's NaN bits depend on the CPU and the code path (0xFFFF for
bf16 in its AVX2/AVX-512 loops on x86, 0x7FC0 in its scalar one; fp16 keeps or quiets payloads by instruction
set), so a chunk holding a NaN is left to torch (:func:`cast_into` returns False), which then decides.
``tests/test_casts.py`` compares every result with torch, over strided sweeps of all 2^32 fp32 patterns,
every pattern near each rounding boundary and every 16-bit pattern.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from .._dtypes import DType

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CASTABLE", "can_cast", "cast_into"]

CASTABLE = frozenset({"float32", "bfloat16", "float16"})
"""Element types cast here (any pair of them)."""


@functools.cache
def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional: the caller casts with torch
        return None
    return numpy


def can_cast(src: DType, dst: DType) -> bool:
    """Whether :func:`cast_into` handles ``src`` -> ``dst`` here (numpy importable, both in :data:`CASTABLE`)."""
    return src.name in CASTABLE and dst.name in CASTABLE and _numpy() is not None


def _has_nan(np: Any, data: Any, src: DType) -> bool:
    if src.name == "float32":
        return bool(np.isnan(np.min(data.view("<f4"))))  # min propagates NaN: one pass, no temporary
    limit = 0x7F80 if src.name == "bfloat16" else 0x7C00  # exponent all ones: above it, a NaN
    return bool((np.bitwise_and(data, 0x7FFF) > limit).any())


def _widen(np: Any, data: Any, src: DType, out: Any) -> None:
    """16-bit patterns ``data`` (``<u2``) to fp32 bit patterns in ``out`` (``<u4``), exactly."""
    if src.name == "bfloat16":
        np.left_shift(data, 16, out=out, dtype=np.uint32)
    else:
        np.copyto(out.view("<f4"), data.view("<f2"), casting="same_kind")


def _narrow(np: Any, bits: Any, dst: DType, out: Any) -> None:
    """fp32 bit patterns ``bits`` (``<u4``, overwritten) rounded to ``dst``'s 16-bit patterns in ``out``."""
    if dst.name == "bfloat16":
        np.right_shift(bits, 16, out=out, casting="unsafe")  # out = high half, then its lowest bit
        np.bitwise_and(out, 1, out=out)
        np.add(bits, 0x7FFF, out=bits)
        np.add(bits, out, out=bits, casting="unsafe")
        np.right_shift(bits, 16, out=out, casting="unsafe")
    else:
        with np.errstate(over="ignore"):  # beyond fp16's range: infinity, as torch rounds
            np.copyto(out.view("<f2"), bits.view("<f4"), casting="same_kind")


def cast_into(data: Buffer, src: DType, dst: DType, out: Buffer) -> bool:
    """Cast the elements in ``data`` (``src``, little-endian) into ``out`` (``dst``; as many elements).

    ``data`` may be overwritten (it is the caller's read buffer). Returns False, writing nothing useful, when
    ``data`` holds a NaN: torch must cast that chunk (see the module doc).
    """
    np = _numpy()
    codes = {"float32": "<u4", "bfloat16": "<u2", "float16": "<u2"}
    raw = np.frombuffer(data, dtype=codes[src.name])
    target = np.frombuffer(out, dtype=codes[dst.name])
    if raw.size == 0:
        return True
    if _has_nan(np, raw, src):
        return False
    if src.name == dst.name:
        np.copyto(target, raw)
        return True
    if src.name == "float32":
        bits = raw
    elif dst.name == "float32":
        _widen(np, raw, src, target)
        return True
    else:  # 16-bit to 16-bit: through fp32, as torch
        bits = np.empty(raw.size, dtype="<u4")
        _widen(np, raw, src, bits)
    _narrow(np, bits, dst, target)
    return True
