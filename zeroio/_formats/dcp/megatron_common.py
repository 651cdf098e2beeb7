"""Megatron's ``common.pt`` (the non-sharded state: run arguments, iteration, optimizer step and param groups)
parsed by the restricted unpickler into inert data: no class it names is ever called.

Megatron-LM pickles an ``argparse.Namespace`` of its arguments (holding ``torch.dtype`` values and a few
Megatron enums), plain numbers and dicts, and the optimizer's shared step as a 0-d tensor. A global outside the
allowlist (``trusted_globals`` extends it) leaves common.pt unread, with a warning: the tensors stay readable.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._dtypes import DType
from ..._io.confine import require_regular_file
from ..._messages import get_logger
from ..._pickles import TensorRef, global_name, inert_parts, is_inert, load_pickle, short_repr
from ...errors import UnsafePickleError

if TYPE_CHECKING:
    import torch

__all__ = ["MEGATRON_GLOBALS", "MegatronCommon", "not_read", "read_common"]

logger = get_logger(__name__)

MEGATRON_GLOBALS = frozenset(
    {
        # Megatron-LM's args: enums Megatron-Core defines (rebuilt inert, their constructors never run).
        "megatron.core.transformer.enums.AttnBackend",
        "megatron.core.transformer.enums.AttnMaskType",
        "megatron.core.enums.ModelType",
        "megatron.core.transformer.enums.ModelType",
        "megatron.core.transformer.enums.LayerType",
        # .metadata: torch's save plans Megatron keeps beside DCP's Metadata (all_local_plans), and the stand-ins
        # Megatron-Core 0.15 pickled for them.
        "torch.distributed.checkpoint.planner.SavePlan",
        "torch.distributed.checkpoint.planner.WriteItem",
        "torch.distributed.checkpoint.planner.WriteItemType",
        "torch.distributed.checkpoint.planner.TensorWriteData",
        "torch.distributed.checkpoint.planner.BytesIOWriteData",
        "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata",
        "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan",
    }
)
"""Globals a Megatron checkpoint's pickles name beyond zeroio's own allowlist, accepted as inert records."""

MAX_NODES = 10_000
"""Nodes copied of common.pt's values, and again of its param groups, each in all (args hold a few hundred, param
groups a few dozen): a 31 KB common.pt whose param groups share one dict of lists took 35 s and 946 MB when each
value had a budget of its own."""


@dataclass(frozen=True, slots=True)
class MegatronCommon:
    """What common.pt says, as plain data."""

    values: dict[str, Any] = field(default_factory=dict)
    """JSON-friendly copy: ``args`` as a dict (dtypes by name), ``iteration``, ``checkpoint_version``, ..."""
    step: torch.Tensor | None = None
    """The optimizer's shared step (``optimizer.state.common_step``, a 0-d tensor), read at open."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """The optimizer's param groups without their ``params`` lists."""
    unread: str | None = None
    """Why common.pt was not read (a global outside the allowlist), or None."""
    optimizer_sharding: str | None = None
    """The distributed optimizer's ``param_state_sharding_type`` (``dp_reshardable``, ``fully_reshardable``, ...)."""

    @property
    def args(self) -> dict[str, Any]:
        found = self.values.get("args")
        return found if isinstance(found, dict) else {}


_TOO_LARGE = "<not shown: too large>"


def _copy(value: Any, budget: list[int], depth: int = 0) -> Any:
    """A JSON-friendly copy: dtypes by name, inert objects by their attributes (Namespace) or global's name,
    tensors by shape, ints past 64 bits by size; stops once ``budget`` (shared by every value copied with it) is
    spent, or at 20 levels."""
    budget[0] -= 1
    if budget[0] < 0 or depth > 20:
        return _TOO_LARGE
    if value is None or isinstance(value, (bool, float, str)):
        return value
    if isinstance(value, int):
        return (
            value if value.bit_length() <= 64 else f"<int of {value.bit_length()} bits>"
        )  # str() refuses 4,300 digits
    if isinstance(value, DType):
        return value.name
    if isinstance(value, TensorRef):
        return f"<tensor {list(value.shape)} {value.dtype_spec.name}>"
    if isinstance(value, (list, tuple)):
        return [_copy(v, budget, depth + 1) for v in _while(value, budget)]
    if isinstance(value, dict):
        return _copy_items(value.items(), budget, depth)
    if is_inert(value) and global_name(value) == "argparse.Namespace":
        return _copy_items(inert_parts(value).state.items(), budget, depth)
    if is_inert(value):
        parts = inert_parts(value)
        return f"<{parts.name}{tuple(_copy(a, budget, depth + 1) for a in _while(parts.args, budget))!r}>"
    return f"<{global_name(value) or type(value).__name__}>"


def _while(items: Iterable[Any], budget: list[int]) -> Iterator[Any]:
    """``items`` until ``budget`` is spent: a million-item list is not walked once nothing more is copied."""
    for item in items:
        if budget[0] <= 0:
            yield _TOO_LARGE
            return
        yield item


def _copy_items(items: Iterable[tuple[Any, Any]], budget: list[int], depth: int) -> dict[str, Any]:
    """A dict's (or Namespace's) items copied, keys as text (bounded: a key may be any hashable value)."""
    out: dict[str, Any] = {}
    for key, value in items:
        if budget[0] <= 0:
            out["..."] = _TOO_LARGE
            break
        out[key if isinstance(key, str) else short_repr(key)] = _copy(value, budget, depth + 1)
    return out


def _optimizer_parts(optimizer: Any) -> tuple[torch.Tensor | None, list[dict[str, Any]], str | None]:
    """(the shared step, the param groups without their ``params``, the distributed optimizer's sharding type).

    Megatron's ChainedOptimizer (MoE: the dense and the expert optimizers) saves ``{0: ..., 1: ...}``, one entry
    per optimizer (their steps synchronized); its mixed-precision optimizer (Float16OptimizerWithFloat16Params:
    every --bf16 / --fp16 run without the distributed optimizer) and its distributed optimizer nest the torch
    optimizer's state dict one level down (the latter's param groups each carry their own step)."""
    chained = isinstance(optimizer, dict) and optimizer and all(isinstance(k, int) for k in optimizer)
    parts = list(optimizer.values()) if chained else [optimizer]
    step, groups, sharding = None, [], None
    budget = [MAX_NODES]  # one for every group of every part: a pickle may repeat one group a million times
    for part in parts:
        if not isinstance(part, dict):
            continue
        found_sharding = part.get("param_state_sharding_type")
        sharding = found_sharding if isinstance(found_sharding, str) else sharding
        inner = part["optimizer"] if isinstance(part.get("optimizer"), dict) else part
        state = inner.get("state")
        found = state.get("common_step") if isinstance(state, dict) else None
        if step is None and isinstance(found, TensorRef) and found.numel <= 1:
            step = found.materialize().clone()
        raw_groups = inner.get("param_groups")
        for group in raw_groups if isinstance(raw_groups, list) else []:
            if budget[0] <= 0:
                break
            if isinstance(group, dict):
                budget[0] -= 1
                groups.append(_copy_items(((k, v) for k, v in group.items() if k != "params"), budget, 0))
    return step, groups, sharding


def read_common(folder: Path, trusted: frozenset[str]) -> MegatronCommon:
    """Parse ``folder/common.pt``; a global outside the allowlist leaves it unread (logged), never run."""
    path = folder / "common.pt"
    require_regular_file(path)
    try:
        tree, file = load_pickle(path, trusted_globals=trusted | MEGATRON_GLOBALS)
    except UnsafePickleError as exc:
        logger.warning("%s: not reading common.pt: %s", folder, exc)
        return MegatronCommon(unread=f"it names {exc.name}, which is not on zeroio's allowlist")
    if not isinstance(tree, dict):
        file.close()
        return MegatronCommon(values={"common": _copy(tree, [MAX_NODES])})
    values = _copy_items(((k, v) for k, v in tree.items() if k != "optimizer"), [MAX_NODES], -1)
    step, groups, sharding = _optimizer_parts(tree.get("optimizer"))
    file.close()
    return MegatronCommon(values=values, step=step, param_groups=groups, optimizer_sharding=sharding)


def not_read(extra: Mapping[str, Any]) -> dict[str, Any]:
    """What a Megatron checkpoint's ``describe()`` adds under any names: ``not_read`` (the non-tensor state zeroio
    does not return, counted) and ``non_tensor_state`` (its keys), from the reader's ``metadata.extra``."""
    return {"not_read": extra.get("skipped"), "non_tensor_state": list(extra.get("non_tensor_state", []))}
