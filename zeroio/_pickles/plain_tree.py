"""One walk from a parsed object tree to plain Python objects; callers decide what tensors and stand-ins become."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._dtypes import DType
from ..errors import CheckpointFormatError
from .archive import TensorRef
from .limits import MAX_DEPTH
from .standins import Device, Inert, Size, ZeroStageEnum

if TYPE_CHECKING:
    import torch

__all__ = [
    "Index",
    "StandinRule",
    "TensorRule",
    "Walk",
    "Where",
    "keep_standin",
    "read_tensor",
    "to_plain",
    "where_text",
]


class Index(int):
    """A list or tuple position in a :data:`Where` path (a dict key is the key itself); shown as ``[i]``."""


Where = tuple[Any, ...]
"""Path from the tree's root to a value: dict keys, :class:`Index` positions and inert objects' attribute names."""

Walk = Callable[[Any, Where], Any]
"""Continues the walk below a value (what a :data:`StandinRule` calls for an object's state)."""

TensorRule = Callable[[TensorRef, Where], Any]
"""What a stored tensor becomes."""

StandinRule = Callable[[Any, Where, Walk], Any]
"""What a stand-in (an inert object or DeepSpeed's ``ZeroStageEnum``) becomes; raise to refuse it."""

RetypeRule = Callable[[dict[Any, Any], Where], None]


def read_tensor(ref: TensorRef, where: Where) -> torch.Tensor:
    """Tensors read whole, with their shape, to CPU."""
    return ref.materialize()


def torch_value(value: DType | Size | Device) -> Any:
    """The torch object a pickle named (a dtype, ``torch.Size``, ``torch.device``): torch is imported here, on
    the first such value a plain tree holds, never while parsing."""
    import torch

    if isinstance(value, DType):
        return value.torch
    if isinstance(value, Size):
        return torch.Size(value)
    return torch.device(*value.args)


def keep_standin(obj: Any, where: Where, walk: Walk) -> Any:
    """Stand-ins kept as they are (inert objects stay inert, ``ZeroStageEnum`` stays an int enum)."""
    return obj


def where_text(where: Where) -> str:
    """``"hyper_parameters.layers[0]"``: a path as a message shows it."""
    text = ""
    for part in where:
        text += f"[{part}]" if isinstance(part, Index) else (f".{part}" if text else str(part))
    return text


def to_plain(
    value: Any,
    where: Where = (),
    *,
    tensor: TensorRule = read_tensor,
    standin: StandinRule = keep_standin,
    retyped: RetypeRule | None = None,
) -> Any:
    """A copy of a parsed tree made of plain containers, with tensors and stand-ins replaced as the rules say.

    Containers are rebuilt: an ``OrderedDict`` stays one, every other dict (Lightning's ``AttributeDict``
    stand-in, ``defaultdict``) becomes a ``dict`` (``retyped`` is told), lists stay lists, tuples stay tuples
    (``torch.Size`` is kept as is), sets keep their type. ``where`` is the path of ``value`` in the whole tree,
    extended on the way down, so rules can say where a value they refuse sits.

    An object the tree references from several places is converted once, at its first path, and the copy shares
    it the same way (as ``torch.load`` would): a pickle can reference one list twice per level, 40 levels deep, in
    a kilobyte. A container that contains itself, or nesting deeper than :data:`~zeroio._pickles.limits.MAX_DEPTH`,
    raises :class:`~zeroio.errors.CheckpointFormatError`.

    Example:
        >>> to_plain({"lr": 0.1, "betas": (0.9, 0.999)})
        {'lr': 0.1, 'betas': (0.9, 0.999)}
    """

    done: dict[int, tuple[Any, Any]] = {}  # id -> (node, copy): the node kept alive so its id stays unique
    active: set[int] = set()  # the nodes being converted, outermost first: their count is the depth

    def walk(node: Any, path: Where) -> Any:
        if isinstance(node, (str, bytes, int, float, type(None))) and not isinstance(node, ZeroStageEnum):
            return node
        if isinstance(node, (DType, Size, Device)):
            return torch_value(node)
        key = id(node)
        if key in done:
            return done[key][1]
        if key in active or len(active) > MAX_DEPTH:
            what = "contains itself" if key in active else f"is nested more than {MAX_DEPTH} levels deep"
            raise CheckpointFormatError(
                f"'{where_text(path)}' {what}; torch.save never writes such a checkpoint. The file is corrupted or "
                "hostile."
            )
        active.add(key)
        copy = convert(node, path)
        active.discard(key)
        done[key] = (node, copy)
        return copy

    def convert(node: Any, path: Where) -> Any:
        if isinstance(node, TensorRef):
            return tensor(node, path)
        if isinstance(node, (Inert, ZeroStageEnum)):
            return standin(node, path, walk)
        if isinstance(node, dict):
            items = {k: walk(v, (*path, k)) for k, v in node.items()}
            if type(node) is OrderedDict:
                return OrderedDict(items)
            if type(node) is not dict and retyped is not None:
                retyped(node, path)
            return items
        if isinstance(node, list):
            return [walk(v, (*path, Index(i))) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            items_ = [walk(v, (*path, Index(i))) for i, v in enumerate(node)]
            return type(node)(*items_) if hasattr(node, "_fields") else tuple(items_)
        if isinstance(node, (set, frozenset)):
            return type(node)(walk(v, path) for v in node)
        return node

    return walk(value, where)
