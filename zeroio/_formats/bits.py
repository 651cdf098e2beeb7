"""Comparing a few stored values without torch, so opening a checkpoint (``zeroio inspect``) never imports it.

Some readers check at open that two stores agree: a 16-bit parameter is its fp32 master rounded (DeepSpeed copies
the master into it after every step), or two files hold the same bits. They compare a sample of elements at both
ends (``plans.sample_ranges``). This module does it on raw bytes with Python's own rounding, which is IEEE
round-to-nearest-even like torch's ``tensor.to()``. Anything it cannot answer exactly (a view that is not one run
of bytes, a short read, a NaN, a dtype pair other than fp32 -> fp32/fp16/bf16) is ``None``: the caller then
compares with torch, as before, and raises what torch's path raises.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

from .._dtypes import DType

if TYPE_CHECKING:
    from .._pickles import TensorRef

__all__ = ["ref_bytes", "rounds_to"]

_ROUNDED = frozenset({"float32", "float16", "bfloat16"})


def ref_bytes(ref: TensorRef, start: int, count: int) -> bytes | None:
    """The stored bytes of flattened elements ``[start, start + count)``, or None when not one plain run."""
    if start < 0 or count < 0 or start + count > ref.numel:
        return None
    if count == 0:
        return b""
    found = ref.byte_range(start, count)
    if found is None:
        return None
    source, offset, nbytes = found
    data = source.read_bytes(offset, nbytes)
    return data if len(data) == nbytes else None


def _round_fp32(values: tuple[float, ...], raw: tuple[int, ...], low: DType) -> bytes | None:
    """fp32 values (and their bit patterns) rounded to ``low``'s bytes, little-endian; None for a NaN."""
    if low.name == "float32":
        return struct.pack(f"<{len(raw)}I", *raw)
    if any(math.isnan(v) for v in values):
        return None  # torch's vectorised casts keep NaN payloads their own way: leave NaNs to torch
    if low.name == "bfloat16":
        return struct.pack(f"<{len(raw)}H", *(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF for b in raw))
    out = bytearray()
    for v in values:
        try:
            out += struct.pack("<e", v)
        except OverflowError:  # beyond fp16's range: torch rounds to infinity
            out += struct.pack("<e", math.copysign(math.inf, v))
    return bytes(out)


def rounds_to(master: bytes, low_bytes: bytes, low: DType) -> bool | None:
    """Whether fp32 ``master`` bytes rounded to ``low`` equal ``low_bytes``; None when not answerable here."""
    if low.name not in _ROUNDED or len(master) % 4:
        return None
    n = len(master) // 4
    values = struct.unpack(f"<{n}f", master)
    raw = struct.unpack(f"<{n}I", master)
    rounded = _round_fp32(values, raw, low)
    return None if rounded is None else rounded == low_bytes
