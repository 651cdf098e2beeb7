"""``names="hf"``: Megatron GPT checkpoints of the Llama family written under transformers' names (MoE models as
Mixtral or Qwen2-MoE).

The check is Megatron's own forward: fixtures/generate_megatron.py saved the logits of the trained model
(megatron-core 0.16.1, tensor, expert or pipeline parallel 2, fp32) on fixed tokens in ``expected/logits.pt``;
the transformers model config.json names (``LlamaForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``),
loaded from zeroio's output, must give the same logits on the same tokens, with no key missing or unexpected.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main
from zeroio.errors import UnsupportedCheckpointError

MEGATRON = Path(__file__).resolve().parent.parent / "fixtures" / "megatron"
NAMES = sorted(p.parent.name for p in MEGATRON.glob("*/manifest.json"))
MOE = [n for n in NAMES if json.loads((MEGATRON / n / "manifest.json").read_text()).get("num_experts")]


def _logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    import transformers

    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, architecture).from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    with torch.no_grad():
        return model.eval()(input_ids).logits


@pytest.mark.parametrize("name", NAMES)
def test_transformers_logits_equal_megatrons_forward(name, tmp_path):
    ref = torch.load(MEGATRON / name / "expected" / "logits.pt", weights_only=True)
    assert main(["convert", str(MEGATRON / name), str(tmp_path / "hf"), "--names", "hf", "--quiet"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    manifest = json.loads((MEGATRON / name / "manifest.json").read_text())
    assert config["num_key_value_heads"] == manifest["num_query_groups"]
    assert config["tie_word_embeddings"] is manifest["tie"]
    got = _logits(tmp_path / "hf", ref["input_ids"])
    assert got.shape == ref["logits"].shape
    torch.testing.assert_close(got, ref["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_split_tensors_are_megatrons_rows_bit_for_bit(name, tmp_path):
    """q/k/v are the fused QKV's per-group rows, gate/up fc1's halves: checked by reshaping Megatron's tensors."""
    live = torch.load(MEGATRON / name / "expected" / "model.pt", weights_only=True)
    zeroio.convert(MEGATRON / name, tmp_path / "hf", names="hf", progress=False)
    out = load_file(tmp_path / "hf" / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    groups, d, h = config["num_key_value_heads"], config["head_dim"], config["hidden_size"]
    per_group = config["num_attention_heads"] // groups
    for i in range(config["num_hidden_layers"]):
        qkv = live[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].view(groups, per_group + 2, d, h)
        assert torch.equal(out[f"model.layers.{i}.self_attn.q_proj.weight"], qkv[:, :per_group].reshape(-1, h))
        assert torch.equal(out[f"model.layers.{i}.self_attn.k_proj.weight"], qkv[:, per_group].reshape(-1, h))
        assert torch.equal(out[f"model.layers.{i}.self_attn.v_proj.weight"], qkv[:, per_group + 1].reshape(-1, h))
        if f"decoder.layers.{i}.mlp.linear_fc1.weight" not in live:
            continue  # a MoE layer: test_every_expert_is_megatrons_block_bit_for_bit
        gate, up = live[f"decoder.layers.{i}.mlp.linear_fc1.weight"].chunk(2)
        assert torch.equal(out[f"model.layers.{i}.mlp.gate_proj.weight"], gate)
        assert torch.equal(out[f"model.layers.{i}.mlp.up_proj.weight"], up)
    assert ("lm_head.weight" in out) is not config["tie_word_embeddings"]


def _expert_names(config: dict) -> tuple[str, tuple[str, str, str]]:
    """Where config.json's model keeps a MoE layer's experts, and their gate, up and down projections' names."""
    if config["model_type"] == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("name", MOE)
def test_every_expert_is_megatrons_block_bit_for_bit(name, tmp_path):
    """Each routed expert's gate and up are the halves of its block of Megatron's expert-stacked linear_fc1, its down
    its block of linear_fc2; the router is the gate; the shared expert and its gate are Megatron's. Nothing is
    dropped (Megatron-LM #5844 dropped every expert): the output holds exactly the elements of Megatron's state."""
    live = torch.load(MEGATRON / name / "expected" / "model.pt", weights_only=True)
    manifest = json.loads((MEGATRON / name / "manifest.json").read_text())
    zeroio.convert(MEGATRON / name, tmp_path / "hf", names="hf", progress=False)
    out = load_file(tmp_path / "hf" / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    block, (w_gate, w_up, w_down) = _expert_names(config)
    experts = manifest["num_experts"]
    layers = [i for i in range(config["num_hidden_layers"]) if f"decoder.layers.{i}.mlp.router.weight" in live]
    assert layers and config.get("num_local_experts", config.get("num_experts")) == experts
    for i in layers:
        src, dst = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.{block}."
        assert torch.equal(out[f"{dst}gate.weight"], live[f"{src}router.weight"])
        fc1, fc2 = live[f"{src}experts.experts.linear_fc1.weight"], live[f"{src}experts.experts.linear_fc2.weight"]
        assert fc1.shape[0] == fc2.shape[0] == experts
        for e in range(experts):
            gate, up = fc1[e].chunk(2)
            assert torch.equal(out[f"{dst}experts.{e}.{w_gate}.weight"], gate)
            assert torch.equal(out[f"{dst}experts.{e}.{w_up}.weight"], up)
            assert torch.equal(out[f"{dst}experts.{e}.{w_down}.weight"], fc2[e])
        if manifest.get("moe_shared_expert_intermediate_size"):
            gate, up = live[f"{src}shared_experts.linear_fc1.weight"].chunk(2)
            assert torch.equal(out[f"{dst}shared_expert.{w_gate}.weight"], gate)
            assert torch.equal(out[f"{dst}shared_expert.{w_up}.weight"], up)
            assert torch.equal(
                out[f"{dst}shared_expert.{w_down}.weight"], live[f"{src}shared_experts.linear_fc2.weight"]
            )
            assert torch.equal(out[f"{dst}shared_expert_gate.weight"], live[f"{src}shared_experts.gate_weight"])
    assert len([k for k in out if ".experts." in k]) == 3 * experts * len(layers)
    assert sum(t.numel() for t in out.values()) == sum(t.numel() for t in live.values())


def test_expert_optimizer_state_under_hf_names_is_its_block():
    plain = torch.load(MEGATRON / "gpt_moe_ep2" / "expected" / "plain.pt", weights_only=True)
    moments = "optimizer.state.{}.decoder.layers.mlp.experts.experts.linear_fc{}.weight"
    with zeroio.open(MEGATRON / "gpt_moe_ep2", names="hf") as ckpt:
        up = ckpt.optimizer_state("model.layers.1.block_sparse_moe.experts.3.w3.weight")["exp_avg"]
        assert up.abs().sum() > 0 and torch.equal(up, plain[moments.format("exp_avg", 1)][1, 3, 24:])
        down = ckpt.optimizer_state("model.layers.0.block_sparse_moe.experts.2.w2.weight")["exp_avg_sq"]
        assert down.abs().sum() > 0 and torch.equal(down, plain[moments.format("exp_avg_sq", 2)][0, 2])


def test_inspect_names_hf_lists_what_is_not_read(capsys):
    assert main(["inspect", str(MEGATRON / "gpt_moe_ep2"), "--names", "hf"]) == 0
    out = capsys.readouterr().out
    assert "not read    5 non-tensor entries (ShardedObjects" in out and "parallel    tp=1 pp=1 ep=2 etp=1" in out
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in out
    assert main(["inspect", str(MEGATRON / "gpt_moe_ep2"), "--names", "hf", "--json"]) == 0
    meta = json.loads(capsys.readouterr().out)["metadata"]
    assert meta["not_read"].startswith("5 non-tensor entries") and "rng_state" in meta["non_tensor_state"]


def test_optimizer_state_under_hf_names_is_cut_like_the_weights():
    plain = torch.load(MEGATRON / "gpt_tp2_untied" / "expected" / "plain.pt", weights_only=True)
    with zeroio.open(MEGATRON / "gpt_tp2_untied", names="hf") as ckpt:
        state = ckpt.optimizer_state("model.layers.1.self_attn.k_proj.weight")
        stacked = plain["optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"][1]
        assert torch.equal(
            state["exp_avg"], stacked.view(2, 4, 4, 16)[:, 2].reshape(-1, 16)
        )  # groups, 2 q + k + v, d, h
        up = ckpt.optimizer_state("model.layers.0.mlp.up_proj.weight")["exp_avg_sq"]
        fc1 = plain["optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight"][0]
        assert torch.equal(up, fc1[24:])


def test_names_hf_is_refused_for_other_formats_and_unknown_values():
    with pytest.raises(UnsupportedCheckpointError, match="maps Megatron checkpoints only"):
        zeroio.open(MEGATRON.parent / "z3_ws2_fp32", names="hf")
    with pytest.raises(ValueError, match="names must be None"):
        zeroio.open(MEGATRON / "gpt_tp2_tied", names="llama")  # type: ignore[arg-type]


def _with_args(tmp_path: Path, name: str, change: dict) -> Path:
    """A copy of fixture ``name`` whose common.pt holds Megatron-LM's args with ``change`` applied."""
    root = tmp_path / "ckpt"
    shutil.copytree(MEGATRON / name, root, ignore=shutil.ignore_patterns("expected"))
    with zeroio.open(root) as ckpt:
        args = dict(ckpt.metadata.extra["common"]["args"])
    torch.save({"args": argparse.Namespace(**{**args, **change}), "iteration": 3}, root / "iter_0000003" / "common.pt")
    return root


@pytest.mark.parametrize(
    ("change", "match"),
    [({"normalization": "LayerNorm"}, "normalization='LayerNorm'"), ({"swiglu": False}, "swiglu=False")],
)
def test_models_outside_the_llama_family_are_refused_by_name(tmp_path, change, match):
    root = _with_args(tmp_path, "gpt_tp2_tied", change)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        zeroio.open(root, names="hf")
    with zeroio.open(root) as ckpt:  # the default names still read it
        assert len(ckpt) == 20


@pytest.mark.parametrize(
    ("name", "change", "match"),
    [
        ("gpt_moe_ep2", {"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid'"),
        ("gpt_moe_ep2", {"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias=True"),
        ("gpt_moe_ep2", {"moe_router_group_topk": 2}, "moe_router_group_topk=2"),
        ("gpt_moe_ep2", {"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn"),
        ("gpt_moe_ep2", {"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True"),
        ("gpt_moe_shared_ep2", {"moe_shared_expert_gate": False}, "shared experts without a gate"),
        (
            "gpt_moe_shared_ep2",
            {"moe_shared_expert_intermediate_size": None, "moe_router_pre_softmax": False},
            r"mixes dense and MoE layers \(moe_layer_freq=\[0, 1\]\)",
        ),
        # Stored tensors the args do not account for are named, never dropped.
        ("gpt_moe_ep2", {"num_experts": None}, r"holds decoder\.layers\.0\.mlp\.router\.weight, "),
        (
            "gpt_moe_ep2",
            {"moe_ffn_hidden_size": 12},
            r"stores 'decoder\.layers\.0\.mlp\.experts\.experts\.linear_fc1\.weight' as \(4, 48, 32\)",
        ),
        ("gpt_moe_ep2", {"num_experts": 8}, r"stores 'decoder\.layers\.0\.mlp\.router\.weight' as \(4, 32\)"),
    ],
)
def test_moe_models_transformers_cannot_express_are_refused_by_name(tmp_path, name, change, match):
    root = _with_args(tmp_path, name, change)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        zeroio.open(root, names="hf")
    assert main(["convert", str(root), str(tmp_path / "hf"), "--names", "hf", "--quiet"]) != 0
    assert not (tmp_path / "hf").exists()
    with zeroio.open(root) as ckpt:  # the default names still read it
        assert ckpt["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"].shape[0] == 4
