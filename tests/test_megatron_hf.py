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
from zeroio.errors import CheckpointFormatError, UnsupportedCheckpointError

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
    # A padded vocabulary (gpt_tp2_padded) is cut to the tokenizer's by default: its columns of Megatron's logits.
    vocab = manifest.get("true_vocab_size", ref["logits"].shape[-1])
    assert config["vocab_size"] == vocab
    got = _logits(tmp_path / "hf", ref["input_ids"])
    assert got.shape == ref["logits"][..., :vocab].shape
    torch.testing.assert_close(got, ref["logits"][..., :vocab], rtol=0, atol=1e-5)


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
        for hf, norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):  # Qwen3: --qk-layernorm
            stored = live.get(f"decoder.layers.{i}.self_attention.{norm}.weight")
            assert (stored is None) is (config["model_type"] not in ("qwen3", "qwen3_moe"))
            assert stored is None or torch.equal(out[f"model.layers.{i}.self_attn.{hf}.weight"], stored)
        halves = _gate_up(live, f"decoder.layers.{i}.mlp.linear_fc1.weight")
        if halves is None:
            continue  # a MoE layer: test_every_expert_is_megatrons_block_bit_for_bit
        gate, up = halves
        assert torch.equal(out[f"model.layers.{i}.mlp.gate_proj.weight"], gate)
        assert torch.equal(out[f"model.layers.{i}.mlp.up_proj.weight"], up)
    assert ("lm_head.weight" in out) is not config["tie_word_embeddings"]


def _gate_up(live: dict[str, torch.Tensor], fc1: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A gated MLP's gate and up projections in Megatron's live state: the halves of ``fc1``, or in its per-expert
    form (``singleton_local_shards``) the tensors ``fc1_w`` and ``fc1_v``; None where neither is."""
    if fc1 in live:
        gate, up = live[fc1].chunk(2)
        return gate, up
    return (live[f"{fc1}_w"], live[f"{fc1}_v"]) if f"{fc1}_w" in live else None


def _expert(live: dict[str, torch.Tensor], src: str, e: int, experts: int) -> tuple[torch.Tensor, ...]:
    """Routed expert ``e`` (of ``experts``)'s gate, up and down in Megatron's live state: blocks of the expert-stacked tensors, or
    in the per-expert form its own tensors (``mlp.experts.experts.<e>.linear_fc1.weight_w``)."""
    stacked = f"{src}experts.experts.linear_fc1.weight"
    if stacked in live:
        fc1, fc2 = live[stacked], live[f"{src}experts.experts.linear_fc2.weight"]
        assert fc1.shape[0] == fc2.shape[0] == experts
        return (*fc1[e].chunk(2), fc2[e])
    halves = _gate_up(live, f"{src}experts.experts.{e}.linear_fc1.weight")
    assert halves is not None
    return (*halves, live[f"{src}experts.experts.{e}.linear_fc2.weight"])


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
        for e in range(experts):
            gate, up, down = _expert(live, src, e, experts)
            assert torch.equal(out[f"{dst}experts.{e}.{w_gate}.weight"], gate)
            assert torch.equal(out[f"{dst}experts.{e}.{w_up}.weight"], up)
            assert torch.equal(out[f"{dst}experts.{e}.{w_down}.weight"], down)
        assert f"{src}experts.experts.{experts}.linear_fc2.weight" not in live  # no expert beyond the count
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


def test_optimizer_state_under_hf_names_in_the_per_expert_form_is_its_tensor():
    """The per-expert form (gpt_qwen3_moe_tp2_singleton): up_proj's moments are ``linear_fc1.weight_v``'s whole, an
    expert's down_proj's its own ``linear_fc2.weight``'s, as Megatron consolidates them."""
    name = "gpt_qwen3_moe_tp2_singleton"
    plain = torch.load(MEGATRON / name / "expected" / "plain.pt", weights_only=True)
    with zeroio.open(MEGATRON / name, names="hf") as ckpt:
        cases = {
            "model.layers.0.mlp.up_proj.weight": "decoder.layers.0.mlp.linear_fc1.weight_v",
            "model.layers.1.mlp.experts.2.gate_proj.weight": "decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight_w",
            "model.layers.1.mlp.experts.3.down_proj.weight": "decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight",
        }
        for hf, key in cases.items():
            state = ckpt.optimizer_state(hf)
            for moment in ("exp_avg", "exp_avg_sq"):
                want = plain[f"optimizer.state.{moment}.{key}"]
                assert want.abs().sum() > 0 and torch.equal(state[moment], want), (hf, moment)


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
    [
        ({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
        ({"swiglu": False}, "swiglu=False"),
        ({"qk_l2_norm": True}, "qk_l2_norm=True"),  # Llama 4's L2 QK norm: no weights, not Qwen3's RMSNorm
    ],
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
        ("gpt_moe_shared_ep2", {"qk_layernorm": True}, "has shared experts and QK norms"),
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


@pytest.mark.parametrize(
    ("name", "change", "match"),
    [
        ("gpt_moe_ep2", {"num_experts": 10**9}, r"stores 'decoder\.layers\.0\.mlp\.router\.weight' as \(4, 32\)"),
        ("gpt_tp2_tied", {"num_layers": 10**9}, r"lacks decoder\.layers\.999999999\.self_attention\.linear_qkv"),
        ("gpt_moe_ep2", {"num_experts": "4"}, r"has num_experts='4', not a positive integer"),
        ("gpt_tp2_tied", {"num_attention_heads": 0}, r"has num_attention_heads=0, not a positive integer"),
        ("gpt_tp2_tied", {"ffn_hidden_size": None}, r"has ffn_hidden_size=None, not a positive integer"),
        ("gpt_moe_ep2", {"moe_router_topk": 5}, r"routes each token to moe_router_topk=5 of its 4 experts"),
        ("gpt_tp2_untied", {"num_query_groups": 10**9}, r"num_query_groups=1000000000, which does not divide"),
        ("gpt_tp2_tied", {"num_attention_heads": 10**9, "kv_channels": 4}, r"linear_qkv\.weight' as \(48, 16\)"),
    ],
)
def test_run_arguments_no_model_has_are_refused_by_name_at_once(tmp_path, name, change, match):
    """Sizes in common.pt that no model has (10**9 experts or layers, a string, zero heads, more experts per token
    than experts) are refused by name before any mapping is built: never a bare TypeError, ZeroDivisionError or
    KeyError, nor a loop over 10**9 experts."""
    root = _with_args(tmp_path, name, change)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        zeroio.open(root, names="hf")


def test_qk_norms_the_args_do_not_declare_are_named_never_dropped(tmp_path):
    """A Qwen3-style checkpoint whose args say qk_layernorm=False: its stored QK norms are not placed, so refused."""
    root = _with_args(tmp_path, "gpt_qwen3_tp2", {"qk_layernorm": False})
    with pytest.raises(UnsupportedCheckpointError, match=r"holds decoder\.layers\.0\.self_attention\.q_layernorm"):
        zeroio.open(root, names="hf")


def test_qwen3_config_is_transformers_own():
    """config.json's fields are what Qwen3Config / Qwen3MoeConfig read: head_dim wider than hidden / heads, every
    layer full attention, the dense first layer of the MoE model in mlp_only_layers, top-k renormalized."""
    import transformers

    with zeroio.open(MEGATRON / "gpt_qwen3_tp2", names="hf") as ckpt:
        dense = transformers.Qwen3Config(**ckpt.metadata.extra["hf_config"])
    assert (dense.head_dim, dense.hidden_size // dense.num_attention_heads, dense.tie_word_embeddings) == (8, 4, True)
    assert set(dense.layer_types) == {"full_attention"}
    with zeroio.open(MEGATRON / "gpt_qwen3_moe_ep2", names="hf") as ckpt:
        moe = transformers.Qwen3MoeConfig(**ckpt.metadata.extra["hf_config"])
    assert (moe.mlp_only_layers, moe.norm_topk_prob, moe.num_experts, moe.moe_intermediate_size) == ([0], True, 4, 8)


# --------------------------------------------------------------------------- Megatron's vocabulary padding

PADDED = MEGATRON / "gpt_tp2_padded"  # NullTokenizer, --vocab-size 50 (51 tokens), padded to 64 rows


def test_padded_vocabulary_is_cut_to_the_tokenizers_rows_bit_for_bit():
    """The first 51 rows of Megatron's embedding and output layer, the size Megatron derives from the args; the
    optimizer moments cut alike."""
    live = torch.load(PADDED / "expected" / "model.pt", weights_only=True)
    plain = torch.load(PADDED / "expected" / "plain.pt", weights_only=True)
    assert live["embedding.word_embeddings.weight"].shape[0] == 64
    with zeroio.open(PADDED, names="hf") as ckpt:
        assert ckpt.metadata.extra["hf_config"]["vocab_size"] == 51
        assert torch.equal(ckpt["model.embed_tokens.weight"], live["embedding.word_embeddings.weight"][:51])
        assert torch.equal(ckpt["lm_head.weight"], live["output_layer.weight"][:51])
        moment = ckpt.optimizer_state("lm_head.weight")["exp_avg"]
        assert moment.abs().sum() > 0 and torch.equal(moment, plain["optimizer.state.exp_avg.output_layer.weight"][:51])
    with zeroio.open(PADDED, names="hf", true_vocab_size=64) as ckpt:  # asked for: every stored row
        assert torch.equal(ckpt["lm_head.weight"], live["output_layer.weight"])
        assert ckpt.metadata.extra["hf_config"]["vocab_size"] == 64
    with zeroio.open(PADDED) as ckpt:  # Megatron's own names: as stored
        assert ckpt.info("output_layer.weight").shape == (64, 16)


def test_load_fills_transformers_model_of_the_tokenizers_vocabulary():
    import transformers

    ref = torch.load(PADDED / "expected" / "logits.pt", weights_only=True)
    with zeroio.open(PADDED, names="hf") as ckpt:
        config = transformers.LlamaConfig(**ckpt.metadata.extra["hf_config"])
    model = transformers.LlamaForCausalLM(config).eval()
    report = zeroio.load(PADDED, model, names="hf", true_vocab_size=51)
    assert not report.missing_keys and not report.unexpected_keys
    with torch.no_grad():
        got = model(ref["input_ids"]).logits
    torch.testing.assert_close(got, ref["logits"][..., :51], rtol=0, atol=1e-5)


def test_true_vocab_size_cuts_where_the_args_do_not_say(tmp_path, capsys):
    """gpt_tp2_tied's args record no tokenizer: every row by default, the first N when asked (tied: no lm_head)."""
    live = torch.load(MEGATRON / "gpt_tp2_tied" / "expected" / "model.pt", weights_only=True)
    argv = ["convert", str(MEGATRON / "gpt_tp2_tied"), str(tmp_path / "hf"), "--names", "hf", "--quiet"]
    assert main([*argv, "--true-vocab-size", "40"]) == 0
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(out["model.embed_tokens.weight"], live["embedding.word_embeddings.weight"][:40])
    assert "lm_head.weight" not in out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 40
    assert main(["inspect", str(MEGATRON / "gpt_tp2_tied"), "--names", "hf"]) == 0
    assert "vocabulary  64 rows as stored (no vocabulary size in common.pt's args" in capsys.readouterr().out
    assert main(["inspect", str(PADDED), "--names", "hf", "--true-vocab-size", "60"]) == 0
    assert "vocabulary  60 of 64 stored rows (true_vocab_size)" in capsys.readouterr().out


def test_true_vocab_size_beyond_the_stored_rows_or_without_names_is_refused(tmp_path, capsys):
    with pytest.raises(CheckpointFormatError, match=r"true_vocab_size=65 is more than the 64 rows of 'embedding\."):
        zeroio.open(PADDED, names="hf", true_vocab_size=65)
    assert main(["convert", str(PADDED), str(tmp_path / "hf"), "--names", "hf", "--true-vocab-size", "65"]) == 1
    assert "--true-vocab-size 65 is more than the 64 rows of 'embedding.word_embeddings.weight'" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="pass names='hf' with it"):
        zeroio.convert(PADDED, tmp_path / "hf", true_vocab_size=51)
    assert main(["convert", str(PADDED), str(tmp_path / "hf"), "--true-vocab-size", "51"]) == 2
    assert "pass --names hf with it" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 1"):
        zeroio.open(PADDED, names="hf", true_vocab_size=0)
    with pytest.raises(TypeError, match="must be an int"):
        zeroio.open(PADDED, names="hf", true_vocab_size=True)
    assert not (tmp_path / "hf").exists()


def test_recorded_vocabulary_that_does_not_pad_to_the_stored_rows_keeps_every_row(tmp_path, caplog):
    """Args whose vocabulary Megatron would pad to another size describe another run: nothing is cut."""
    root = _with_args(tmp_path, "gpt_tp2_padded", {"make_vocab_size_divisible_by": 128, "padded_vocab_size": 256})
    with zeroio.open(root, names="hf") as ckpt:
        assert ckpt.info("lm_head.weight").shape == (64, 16)
        assert "which does not pad to the stored rows" in ckpt.describe()["metadata"]["vocab"]
    assert "keeping them all" in caplog.text
    root = _with_args(tmp_path / "tik", "gpt_tp2_padded", {"tokenizer_type": "TikTokenizer", "vocab_size": 60})
    with zeroio.open(root, names="hf") as ckpt:  # TikTokenizer: --vocab-size is the whole vocabulary
        assert ckpt.info("model.embed_tokens.weight").shape == (60, 16)


# --------------------------------------------------------------------------- verify --names hf


@pytest.mark.parametrize("name", NAMES)
def test_verify_names_hf_checks_the_converted_folder_against_megatron(name, tmp_path):
    zeroio.convert(MEGATRON / name, tmp_path / "hf", names="hf", progress=False)
    report = zeroio.verify(MEGATRON / name, tmp_path / "hf", names="hf")
    assert report.ok, report.summary()
    assert report.num_tensors == len(load_file(tmp_path / "hf" / "model.safetensors"))
    # Megatron's names against transformers': nothing in common
    unnamed = zeroio.verify(MEGATRON / name, tmp_path / "hf")
    assert {m.kind for m in unnamed.mismatches} == {"missing", "extra"}


def test_verify_names_hf_finds_a_changed_element_a_cast_and_a_vocabulary_cut(tmp_path, capsys):
    from safetensors.torch import save_file

    out = tmp_path / "hf"
    assert main(["convert", str(PADDED), str(out), "--names", "hf", "--dtype", "bf16", "--quiet"]) == 0
    argv = ["verify", str(PADDED), str(out), "--names", "hf"]
    assert main([*argv, "--dtype", "bf16"]) == 0
    assert "OK: all 21 tensors" in capsys.readouterr().out
    assert main(argv) == 1  # fp32 source against its bf16 copy, without --dtype
    assert "dtype fp32 (A) vs bf16 (B)" in capsys.readouterr().out
    assert main([*argv, "--dtype", "bf16", "--true-vocab-size", "64"]) == 1  # converted at 51 rows
    assert "lm_head.weight: shape (64, 16) (A) vs (51, 16) (B)" in capsys.readouterr().out
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"][3, 5] += 1
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert main([*argv, "--dtype", "bf16"]) == 1
    assert "model.layers.1.self_attn.k_proj.weight: 1 of 128 elements differ; first at [3, 5]" in (
        capsys.readouterr().out
    )
