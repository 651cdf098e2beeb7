"""Pure name rules of PEFT LoRA checkpoints: which tensors are adapters, PEFT's adapter keys, merged base names."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "PEFT_PREFIX",
    "LoraPair",
    "adapter_keys",
    "adapter_names",
    "base_names",
    "lora_pairs",
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


def adapter_keys(names: Iterable[str], adapter: str) -> dict[str, str]:
    """``{PEFT adapter-file key: stored name}`` of one adapter, as ``get_peft_model_state_dict`` names them.

    peft 0.21.2: LoRA tensors keep their path with the adapter name removed (``...q_proj.lora_A.weight``), DoRA's
    magnitude also loses ``.weight`` (``LoraModel._get_adapter_state_dict``), and a ``modules_to_save`` copy is
    stored under its module's own name (``ModulesToSaveWrapper.adapter_state_dict``), after the LoRA tensors.
    """
    lora: dict[str, str] = {}
    saved: dict[str, str] = {}
    for name in names:
        match = _LORA.match(name)
        if match and match["adapter"] == adapter:
            rest = match["rest"]
            if match["part"] == "lora_magnitude_vector" and rest == ".weight":
                rest = ""
            lora[f"{match['module']}.{match['part']}{rest}"] = name
            continue
        match = _SAVED.match(name)
        if match and match["adapter"] == adapter:
            saved[f"{match['module']}.{match['rest']}"] = name
    return {**lora, **saved}


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
