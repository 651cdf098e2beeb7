"""``names="hf"`` for Megatron-Core MoE GPTs: the routed experts, router and shared experts under transformers'
``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM`` names, and what their ``config.json`` says about them.

Megatron's ``torch_dist`` stores a MoE layer's experts stacked on an expert axis whatever the module that trained
them (``SequentialMLP``'s ``local_experts.N``, ``GroupedMLP``'s ``weight1``/``weight2``, TE's ``linear_fc1.weightN``
all save ``mlp.experts.experts.linear_fc1.weight`` as ``[experts, 2 * ffn, hidden]`` across expert-parallel ranks):
expert ``e``'s gate and up projections are rows of its block, its down projection its block of ``linear_fc2``. In
the per-expert form (``singleton_local_shards``) each expert has its own keys and fc1 is two tensors, ``_w`` (gate)
and ``_v`` (up).
Which transformers model fits is decided by the router and shared experts Megatron-LM's args describe; anything
transformers' model would compute differently (sigmoid scores, expert bias, group-limited or scaled top-k, ungated
shared experts) is refused by name, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._pickles import short_repr
from ...errors import UnsupportedCheckpointError

__all__ = [
    "MoeShape",
    "Piece",
    "Recipes",
    "hf_refusal",
    "mlp_recipes",
    "moe_config",
    "moe_mlp_recipes",
    "moe_shape",
    "positive",
    "rows",
]


@dataclass(frozen=True, slots=True)
class Piece:
    """Flat elements ``[start, start + count)`` of the stored tensor ``source``."""

    source: str
    start: int
    count: int


Recipes = dict[str, tuple[tuple[Piece, ...], tuple[int, ...]]]
"""HF name -> (its pieces in order, its shape)."""


def rows(source: str, cols: int, blocks: list[tuple[int, int]], first: int = 0) -> tuple[Piece, ...]:
    """Row blocks ``[r0, r1)`` of a tensor with ``cols`` columns, rows counted from flat element ``first``."""
    return tuple(Piece(source, first + r0 * cols, (r1 - r0) * cols) for r0, r1 in blocks)


def hf_refusal(path: Any, why: str) -> UnsupportedCheckpointError:
    """The one error for a checkpoint ``names='hf'`` cannot map (the default names still read it)."""
    return UnsupportedCheckpointError(
        f"names='hf' maps Megatron GPT models of the Llama family (RMSNorm, SwiGLU, rotary, no biases; QK norms as "
        f"Qwen3; MoE layers as Mixtral, Qwen2-MoE or Qwen3-MoE) to transformers' names; '{path}' {why}. Convert with "
        "the default names instead.",
        path=path,
    )


def positive(args: dict[str, Any], key: str, where: Any, default: int | None = None) -> int:
    """``args[key]`` (``default`` when absent or None) as a positive int, else refused by name: these sizes shape
    every recipe, so a broken or hostile common.pt must name its value, not raise a bare TypeError deep inside."""
    value = args.get(key)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise hf_refusal(where, f"has {key}={short_repr(value)}, not a positive integer")
    return value


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The MoE layers' sizes and routing, from Megatron-LM's args."""

    arch: str
    """``mixtral`` (routed experts only), ``qwen2_moe`` (plus a gated shared expert) or ``qwen3_moe`` (routed
    experts only, QK norms)."""
    experts: int
    topk: int
    ffn: int
    """Each routed expert's hidden size (``moe_ffn_hidden_size``)."""
    shared: int | None
    """The shared experts' total hidden size, or None."""
    normalized: bool
    """Top-k weights renormalized to sum to 1 (softmax over the top-k logits: ``moe_router_pre_softmax`` off)."""
    moe_layers: tuple[int, ...]


_ROUTING = {  # arg: (Megatron-LM's default, the value transformers' Mixtral / Qwen2-MoE router computes with)
    "moe_router_score_function": ("softmax", "softmax"),
    "moe_router_topk_scaling_factor": (None, None),
    "moe_router_enable_expert_bias": (False, False),
    "moe_router_num_groups": (None, None),
    "moe_router_group_topk": (None, None),
    "moe_router_topk_limited_devices": (None, None),
    "moe_latent_size": (None, None),
}


def _pattern(args: dict[str, Any], layers: int, where: Any) -> tuple[int, ...]:
    """The MoE layers, as megatron.core's ``get_gpt_decoder_block_spec`` reads ``moe_layer_freq``."""
    freq = args.get("moe_layer_freq", 1)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return tuple(i for i in range(layers) if i % freq == 0)
    if isinstance(freq, (list, tuple)) and len(freq) == layers and all(f in (0, 1) for f in freq):
        return tuple(i for i, f in enumerate(freq) if f == 1)
    raise hf_refusal(where, f"has moe_layer_freq={freq!r}, not a frequency or a 0/1 list of {layers} layers")


def moe_shape(args: dict[str, Any], layers: int, dense_ffn: int, where: Any) -> MoeShape | None:
    """The MoE layout (None for a dense model); a router or shared expert transformers cannot express is refused."""
    if args.get("num_experts") is None:
        return None
    experts = positive(args, "num_experts", where)
    for key, (default, wanted) in _ROUTING.items():
        if args.get(key, default) != wanted:
            raise hf_refusal(where, f"routes its experts with {key}={args.get(key)!r} (the mapping needs {wanted!r})")
    if args.get("moe_router_load_balancing_type", "aux_loss") == "sinkhorn":
        raise hf_refusal(where, "routes with sinkhorn (sigmoid scores at inference), which neither model computes")
    shared, qk_norm = None, bool(args.get("qk_layernorm", False))
    if args.get("moe_shared_expert_intermediate_size"):
        shared = positive(args, "moe_shared_expert_intermediate_size", where)
    if shared and not args.get("moe_shared_expert_gate", False):
        raise hf_refusal(where, "has shared experts without a gate (Qwen2-MoE's shared expert is always gated)")
    if shared and qk_norm:
        raise hf_refusal(where, "has shared experts and QK norms (Qwen2-MoE has no QK norms, Qwen3-MoE no shared "
                         "experts)")  # fmt: skip
    topk = positive(args, "moe_router_topk", where, 2)
    if topk > experts:
        raise hf_refusal(where, f"routes each token to moe_router_topk={topk} of its {experts} experts")
    moe = MoeShape(
        arch="qwen2_moe" if shared else "qwen3_moe" if qk_norm else "mixtral",
        experts=experts,
        topk=topk,
        ffn=positive(args, "moe_ffn_hidden_size", where, dense_ffn),
        shared=shared,
        normalized=not args.get("moe_router_pre_softmax", False),
        moe_layers=_pattern(args, layers, where),
    )
    if moe.arch == "mixtral" and not moe.normalized:
        raise hf_refusal(where, "routes with moe_router_pre_softmax=True (top-k weights not renormalized), which "
                         "Mixtral's router always renormalizes; without shared experts no other model fits")  # fmt: skip
    if moe.arch == "mixtral" and len(moe.moe_layers) != layers:
        raise hf_refusal(where, f"mixes dense and MoE layers (moe_layer_freq={args.get('moe_layer_freq')!r}), "
                         "which Mixtral cannot express without shared experts")  # fmt: skip
    return moe


def mlp_recipes(
    fc1: str, fc2: str, hidden: int, ffn: int, at: str, names: tuple[str, ...], index: int = 0, split: bool = False
) -> Recipes:
    """A gated MLP's projections ``at + names``: gate and up are the row halves of ``fc1``'s block ``index`` (of
    experts stacked on a leading axis; 0 for a lone MLP), down is ``fc2``'s block ``index``. ``split``: Megatron's
    per-expert form (``singleton_local_shards``), which saves gate and up as tensors of their own, ``fc1 + "_w"``
    and ``fc1 + "_v"``."""
    gate, up, down = (f"{at}{n}.weight" for n in names)
    first1, first2 = index * 2 * ffn * hidden, index * hidden * ffn
    halves = (
        (rows(f"{fc1}_w", hidden, [(0, ffn)]), rows(f"{fc1}_v", hidden, [(0, ffn)]))
        if split
        else (rows(fc1, hidden, [(0, ffn)], first1), rows(fc1, hidden, [(ffn, 2 * ffn)], first1))
    )
    return {
        gate: (halves[0], (ffn, hidden)),
        up: (halves[1], (ffn, hidden)),
        down: (rows(fc2, ffn, [(0, hidden)], first2), (hidden, ffn)),
    }


def moe_mlp_recipes(src: str, dst: str, hidden: int, moe: MoeShape, split: bool = False) -> Recipes:
    """One MoE layer's router, every routed expert and the shared expert: ``src``/``dst`` are the layer prefixes.
    ``split``: the per-expert form, each expert under its own keys (``mlp.experts.experts.<e>.linear_fc1.weight_w``,
    whatever module trained them) instead of a block of the expert-stacked tensor."""
    if moe.arch == "mixtral":
        block, names = f"{dst}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, names = f"{dst}mlp.", ("gate_proj", "up_proj", "down_proj")
    router = rows(f"{src}mlp.router.weight", hidden, [(0, moe.experts)])
    found: Recipes = {f"{block}gate.weight": (router, (moe.experts, hidden))}
    experts = f"{src}mlp.experts.experts."
    for e in range(moe.experts):
        at, index = (f"{experts}{e}.", 0) if split else (experts, e)
        found.update(
            mlp_recipes(f"{at}linear_fc1.weight", f"{at}linear_fc2.weight", hidden, moe.ffn,
                        f"{block}experts.{e}.", names, index, split)
        )  # fmt: skip
    if moe.shared:
        shared = f"{src}mlp.shared_experts."
        found.update(
            mlp_recipes(f"{shared}linear_fc1.weight", f"{shared}linear_fc2.weight", hidden, moe.shared,
                        f"{block}shared_expert.", names, split=split)
        )  # fmt: skip
        gate = rows(f"{shared}gate_weight", hidden, [(0, 1)])
        found[f"{block}shared_expert_gate.weight"] = (gate, (1, hidden))
    return found


def moe_config(moe: MoeShape, args: dict[str, Any], layers: int, dense_ffn: int) -> dict[str, Any]:
    """What transformers' ``MixtralConfig`` / ``Qwen2MoeConfig`` / ``Qwen3MoeConfig`` adds to the Llama fields for
    these MoE layers."""
    aux = args.get("moe_aux_loss_coeff", 0.0)
    common = {"num_experts_per_tok": moe.topk, "router_aux_loss_coef": aux if isinstance(aux, float) else 0.0}
    if moe.arch == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": moe.ffn,
            "num_local_experts": moe.experts,
            "sliding_window": None,
            **common,
        }
    sparse = {
        "intermediate_size": dense_ffn,
        "moe_intermediate_size": moe.ffn,
        "num_experts": moe.experts,
        "norm_topk_prob": moe.normalized,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in moe.moe_layers],
        "use_sliding_window": False,
        **common,
    }
    if moe.arch == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "sliding_window": None, **sparse}
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": moe.shared,
        "qkv_bias": False,
        **sparse,
    }
