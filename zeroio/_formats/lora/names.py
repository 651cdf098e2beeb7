"""Pure name rules of PEFT LoRA checkpoints: which tensors are adapters, PEFT's adapter keys, merged base names."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "EMBEDDING_LAYER_NAMES",
    "PEFT_PREFIX",
    "AdapterFileRules",
    "LoraPair",
    "adapter_keys",
    "adapter_names",
    "base_names",
    "lora_pairs",
    "unmergeable_tensors",
]

PEFT_PREFIX = "base_model.model."
"""What ``PeftModel`` puts before every name of the model it wraps (kept in adapter files, dropped when merged)."""

# peft 0.21.2 LoraLayer.adapter_layer_names + other_param_names that hold tensors: one entry per adapter, the
# adapter name right after the part (``q_proj.lora_A.default.weight``; embeddings' factors are ParameterDict
# entries: ``embed_tokens.lora_embedding_A.default``).
_LORA = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"\.(?P<adapter>[^.]+)(?P<rest>(?:\..+)?)$"
)
# ModulesToSaveWrapper: the trained copy per adapter, and the untouched original beside it.
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<rest>.+)$")
# TrainableTokensWrapper (LoraConfig.trainable_token_indices): the trained rows of an embedding, per adapter.
_TOKENS = re.compile(r"^(?P<module>.+)\.token_adapter\.trainable_tokens_delta\.(?P<adapter>[^.]+)$")

EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")
"""peft 0.21.2 ``EMBEDDING_LAYER_NAMES``: a LoRA config targeting one of these saves the embedding layers too."""


@dataclass(frozen=True, slots=True)
class AdapterFileRules:
    """What ``get_peft_model_state_dict`` puts in an adapter file besides the adapter's own tensors (its
    config decides: peft 0.21.2 ``BaseTuner._get_learnable_bias_state_dict`` and the ``save_embedding_layers``
    step)."""

    bias: str = "none"
    """``LoraConfig.bias``: ``"all"`` saves every bias, ``"lora_only"`` the bias of each LoRA-wrapped layer."""
    embeddings: bool = False
    """An embedding layer name is targeted: the LoRA-wrapped embedding layers' base weights are saved too."""


@dataclass(frozen=True, slots=True)
class LoraPair:
    """The two factors of one LoRA-wrapped weight: ``W + scale * B @ A``."""

    module: str
    """The wrapped module's name as stored (``base_model.model.model.layers.0.self_attn.q_proj``)."""
    lora_a: str
    """Stored name of ``lora_A`` (``[r, in]``; ``lora_embedding_A``: ``[r, num_embeddings]``)."""
    lora_b: str
    """Stored name of ``lora_B`` (``[out, r]``)."""
    embedding: bool
    """True for ``lora_embedding_A``/``_B`` (an ``nn.Embedding`` target)."""


def adapter_names(names: Iterable[str]) -> list[str]:
    """The adapters a checkpoint holds (``default`` unless named), in order of first appearance."""
    found: dict[str, None] = {}
    for name in names:
        match = _LORA.match(name)
        if match:
            found.setdefault(match["adapter"])
    return list(found)


def adapter_keys(
    names: Sequence[str],
    adapter: str,
    *,
    others: Sequence[str] = (),
    rules: AdapterFileRules = AdapterFileRules(),
    tied: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``{PEFT adapter-file key: stored name}`` of one adapter, as ``get_peft_model_state_dict`` names them.

    peft 0.21.2: LoRA tensors keep their path with the adapter name removed (``...q_proj.lora_A.weight``), DoRA's
    magnitude also loses ``.weight`` (``LoraModel._get_adapter_state_dict``); ``rules`` adds the biases and the
    targeted embedding layers' base weights; a ``modules_to_save`` copy is stored under its module's own name
    (``ModulesToSaveWrapper.adapter_state_dict``) and trained token rows as ``<module>.token_adapter.
    trainable_tokens_delta`` (``TrainableTokensWrapper``; not for a tied alias, which PEFT leaves to its source).
    Names of the ``others`` adapters are left out first, as PEFT filters them out of the state dict.
    """
    kept = [n for n in names if not any(f".{o}." in n or n.endswith(f".{o}") for o in others)]
    lora: dict[str, str] = {}
    for name in kept:
        match = _LORA.match(name)
        if match and match["adapter"] == adapter:
            rest = match["rest"]
            if match["part"] == "lora_magnitude_vector" and rest == ".weight":
                rest = ""
            lora[f"{match['module']}.{match['part']}{rest}"] = name
    lora.update({_without_adapter(n, adapter): n for n in _extra_base_tensors(names, kept, rules)})
    saved: dict[str, str] = {}
    for name in kept:
        match = _SAVED.match(name)
        if match and match["adapter"] == adapter:
            saved[f"{match['module']}.{match['rest']}"] = name
        match = _TOKENS.match(name)
        if match and match["adapter"] == adapter and name not in (tied or {}):
            saved[f"{match['module']}.token_adapter.trainable_tokens_delta"] = name
    return {**lora, **saved}


def _extra_base_tensors(names: Sequence[str], kept: Sequence[str], rules: AdapterFileRules) -> list[str]:
    """The biases and embedding base weights ``rules`` add (from ``kept``, the state dict without other adapters)."""
    wrapped = {m["module"] for m in map(_LORA.match, names) if m}  # every LoRA layer, whichever adapter
    embeddings = {m["module"] for m in map(_LORA.match, names) if m and m["part"].startswith("lora_embedding")}
    extra: list[str] = []
    if rules.bias == "all":
        extra += [n for n in kept if n == "bias" or n.endswith(".bias")]
    elif rules.bias.endswith("_only"):
        present = set(kept)
        extra += [f"{m}.base_layer.bias" for m in wrapped if f"{m}.base_layer.bias" in present]
    if rules.embeddings:
        # PEFT saves the model's input and output embeddings when LoRA wraps them: the wrapped embedding
        # layers and a wrapped layer named like one (lm_head).
        layers = embeddings | {m for m in wrapped if m.rpartition(".")[2] in EMBEDDING_LAYER_NAMES}
        extra += [n for n in kept if any(n.startswith(f"{m}.base_layer.") for m in layers)]
    return list(dict.fromkeys(extra))


def _without_adapter(key: str, adapter: str) -> str:
    """peft 0.21.2 ``_remove_adapter_name_from_state_dict_key``: the adapter name dropped at the end of the key
    or before its last part (``lora_A.default.weight`` -> ``lora_A.weight``), never in the middle."""
    if "." not in key:
        return key
    if key.endswith(f".{adapter}"):
        return key.removesuffix(f".{adapter}")
    head, _, suffix = key.rpartition(".")
    return f"{head.removesuffix(f'.{adapter}')}.{suffix}"


def unmergeable_tensors(names: Sequence[str], adapter: str) -> dict[str, str]:
    """``{module: what}`` for each of ``adapter``'s tensors that a ``W + scale * B @ A`` merge cannot place:
    trained token rows (``trainable_token_indices``) and factors whose layer keeps no ``base_layer.weight``
    (``target_parameters`` on a parameter of another name, such as fused MoE experts, or a checkpoint without
    its base weights)."""
    present = set(names)
    found: dict[str, str] = {}
    for name in names:
        tokens = _TOKENS.match(name)
        if tokens and tokens["adapter"] == adapter:
            found.setdefault(tokens["module"], "trained token rows (trainable_token_indices)")
        match = _LORA.match(name)
        if match and match["adapter"] == adapter and f"{match['module']}.base_layer.weight" not in present:
            found.setdefault(match["module"], f"'{match['part']}' factors but no '{match['module']}.base_layer.weight'")
    return found


def lora_pairs(names: Sequence[str], adapter: str) -> dict[str, LoraPair]:
    """``{stored base weight name: LoraPair}`` for every weight ``adapter`` wraps.

    A LoRA-wrapped ``nn.Linear``/``Conv1D`` keeps its weight at ``<module>.base_layer.weight``; PEFT wraps an
    embedding the same way. Factors without a base weight (a model saved without its base) are not pairs.
    """
    present = set(names)
    pairs: dict[str, LoraPair] = {}
    for name in names:
        match = _LORA.match(name)
        if not match or match["adapter"] != adapter or match["part"] not in ("lora_A", "lora_embedding_A"):
            continue
        module, embedding = match["module"], match["part"] == "lora_embedding_A"
        b_part = "lora_embedding_B" if embedding else "lora_B"
        lora_b = f"{module}.{b_part}.{adapter}{match['rest']}"
        base = f"{module}.base_layer.weight"
        if lora_b in present and base in present:
            pairs[base] = LoraPair(module=module, lora_a=name, lora_b=lora_b, embedding=embedding)
    return pairs


def base_names(names: Sequence[str], adapter: str | None) -> dict[str, str]:
    """``{merged name: stored name}``: the plain base model's state dict names (``merge_and_unload()``'s).

    ``base_model.model.`` and ``.base_layer`` are dropped, every LoRA tensor is left out, and a module in
    ``modules_to_save`` is ``adapter``'s trained copy under the module's own name (its ``original_module`` left out),
    as ``merge_and_unload`` replaces the wrapper by that copy.
    """
    saved_modules = {m["module"] for m in map(_SAVED.match, names) if m and m["adapter"] == adapter}
    out: dict[str, str] = {}
    for name in names:
        if _LORA.match(name):
            continue
        saved = _SAVED.match(name)
        if saved:
            if saved["adapter"] == adapter:
                out[_plain(f"{saved['module']}.{saved['rest']}")] = name
            continue
        original = _ORIGINAL.match(name)
        if original and original["module"] in saved_modules:
            continue
        if original:  # a modules_to_save wrapper of another adapter only: the original is the base
            out[_plain(f"{original['module']}.{original['rest']}")] = name
            continue
        out[_plain(name.replace(".base_layer.", "."))] = name
    return out


def _plain(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)
