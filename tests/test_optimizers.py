"""Optimizers other than Adam: SGD with momentum, Lion, DeepSpeed's Muon (fixtures/layouts/, generate_legacy.py).

Whatever per-element state an optimizer keeps is passed through by name (``momentum_buffer``, ``exp_avg``) and
equals the live engine's ``safe_get_full_optimizer_state``; Muon's momentum, which is not partitioned like the
weights, is refused with a typed error naming it, never read into wrong values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from layout_checks import (
    assert_convert_equals_engine,
    assert_load_equals_engine,
    assert_open_equals_engine,
    assert_optimizer_state_equals_engine,
    case,
)
from safetensors.torch import load_file

import zeroio
from zeroio.errors import UnsupportedCheckpointError

STATE = {"sgd_z2_ws2_fp32": ("momentum_buffer",), "lion_z3_ws2_fp32": ("exp_avg",)}
MUON = "muon_z2_ws2_bf16_frozen_groups"


@pytest.mark.parametrize("name", [*STATE, MUON])
def test_open_load_convert_equal_engine(name: str, tmp_path: Path) -> None:
    assert_open_equals_engine(name)
    assert_load_equals_engine(name)
    assert_convert_equals_engine(name, tmp_path)


@pytest.mark.parametrize("name", STATE)
def test_optimizer_state_equals_engine(name: str) -> None:
    assert_optimizer_state_equals_engine(name, STATE[name])


@pytest.mark.parametrize(("name", "optimizer"), [("sgd_z2_ws2_fp32", "SGD"), ("lion_z3_ws2_fp32", "Lion"),
                                                 (MUON, "Muon")])  # fmt: skip
def test_metadata_names_the_optimizer(name: str, optimizer: str) -> None:
    """From ds_config's optimizer.type (SGD, Muon) or, for a client optimizer, from its state keys (Lion)."""
    with zeroio.open(case(name)) as ckpt:
        assert ckpt.metadata.optimizer == optimizer
        assert ckpt.metadata.serialization == "zip"


@pytest.mark.parametrize("name", STATE)
def test_include_optimizer_writes_the_state_by_name(name: str, tmp_path: Path) -> None:
    """convert(include_optimizer=True) writes ``<param>.<key>`` for the optimizer's own keys, engine-equal."""
    import torch

    out = tmp_path / "out"
    zeroio.convert(case(name), out, include_optimizer=True, progress=False)
    state = load_file(out / "optimizer.safetensors")
    summary = json.loads((out / "optimizer.json").read_text())
    assert summary["state_keys"] == list(STATE[name])
    want = torch.load(case(name) / "expected" / "optimizer.pt", weights_only=True)
    assert want
    for param, states in want.items():
        for key, value in states.items():
            assert torch.equal(state[f"{param}.{key}"], value), f"{param}.{key}"


@pytest.mark.parametrize("name", ["lion_z3_ws2_fp32"])
def test_reshard_passes_the_state_through(name: str, tmp_path: Path) -> None:
    """reshard (ZeRO-3 only) to another world size keeps every state value (read back through zeroio)."""
    out = tmp_path / "resharded"
    zeroio.reshard(case(name), out, world_size=3)
    with zeroio.open(case(name)) as src, zeroio.open(out) as dst:
        assert dst.metadata.world_size == 3
        for param in (n for n, i in src.infos.items() if i.kind == "trainable" and n not in src.tied):
            a, b = src.optimizer_state(param), dst.optimizer_state(param)
            for key in STATE[name]:
                assert a[key].equal(b[key]), f"{param} {key}"


def test_muon_momentum_is_refused_by_name(tmp_path: Path) -> None:
    """Muon's bf16 momentum covers whole matrices (91 elements against an 82-element partition): refused, named."""
    match = "'momentum_buffer' of flat group 0 holds 91 elements"
    with zeroio.open(case(MUON)) as ckpt, pytest.raises(UnsupportedCheckpointError, match=match):
        ckpt.optimizer_state("emb.weight")
    with pytest.raises(UnsupportedCheckpointError, match="momentum_buffer"):
        zeroio.convert(case(MUON), tmp_path / "out", include_optimizer=True, progress=False)
    assert not (tmp_path / "out").exists()


def test_deepspeed_ds_to_universal_fails_on_muon(tmp_path: Path) -> None:
    """DeepSpeed's own converter raises KeyError 'exp_avg' on the Muon checkpoint (extract_zero_shards)."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(case(MUON) / "global_step2"), "--output_folder", str(tmp_path / "u"), "--num_extract_workers", "1",
           "--num_merge_workers", "1", "--inject_missing_state"]  # fmt: skip
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=300
    )
    assert proc.returncode != 0
    assert "KeyError: 'exp_avg'" in proc.stderr + proc.stdout
