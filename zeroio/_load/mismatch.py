"""``strict=True``'s error: missing and unexpected keys and shape mismatches, in torch's own wording."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

import torch
from torch import nn

from .._messages import SHOWN, listing
from ..errors import StateDictMismatchError, ZeroIOError

__all__ = ["strict_failure"]

_SHOWN = SHOWN  # list items shown in an error message before "... and N more"


def _listing(keys: list[str], notes: Mapping[str, str] | None = None) -> str:
    notes = notes or {}
    return listing(keys, limit=_SHOWN, show=lambda k: f'"{k}"{notes.get(k, "")}')


def _mismatch_message(
    model: nn.Module,
    missing: list[str],
    unexpected: list[str],
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    where: str,
    matching: int,
) -> str:
    # torch's wording (Module.load_state_dict), so that searches for the familiar message find this one.
    lines = [f"Error(s) in loading state_dict for {type(model).__name__}:"]
    if missing:
        notes = {}
        for key in missing[:_SHOWN]:
            close = difflib.get_close_matches(key, unexpected, n=1, cutoff=0.8)
            if close:
                notes[key] = f' (did you mean "{close[0]}"?)'
        lines.append(f"Missing key(s) in state_dict: {_listing(missing, notes)}.")
    if unexpected:
        lines.append(f"Unexpected key(s) in state_dict: {_listing(unexpected)}.")
    for key, ckpt_shape, model_shape in mismatched[:_SHOWN]:
        lines.append(
            f"size mismatch for {key}: copying a param with shape {torch.Size(ckpt_shape)} from checkpoint, "
            f"the shape in current model is {torch.Size(model_shape)}."
        )
    if len(mismatched) > _SHOWN:
        lines.append(f"... and {len(mismatched) - _SHOWN} more size mismatches.")
    if matching == 0 and not mismatched:  # an entirely different model: strict=False would load nothing (issue 32)
        lines.append(
            f"Checkpoint: '{where}'. No parameter was modified: no key of the checkpoint matches the model (it holds "
            f"{len(unexpected)} tensors, listed above as unexpected; the model expects {len(missing)}). Check that "
            "this is the checkpoint of this model, or pass key_map= to rename keys."
        )
        return "\n\t".join(lines)
    lines.append(
        f"Checkpoint: '{where}'. No parameter was modified; pass strict=False to load the {matching} matching "
        "tensors (the LoadReport lists the rest), or key_map= to rename keys."
    )
    return "\n\t".join(lines)


def strict_failure(
    model: nn.Module,
    keys: tuple[list[str], list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]],
    where: str,
    matched: int,
) -> ZeroIOError | None:
    """``strict=True``: the error that missing or unexpected keys or shape mismatches raise, or None."""
    missing, unexpected, mismatched = keys
    if not (missing or unexpected or mismatched):
        return None
    return StateDictMismatchError(
        _mismatch_message(model, missing, unexpected, mismatched, where, matched),
        missing_keys=missing,
        unexpected_keys=unexpected,
        mismatched_shapes=mismatched,
        path=where,
    )
