"""Where the DeepSpeed fixtures live and how to read their references (shared by the tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

# Framework-written fixtures (fixtures/frameworks/, see fixtures/README.md).
FRAMEWORKS = FIXTURES / "frameworks"
HF = FRAMEWORKS / "hf_trainer_gpt2_z3"
HF_CKPT = HF / "checkpoint-3"
LIGHTNING = ["lightning_z3_fp32", "lightning_z3_bf16"]
LIGHTNING_CLIENT_KEYS = (
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "loops",
    "callbacks",
    "lr_schedulers",
    "hparams_name",
    "hyper_parameters",
)
"""Lightning's client state in its DeepSpeed model_states, in the order Lightning 2.6.6 writes it."""


def fixture_names(**match: Any) -> list[str]:
    """Names of fixtures whose manifest matches every ``key=value`` given (e.g. ``stage=3``)."""
    names = []
    for manifest_path in sorted(FIXTURES.glob("*/manifest.json")):
        manifest = json.loads(manifest_path.read_text())
        if all(manifest.get(k) == v for k, v in match.items()):
            names.append(manifest_path.parent.name)
    return names


def manifest(name: str) -> dict[str, Any]:
    """The fixture's manifest.json."""
    return json.loads((FIXTURES / name / "manifest.json").read_text())


def reference(name: str, kind: str = "zero_to_fp32") -> dict[str, torch.Tensor] | None:
    """DeepSpeed's consolidation (``zero_to_fp32``) or the live engine's tensors (``engine``); None if absent."""
    path = FIXTURES / name / "expected" / f"{kind}.pt"
    if not path.exists():
        return None
    return torch.load(path, weights_only=True)


def assert_state_dicts_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys, dtypes, shapes and bits."""
    assert sorted(actual) == sorted(expected)
    for key, want in expected.items():
        got = actual[key]
        assert got.dtype == want.dtype, f"{key}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{key}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{key}: values differ"
