"""How each tensor of a tensor-parallel checkpoint is split over the tp ranks: recorded metadata or user rules.

A rule is a dimension (the shards are concatenated along it, in tp-rank order) or ``"replicated"`` (every rank
holds the whole tensor). Nothing here guesses: a tensor that neither the files nor the user's rules describe is
left undecided, and the reader refuses it by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

from .name_patterns import PatternError, bounded_match, bounded_pattern

__all__ = [
    "PRESETS",
    "REPLICATED",
    "UNSUPPORTED",
    "PatternError",
    "Rule",
    "TPRules",
    "describe_rule",
    "parse_tp_rules",
    "recorded_rule",
    "user_rule",
]

REPLICATED: Literal["replicated"] = "replicated"
Rule: TypeAlias = int | Literal["replicated"]
"""A tensor's partition: the dimension its shards are concatenated on, or ``"replicated"``."""
TPRules: TypeAlias = Mapping[str, Rule] | str
"""What ``tp_rules=`` takes: ``{regex: dim | "replicated"}``, a preset name, or that mapping as JSON text."""

UNSUPPORTED: Literal["unsupported"] = (
    "unsupported"  # recorded, but not as one contiguous split or a plain replica: refused, never guessed
)

# Megatron-LM / Megatron-DeepSpeed (GPT): ColumnParallelLinear (qkv, h->4h, output layer) and the vocab-parallel
# embedding split dim 0, weight and bias; RowParallelLinear (attention dense, 4h->h) split the weight's dim 1 and
# replicate the bias; norms and learned position embeddings are replicated.
_MEGATRON: dict[str, Rule] = {
    r"(^|\.)word_embeddings\.weight$": 0,
    r"(^|\.)position_embeddings\.weight$": REPLICATED,
    r"\.query_key_value\.(weight|bias)$": 0,
    r"\.(query|key_value)\.(weight|bias)$": 0,
    r"\.dense_h_to_4h\.(weight|bias)$": 0,
    r"\.(self_attention|attention|inter_attention)\.dense\.weight$": 1,
    r"\.dense_4h_to_h\.weight$": 1,
    r"\.(self_attention|attention|inter_attention)\.dense\.bias$": REPLICATED,
    r"\.dense_4h_to_h\.bias$": REPLICATED,
    r"layer_?norm[^.]*\.(weight|bias)$": REPLICATED,
    r"(^|\.)(output_layer|lm_head)\.weight$": 0,
}
# GPT-NeoX: the same parallel linears under NeoX's names (embed_in / embed_out vocab-parallel on dim 0).
_NEOX: dict[str, Rule] = {
    r"(^|\.)embed_in\.weight$": 0,
    r"(^|\.)embed_out\.weight$": 0,
    r"\.attention\.query_key_value\.(weight|bias)$": 0,
    r"\.mlp\.dense_h_to_4h\.(weight|bias)$": 0,
    r"\.attention\.dense\.weight$": 1,
    r"\.mlp\.dense_4h_to_h\.weight$": 1,
    r"\.attention\.dense\.bias$": REPLICATED,
    r"\.mlp\.dense_4h_to_h\.bias$": REPLICATED,
    r"(input_layernorm|post_attention_layernorm|final_layer_norm)\.(weight|bias)$": REPLICATED,
}
PRESETS: dict[str, dict[str, Rule]] = {"megatron": _MEGATRON, "neox": _NEOX}
"""Rule sets for well-known parameter names: ``tp_rules="megatron"`` (Megatron-LM/-DeepSpeed) or ``"neox"``."""


def _check_rule(pattern: Any, value: Any) -> tuple[str, Rule]:
    if not isinstance(pattern, str):
        raise TypeError(f"tp_rules keys are regular expressions (str), got {pattern!r}.")
    try:
        bounded_pattern(pattern)
    except PatternError as exc:
        raise ValueError(f"tp_rules pattern {_short(pattern)} is refused: {exc}.") from None
    if value == REPLICATED:
        return pattern, REPLICATED
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"tp_rules[{pattern!r}] must be a dimension (int >= 0) or 'replicated', got {value!r}.")
    return pattern, value


def parse_tp_rules(value: TPRules | None) -> dict[str, Rule] | None:
    """Validate ``tp_rules=``: a mapping, a preset name (``megatron``, ``neox``) or a JSON object; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text in PRESETS:
            return dict(PRESETS[text])
        if not text.startswith("{"):
            raise ValueError(
                f"tp_rules={value!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a JSON object "
                '({"regex": dim or "replicated"}).'
            )
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tp_rules is not valid JSON: {exc}.") from None
    if not isinstance(value, Mapping):
        raise TypeError(f"tp_rules must be a mapping {{regex: dim or 'replicated'}} or a preset name, got {value!r}.")
    return dict(_check_rule(k, v) for k, v in value.items())


def user_rule(rules: Mapping[str, Rule], name: str) -> tuple[Rule | None, list[str]]:
    """The rule the user's regexes give ``name`` (None when none matches) and the patterns that matched.

    Two matching patterns that disagree leave it undecided (the caller refuses it, naming both).
    """
    matched = [p for p in rules if _match(p, name, search=True, origin="tp_rules")]
    values = {rules[p] for p in matched}
    return (values.pop() if len(values) == 1 else None), matched


def describe_rule(rule: Rule) -> str:
    """``"dim 1"`` or ``"replicated"``: how a rule reads in messages and inspect output."""
    return rule if rule == REPLICATED else f"dim {rule}"


# --------------------------------------------------------------------------- recorded metadata


def _row_major(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [int(v) for v in value]
    return None


def _affine_rule(entry: Any, tp: int) -> Rule | Literal["unsupported"]:
    """The rule an AutoTP ``affine_map`` entry describes, or ``"unsupported"`` for any other geometry.

    Understood: every rank holds one unscaled piece that is its whole shard; either all ranks the whole tensor
    (replicated) or each rank a contiguous block along one dimension, in rank order, that together cover it.
    """
    if not isinstance(entry, Mapping) or not isinstance(entry.get("ranks"), Mapping):
        return UNSUPPORTED
    logical = _ints(entry.get("logical_shape"))
    ranks = entry["ranks"]
    if logical is None or sorted(ranks) != list(range(tp)):
        return UNSUPPORTED
    dims: set[Rule] = set()
    start = 0
    for rank in range(tp):
        shard, pieces = _ints(ranks[rank].get("shard_shape")), ranks[rank].get("pieces")
        if shard is None or len(shard) != len(logical) or not isinstance(pieces, list) or len(pieces) != 1:
            return UNSUPPORTED
        piece = pieces[0]
        source, dest = piece.get("source"), piece.get("dest")
        if (
            _ints(piece.get("shape")) != shard
            or float(piece.get("scale", 1.0)) != 1.0
            or not isinstance(source, list | tuple)
            or not isinstance(dest, list | tuple)
            or len(source) != 2
            or len(dest) != 2
            or _ints(source[1]) != _row_major(logical)
            or list(dest) != [0, _row_major(shard)]
        ):
            return UNSUPPORTED
        split = [d for d, (a, b) in enumerate(zip(shard, logical)) if a != b]
        locations = sorted(piece.get("locations") or ())
        if not split and locations == list(range(tp)) and source[0] == 0:
            dims.add(REPLICATED)
            continue
        if len(split) != 1 or locations != [rank] or source[0] != start * _row_major(logical)[split[0]]:
            return UNSUPPORTED
        dims.add(split[0])
        start += shard[split[0]]
    if len(dims) != 1:
        return UNSUPPORTED
    rule = dims.pop()
    if rule != REPLICATED and start != logical[int(rule)]:
        return UNSUPPORTED
    return rule


def _short(text: str) -> str:
    """``repr`` of a pattern or name, cut to 100 characters (a hostile one may be megabytes long)."""
    shown = repr(text)
    return shown if len(shown) <= 100 else f"{shown[:80]}... ({len(text)} characters)"


def _match(pattern: str, name: str, *, search: bool, origin: str) -> bool:
    """Bounded ``re.search``/``re.match`` (``patterns.py``); a refusal names the pattern, the name and ``origin``."""
    try:
        return bounded_match(bounded_pattern(pattern), name, search=search)
    except PatternError as exc:
        fix = "Simplify the pattern" if origin == "tp_rules" else "The checkpoint is corrupted or hostile"
        raise PatternError(
            f"{origin} pattern {_short(pattern)} on parameter {_short(name)} is refused: {exc}. {fix} "
            "(docs/security.md, 'Recorded patterns')."
        ) from None


def _matches(patterns: Any, name: str) -> bool:
    return isinstance(patterns, list) and any(
        isinstance(p, str) and _match(p, name, search=False, origin="recorded universal_checkpoint_info")
        for p in patterns
    )


def recorded_rule(info: Mapping[str, Any], name: str, tp: int) -> Rule | Literal["unsupported"] | None:
    """What AutoTP's ``universal_checkpoint_info`` records for parameter ``name``.

    The per-parameter ``affine_map`` first (its key is the anchored, escaped name), then the pattern lists:
    row-parallel weights split dim 1, replicated patterns are replicated. Fused sub-parameters and parameters
    AutoTP marks unsupported are ``"unsupported"``. Anything else is None: DeepSpeed's converter concatenates
    it on dim 0 by default (vocabulary patterns are recorded as dim 0), which doubles a replicated tensor the lists forgot, so zeroio does not assume it.
    """
    affine = info.get("affine_map")
    params = affine.get("params") if isinstance(affine, Mapping) else None
    if isinstance(params, Mapping):
        entry = params.get(rf"^{re.escape(name)}$")
        if entry is not None:
            return _affine_rule(entry, tp)
    unsupported = info.get("autotp_unsupported_parameter_patterns")
    if isinstance(unsupported, Mapping) and _matches(list(unsupported), name):
        return UNSUPPORTED
    sub_params = info.get("parameter_with_sub_params")
    if isinstance(sub_params, list) and any(
        isinstance(s, Mapping) and _matches(s.get("patterns"), name) for s in sub_params
    ):
        return UNSUPPORTED
    if _matches(info.get("tp_replicated_parameter_patterns"), name):
        return REPLICATED
    if _matches(info.get("parameter_with_row_parallelism_patterns"), name):
        return 1
    if _matches(info.get("vocabulary_parameter_patterns"), name):
        return 0  # vocabulary-parallel embeddings and heads: split on the vocabulary (padded rows kept)
    return None
