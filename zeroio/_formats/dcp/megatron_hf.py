"""``names="hf"``: a Megatron-Core GPT of the Llama family under ``transformers``' ``LlamaForCausalLM`` names and
layouts (``Qwen3ForCausalLM`` with QK norms; ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM``
for MoE models, :mod:`.megatron_hf_moe`), read lazily, plus the matching ``config.json``.

Megatron fuses each layer's query, key and value projections into ``linear_qkv`` with rows grouped per query
group (for each group: its heads' queries, then its key, then its value) and the gated MLP's gate and up
projections into ``linear_fc1`` (gate rows, then up rows). Each HF tensor is a list of row blocks of one stored
tensor, i.e. flat element ranges: nothing is read until a tensor is, and then only its rows. Every element of
every stored tensor must land in exactly one HF tensor (before the embedding and output layer are cut to the
tokenizer's vocabulary, :mod:`.megatron_vocab`): a tensor the mapping does not place is an error naming
it, never a silent drop; so is a model outside the family (LayerNorm, biases, partial or interleaved rotary, L2 QK
norms, a router transformers computes differently). Megatron's ``--qk-layernorm`` (RMSNorm over each head's queries
and keys, before rotary) is Qwen3's ``q_norm`` / ``k_norm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo
from ..view import CheckpointView
from .megatron_common import not_read
from .megatron_hf_moe import (
    MoeShape,
    Piece,
    Recipes,
    hf_refusal,
    mlp_recipes,
    moe_config,
    moe_mlp_recipes,
    moe_shape,
    positive,
    rows,
)
from .megatron_vocab import Vocab, vocab_rows

if TYPE_CHECKING:
    import torch

    from ..._io.read_ahead import ReadAhead

__all__ = ["HfNamedCheckpoint", "hf_view"]

_LAYER = "decoder.layers."
_SPLIT_FC1 = ".linear_fc1.weight_w"
"""The gate half of a gated fc1 saved in Megatron's per-expert form (``singleton_local_shards``)."""
_NORMS = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
}


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """What the mapping needs from Megatron-LM's args (common.pt)."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: Vocab
    tied: bool
    moe: MoeShape | None
    qk_norm: bool
    """``--qk-layernorm``: each layer's ``q_layernorm`` / ``k_layernorm`` (Qwen3's ``q_norm`` / ``k_norm``)."""
    split: bool
    """Megatron's per-expert form (``singleton_local_shards``): gated fc1s saved as ``linear_fc1.weight_w`` (gate)
    and ``_v`` (up), each expert under its own keys."""


class HfNamedCheckpoint(CheckpointView):
    """A Megatron checkpoint seen under transformers' Llama names; each tensor is row blocks of a stored one."""

    def __init__(
        self,
        base: Checkpoint,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        recipes: dict[str, tuple[Piece, ...]],
    ) -> None:
        super().__init__(base, metadata, infos, {})
        self._recipes = recipes

    def read_ahead_into(self, name: str, start: int, out: torch.Tensor, read_ahead: ReadAhead | None) -> None:
        end, at = start + out.numel(), 0
        for piece in self._recipes[name]:
            a, b = max(start, at), min(end, at + piece.count)
            if a < b:
                self._inner.read_ahead_into(piece.source, piece.start + a - at, out[a - start : b - start], read_ahead)
            at += piece.count

    def describe(self) -> dict[str, Any]:
        """:meth:`Checkpoint.describe` plus ``metadata.not_read`` (the non-tensor state zeroio does not return) and
        ``metadata.vocab`` (the embedding rows kept, and why)."""
        summary = super().describe()
        summary["metadata"].update(not_read(self._metadata.extra), vocab=self._metadata.extra.get("vocab"))
        return summary

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The stored parameter's optimizer state, its moments cut to this tensor's rows."""
        return self._cut(name, self._inner.optimizer_state(self._source(name)))

    def optimizer_state_spec(self, name: str) -> dict[str, Any]:
        """:meth:`optimizer_state` with the state tensors on the ``meta`` device (nothing read)."""
        return self._cut(name, self._inner.optimizer_state_spec(self._source(name)))  # type: ignore[attr-defined]

    def _source(self, name: str) -> str:
        self._resolve(name)
        return self._recipes[name][0].source

    def _cut(self, name: str, state: dict[str, Any]) -> dict[str, Any]:
        import torch

        info, numel = self._infos[name], self._inner.info(self._recipes[name][0].source).numel
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() == numel and value.dim():
                flat = value.reshape(-1)
                state[key] = torch.cat([flat[p.start : p.start + p.count] for p in self._recipes[name]]).view(
                    info.shape
                )
        return state


def _shape(ckpt: Checkpoint, true_vocab_size: int | None) -> LlamaShape:
    """The model's sizes from common.pt's args, checked against the Llama family."""
    meta = ckpt.metadata
    common = meta.extra.get("common")
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, dict):
        raise hf_refusal(
            meta.path, "has no readable run arguments in common.pt (heads and groups are stored only there)"
        )
    checks = {
        "normalization": (args.get("normalization"), "RMSNorm"),
        "swiglu": (args.get("swiglu"), True),
        "position_embedding_type": (args.get("position_embedding_type"), "rope"),
        "add_bias_linear": (args.get("add_bias_linear"), False),
        "add_qkv_bias": (args.get("add_qkv_bias", False), False),
        "rotary_percent": (args.get("rotary_percent", 1.0), 1.0),
        "rotary_interleaved": (args.get("rotary_interleaved", False), False),
        "qk_l2_norm": (args.get("qk_l2_norm", False), False),
        "multi_latent_attention": (args.get("multi_latent_attention", False), False),
    }
    for key, (found, wanted) in checks.items():
        if found != wanted:
            raise hf_refusal(meta.path, f"was trained with {key}={found!r} (the family needs {wanted!r})")
    layers, hidden, heads, ffn = (
        positive(args, key, meta.path)
        for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")
    )
    groups = positive(args, "num_query_groups", meta.path, heads) if args.get("group_query_attention") else heads
    embedding = "embedding.word_embeddings.weight"
    if embedding not in ckpt:
        raise hf_refusal(meta.path, f"lacks {embedding}")
    head_dim = positive(args, "kv_channels", meta.path, hidden // heads)
    if heads % groups:
        raise hf_refusal(meta.path, f"has num_query_groups={groups}, which does not divide num_attention_heads={heads}")
    _check_rows(ckpt, f"{_LAYER}{layers - 1}.self_attention.linear_qkv.weight", (heads + 2 * groups) * head_dim, layers)
    moe = moe_shape(args, layers, ffn, meta.path)
    if moe is not None and moe.moe_layers:
        _check_rows(ckpt, f"{_LAYER}{moe.moe_layers[0]}.mlp.router.weight", moe.experts, layers)
    return LlamaShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        groups=groups,
        head_dim=head_dim,
        ffn=ffn,
        vocab=vocab_rows(true_vocab_size, args, ckpt.info(embedding).shape[0], embedding, meta.path),
        tied="output_layer.weight" not in ckpt,
        moe=moe,
        qk_norm=bool(args.get("qk_layernorm", False)),
        split=any(name.endswith(_SPLIT_FC1) for name in ckpt),
    )


def _check_rows(ckpt: Checkpoint, name: str, wanted: int, layers: int) -> None:
    """``name`` stored with ``wanted`` rows: counts that recipes loop over (layers, query groups, experts) are held
    to the stored tensors first, since 10**9 of any in a broken common.pt would loop for hours before
    :func:`_check_placement` named the same tensor."""
    if layers > len(ckpt) or name not in ckpt:
        raise hf_refusal(ckpt.metadata.path, f"lacks {name}")
    if ckpt.info(name).shape[0] != wanted:
        raise hf_refusal(ckpt.metadata.path, f"stores '{name}' as {ckpt.info(name).shape}, not the size its args give")


def _layer_recipes(ckpt: Checkpoint, s: LlamaShape, i: int) -> Recipes:
    src, dst, h, d = f"{_LAYER}{i}.", f"model.layers.{i}.", s.hidden, s.head_dim
    found: Recipes = {}
    for hf, names in _NORMS.items():
        name = next((src + n for n in names if src + n in ckpt), src + names[0])
        found[dst + hf] = ((Piece(name, 0, h),), (h,))
    per_group = s.heads // s.groups
    stride = (per_group + 2) * d
    qkv = src + "self_attention.linear_qkv.weight"
    q = [(g * stride, g * stride + per_group * d) for g in range(s.groups)]
    k = [(g * stride + per_group * d, g * stride + (per_group + 1) * d) for g in range(s.groups)]
    v = [(g * stride + (per_group + 1) * d, (g + 1) * stride) for g in range(s.groups)]
    found[dst + "self_attn.q_proj.weight"] = (rows(qkv, h, q), (s.heads * d, h))
    found[dst + "self_attn.k_proj.weight"] = (rows(qkv, h, k), (s.groups * d, h))
    found[dst + "self_attn.v_proj.weight"] = (rows(qkv, h, v), (s.groups * d, h))
    found[dst + "self_attn.o_proj.weight"] = (
        rows(src + "self_attention.linear_proj.weight", s.heads * d, [(0, h)]),
        (h, s.heads * d),
    )
    if s.qk_norm:  # one RMSNorm weight over head_dim, shared by every head (Qwen3's q_norm / k_norm)
        for hf, norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            found[f"{dst}self_attn.{hf}.weight"] = ((Piece(f"{src}self_attention.{norm}.weight", 0, d),), (d,))
    if s.moe is not None and i in s.moe.moe_layers:
        found.update(moe_mlp_recipes(src, dst, h, s.moe, s.split))
    else:
        fc1, fc2 = src + "mlp.linear_fc1.weight", src + "mlp.linear_fc2.weight"
        found.update(mlp_recipes(fc1, fc2, h, s.ffn, dst + "mlp.", ("gate_proj", "up_proj", "down_proj"), 0, s.split))
    return found


def hf_config(ckpt: Checkpoint, s: LlamaShape) -> dict[str, Any]:
    """transformers' ``LlamaConfig`` for the model (``config.json``), ``Qwen3Config`` with QK norms; for MoE models
    ``MixtralConfig`` / ``Qwen2MoeConfig`` / ``Qwen3MoeConfig``."""
    args = ckpt.metadata.extra["common"]["args"]
    base = args.get("rotary_base", 10000)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.groups,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab.size,
        "max_position_embeddings": args.get("max_position_embeddings") or args.get("seq_length"),
        "rms_norm_eps": args.get("norm_epsilon", 1e-5),
        "rope_theta": base,
        "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": s.tied,
        "dtype": str(ckpt.metadata.train_spec.name if ckpt.metadata.train_spec else "float32"),
    }
    if s.qk_norm:  # Qwen3: full attention in every layer
        del config["mlp_bias"]
        config.update(
            architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False, sliding_window=None,
            max_window_layers=s.layers,
        )  # fmt: skip
    if s.moe is not None:
        for key in ("attention_bias", "mlp_bias", "max_window_layers"):
            config.pop(key, None)
        config.update(moe_config(s.moe, args, s.layers, s.ffn))
    return config


def _check_placement(ckpt: Checkpoint, recipes: Recipes) -> None:
    """Every element of every stored tensor in exactly one HF tensor, each HF tensor exactly its shape's size: a
    tensor left out, lacking, or stored at sizes the args do not tile is refused by name."""
    where = ckpt.metadata.path
    spans: dict[str, list[tuple[int, int]]] = {}
    for pieces, _ in recipes.values():
        for p in pieces:
            spans.setdefault(p.source, []).append((p.start, p.start + p.count))
    unplaced = [n for n in ckpt if n not in spans]
    if unplaced:
        raise hf_refusal(where, f"holds {', '.join(unplaced[:5])} which the mapping does not place")
    missing = sorted(n for n in spans if n not in ckpt)
    if missing:
        raise hf_refusal(where, f"lacks {', '.join(missing[:5])}")
    for source, found in spans.items():
        at = 0
        for a, b in sorted(found):
            at = b if a == at else -1
        if at != ckpt.info(source).numel:
            raise hf_refusal(where, f"stores '{source}' as {ckpt.info(source).shape}, not the size its args give")


def _vocab_recipes(s: LlamaShape, count: int) -> Recipes:
    """The embedding and the (untied) output layer as their first ``count`` rows."""
    found: Recipes = {
        "model.embed_tokens.weight": (
            rows("embedding.word_embeddings.weight", s.hidden, [(0, count)]),
            (count, s.hidden),
        )
    }
    if not s.tied:
        found["lm_head.weight"] = (rows("output_layer.weight", s.hidden, [(0, count)]), (count, s.hidden))
    return found


def hf_view(ckpt: Checkpoint, true_vocab_size: int | None = None) -> HfNamedCheckpoint:
    """``ckpt`` (a Megatron reader) under transformers' names; every stored element must be placed exactly once,
    then the embedding and output layer are cut to the vocabulary (:mod:`.megatron_vocab`: ``true_vocab_size``,
    else what common.pt's args record, else every stored row)."""
    s = _shape(ckpt, true_vocab_size)
    vocab = _vocab_recipes(s, s.vocab.stored)
    recipes: Recipes = {"model.embed_tokens.weight": vocab.pop("model.embed_tokens.weight")}
    for i in range(s.layers):
        recipes.update(_layer_recipes(ckpt, s, i))
    recipes["model.norm.weight"] = ((Piece("decoder.final_layernorm.weight", 0, s.hidden),), (s.hidden,))
    recipes.update(vocab)
    for name, (pieces, shape) in recipes.items():
        if sum(p.count for p in pieces) != math.prod(shape):
            raise hf_refusal(ckpt.metadata.path, f"gives '{name}' {shape}, which its pieces do not fill")
    _check_placement(ckpt, recipes)
    recipes.update(_vocab_recipes(s, s.vocab.size))  # the vocabulary's rows: the padding is never read
    infos = {}
    for name, (pieces, shape) in recipes.items():
        source = ckpt.info(pieces[0].source)
        infos[name] = TensorInfo(name, shape, source.dtype_spec, source.kind, source.files)
    extra = {**ckpt.metadata.extra, "names": "hf", "hf_config": hf_config(ckpt, s), "vocab": s.vocab.describe()}
    return HfNamedCheckpoint(ckpt, replace(ckpt.metadata, extra=extra), infos, {n: r[0] for n, r in recipes.items()})
