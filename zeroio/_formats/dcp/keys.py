"""Which tensors of a DCP checkpoint are the model's, under which names: the one rule, said out loud.

``dcp.save({"model": sd, "optim": osd})`` (FSDP, accelerate) prefixes every model key with ``model.``; a Hugging
Face-style ``dcp.save(model.state_dict())`` has keys that begin with ``model.`` by themselves
(``model.embed_tokens.weight``) beside others that do not (``lm_head.weight``). Stripping ``model.`` whenever some
key has it filed ``lm_head.weight`` as non-model state: a tensor dropped silently from every conversion. Now
``"auto"`` strips the prefix only when every other tensor is known non-model state (``optim.``, ``train_state.``,
``lr_scheduler.``, ...), and keeps every name as stored otherwise; ``dcp_keys`` lets the user choose, and the
checkpoint's ``metadata.extra["dcp_keys"]`` says what was done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from ..options import DCP_KEYS, DcpKeys

__all__ = ["DCP_KEYS", "NOT_MODEL", "OPTIM_ROOTS", "KeySplit", "split_keys"]

OPTIM_ROOTS = ("optim.", "optimizer.")
NOT_MODEL = (*OPTIM_ROOTS, "train_state.", "lr_scheduler.", "dataloader.", "lr_schedulers.")

T = TypeVar("T")

KeySplit = tuple[dict[str, T], list[str], str]
"""``({model name: item}, [names of tensors left out], one line saying how the keys were split)``."""


def split_keys(tensors: Sequence[tuple[str, T]], mode: DcpKeys) -> KeySplit[T]:
    """Split the non-optimizer tensors ``(stored name, item)`` into the model's (renamed) and the rest."""
    prefixed = [name for name, _ in tensors if name.startswith("model.")]
    strays = [name for name, _ in tensors if not name.startswith(("model.", *NOT_MODEL))]
    strip = mode == "model" or (mode == "auto" and bool(prefixed) and not strays)
    model: dict[str, T] = {}
    left: list[str] = []
    for name, item in tensors:
        if strip and name.startswith("model."):
            model[name[len("model.") :]] = item
        elif not strip and (mode == "all" or not name.startswith(NOT_MODEL)):
            model[name] = item
        else:
            left.append(name)
    if strip:
        how = f"'model.' stripped from {len(model)} tensor name(s)"
    elif prefixed:
        how = (
            f"names kept as stored: {len(strays)} tensor(s) outside 'model.' (first: '{strays[0]}') are model "
            "tensors too"
            if strays
            else "names kept as stored"
        )
    else:
        how = "names kept as stored"
    if left:
        how += f"; {len(left)} tensor(s) left out as non-model state (first: '{left[0]}')"
    return model, left, how + " (dcp_keys=" + repr(mode) + ")."
