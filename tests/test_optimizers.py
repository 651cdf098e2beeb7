"""Optimizers other than Adam: SGD with momentum, Lion, DeepSpeed's Muon (fixtures/layouts/, generate_legacy.py).

Whatever per-element state an optimizer keeps is passed through by name (``momentum_buffer``, ``exp_avg``) and
equals the live engine's ``safe_get_full_optimizer_state``. Muon's momentum, which covers whole matrices per rank
(not partitioned like the weights), is read per parameter and equals the live engine's own buffers
(``expected/optimizer_live.pt``: DeepSpeed's accessor cannot assemble it); the verbs that need partition-aligned
state (universal export) refuse it with a typed error naming it, never reading wrong values.
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


def _muon_live() -> dict:
    import torch

    want = torch.load(case(MUON) / "expected" / "optimizer_live.pt", weights_only=True)
    assert json.loads((case(MUON) / "expected" / "optimizer_live_missing.json").read_text()) == []
    return want


def test_muon_optimizer_state_equals_live_engine() -> None:
    """Each parameter gets its own half's state, bit for bit and in its stored dtype: the matrices Muon's bf16
    ``momentum_buffer`` (emb.weight straddles both ranks' partitions; mlp_out/mlp_in sit 91 and 126 elements into
    rank 1's 161-element buffer), the rest the Adam half's fp32 ``exp_avg``/``exp_avg_sq`` and ``step``."""
    import torch

    want = _muon_live()
    muon = {"emb.weight", "mlp_in.weight", "mlp_out.weight"}
    assert set(want) == muon | {"mlp_in.bias", "norm.weight", "norm.bias"}
    with zeroio.open(case(MUON)) as ckpt:
        for param, states in want.items():
            got = ckpt.optimizer_state(param)
            tensors = {k for k, v in got.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
            assert tensors == set(states), param
            assert got["use_muon"] is (param in muon)
            for key, value in states.items():
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{param} {key}"
            if param in muon:
                assert got["momentum_buffer"].dtype == torch.bfloat16 and got["step"] is None
                assert got["momentum_buffer"].abs().sum() > 0
            else:
                assert float(got["step"]) == 2.0
        tied = ckpt.optimizer_state("head.weight")["momentum_buffer"]  # tied to emb.weight
        assert torch.equal(tied, want["emb.weight"]["momentum_buffer"])


def test_muon_adam_half_equals_deepspeed_accessor() -> None:
    """Where DeepSpeed's own safe_get_full_optimizer_state works (the Adam half) it agrees with zeroio; it cannot
    assemble Muon's momentum_buffer for any parameter ('not found in optimizer state fragment')."""
    import torch

    want = torch.load(case(MUON) / "expected" / "optimizer.pt", weights_only=True)
    assert set(want) == {"mlp_in.bias", "norm.weight", "norm.bias"}
    missing = json.loads((case(MUON) / "expected" / "optimizer_reference_missing.json").read_text())
    assert "emb.weight:momentum_buffer: ValueError: momentum_buffer not found in optimizer state fragment" in missing
    with zeroio.open(case(MUON)) as ckpt:
        for param, states in want.items():
            got = ckpt.optimizer_state(param)
            for key, value in states.items():
                assert torch.equal(got[key], value), f"{param} {key}"


def test_muon_include_optimizer_writes_each_half(tmp_path: Path) -> None:
    """convert(include_optimizer=True) writes ``<param>.momentum_buffer`` (bf16) for the Muon half and
    ``<param>.exp_avg``/``exp_avg_sq`` for the Adam half, engine-equal; optimizer.json lists both groups."""
    import torch

    want = _muon_live()
    out = tmp_path / "out"
    zeroio.convert(case(MUON), out, include_optimizer=True, progress=False)
    state = load_file(out / "optimizer.safetensors")
    expected_keys = {f"{p}.{k}" for p, states in want.items() for k in states}
    assert set(state) == expected_keys
    for param, states in want.items():
        for key, value in states.items():
            got = state[f"{param}.{key}"]
            assert got.dtype == value.dtype and torch.equal(got, value), f"{param}.{key}"
    summary = json.loads((out / "optimizer.json").read_text())
    assert summary["state_keys"] == ["momentum_buffer", "exp_avg", "exp_avg_sq"]
    groups = summary["param_groups"]
    assert [g["use_muon"] for g in groups] == [True, False]
    assert groups[0]["params"] == ["emb.weight", "mlp_in.weight", "mlp_out.weight"]
    assert groups[1]["step"] == 2 and groups[1]["params"] == ["mlp_in.bias", "norm.weight", "norm.bias"]


def test_muon_buffer_of_the_wrong_size_is_named(tmp_path: Path) -> None:
    """A momentum buffer that is not the whole matrices its partition touches (rank 1's cut to 160 of 161
    elements) is a typed PartitionMismatchError naming the file, never a shifted read."""
    import shutil

    import torch

    from zeroio.errors import PartitionMismatchError

    folder = tmp_path / "muon"
    shutil.copytree(case(MUON), folder)
    path = folder / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    tree = torch.load(path, weights_only=False)  # DeepSpeed classes inside: the test environment has DeepSpeed
    state = tree["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["momentum_buffer"] = state["momentum_buffer"][:160].clone()
    torch.save(tree, path)
    with zeroio.open(folder) as ckpt, pytest.raises(PartitionMismatchError, match="hold 161") as info:
        ckpt.optimizer_state("mlp_in.weight")
    assert "bf16_zero_pp_rank_1" in str(info.value) and "momentum_buffer" in str(info.value)


def test_muon_universal_export_is_refused_by_name(tmp_path: Path) -> None:
    """A universal checkpoint stores partition-free fp32 fragments keyed exp_avg/exp_avg_sq: Muon's whole-matrix
    momentum is refused there with a typed error naming it (91 elements against an 82-element partition)."""
    match = "'momentum_buffer' of flat group 0 holds 91 elements"
    with pytest.raises(UnsupportedCheckpointError, match=match):
        zeroio.convert(case(MUON), tmp_path / "u", fmt="universal", progress=False)
    assert not (tmp_path / "u").exists()


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
