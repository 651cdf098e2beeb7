"""Checkpoints written by older DeepSpeed releases (fixtures/versions/, fixtures/generate_versions.py) read bit for bit.

Each fixture was trained and saved by the release its manifest names, on torch 2.13's CPU build; its
``expected/engine.pt`` holds that engine's own tensors at save time and ``expected/optimizer.pt`` DeepSpeed's
``safe_get_full_optimizer_state``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES
from hostile_files import Ops, archive
from safetensors.torch import load_file

import zeroio
from zeroio._pickles import load_pickle
from zeroio.errors import UnsafePickleError, UnsupportedCheckpointError

VERSIONS = FIXTURES / "versions"


def _manifest(name: str) -> dict[str, Any]:
    return json.loads((VERSIONS / name / "manifest.json").read_text())


ALL = sorted(p.parent.name for p in VERSIONS.glob("*/manifest.json"))
NAMES = [n for n in ALL if not any(_manifest(n).get(k) for k in ("masters_unsaved", "expert_accessor_wrong"))]


def _expected(name: str, kind: str) -> dict[str, Any]:
    return torch.load(VERSIONS / name / "expected" / f"{kind}.pt", weights_only=True)


def _assert_engine_bits(ckpt: zeroio.Checkpoint, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor equals the engine's, dtype for dtype; floating buffers come back as fp32 (docs/format.md), so a
    16-bit live buffer must be what the file stores and equal the fp32 one once upcast."""
    assert list(got) == list(want)
    for key, value in want.items():
        if ckpt.info(key).kind == "buffer" and value.is_floating_point() and value.dtype != torch.float32:
            assert ckpt.info(key).stored_dtype == value.dtype, key
            value = value.float()
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("name", NAMES)
def test_open_equals_the_engine(name: str) -> None:
    """zeroio.open serves the release's engine tensors bit for bit, in model.state_dict() order."""
    manifest = _manifest(name)
    with zeroio.open(VERSIONS / name) as ckpt:
        # MoE model states of DeepSpeed <= 0.18 record no ds_version.
        assert ckpt.metadata.ds_version == (None if manifest.get("model") == "moe" else manifest["deepspeed"])
        _assert_engine_bits(ckpt, {key: ckpt[key] for key in ckpt}, _expected(name, "engine"))
        for param, states in _expected(name, "optimizer").items():
            got = ckpt.optimizer_state(param)
            for key, value in states.items():
                assert torch.equal(got[key].float(), value), f"{param} {key}"


@pytest.mark.parametrize("name", NAMES)
def test_convert_equals_the_engine(name: str, tmp_path: Path) -> None:
    """zeroio.convert writes the engine's tensors (the tied head left out, as Hugging Face does)."""
    zeroio.convert(VERSIONS / name, tmp_path / "out", progress=False)
    got: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        got.update(load_file(shard))
    want = _expected(name, "engine")
    assert "emb.weight" in got and set(got) <= set(want)
    with zeroio.open(VERSIONS / name) as ckpt:
        _assert_engine_bits(ckpt, got, {key: want[key] for key in got})


def test_bf16_optimizer_at_stage_0_reads_as_zero_1() -> None:
    """DeepSpeed <= 0.16 wraps bf16 training at ZeRO stage 0 in BF16_Optimizer: ZeRO-1's partitions, no zero_stage."""
    name = "ds0_16_9_z0_ws2_bf16"
    with zeroio.open(VERSIONS / name) as ckpt:
        assert ckpt.metadata.extra["ds_config"]["zero_optimization"]["stage"] == 0
        assert ckpt.metadata.zero_stage == 1 and ckpt.metadata.world_size == 2
        assert ckpt.info("emb.weight").kind == "trainable" and ckpt.info("frozen.weight").kind == "frozen"


def test_bf16_masters_deepspeed_never_saved(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed 0.17.6-0.18.4 wrap ZeRO-1 + bf16 + fp32 accumulation in FP16_UnfusedOptimizer and save no optimizer
    file: the bf16 weights are all there is. They are returned (each the engine's fp32 master rounded), the masters
    reported missing and the reason logged, instead of asking for optimizer files that were never written."""
    name = "ds0_17_6_z1_ws2_bf16_fp32acc"
    assert _manifest(name)["masters_unsaved"] and not list((VERSIONS / name).glob("*/*optim_states.pt"))
    want = _expected(name, "engine")
    with caplog.at_level("WARNING"), zeroio.open(VERSIONS / name) as ckpt:
        assert not ckpt.metadata.has_fp32_master and ckpt.metadata.zero_stage == 1
        for key, value in want.items():
            got = ckpt[key]
            if ckpt.info(key).kind == "buffer":
                assert torch.equal(got, value.to(got.dtype)), key
                assert got.dtype == (torch.float32 if value.is_floating_point() else value.dtype), key
            else:
                assert got.dtype == torch.bfloat16 and torch.equal(got, value.to(torch.bfloat16)), key
    assert "did not save the fp32 master weights" in caplog.text and "0.18.5" in caplog.text


@pytest.mark.parametrize("name", ["ds0_18_9_z3_ws2_fp32", "ds0_16_9_z0_ws2_bf16"])
def test_ties_are_one_tensor_in_the_module_pickle(name: str) -> None:
    """What ties are inferred from where DeepSpeed recorded none (below): in genuine files a tied parameter is one
    storage view under both names, and every other parameter has its own (ZeRO-3's 0-element placeholders too)."""
    path = min((VERSIONS / name / "global_step2").glob("*model_states.pt"))
    tree, _ = load_pickle(path)
    params = {k: v for k, v in tree["module"].items() if k not in tree["buffer_names"]}
    views = {k: (v.storage.key, v.storage_offset, v.shape, v.stride) for k, v in params.items()}
    assert tree["shared_params"] == {"head.weight": "emb.weight"} and views["head.weight"] == views["emb.weight"]
    assert len(set(views.values())) == len(views) - 1


def _as_deepspeed_0_9_0(name: str, tmp_path: Path) -> Path:
    """A copy of fixture ``name`` whose model states lack what DeepSpeed 0.9.0 did not save (read in its
    engine._save_checkpoint): shared_params, frozen_param_shapes, frozen_param_fragments. ``module`` keeps the tie as
    state_dict() gives it: one tensor under both names."""
    tag = _copy(name, tmp_path)
    for path in tag.glob("*model_states.pt"):
        tree = torch.load(path, weights_only=True)
        for key in ("shared_params", "frozen_param_shapes", "frozen_param_fragments"):
            tree.pop(key, None)
        tree["module"]["head.weight"] = tree["module"]["emb.weight"]
        torch.save(tree, path)
    return tag


@pytest.mark.parametrize("name", ["ds0_18_9_z3_ws2_fp32", "ds0_16_9_z0_ws2_bf16"])
def test_checkpoint_without_shared_params(name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without shared_params (DeepSpeed < 0.9.2) the tied head is found as one tensor with the embedding and served
    from its fp32 master (ZeRO-1: before, the bf16 copy as a frozen parameter; ZeRO-3: before, left out). ZeRO-3's
    frozen parameters, which DeepSpeed < 0.9.1 did not save, are named as left out instead of silently missing."""
    tag = _as_deepspeed_0_9_0(name, tmp_path)
    want = _expected(name, "engine")
    with caplog.at_level("WARNING"), zeroio.open(tag) as ckpt:
        assert ckpt.info("head.weight").tied_to == "emb.weight"
        frozen = [] if ckpt.metadata.zero_stage != 3 else ["frozen.weight", "frozen.bias"]
        assert ckpt.metadata.extra.get("unsaved_params", []) == frozen
        _assert_engine_bits(ckpt, {k: ckpt[k] for k in ckpt}, {k: v for k, v in want.items() if k not in frozen})
    assert ("frozen.weight, frozen.bias" in caplog.text) == bool(frozen)


def test_elastic_optimizer_state_read_by_name_only(tmp_path: Path) -> None:
    """ZeRO-2 with elastic_checkpoint (0.18.9): one lean state per param group and no param_groups. optimizer_state()
    reads the moments and step (the moments equal DeepSpeed's accessor: test_open_equals_the_engine); writers that
    need the groups' hyper-parameters refuse it by name and write nothing."""
    name = "ds0_18_9_z2_ws2_fp32_elastic"
    with zeroio.open(VERSIONS / name) as ckpt:
        state = ckpt.optimizer_state("norm.bias")
        assert float(state["step"]) == 2.0 and "lr" not in state
    with pytest.raises(UnsupportedCheckpointError) as caught:
        zeroio.convert(VERSIONS / name, tmp_path / "out", include_optimizer=True, progress=False)
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt' holds an elastic" in str(caught.value)
    assert "elastic_checkpoint=false" in str(caught.value) and not (tmp_path / "out").exists()


LEGACY_MOE = [n for n in NAMES if _manifest(n).get("model") == "moe"]


@pytest.mark.parametrize("name", LEGACY_MOE)
def test_legacy_moe_records_what_it_rebuilt(name: str) -> None:
    """DeepSpeed <= 0.18 MoE: the tied head found (one tensor in 0.16.9's pickle, a copy in 0.18.9's), the entries
    no optimizer group holds are of unknown role (frozen parameter or buffer: 'tensor'), the rebuild is recorded."""
    with zeroio.open(VERSIONS / name) as ckpt:
        assert ckpt.info("head.weight").tied_to == "emb.weight"
        assert {n for n in ckpt if ckpt.info(n).kind == "tensor"} == {"scale", "calls", "frozen.weight", "frozen.bias"}
        assert ckpt.info("moe.deepspeed_moe.experts.deepspeed_experts.1.0.weight").kind == "trainable"
        assert "param_slice_mappings" in ckpt.metadata.extra["rebuilt"]


def _copy(name: str, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(VERSIONS / name, tmp_path / name, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return tmp_path / name / "global_step2"


def test_legacy_moe_order_checked_against_the_saved_values(tmp_path: Path) -> None:
    """A rebuilt master that does not round to the value DeepSpeed saved for it (here: two module entries swapped,
    as a wrong order would place them) refuses the checkpoint, naming the parameter, instead of returning it."""
    tag = _copy(LEGACY_MOE[0], tmp_path)
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    module = states["module"]
    module["norm.weight"], module["norm.bias"] = module["norm.bias"].clone(), module["norm.weight"].clone()
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(UnsupportedCheckpointError, match="'norm.weight'"):
        zeroio.open(tag)


def test_legacy_moe_expert_optimizer_file_with_state_refused(tmp_path: Path) -> None:
    """The expp_rank_* files DeepSpeed <= 0.18 writes next to ZeRO's must be empty; one holding state is refused."""
    tag = _copy(LEGACY_MOE[0], tmp_path)
    torch.save({"optimizer": {"state": {}, "param_groups": []}}, tag / "expp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(UnsupportedCheckpointError, match="expp_rank_1_mp_rank_00_optim_states.pt"):
        zeroio.open(tag)


OLD_MOE = "ds0_12_6_moe_z2_ws2_ep2_fp32"


def _expert_files(tag: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(tag.glob("layer_*_expert_*_model_states.pt")):
        found.update(torch.load(path, weights_only=True))
    return found


def test_legacy_moe_expert_mappings_completed_by_value(tmp_path: Path) -> None:
    """DeepSpeed < 0.14.5 MoE (0.12.6, each rank holding its experts whole): the mappings name the first 1/ep of each
    expert group only. The rest is named by value and every expert master equals, bit for bit, the fp32 value
    DeepSpeed saved in its expert file (0.12.6's own safe_get_full_fp32_param returns zeros there, so engine.pt is the
    reference for the other tensors only); convert writes the same."""
    experts = _expert_files(VERSIONS / OLD_MOE / "global_step2")
    want = {k: v for k, v in _expected(OLD_MOE, "engine").items() if k not in experts}
    with zeroio.open(VERSIONS / OLD_MOE) as ckpt:
        got = {k: ckpt[k] for k in ckpt}
        assert {k for k in got if ckpt.info(k).kind == "trainable"} >= set(experts)
    assert set(got) == set(want) | set(experts)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in {**want, **experts}.items())
    zeroio.convert(VERSIONS / OLD_MOE, tmp_path / "out", progress=False)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in experts.items())


def test_legacy_moe_group_no_value_names_is_refused(tmp_path: Path) -> None:
    """When no unlisted expert parameter's saved value matches the rest of a group (here: an expert file altered),
    the group cannot be named: one typed line naming the optimizer file and the fix, and convert writes nothing."""
    tag = _copy(OLD_MOE, tmp_path)
    path = tag / "layer_0_expert_0_mp_rank_00_model_states.pt"
    tensors = torch.load(path, weights_only=True)
    name = next(k for k in tensors if k.endswith(".2.weight"))
    tensors[name] = tensors[name] + 1
    torch.save(tensors, path)
    with pytest.raises(UnsupportedCheckpointError) as caught:
        zeroio.open(tag)
    message = str(caught.value)
    assert "\n" not in message and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in message
    assert "DeepSpeed >= 0.19" in message
    with pytest.raises(UnsupportedCheckpointError):
        zeroio.convert(tag, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_python2_names_of_protocol_2_pickles(tmp_path: Path) -> None:
    """torch.save writes protocol 2, where a set is '__builtin__.set': read as a set. The mapping only renames:
    '__builtin__.eval' is still refused, under its Python 3 name."""
    path = tmp_path / "set.pt"
    ops = Ops().dict().text("names").glob("__builtin__.set").mark().text("a").raw(b"l").tuple(1).reduce().setitem()
    path.write_bytes(archive(ops.stop()))
    tree, _ = load_pickle(path)
    assert tree == {"names": {"a"}}
    path.write_bytes(archive(Ops().glob("__builtin__.eval").text("1").tuple(1).reduce().stop()))
    with pytest.raises(UnsafePickleError, match="'builtins.eval'"):
        load_pickle(path)
