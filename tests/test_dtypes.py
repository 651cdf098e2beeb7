"""The torch-free dtype vocabulary (``zeroio._dtypes``) and byte-level rounding (``zeroio._formats.stored_bits``) agree
with torch itself: a new torch that renames or resizes a dtype, or rounds differently, fails here (issue 17)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from zeroio._dtypes import BY_NAME, BY_STORAGE, SAFETENSORS_ORDER, as_dtype
from zeroio._formats.stored_bits import rounds_to


def test_every_name_is_the_torch_dtype_of_that_name():
    for name, dtype in BY_NAME.items():
        real = getattr(torch, name)
        assert dtype.torch is real, name
        assert (dtype.itemsize, dtype.is_floating_point, dtype.is_complex) == (
            real.itemsize,
            real.is_floating_point,
            real.is_complex,
        ), name
        assert str(dtype) == str(real) and dtype == real and real == dtype and as_dtype(real) is dtype


def test_every_torch_dtype_has_a_name():
    quantized = {"qint8", "qint32", "quint8", "quint4x2", "quint2x4"}
    names = {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)} - quantized
    assert names <= set(BY_NAME)


def test_storage_classes_match_torch_save():
    expected = {s: d for d, s in torch.storage._dtype_to_storage_type_map().items() if not s.startswith("Q")}
    assert {name: d.torch for name, d in BY_STORAGE.items()} == expected


def test_safetensors_codes_match_safetensors():
    from safetensors.torch import _TYPES  # safetensors' own code -> dtype table

    assert {d.safetensors: d.torch for d in SAFETENSORS_ORDER if d.safetensors in _TYPES} == {
        code: dt for code, dt in _TYPES.items() if code in {d.safetensors for d in SAFETENSORS_ORDER}
    }


def test_a_dtype_is_read_only():
    with pytest.raises(AttributeError):
        BY_NAME["float32"].itemsize = 8  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(BY_NAME["bfloat16"])) is BY_NAME["bfloat16"]


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scaled = [torch.randn(20000, generator=g) * s for s in (1e-8, 1e-5, 1.0, 1e3, 7e4, 1e38)]
    bits = torch.randint(-(2**31), 2**31 - 1, (50000,), generator=g, dtype=torch.int64).to(torch.int32)
    anything = bits.view(torch.float32)
    edges = torch.tensor([65504.0, 65520.0, 65519.99, -65520.0, math.inf, -math.inf, 0.0, -0.0, 1e-45])
    return torch.cat([*scaled, anything[~anything.isnan()], edges])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rounding_on_bytes_is_torchs(dtype):
    """Ties, subnormals, overflow to infinity and every bit pattern round as ``tensor.to(dtype)`` does."""
    x = _values()
    master = x.numpy().tobytes()
    low = x.to(dtype).view(torch.uint8).numpy().tobytes()
    assert rounds_to(master, low, as_dtype(dtype)) is True
    flipped = bytearray(low)
    flipped[-1] ^= 1
    assert rounds_to(master, bytes(flipped), as_dtype(dtype)) is False


def test_nan_and_other_dtypes_are_left_to_torch():
    nan = torch.tensor([math.nan]).numpy().tobytes()
    assert rounds_to(nan, b"\x00\x7e", as_dtype(torch.float16)) is None
    assert rounds_to(b"\x00" * 4, b"\x00" * 8, as_dtype(torch.float64)) is None
