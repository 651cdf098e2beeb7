"""Raw rank-file values checked into typed ones (shapes, tensor references, counts), failing with the file named."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _constants as C
from .._pickles import TensorRef, short_repr
from ..errors import CheckpointFormatError
from .metadata import require, require_dict

__all__ = [
    "ModelStates",
    "ParamShapes",
    "base_optimizer_state",
    "config_flag",
    "config_stage",
    "model_states",
    "numel_of",
    "param_shapes",
    "partition_count",
    "ref_list",
    "same_tensor_aliases",
    "shape_of",
    "tensor_ref",
]


def numel_of(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape``."""
    return math.prod(int(s) for s in shape)


def shape_of(value: Any, name: str, path: Path) -> tuple[int, ...]:
    """A recorded shape as a tuple of non-negative ints, or CheckpointFormatError naming the file."""
    try:
        shape = tuple(int(s) for s in value)
    except (TypeError, ValueError):
        raise CheckpointFormatError(
            f"'{path}': the shape recorded for '{name}' is {short_repr(value)}, not a sequence of ints. The file is "
            "corrupted.",
            path=path,
            name=name,
        ) from None
    if any(s < 0 for s in shape):
        raise CheckpointFormatError(f"'{path}': negative shape {shape} recorded for '{name}'.", path=path, name=name)
    return shape


def tensor_ref(value: Any, what: str, path: Path) -> TensorRef:
    """``value`` when it is a tensor reference, else CheckpointFormatError saying ``what`` should have been one."""
    if not isinstance(value, TensorRef):
        raise CheckpointFormatError(
            f"'{path}': {what} should be a tensor, found {type(value).__name__}. The file is corrupted or not a "
            "DeepSpeed checkpoint.",
            path=path,
        )
    return value


def ref_list(value: Any, key: str, path: Path) -> tuple[TensorRef, ...]:
    """A recorded list of tensors (``key`` names it in errors) as a tuple of references."""
    if not isinstance(value, (list, tuple)):
        raise CheckpointFormatError(
            f"'{path}': '{key}' should be a list of tensors, found {type(value).__name__}.", path=path
        )
    return tuple(tensor_ref(v, f"'{key}[{i}]'", path) for i, v in enumerate(value))


def partition_count(osd: dict[str, Any], path: Path) -> int:
    """The data-parallel world size an optimizer state was partitioned for."""
    count = require(osd, C.PARTITION_COUNT, path, "DeepSpeed ZeRO optimizer state")
    # ZeRO-1/2 record one count per param group (expert groups may differ); DeepSpeed uses the max.
    if isinstance(count, (list, tuple)):
        count = max(int(c) for c in count) if count else 0
    return int(count)


def config_stage(ds_config: Any, *, default: int) -> int:
    """``ds_config['zero_optimization']['stage']``, or ``default`` when the config does not say."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return int(stage) if isinstance(stage, int) else default


def config_flag(ds_config: Any, key: str) -> bool:
    """Whether ``ds_config['zero_optimization'][key]`` is ``True`` (False when the config does not say)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    return isinstance(zero, dict) and zero.get(key) is True


def base_optimizer_state(optim_tree: Any) -> Any:
    """The torch optimizer's own ``state_dict()`` inside a rank's optimizer file (Adam moments, ``step``), or None.

    ZeRO-3 nests it as ``optimizer_state_dict.optimizer_state_dict``; ZeRO-1/2 as ``.base_optimizer_state``.
    """
    osd = optim_tree.get(C.OPTIMIZER_STATE_DICT) if isinstance(optim_tree, dict) else None
    if not isinstance(osd, dict):
        return None
    return osd.get(C.OPTIMIZER_STATE_DICT, osd.get(C.BASE_OPTIMIZER_STATE))


# --------------------------------------------------------------------------- rank files as typed records


@dataclass(frozen=True, slots=True)
class ModelStates:
    """Rank 0's model states file, checked: its tree, the module's tensors and the buffer names."""

    path: Path
    tree: dict[Any, Any]
    module: dict[Any, Any]
    """``model.state_dict()`` as saved: every parameter and buffer, in key order."""
    buffer_names: list[str]

    @property
    def param_shapes(self) -> Any:
        """The raw ``param_shapes`` record (None at ZeRO stage 0)."""
        return self.tree.get(C.PARAM_SHAPES)


def model_states(tree: Any, path: Path) -> ModelStates:
    """Check rank 0's model states tree: a dict with ``module`` (a dict) and ``buffer_names``."""
    module = require_dict(require(tree, C.MODULE, path), C.MODULE, path)
    buffer_names = [str(b) for b in (require(tree, C.BUFFER_NAMES, path) or [])]
    return ModelStates(path, tree, module, buffer_names)


@dataclass(frozen=True, slots=True)
class ParamShapes:
    """What rank 0's model states record about parameters (ZeRO-1/2/3)."""

    groups: list[list[tuple[str, tuple[int, ...]]]]
    """``(name, shape)`` of the trainable parameters, per param group, in partition order."""
    shared: dict[str, str]
    """Tied aliases, ``{alias: source}`` (DeepSpeed's ``shared_params``)."""
    frozen: dict[str, tuple[int, ...]]
    """Shapes of the frozen parameters (empty when not recorded)."""

    @property
    def trainable(self) -> list[str]:
        """Names of the trainable parameters, in partition order."""
        return [name for group in self.groups for name, _ in group]


def param_shapes(states: ModelStates) -> ParamShapes:
    """Check and read ``param_shapes``, ``shared_params`` and ``frozen_param_shapes``."""
    path, tree = states.path, states.tree
    raw = states.param_shapes
    if not isinstance(raw, list):
        raise CheckpointFormatError(
            f"'{path}' has no parameter shapes ('{C.PARAM_SHAPES}' is {type(raw).__name__}); "
            "it was saved without ZeRO optimizer state. Save with engine.save_checkpoint() under ZeRO 1-3.",
            path=path,
        )
    groups: list[list[tuple[str, tuple[int, ...]]]] = []
    for g, group in enumerate(raw):
        group = require_dict(group, f"{C.PARAM_SHAPES}[{g}]", path)
        groups.append([(str(n), shape_of(s, str(n), path)) for n, s in group.items()])
    if C.SHARED_PARAMS in tree:
        shared = {str(k): str(v) for k, v in (tree.get(C.SHARED_PARAMS) or {}).items()}
    else:  # DeepSpeed before 0.9.2 records no ties; torch.save keeps a tied parameter one tensor in `module`
        shared = same_tensor_aliases(states.module, set(states.buffer_names))
    frozen = {str(n): shape_of(s, str(n), path) for n, s in (tree.get(C.FROZEN_PARAM_SHAPES) or {}).items()}
    return ParamShapes(groups, shared, frozen)


def same_tensor_aliases(module: dict[Any, Any], skip: set[str]) -> dict[str, str]:
    """``{alias: first name}`` for entries of ``module`` (buffers in ``skip`` aside) that are one tensor in the pickle.

    ``state_dict()`` lists a tied parameter under each name, and torch.save keeps it one storage view (same storage,
    offset, shape and stride; ZeRO-3's 0-element placeholders too: each untied parameter has its own storage).
    """
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for key, ref in module.items():
        name = str(key)
        if name in skip or not isinstance(ref, TensorRef):
            continue
        identity = (ref.storage.key, ref.storage_offset, ref.shape, ref.stride)
        if identity in first:
            aliases[name] = first[identity]
        else:
            first[identity] = name
    return aliases
