"""ZeRO-3 with optimizer and parameters offloaded to CPU (DeepSpeedCPUAdam): fixtures/layouts/offload_z3_ws2_bf16.

The files have plain ZeRO-3's names and keys; only the optimizer state differs: Adam's ``step`` is a Python int
and ``bias_correction`` sits in the param groups. Everything reads like the live engine had it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from layout_checks import (
    assert_convert_equals_engine,
    assert_load_equals_engine,
    assert_open_equals_engine,
    assert_optimizer_state_equals_engine,
    case,
    expected,
)
from safetensors.torch import load_file

import zeroio

NAME = "offload_z3_ws2_bf16"


def test_open_load_convert_equal_engine(tmp_path: Path) -> None:
    assert_open_equals_engine(NAME)
    assert_load_equals_engine(NAME)
    assert_convert_equals_engine(NAME, tmp_path)


def test_metadata_says_cpu_offload() -> None:
    with zeroio.open(case(NAME)) as ckpt:
        assert ckpt.metadata.offload == "cpu"
        assert ckpt.metadata.optimizer == "AdamW"
        assert ckpt.metadata.serialization == "zip"


def test_optimizer_state_has_an_int_step_and_bias_correction() -> None:
    assert_optimizer_state_equals_engine(NAME, ("exp_avg", "exp_avg_sq"))
    with zeroio.open(case(NAME)) as ckpt:
        state = ckpt.optimizer_state("emb.weight")
    assert state["step"] == 2 and type(state["step"]) is int
    assert state["bias_correction"] is True


def test_include_optimizer_and_reshard(tmp_path: Path) -> None:
    """include_optimizer writes the int step into optimizer.json; reshard to 3 ranks keeps every moment."""
    out = tmp_path / "out"
    zeroio.convert(case(NAME), out, include_optimizer=True, progress=False)
    summary = json.loads((out / "optimizer.json").read_text())
    assert {g["step"] for g in summary["param_groups"]} == {2}
    assert all(g["bias_correction"] is True for g in summary["param_groups"])
    state = load_file(out / "optimizer.safetensors")
    for param, states in expected(NAME, "optimizer").items():
        for key, value in states.items():
            assert torch.equal(state[f"{param}.{key}"], value), f"{param}.{key}"
    resharded = tmp_path / "resharded"
    zeroio.reshard(case(NAME), resharded, world_size=3)
    with zeroio.open(case(NAME)) as src, zeroio.open(resharded) as dst:
        for param in (n for n, i in src.infos.items() if i.kind == "trainable" and n not in src.tied):
            a, b = src.optimizer_state(param), dst.optimizer_state(param)
            assert a["exp_avg"].equal(b["exp_avg"]) and a["exp_avg_sq"].equal(b["exp_avg_sq"]), param
            assert b["step"] == 2
