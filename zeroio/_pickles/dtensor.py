"""DTensor pickles (an FSDP2 state dict saved with ``torch.save``) rebuilt as inert records, never as DTensors.

torch 2.13 pickles a DTensor as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype,
size, stride, storage_offset, layout, device, requires_grad), {"_local_tensor": tensor, "_spec": DTensorSpec})``;
the spec holds a ``DeviceMesh`` (with ``_MeshLayout``/``_FlatLayout``), ``Shard``/``Replicate`` placements, a
``TensorMeta`` named tuple and ``ShardOrderEntry`` records. Here the wrapper becomes an :class:`~.standins.Inert`
record of class ``DTENSOR`` (its arguments checked, then its state set as torch sets it), and the spec's classes
are inert stand-ins: no DTensor, mesh or placement code runs, torch.distributed is never imported.
"""

from __future__ import annotations

from typing import Any

from .._dtypes import DType
from ..errors import CheckpointFormatError
from .limits import MAX_DIMS, short_repr
from .standins import Inert, inert_class

__all__ = ["DTENSOR", "DTENSOR_CLASSES", "STRIDED", "get_layout", "rebuild_wrapper_subclass"]

DTENSOR = "torch.distributed.tensor.DTensor"
"""The global name a rebuilt DTensor record carries (:func:`~.standins.global_name`), whatever torch called it."""

DTENSOR_TYPES = (DTENSOR, "torch.distributed.tensor._api.DTensor", "torch.distributed._tensor.api.DTensor")
"""The names DTensor's class is pickled under (torch 2.5+ public, its defining module, torch 2.2-2.4)."""

_SPEC_HOMES = ("torch.distributed.tensor._dtensor_spec", "torch.distributed._tensor.placement_types")
_PLACEMENT_HOMES = ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types")

DTENSOR_CLASSES = (
    *(f"{home}.{name}" for home in _SPEC_HOMES for name in ("DTensorSpec", "TensorMeta", "ShardOrderEntry")),
    *(f"{home}.{name}" for home in _PLACEMENT_HOMES for name in ("Shard", "Replicate", "Partial", "_StridedShard")),
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
)
"""Classes a DTensor's spec names, each rebuilt as an inert record (checked with torch 2.13 pickles)."""

STRIDED = "torch.strided"


def get_layout(name: Any) -> str:
    """``torch.serialization._get_layout('torch.strided')``: the layout's name (wrapper subclasses are strided)."""
    if name != STRIDED:
        raise CheckpointFormatError(
            f"a tensor is pickled with layout {short_repr(name)}; zeroio reads strided tensors only (torch.save "
            "writes 'torch.strided' for a DTensor)."
        )
    return STRIDED


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
        raise CheckpointFormatError(
            f"a DTensor's {what} is {short_repr(value)}, not a shape of at most {MAX_DIMS} dims."
        )
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise CheckpointFormatError(f"a DTensor's {what} {short_repr(value)} holds a value that is not a size.")
    return tuple(value)


def rebuild_wrapper_subclass(
    cls: Any, dtype: Any, size: Any, stride: Any, storage_offset: Any, layout: Any, device: Any, requires_grad: Any
) -> Inert:
    """``torch._utils._rebuild_wrapper_subclass``: an inert DTensor record with its arguments checked.

    torch then sets the state (``_local_tensor``, ``_spec``) on what this returns, as
    ``_rebuild_from_type_v2`` does (see :mod:`.allowed`)."""
    if getattr(cls, "name", None) not in DTENSOR_TYPES:
        raise CheckpointFormatError(
            f"_rebuild_wrapper_subclass is asked for {getattr(cls, 'name', type(cls).__name__)!r}; zeroio rebuilds "
            "DTensor records only."
        )
    if not isinstance(dtype, DType) or layout != STRIDED:
        raise CheckpointFormatError(f"a DTensor is pickled with dtype {str(dtype)[:40]!r} and layout {layout!r}.")
    return inert_class(DTENSOR)(dtype, _dims(size, "size"), _dims(stride, "stride"), storage_offset)
