"""Megatron-Core ``torch_dist`` checkpoints: every verb, bit for bit against Megatron's own references.

The fixtures in fixtures/megatron/ were written by megatron-core 0.16.1 itself (``dist_checkpointing.save``,
tensor, expert or pipeline parallel 2 on gloo, fixtures/generate_megatron.py). References beside them, made by Megatron in the same
run: ``expected/plain.pt`` (``dist_checkpointing.load_plain_tensors``: stacked tensors, optimizer moments),
``expected/step.pt`` (the optimizer's shared step), ``expected/model.pt`` (the live model's full per-layer state
assembled from every rank's shard at Megatron's own offsets) and ``expected/keys.json`` (module names -> those).
Megatron is not needed to run these tests.
"""

from __future__ import annotations

import json
from collections.abc import Container
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointNotFoundError

ROOT = Path(__file__).resolve().parent.parent
MEGATRON = ROOT / "fixtures" / "megatron"
NAMES = sorted(p.parent.name for p in MEGATRON.glob("*/manifest.json"))
ITER = "iter_0000003"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


def _expected(name: str, what: str) -> dict[str, torch.Tensor]:
    return torch.load(MEGATRON / name / "expected" / what, weights_only=True)


def _stacked(layer_name: str, saved: Container[str] = ()) -> tuple[str, int | None]:
    """``decoder.layers.1.mlp.x`` -> (``decoder.layers.mlp.x``, 1): the stacked key Megatron saved it under; a key
    in ``saved`` as it is (layers Megatron does not stack: dense and MoE layers mixed) -> (the key, None)."""
    head, sep, rest = layer_name.partition(".layers.")
    if not sep or layer_name in saved:
        return layer_name, None
    index, _, rest = rest.partition(".")
    return f"{head}.layers.{rest}", int(index)


@pytest.mark.parametrize("name", NAMES)
def test_open_equals_the_live_model_and_megatrons_consolidation(name):
    live = _expected(name, "model.pt")
    plain = _expected(name, "plain.pt")
    with zeroio.open(MEGATRON / name) as ckpt:
        assert list(ckpt) == list(live)  # per-layer names, layer by layer (module order)
        for key, tensor in live.items():
            got = ckpt[key]
            assert _same(got, tensor), key
            stacked, layer = _stacked(key, plain)
            assert _same(got, plain[stacked] if layer is None else plain[stacked][layer]), key
        model_keys = {k for k in plain if not k.startswith("optimizer.")}
        assert {_stacked(k, plain)[0] for k in ckpt} == model_keys  # nothing Megatron consolidates is dropped


@pytest.mark.parametrize("name", NAMES)
def test_names_follow_megatrons_own_module_mapping(name):
    """keys.json is Megatron's ``sharded_state_dict()``: module name -> ShardedTensor key at its layer."""
    mapping = json.loads((MEGATRON / name / "expected" / "keys.json").read_text())
    keys = [key for found in mapping.values() for key in ([found] if isinstance(found, str) else found)]
    with zeroio.open(MEGATRON / name) as ckpt:
        assert set(keys) == set(ckpt)


def test_metadata_and_non_tensor_state():
    with zeroio.open(MEGATRON / "gpt_tp2_untied") as ckpt:
        meta = ckpt.metadata
        assert (meta.format, meta.tag, meta.global_step, meta.layout) == ("megatron", ITER, 3, "torch_dist")
        assert dict(meta.parallel) == {"tp": 2, "pp": 1}
        assert meta.train_dtype == torch.float32 and meta.optimizer == "Adam"
        assert meta.extra["megatron"]["sharded_backend"] == "torch_dist"
        args = meta.extra["common"]["args"]
        assert (args["num_layers"], args["num_query_groups"], args["params_dtype"]) == (2, 2, "float32")
        assert "rng_state" in meta.extra["non_tensor_state"]
        assert "decoder.layers.self_attention.linear_qkv._extra_state" in meta.extra["non_tensor_state"]
        described = ckpt.describe()["metadata"]
        assert described["not_read"].startswith("5 non-tensor entries")


@pytest.mark.parametrize(
    "name",
    [
        "gpt_tp2_untied",
        "gpt_moe_ep2",
        "gpt_pp2_tied",
        "gpt_moe_tp2_ep2",
        "gpt_qwen3_moe_tp2_singleton",
        "gpt_moe_grouped_ep2",
    ],
)
def test_optimizer_state_per_layer_equals_megatrons(name):
    plain = _expected(name, "plain.pt")
    step = torch.load(MEGATRON / name / "expected" / "step.pt", weights_only=True)
    with zeroio.open(MEGATRON / name) as ckpt:
        for key in ckpt:
            state = ckpt.optimizer_state(key)
            stacked, layer = _stacked(key, plain)
            for moment in ("exp_avg", "exp_avg_sq"):
                want = plain[f"optimizer.state.{moment}.{stacked}"]
                assert _same(state[moment], want if layer is None else want[layer]), (key, moment)
            assert _same(state["step"], step)
            assert state["lr"] == 0.01 and state["betas"] == [0.9, 0.999]
            spec = ckpt.optimizer_state_spec(key)
            assert spec["exp_avg"].device.type == "meta" and spec["exp_avg"].shape == ckpt.info(key).shape


def test_pipeline_stages_are_read_from_their_own_ranks_files():
    """Pipeline parallel 2: the embedding and layers 0-1 were saved by stage 0 (rank 0: ``__0_*``), layers 2-3 and
    the final norm by stage 1; the last stage's tied output layer is a replica of the embedding, saved once."""
    with zeroio.open(MEGATRON / "gpt_pp2_tied") as ckpt:
        assert dict(ckpt.metadata.parallel) == {"tp": 1, "pp": 2} and "output_layer.weight" not in ckpt
        ranks = {name: {f.name.split("_")[2] for f in ckpt.info(name).files} for name in ckpt}
        stage0 = [n for n in ckpt if n.startswith(("embedding.", "decoder.layers.0.", "decoder.layers.1."))]
        assert len(stage0) == 13 and all(ranks[n] == {"0"} for n in stage0)
        assert all(ranks[n] == {"1"} for n in ckpt if n not in stage0)


def test_tensor_and_expert_parallel_chunks_come_from_every_rank():
    """gpt_moe_tp2_ep2 (4 ranks: tensor parallel 2 with sequence parallel, expert parallel 2, expert tensor parallel
    2): each expert-stacked tensor is pieced from all four ranks' chunks (2 experts a rank pair, each expert's fc1
    rows and fc2 columns halved), the attention from the two tensor-parallel ranks, replicated norms saved once."""
    with zeroio.open(MEGATRON / "gpt_moe_tp2_ep2") as ckpt:
        assert dict(ckpt.metadata.parallel) == {"tp": 2, "pp": 1, "ep": 2, "etp": 2}
        ranks = {name: {f.name.split("_")[2] for f in ckpt.info(name).files} for name in ckpt}
        for i in range(2):
            layer = f"decoder.layers.{i}."
            for fc in ("linear_fc1", "linear_fc2"):
                assert ranks[f"{layer}mlp.experts.experts.{fc}.weight"] == {"0", "1", "2", "3"}
            assert ranks[f"{layer}self_attention.linear_qkv.weight"] == {"0", "1"}
            assert len(ranks[f"{layer}mlp.linear_fc1.layer_norm_weight"]) == 1


def test_grouped_gemm_experts_are_saved_under_the_sequential_keys():
    """gpt_moe_grouped_ep2 trained megatron-core's GroupedMLP (``--moe-grouped-gemm``: one ``weight1`` of [hidden,
    experts x 2 ffn] and one ``weight2`` a rank): Megatron saves them transposed under SequentialMLP's
    expert-stacked keys, so they read as any other experts (their logits: tests/test_megatron_hf.py)."""
    mapping = json.loads((MEGATRON / "gpt_moe_grouped_ep2" / "expected" / "keys.json").read_text())
    live = _expected("gpt_moe_grouped_ep2", "model.pt")
    with zeroio.open(MEGATRON / "gpt_moe_grouped_ep2") as ckpt:
        for i in range(2):
            for weight, fc, shape in (("weight1", "linear_fc1", (4, 16, 16)), ("weight2", "linear_fc2", (4, 16, 8))):
                key = f"decoder.layers.{i}.mlp.experts.experts.{fc}.weight"
                assert mapping[f"decoder.layers.{i}.mlp.experts.{weight}"] == key
                assert ckpt.info(key).shape == shape and _same(ckpt[key], live[key])


@pytest.mark.parametrize(
    "where", ["", ITER, f"{ITER}/metadata.json", f"{ITER}/common.pt"], ids=["root", "iter", "json", "common"]
)
def test_open_the_root_the_iteration_folder_or_its_files(where):
    with zeroio.open(MEGATRON / "gpt_tp2_tied" / where) as ckpt:
        assert ckpt.metadata.format == "megatron" and len(ckpt) == 20
    with zeroio.open(MEGATRON / "gpt_tp2_tied", tag=ITER) as ckpt:
        assert ckpt.metadata.tag == ITER


def test_missing_tag_is_not_found():
    with pytest.raises(CheckpointNotFoundError, match="iter_0000009"):
        zeroio.open(MEGATRON / "gpt_tp2_tied", tag="iter_0000009")


@pytest.mark.parametrize("name", NAMES)
def test_convert_to_safetensors_and_torch_is_bit_exact(name, tmp_path):
    live = _expected(name, "model.pt")
    zeroio.convert(MEGATRON / name, tmp_path / "st")
    written = load_file(tmp_path / "st" / "model.safetensors")
    assert set(written) == set(live) and all(_same(written[k], v) for k, v in live.items())
    assert zeroio.verify(MEGATRON / name, tmp_path / "st").ok
    zeroio.convert(MEGATRON / name, tmp_path / "pt", fmt="torch")
    with zeroio.open(tmp_path / "pt") as back:
        assert all(_same(back[k], v) for k, v in live.items())


def test_cli_convert_and_inspect(tmp_path, capsys):
    assert main(["convert", str(MEGATRON / "gpt_tp2_untied"), str(tmp_path / "out"), "--quiet"]) == 0
    assert main(["inspect", str(MEGATRON / "gpt_tp2_untied")]) == 0
    out = capsys.readouterr().out
    assert "format      megatron" in out and "not read    5 non-tensor entries" in out
    assert "decoder.layers.1.mlp.linear_fc1.weight" in out


def _module_for(names: dict[str, torch.Size]) -> torch.nn.Module:
    """A module whose parameters have exactly these dotted names (zeros), as a model would."""
    root = torch.nn.Module()
    for name, shape in names.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return root


@pytest.mark.parametrize("name", NAMES)
def test_load_fills_a_module_with_megatrons_values(name):
    live = _expected(name, "model.pt")
    model = _module_for({k: v.shape for k, v in live.items()})
    zeroio.load(MEGATRON / name, model)
    state = model.state_dict()
    assert all(_same(state[k], v) for k, v in live.items())
