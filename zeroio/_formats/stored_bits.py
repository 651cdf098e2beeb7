"""Comparing a few stored values without torch, so opening a checkpoint (``zeroio inspect``) never imports it.

Some readers check at open that two stores agree: a 16-bit parameter is its fp32 master rounded (DeepSpeed copies
the master into it after every step), or two files hold the same bits. They compare a sample of elements at both
ends (``plans.sample_ranges``). This module fetches those bytes; the rounding is zeroio's one torch-free cast,
:func:`zeroio._io.casts.cast_into`, bit-identical to torch's ``tensor.to()``. Anything it cannot answer exactly (a
view that is not one run of bytes, a short read, a NaN, a dtype pair other than fp32 -> fp32/fp16/bf16, numpy not
installed) is ``None``: the caller then compares with torch, as before, and raises what torch's path raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._dtypes import FLOAT32, DType
from .._io.casts import CASTABLE, can_cast, cast_into

if TYPE_CHECKING:
    from .._pickles import TensorRef

__all__ = ["ref_bytes", "rounds_to"]


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


def rounds_to(master: bytes, low_bytes: bytes, low: DType) -> bool | None:
    """Whether fp32 ``master`` bytes rounded to ``low`` equal ``low_bytes``; None when not answerable here."""
    if low.name not in CASTABLE or len(master) % 4:
        return None
    if low == FLOAT32:
        return master == low_bytes
    if not can_cast(FLOAT32, low):
        return None
    rounded = bytearray(len(master) // 4 * low.itemsize)
    if not cast_into(bytearray(master), FLOAT32, low, rounded):
        return None  # a NaN: torch's casts keep NaN payloads their own way, so torch answers
    return rounded == low_bytes
