"""The init hooks ``zeroio.load`` runs before matching keys: the caller's ``init_hook``, or the sharded-init hooks a
Lightning module overrides (``configure_sharded_model``, ``configure_model``), which build lazily created layers."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from .._messages import get_logger
from .._types import InitHook
from ..errors import InitHookError

__all__ = ["run_init_hooks"]

logger = get_logger(__name__)

_FRAMEWORK_MODULES = ("lightning", "pytorch_lightning", "lightning_fabric")
_HOOK_NAMES = ("configure_sharded_model", "configure_model")  # Lightning's order: legacy hook first


def _is_lightning_module(model: nn.Module) -> bool:
    """Whether ``model`` is a Lightning ``LightningModule``, checked by class name so Lightning is never imported."""
    return any(
        cls.__name__ == "LightningModule" and cls.__module__.split(".")[0] in _FRAMEWORK_MODULES
        for cls in type(model).__mro__
    )


def _default_hooks(model: nn.Module) -> list[str]:
    """Lightning's sharded-init hooks that a LightningModule's class overrides (the framework's base ones are
    no-ops). Like Lightning's own ``load_from_checkpoint`` (``is_overridden`` on a LightningModule), a plain
    ``nn.Module`` gets none: a method it happens to call ``configure_model`` is the user's, not a contract."""
    if not _is_lightning_module(model):
        return []
    names = []
    for name in _HOOK_NAMES:
        fn = getattr(type(model), name, None)
        if not callable(fn):
            continue
        module = str(getattr(fn, "__module__", "") or "")
        if module.split(".")[0] in _FRAMEWORK_MODULES:
            continue
        names.append(name)
    return names


def _on_meta(model: nn.Module) -> bool:
    """Whether the model has parameters and all of them are on ``meta`` (built under ``torch.device("meta")``)."""
    params = list(model.parameters())
    return bool(params) and all(p.is_meta for p in params)


def run_init_hooks(model: nn.Module, init_hook: InitHook | None, where: str) -> tuple[str, ...]:
    """Run ``init_hook(model)``, or else the Lightning hooks the model's class overrides, once, before keys are
    matched (on ``meta`` when the model is); the names of the hooks run.

    Raises:
        InitHookError: a hook raised (its exception is ``__cause__``; nothing was loaded from ``where``).
    """
    if init_hook is not None:
        calls: list[tuple[str, Callable[[], Any]]] = [
            (getattr(init_hook, "__qualname__", None) or repr(init_hook), lambda: init_hook(model))
        ]
    else:
        calls = [(name, getattr(model, name)) for name in _default_hooks(model)]
    # A model built on meta gets its hook-built layers on meta too (as Lightning's empty-init context does):
    # otherwise every new layer would be allocated and randomly initialised on the CPU only to be overwritten.
    on_meta = bool(calls) and _on_meta(model)
    for name, call in calls:
        logger.debug("running init hook %s", name)
        try:
            with torch.device("meta") if on_meta else nullcontext():
                call()
        except Exception as exc:
            shown = name if init_hook is not None else f"{type(model).__name__}.{name}"
            raise InitHookError(
                f"The init hook {shown} raised {type(exc).__name__}: {exc}. Nothing was loaded from '{where}'; fix "
                "the hook so that it builds the model's layers, then call zeroio.load again.",
                path=where,
                name=name,
            ) from exc
    return tuple(name for name, _ in calls)
