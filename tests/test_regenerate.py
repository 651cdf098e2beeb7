"""Regenerate a fixture with the installed DeepSpeed and check zeroio against it, so the suite follows DeepSpeed."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from fixture_data import ROOT, assert_state_dicts_equal

import zeroio

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="needs the deepspeed launcher (pip install -e '.[test]')")
@pytest.mark.parametrize("name", ["z3_ws3_fp32", "z2_ws2_bf16"])
def test_fresh_checkpoint_matches_deepspeed(tmp_path, name):
    """A checkpoint DeepSpeed writes now is consolidated bit for bit like DeepSpeed's tool and the live engine."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "fixtures" / "generate.py"), "--out", str(tmp_path), name],
        check=False, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / name
    with zeroio.open(out) as ckpt:
        actual = ckpt.state_dict()
    reference = torch.load(out / "expected" / "zero_to_fp32.pt", weights_only=True)
    engine = torch.load(out / "expected" / "engine.pt", weights_only=True)
    assert_state_dicts_equal({k: actual[k] for k in reference}, reference)
    assert_state_dicts_equal(actual, engine)
    assert actual["head.weight"] is actual["emb.weight"]
