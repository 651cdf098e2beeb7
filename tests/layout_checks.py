"""Checks shared by the layout suites (legacy, offload, optimizers): a fixtures/layouts/ case against its engine.

Each case was written by fixtures/generate_legacy.py with ``expected/engine.pt`` (the live engine's tensors) and
``expected/optimizer.pt`` (``safe_get_full_optimizer_state`` of every parameter and tensor state key).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import torch
from fixture_data import FIXTURES, assert_state_dicts_equal
from safetensors.torch import load_file
from torch import nn

import zeroio

LAYOUTS = FIXTURES / "layouts"


def case(name: str) -> Path:
    return LAYOUTS / name


def manifest(name: str) -> dict[str, Any]:
    return json.loads((LAYOUTS / name / "manifest.json").read_text())


def expected(name: str, kind: str = "engine") -> dict[str, Any]:
    return torch.load(LAYOUTS / name / "expected" / f"{kind}.pt", weights_only=True)


@cache
def _generate() -> Any:
    spec = importlib.util.spec_from_file_location("fixtures_generate", FIXTURES / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fixtures_generate"] = module
    spec.loader.exec_module(module)
    return module


def tiny_model() -> nn.Module:
    """The fixtures' TinyLM (fixtures/generate.py), freshly initialised."""
    return _generate()._build_model({})


def assert_open_equals_engine(name: str) -> None:
    """zeroio.open serves every tensor of the engine's state dict, bit for bit, dtype for dtype."""
    want = expected(name)
    with zeroio.open(case(name)) as ckpt:
        got = {key: ckpt[key] for key in ckpt}
    assert_state_dicts_equal(got, want)


def assert_load_equals_engine(name: str) -> None:
    """zeroio.load fills a fresh TinyLM with the engine's values (the model's own dtypes)."""
    model = tiny_model()
    zeroio.load(case(name), model)
    want = expected(name)
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key].to(value.dtype)), key


def assert_convert_equals_engine(name: str, tmp_path: Path) -> None:
    """zeroio.convert writes the engine's tensors (tied head dropped, as Hugging Face does)."""
    out = tmp_path / name
    zeroio.convert(case(name), out, progress=False)
    got = {}
    for shard in sorted(out.glob("*.safetensors")):
        got.update(load_file(shard))
    want = {k: v for k, v in expected(name).items() if k in got}
    assert set(got) <= set(expected(name)) and "emb.weight" in got
    assert_state_dicts_equal(got, want)


def assert_optimizer_state_equals_engine(name: str, keys: tuple[str, ...]) -> None:
    """ckpt.optimizer_state(param)[key] equals the live engine's safe_get_full_optimizer_state, bit for bit."""
    want = expected(name, "optimizer")
    assert want, "the fixture has no optimizer reference"
    with zeroio.open(case(name)) as ckpt:
        for param, states in want.items():
            got = ckpt.optimizer_state(param)
            assert sorted(k for k in states) == sorted(keys), param
            for key, value in states.items():
                assert got[key].shape == value.shape, f"{param} {key}"
                assert torch.equal(got[key].float(), value), f"{param} {key}"
