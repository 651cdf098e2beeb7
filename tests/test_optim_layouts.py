"""Optimizer state of pipeline-parallel and tensor-parallel checkpoints (fixtures/layouts/pipe_*, autotp_*).

Each pipeline stage is a ZeRO-1 checkpoint whose dp ranks hold the Adam moments in the fp32 masters' partitions;
each tp rank's moments are its shard's and merge along the weight's partition dimension. Both equal, bit for bit,
the live engine's ``safe_get_full_optimizer_state`` captured at fixture time (``expected/optimizer.pt``: per stage;
per tp rank, merged like the weights by generate_autotp.py), through ``optimizer_state`` and
``convert(include_optimizer=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from layout_checks import case
from safetensors.torch import load_file

import zeroio
from zeroio.errors import TensorNotFoundError

PIPELINE = ["pipe_z1_ws2_pp2_bf16", "pipe_z1_ws4_pp2dp2_fp32_frozen", "pipe_z0_ws4_pp2dp2_bf16"]
TENSOR_PARALLEL = ["autotp_z1_ws2_tp2_bf16", "autotp_z1_ws4_dp2_tp2_fp32"]
KEYS = {"exp_avg", "exp_avg_sq"}


def _reference(name: str) -> dict:
    import torch

    want = torch.load(case(name) / "expected" / "optimizer.pt", weights_only=True)
    assert want, f"{name} has no optimizer reference"
    return want


@pytest.mark.parametrize("name", PIPELINE + TENSOR_PARALLEL)
def test_optimizer_state_equals_engine(name: str) -> None:
    """Every trainable parameter's moments equal the engine's, bit for bit, in full (merged) shape."""
    import torch

    want = _reference(name)
    with zeroio.open(case(name)) as ckpt:
        trainable = {n for n, i in ckpt.infos.items() if i.kind == "trainable" and n not in ckpt.tied}
        assert set(want) == trainable
        for param, states in want.items():
            got = ckpt.optimizer_state(param)
            assert set(states) == KEYS
            for key, value in states.items():
                assert got[key].shape == ckpt.info(param).shape == value.shape, f"{param} {key}"
                assert torch.equal(got[key], value), f"{param} {key}"
            assert float(got["step"]) == 2.0 and got["lr"] == 0.05


@pytest.mark.parametrize("name", ["pipe_z1_ws4_pp2dp2_fp32_frozen", "autotp_z1_ws2_tp2_bf16"])
def test_include_optimizer_equals_engine(name: str, tmp_path: Path) -> None:
    """convert(include_optimizer=True) writes ``<param>.exp_avg``/``exp_avg_sq`` of every trainable parameter."""
    import torch

    want = _reference(name)
    out = tmp_path / "out"
    zeroio.convert(case(name), out, include_optimizer=True, progress=False)
    state = load_file(out / "optimizer.safetensors")
    assert set(state) == {f"{p}.{k}" for p, states in want.items() for k in states}
    for param, states in want.items():
        for key, value in states.items():
            assert torch.equal(state[f"{param}.{key}"], value), f"{param}.{key}"
    summary = json.loads((out / "optimizer.json").read_text())
    assert summary["state_keys"] == ["exp_avg", "exp_avg_sq"]
    assert sorted(p for g in summary["param_groups"] for p in g["params"]) == sorted(want)
    assert all(g["step"] == 2 for g in summary["param_groups"])
    with zeroio.open(out) as converted, zeroio.open(case(name)) as source:  # the weights are unchanged
        for param in want:
            assert torch.equal(converted[param], source[param])


def test_pipeline_frozen_parameter_has_no_state() -> None:
    """Layer 3 is frozen: no optimizer owns it, said by name (typed), never an empty or stale state."""
    with zeroio.open(case("pipe_z1_ws4_pp2dp2_fp32_frozen")) as ckpt:
        frozen = [n for n, i in ckpt.infos.items() if i.kind == "frozen"]
        assert frozen
        with pytest.raises(TensorNotFoundError, match="frozen parameter"):
            ckpt.optimizer_state(frozen[0])
        with pytest.raises(TensorNotFoundError):
            ckpt.optimizer_state("no.such.tensor")
