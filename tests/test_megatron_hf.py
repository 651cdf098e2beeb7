"""``names="hf"``: Megatron GPT checkpoints of the Llama family written under transformers' names.

The check is Megatron's own forward: fixtures/generate_megatron.py saved the logits of the trained model
(megatron-core 0.16.1, tensor parallel 2, fp32) on fixed tokens in ``expected/logits.pt``; transformers'
``LlamaForCausalLM`` loaded from zeroio's output must give the same logits on the same tokens.
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


def _logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


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
        gate, up = live[f"decoder.layers.{i}.mlp.linear_fc1.weight"].chunk(2)
        assert torch.equal(out[f"model.layers.{i}.mlp.gate_proj.weight"], gate)
        assert torch.equal(out[f"model.layers.{i}.mlp.up_proj.weight"], up)
    assert ("lm_head.weight" in out) is not config["tie_word_embeddings"]


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


@pytest.mark.parametrize(
    ("change", "match"),
    [({"normalization": "LayerNorm"}, "normalization='LayerNorm'"), ({"swiglu": False}, "swiglu=False")],
)
def test_models_outside_the_llama_family_are_refused_by_name(tmp_path, change, match):
    root = tmp_path / "ckpt"
    shutil.copytree(MEGATRON / "gpt_tp2_tied", root, ignore=shutil.ignore_patterns("expected"))
    with zeroio.open(root) as ckpt:
        args = dict(ckpt.metadata.extra["common"]["args"])
    torch.save({"args": argparse.Namespace(**{**args, **change}), "iteration": 3}, root / "iter_0000003" / "common.pt")
    with pytest.raises(UnsupportedCheckpointError, match=match):
        zeroio.open(root, names="hf")
    with zeroio.open(root) as ckpt:  # the default names still read it
        assert len(ckpt) == 20
