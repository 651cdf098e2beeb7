"""Regenerate a fixture with the installed DeepSpeed and check zeroio against it, so the suite follows DeepSpeed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixture_data import ROOT, assert_state_dicts_equal

import zeroio

pytestmark = pytest.mark.slow

NAMES = ["z3_ws3_fp32", "z2_ws2_bf16"]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every fixture of NAMES, trained now by the installed DeepSpeed: one run of fixtures/generate.py for all."""
    if shutil.which("deepspeed") is None:
        pytest.skip("needs the deepspeed launcher (pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("regenerated")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "fixtures" / "generate.py"), "--out", str(root), *NAMES],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("name", NAMES)
def test_fresh_checkpoint_matches_deepspeed(regenerated, name):
    """A checkpoint DeepSpeed writes now is consolidated bit for bit like DeepSpeed's tool and the live engine."""
    out = regenerated / name
    with zeroio.open(out) as ckpt:
        actual = ckpt.state_dict()
    reference = torch.load(out / "expected" / "zero_to_fp32.pt", weights_only=True)
    engine = torch.load(out / "expected" / "engine.pt", weights_only=True)
    assert_state_dicts_equal({k: actual[k] for k in reference}, reference)
    assert_state_dicts_equal(actual, engine)
    assert actual["head.weight"] is actual["emb.weight"]
