"""Matching checkpoint keys to a model's: the user's ``key_map``, then wrapper-prefix normalisation."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["PREFIXES", "KeyMap", "apply_key_map", "normalise_prefixes"]

KeyMap = Mapping[str, str | None] | Callable[[str], str | None]
"""Checkpoint key -> model key; ``None`` drops the key."""

PREFIXES = ("module.", "_forward_module.", "model.")
"""Wrapper prefixes real checkpoints carry: DeepSpeed's engine (``module.``), Lightning's strategy wrapper
(``_forward_module.``) and a LightningModule holding the network as ``self.model`` (``model.``)."""


def apply_key_map(keys: list[str], key_map: KeyMap | None) -> tuple[dict[str, str], list[str]]:
    """``{checkpoint key: mapped key}`` and the keys the map dropped."""
    if key_map is None:
        return {k: k for k in keys}, []
    mapped: dict[str, str] = {}
    dropped: list[str] = []
    for key in keys:
        new = key_map.get(key, key) if isinstance(key_map, Mapping) else key_map(key)
        if new is None:
            dropped.append(key)
        elif not isinstance(new, str):
            raise TypeError(f"key_map must return a str or None, got {type(new).__name__} for {key!r}.")
        else:
            mapped[key] = new
    return mapped, dropped


def _prefix_candidates(key: str) -> list[str]:
    """``key`` with known wrapper prefixes stripped (up to three deep) and then at most one added, shortest first."""
    stripped = [key]
    frontier = [key]
    for _ in range(3):
        frontier = [k[len(p) :] for k in frontier for p in PREFIXES if k.startswith(p) and len(k) > len(p)]
        stripped += frontier
    return stripped[1:] + [p + k for k in stripped for p in PREFIXES]


def normalise_prefixes(mapped: dict[str, str], model_keys: Mapping[str, Any]) -> dict[str, str]:
    """Rename a key only when stripping or adding a wrapper prefix makes it match a model key no other key fills."""
    taken = {v for v in mapped.values() if v in model_keys}
    out = dict(mapped)
    for key, name in mapped.items():
        if name in model_keys:
            continue
        for candidate in _prefix_candidates(name):
            if candidate in model_keys and candidate not in taken:
                out[key] = candidate
                taken.add(candidate)
                break
    return out
