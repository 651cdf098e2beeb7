"""Which Megatron-Core optimizer layouts zeroio reads, and the one reason it gives for any other.

zeroio reads optimizer state saved one tensor per parameter, ``optimizer.state.<moment>.<key>`` shaped like the
parameter: Megatron's own optimizers without the distributed one, and the distributed optimizer saved
``fully_reshardable``. Everything else under ``optimizer.`` is refused by name, the weights staying readable:
the distributed optimizer's flat buckets (``dp_reshardable``, Megatron-LM's default, and the older bucket
layouts), whose parameter ranges the checkpoint does not record (docs/formats.md, "Why `dp_reshardable` optimizer
state is not read"); a ``param_state_sharding_type`` zeroio has not checked; moments not shaped like their parameter
(``fully_sharded_model_space``'s flattened ranges); tensors under ``optimizer.`` of any other family.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "BUCKETS",
    "OPTIMIZER",
    "OPTIMIZER_STATE",
    "READ_SHARDING",
    "not_per_parameter",
    "optimizer_refusal",
    "shape_mismatches",
    "unchained",
]

OPTIMIZER = "optimizer."
OPTIMIZER_STATE = "optimizer.state."
BUCKETS = "optimizer.distributed."
"""Distributed-optimizer state kept in its gradient buffers' layout: flat bucket tensors (``dp_reshardable``) or
ShardedObjects (``dp_zero_gather_scatter``'s ``param_state``, ``per_bucket_numel``)."""
READ_SHARDING = frozenset({"fully_reshardable"})
"""``param_state_sharding_type`` values whose ``optimizer.state.*`` tensors are per-parameter and shaped like it
(checked on megatron-core 0.16.1's own checkpoints); no value (no distributed optimizer) is read too."""
_BUCKET_SHARDING = frozenset({"dp_reshardable", "fully_sharded_bucket_space", "dp_zero_gather_scatter"})
_CHAINED = re.compile(r"^chained_\d+\.(?=optimizer\.)")
"""ChainedOptimizer's prefix (MoE's dense and expert optimizers; Megatron adds it unless the metadata says
``chained_optim_avoid_prefix`` and the format is fully reshardable): ``chained_1.optimizer.state.exp_avg.<key>``."""
_BUCKET_KEY = re.compile(r"\.gbuf_idx_\d+\.dtype_.*\.bucket_idx_\d+\.[^.]+$")

_FIX = (
    "Load it in Megatron-LM with the parallel layout it was saved with and save it again with "
    "--dist-ckpt-optim-fully-reshardable (one optimizer.state.<moment>.<key> tensor per parameter), or convert "
    "the weights alone (drop include_optimizer)."
)


def unchained(fqn: str) -> str:
    """``fqn`` without ChainedOptimizer's ``chained_<i>.`` prefix."""
    return _CHAINED.sub("", fqn, count=1)


def not_per_parameter(fqn: str) -> bool:
    """A key under ``[chained_<i>.]optimizer.`` that is not ``optimizer.state.<moment>.<key>``: optimizer state,
    never a weight, and not read."""
    key = unchained(fqn)
    return key.startswith(OPTIMIZER) and not key.startswith(OPTIMIZER_STATE)


def shape_mismatches(
    moments: Mapping[str, Mapping[str, tuple[int, ...]]], params: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    """``(moment, parameter, moment shape, parameter shape)`` for each state tensor of at least one dimension not
    shaped like its parameter (a 0-d state, a per-parameter step, is shape-free)."""
    return [
        (moment, name, shape, params[name])
        for name, states in moments.items()
        for moment, shape in states.items()
        if shape and shape != params[name]
    ]


def optimizer_refusal(
    folder: Path,
    *,
    sharding: str | None,
    other: Sequence[str],
    mismatched: Sequence[tuple[str, str, tuple[int, ...], tuple[int, ...]]],
) -> str | None:
    """Why ``folder``'s optimizer state is not read (None: it is). ``sharding`` is common.pt's
    ``param_state_sharding_type``, ``other`` the keys (tensors and ShardedObjects) under ``[chained_<i>.]optimizer.``
    that are not per-parameter state, ``mismatched`` what :func:`shape_mismatches` found."""
    buckets = [k for k in other if unchained(k).startswith(BUCKETS)]
    if buckets or sharding in _BUCKET_SHARDING:
        return _bucket_refusal(folder, buckets, sharding)
    if sharding is not None and sharding not in READ_SHARDING:
        return (
            f"'{folder / 'common.pt'}' says the distributed optimizer was saved as {sharding!r} "
            f"(param_state_sharding_type), a layout zeroio has not checked (it reads "
            f"{', '.join(sorted(READ_SHARDING))}), so its optimizer state is not read. {_FIX}"
        )
    if mismatched:
        moment, name, shape, param = mismatched[0]
        return (
            f"'{folder}': Megatron optimizer state {moment!r} of {name!r} has shape {list(shape)}, its parameter "
            f"{list(param)} (a layout of flattened ranges, as fully_sharded_model_space saves, which zeroio does not "
            f"read), so no optimizer state is read. {_FIX}"
        )
    if other:
        more = f", ... and {len(other) - 1} more" if len(other) > 1 else ""
        return (
            f"'{folder}' holds optimizer tensors zeroio does not know ({other[0]}{more}: neither "
            f"optimizer.state.<moment>.<key> nor the distributed optimizer's buckets), so its optimizer state is not "
            f"read. {_FIX}"
        )
    return None


def _bucket_refusal(folder: Path, buckets: Sequence[str], sharding: str | None) -> str:
    """The distributed optimizer's bucket layouts: what they record, and the one fact zeroio would need."""
    tensors = [k for k in buckets if _BUCKET_KEY.search(k)]
    if tensors:
        count = len({k.rpartition(".")[0] for k in tensors})
        held = f"{count} flat bucket{'s' if count > 1 else ''} ({tensors[0]}{', ...' if len(tensors) > 1 else ''})"
    else:
        held = buckets[0] if buckets else "gradient-buffer buckets"
    return (
        f"'{folder}' holds Megatron's distributed-optimizer state in its {sharding or 'bucket'} layout: {held}. "
        "The checkpoint does not record which parameter each range of a bucket holds, only each bucket's element "
        "counts (per_bucket_numel): Megatron lays buckets out from the live model (its trainable parameters in "
        "reverse named_parameters() order, per dtype and dense/expert group), an order not saved (.metadata lists "
        f"tensors in the writing ranks' order under --ckpt-fully-parallel-save). {_FIX}"
    )
