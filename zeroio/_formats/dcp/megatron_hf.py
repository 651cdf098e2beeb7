"""``names="hf"``: a Megatron-Core GPT of the Llama family under ``transformers``' ``LlamaForCausalLM`` names and
layouts, read lazily, plus the matching ``config.json``.

Megatron fuses each layer's query, key and value projections into ``linear_qkv`` with rows grouped per query
group (for each group: its heads' queries, then its key, then its value) and the gated MLP's gate and up
projections into ``linear_fc1`` (gate rows, then up rows). Each HF tensor is a list of row blocks of one stored
tensor, i.e. flat element ranges: nothing is read until a tensor is, and then only its rows. A tensor the
mapping does not place is an error, never a silent drop; so is a model outside the family (LayerNorm, biases,
partial or interleaved rotary, QK norms, MoE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import UnsupportedCheckpointError
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo

if TYPE_CHECKING:
    import torch

__all__ = ["HfNamedCheckpoint", "hf_view"]

_LAYER = "decoder.layers."
_NORMS = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
}


@dataclass(frozen=True, slots=True)
class Piece:
    """Flat elements ``[start, start + count)`` of the stored tensor ``source``."""

    source: str
    start: int
    count: int


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """What the mapping needs from Megatron-LM's args (common.pt)."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool


class HfNamedCheckpoint(Checkpoint):
    """A Megatron checkpoint seen under transformers' Llama names; each tensor is row blocks of a stored one."""

    def __init__(
        self,
        base: Checkpoint,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        recipes: dict[str, tuple[Piece, ...]],
    ) -> None:
        super().__init__(metadata, infos, {})
        self._base = base
        self._recipes = recipes

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        end, at = start + out.numel(), 0
        for piece in self._recipes[name]:
            a, b = max(start, at), min(end, at + piece.count)
            if a < b:
                self._base.read_into(piece.source, piece.start + a - at, out[a - start : b - start])
            at += piece.count

    @property
    def verify_crc(self) -> bool:
        """Whether reads check each zip record's CRC-32 (the Megatron reader's, which this view reads through)."""
        return self._base.verify_crc

    @verify_crc.setter
    def verify_crc(self, on: bool) -> None:
        self._base.verify_crc = on

    def finish_crc_checks(self) -> None:
        self.ensure_open()
        self._base.finish_crc_checks()

    def _release(self) -> None:
        self._base.close()

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The stored parameter's optimizer state, its moments cut to this tensor's rows."""
        return self._cut(name, self._base.optimizer_state(self._source(name)))

    def optimizer_state_spec(self, name: str) -> dict[str, Any]:
        """:meth:`optimizer_state` with the state tensors on the ``meta`` device (nothing read)."""
        return self._cut(name, self._base.optimizer_state_spec(self._source(name)))  # type: ignore[attr-defined]

    def _source(self, name: str) -> str:
        self._resolve(name)
        return self._recipes[name][0].source

    def _cut(self, name: str, state: dict[str, Any]) -> dict[str, Any]:
        import torch

        info, numel = self._infos[name], self._base.info(self._recipes[name][0].source).numel
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() == numel and value.dim():
                flat = value.reshape(-1)
                state[key] = torch.cat([flat[p.start : p.start + p.count] for p in self._recipes[name]]).view(
                    info.shape
                )
        return state


def _refuse(path: Any, why: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"names='hf' maps Megatron GPT models of the Llama family (RMSNorm, SwiGLU, rotary, no biases) to "
        f"transformers' LlamaForCausalLM; '{path}' {why}. Convert with the default names instead.",
        path=path,
    )


def _shape(ckpt: Checkpoint) -> LlamaShape:
    """The model's sizes from common.pt's args, checked against the Llama family."""
    meta = ckpt.metadata
    common = meta.extra.get("common")
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, dict):
        raise _refuse(meta.path, "has no readable run arguments in common.pt (heads and groups are stored only there)")
    checks = {
        "normalization": (args.get("normalization"), "RMSNorm"),
        "swiglu": (args.get("swiglu"), True),
        "position_embedding_type": (args.get("position_embedding_type"), "rope"),
        "add_bias_linear": (args.get("add_bias_linear"), False),
        "add_qkv_bias": (args.get("add_qkv_bias", False), False),
        "rotary_percent": (args.get("rotary_percent", 1.0), 1.0),
        "rotary_interleaved": (args.get("rotary_interleaved", False), False),
        "qk_layernorm": (args.get("qk_layernorm", False), False),
        "num_experts": (args.get("num_experts"), None),
    }
    for key, (found, wanted) in checks.items():
        if found != wanted:
            raise _refuse(meta.path, f"was trained with {key}={found!r} (the family needs {wanted!r})")
    heads, hidden = args["num_attention_heads"], args["hidden_size"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    return LlamaShape(
        layers=args["num_layers"],
        hidden=hidden,
        heads=heads,
        groups=groups or heads,
        head_dim=args.get("kv_channels") or hidden // heads,
        ffn=args["ffn_hidden_size"],
        vocab=ckpt.info("embedding.word_embeddings.weight").shape[0],
        tied="output_layer.weight" not in ckpt,
    )


def _rows(source: str, cols: int, blocks: list[tuple[int, int]]) -> tuple[Piece, ...]:
    return tuple(Piece(source, r0 * cols, (r1 - r0) * cols) for r0, r1 in blocks)


def _layer_recipes(ckpt: Checkpoint, s: LlamaShape, i: int) -> dict[str, tuple[tuple[Piece, ...], tuple[int, ...]]]:
    src, dst, h, d = f"{_LAYER}{i}.", f"model.layers.{i}.", s.hidden, s.head_dim
    found: dict[str, tuple[tuple[Piece, ...], tuple[int, ...]]] = {}
    for hf, names in _NORMS.items():
        name = next((src + n for n in names if src + n in ckpt), src + names[0])
        found[dst + hf] = ((Piece(name, 0, h),), (h,))
    per_group = s.heads // s.groups
    stride = (per_group + 2) * d
    qkv = src + "self_attention.linear_qkv.weight"
    q = [(g * stride, g * stride + per_group * d) for g in range(s.groups)]
    k = [(g * stride + per_group * d, g * stride + (per_group + 1) * d) for g in range(s.groups)]
    v = [(g * stride + (per_group + 1) * d, (g + 1) * stride) for g in range(s.groups)]
    found[dst + "self_attn.q_proj.weight"] = (_rows(qkv, h, q), (s.heads * d, h))
    found[dst + "self_attn.k_proj.weight"] = (_rows(qkv, h, k), (s.groups * d, h))
    found[dst + "self_attn.v_proj.weight"] = (_rows(qkv, h, v), (s.groups * d, h))
    found[dst + "self_attn.o_proj.weight"] = (
        _rows(src + "self_attention.linear_proj.weight", s.heads * d, [(0, h)]),
        (h, s.heads * d),
    )
    fc1 = src + "mlp.linear_fc1.weight"
    found[dst + "mlp.gate_proj.weight"] = (_rows(fc1, h, [(0, s.ffn)]), (s.ffn, h))
    found[dst + "mlp.up_proj.weight"] = (_rows(fc1, h, [(s.ffn, 2 * s.ffn)]), (s.ffn, h))
    found[dst + "mlp.down_proj.weight"] = (_rows(src + "mlp.linear_fc2.weight", s.ffn, [(0, h)]), (h, s.ffn))
    return found


def hf_config(ckpt: Checkpoint, s: LlamaShape) -> dict[str, Any]:
    """transformers' ``LlamaConfig`` for the model (``config.json``)."""
    args = ckpt.metadata.extra["common"]["args"]
    base = args.get("rotary_base", 10000)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.groups,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
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


def hf_view(ckpt: Checkpoint) -> HfNamedCheckpoint:
    """``ckpt`` (a Megatron reader) under transformers' Llama names; every stored tensor must be placed."""
    s = _shape(ckpt)
    recipes: dict[str, tuple[tuple[Piece, ...], tuple[int, ...]]] = {
        "model.embed_tokens.weight": (
            (Piece("embedding.word_embeddings.weight", 0, s.vocab * s.hidden),),
            (s.vocab, s.hidden),
        )
    }
    for i in range(s.layers):
        recipes.update(_layer_recipes(ckpt, s, i))
    recipes["model.norm.weight"] = ((Piece("decoder.final_layernorm.weight", 0, s.hidden),), (s.hidden,))
    if not s.tied:
        recipes["lm_head.weight"] = ((Piece("output_layer.weight", 0, s.vocab * s.hidden),), (s.vocab, s.hidden))
    used = {p.source for pieces, _ in recipes.values() for p in pieces}
    unplaced = [n for n in ckpt if n not in used]
    missing = sorted(used - set(ckpt))
    if unplaced or missing:
        what = f"holds {', '.join(unplaced[:5])} which the mapping does not place" if unplaced else ""
        what = what or f"lacks {', '.join(missing[:5])}"
        raise _refuse(ckpt.metadata.path, what)
    infos = {}
    for name, (pieces, shape) in recipes.items():
        source = ckpt.info(pieces[0].source)
        if sum(p.count for p in pieces) != _numel(shape) or any(
            p.start + p.count > ckpt.info(p.source).numel for p in pieces
        ):
            raise _refuse(ckpt.metadata.path, f"stores '{pieces[0].source}' as {source.shape}, not the size args give")
        infos[name] = TensorInfo(name, shape, source.dtype_spec, source.kind, source.files)
    from dataclasses import replace

    extra = {**ckpt.metadata.extra, "names": "hf", "hf_config": hf_config(ckpt, s)}
    return HfNamedCheckpoint(ckpt, replace(ckpt.metadata, extra=extra), infos, {n: r[0] for n, r in recipes.items()})


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
