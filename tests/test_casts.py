"""numpy casts between fp32, bf16 and fp16 (``zeroio._io.casts``) are bit-identical to torch's ``tensor.to()``.

Compared over a strided sweep of all 2^32 fp32 bit patterns, every pattern next to each rounding boundary (ties,
overflow to infinity, fp16 subnormals), every 16-bit pattern, and through ``zeroio.convert`` on a safetensors file
holding all of them plus NaNs (which the numpy path hands to torch). The full 2^32 sweep was run once
(docs/benchmarks.md, "Convert without torch"): too slow for the suite.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import zeroio
from zeroio._dtypes import BY_NAME
from zeroio._io.casts import can_cast, cast_into

F32, BF16, F16 = BY_NAME["float32"], BY_NAME["bfloat16"], BY_NAME["float16"]
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NARROW = [BF16, F16]


def _boundary_patterns() -> np.ndarray:
    """fp32 patterns around every place rounding changes its answer, for any number of dropped mantissa bits."""
    found = []
    sign_exp = np.arange(512, dtype=np.uint32) << 23  # every sign and exponent
    for dropped in range(1, 24):
        tie = 1 << (dropped - 1)
        for kept in (0, 1, 2, 3, (1 << (23 - dropped)) - 1, (1 << (23 - dropped)) - 2):
            base = (kept << dropped) & 0x7FFFFF
            for low in (tie - 1, tie, tie + 1, 0, 1, (1 << dropped) - 1):
                found.append(sign_exp | np.uint32(base | low))
    every_bf16 = np.arange(1 << 16, dtype=np.uint32) << 16  # each bf16 value's neighbourhood, ties included
    for low in (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
        found.append(every_bf16 | np.uint32(low))
    specials = [0x477FEFFF, 0x477FF000, 0x477FF001, 0x33000000, 0x33000001, 0x337FFFFF, 0x7F7FFFFF, 0x7F800000]
    found.append(np.array(specials + [s | 0x80000000 for s in specials], dtype=np.uint32))
    return np.unique(np.concatenate(found))


def _not_nan(bits: np.ndarray) -> np.ndarray:
    return bits[(bits & 0x7FFFFFFF) <= 0x7F800000]


def _torch_cast(bits: np.ndarray, src: str, dst: str) -> bytes:
    tensor = torch.from_numpy(bits.copy()).view(TORCH[src]).to(TORCH[dst])
    return bytes(tensor.view(torch.uint8).numpy())


def _numpy_cast(bits: np.ndarray, src, dst) -> bytes | None:
    out = bytearray(bits.size * dst.itemsize)
    return bytes(out) if cast_into(bits.copy(), src, dst, out) else None


@pytest.mark.parametrize("dst", NARROW, ids=str)
def test_strided_sweep_of_every_fp32_pattern(dst):
    """~4.3 million patterns spread over all 2^32 (a prime stride): the numpy cast is torch's, bit for bit."""
    bits = _not_nan((np.arange(0, 1 << 32, 997, dtype=np.uint64)).astype(np.uint32))
    assert bits.size > 4_000_000
    assert _numpy_cast(bits, F32, dst) == _torch_cast(bits, "float32", dst.name)


@pytest.mark.parametrize("dst", NARROW, ids=str)
def test_every_pattern_at_a_rounding_boundary(dst):
    """Ties (to even), one below and above, overflow to infinity, subnormals, -0.0 and infinities."""
    bits = _not_nan(_boundary_patterns())
    assert bits.size > 500_000
    assert _numpy_cast(bits, F32, dst) == _torch_cast(bits, "float32", dst.name)


@pytest.mark.parametrize("src", NARROW, ids=str)
@pytest.mark.parametrize("dst", [F32, *NARROW], ids=str)
def test_every_16_bit_pattern(src, dst):
    """Every bf16/fp16 value widened to fp32 (exact) or cast to the other 16-bit type (through fp32, as torch)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    nan = (bits & 0x7FFF) > (0x7F80 if src is BF16 else 0x7C00)
    clean = bits[~nan]
    assert _numpy_cast(clean, src, dst) == _torch_cast(clean, src.name, dst.name)
    assert _numpy_cast(bits, src, dst) is None  # a chunk holding a NaN is left to torch


def test_a_chunk_holding_a_nan_is_left_to_torch():
    """torch's NaN bits depend on the CPU and the code path, so any NaN hands the chunk back (False)."""
    for nan in (0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFFFFFFF):
        bits = np.array([0x3F800000] * 100 + [nan] + [0] * 27, dtype=np.uint32)
        assert _numpy_cast(bits, F32, BF16) is None and _numpy_cast(bits, F32, F16) is None
    assert can_cast(F32, BF16) and not can_cast(F32, BY_NAME["float64"]) and not can_cast(BY_NAME["int64"], F32)


def test_convert_casts_like_torch_including_nans(tmp_path):
    """``zeroio.convert(dtype=bf16/fp16)`` of an fp32 safetensors file holding the boundary patterns, a strided
    sweep and NaNs of every kind writes what torch's ``.to()`` gives, NaN bits included (torch casts those)."""
    sweep = np.arange(0, 1 << 32, 65537, dtype=np.uint64).astype(np.uint32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA12345], np.uint32)
    tensors = {
        "boundaries": torch.from_numpy(_not_nan(_boundary_patterns())).view(torch.float32),
        "sweep": torch.from_numpy(sweep).view(torch.float32),  # NaNs included: its chunks go to torch
        "nans": torch.from_numpy(np.concatenate([nans, sweep[:1000]])).view(torch.float32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        # small chunks: numpy and torch chunks alternate within one tensor
        zeroio.convert(tmp_path / "model.safetensors", tmp_path / name, dtype=name, progress=False, chunk_bytes=4096)
        written = load_file(str(tmp_path / name / "model.safetensors"))
        for key, tensor in tensors.items():
            expected = tensor.to(dtype)
            assert written[key].dtype == dtype
            assert torch.equal(written[key].view(torch.int16), expected.view(torch.int16)), (name, key)
