"""Checking one rank's optimizer state against its fp32 partitions before any of it is read.

DeepSpeed pickles each rank's base optimizer ``state_dict`` beside the fp32 flat groups it updates: one
parameter per flat group, in param-group order. These checks tie the two together and refuse, naming the file,
state that is missing, laid out otherwise (Muon's whole matrices where a reader does not take them by name) or
mixed between groups, so a consolidation never reads moments against the wrong partition.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..._pickles import TensorRef
from ...errors import CheckpointFormatError, PartitionMismatchError, UnsupportedCheckpointError
from ..zero.muon import WholeMatrices

__all__ = [
    "NO_STATE",
    "base_state_dict",
    "flat_group_ids",
    "group_keys_of",
    "moments_of_rank",
    "per_element_keys",
    "require_laid_out",
    "require_same_keys",
]


def group_keys_of(ranks: list[tuple[dict[Any, Any], list[tuple[Any, int]]]], count: int) -> tuple[tuple[str, ...], ...]:
    """Each flat group's per-element state keys, over every rank (a rank with an empty partition has none)."""
    keys: list[dict[str, None]] = [{} for _ in range(count)]
    for state, ids in ranks:
        for j, (pid, _) in enumerate(ids):
            keys[j].update(dict.fromkeys(per_element_keys(state.get(pid))))
    return tuple(tuple(k) for k in keys)


NO_STATE = (
    "{path} holds no optimizer moments ({why}): it was stripped, or saved before the optimizer's first step, "
    "so {what} cannot proceed. The weights can still be read (zeroio.open, zeroio.convert without "
    "include_optimizer)."
)


def base_state_dict(
    base: Any, path: Path, rank: int, no_state: str, *, elastic: bool = False
) -> tuple[dict[Any, Any], list[Any]]:
    """``state`` and ``param_groups`` of one rank's base optimizer state_dict, checked to be there and non-empty.

    ``elastic``: also take ZeRO-1/2's elastic form (``zero_optimization.elastic_checkpoint``), one lean state per param
    group (its flat group's moments without padding, as the fp32 partitions are saved) and no ``param_groups``: as
    ``state[g]`` of param group ``g`` with no hyper-parameters. Readers that write the hyper-parameters refuse it.
    """
    if base is None:
        raise CheckpointFormatError(
            no_state.format(path=f"'{path}'", why="its base optimizer state is missing"), path=path, rank=rank
        )
    if isinstance(base, list) and elastic and all(isinstance(entry, dict) for entry in base):
        return dict(enumerate(base)), [{"params": [g]} for g in range(len(base))]
    if isinstance(base, list):
        raise UnsupportedCheckpointError(
            f"'{path}' holds an elastic (per-group list) optimizer state, which keeps no param groups' "
            "hyper-parameters; zeroio reads its moments with optimizer_state() only. Save with "
            "zero_optimization.elastic_checkpoint=false.",
            path=path,
        )
    state, pgroups = base.get("state") if isinstance(base, dict) else None, None
    if isinstance(base, dict):
        pgroups = base.get("param_groups")
    if not isinstance(state, dict) or not isinstance(pgroups, list):
        raise CheckpointFormatError(
            f"'{path}': the base optimizer state should be a torch optimizer state_dict with 'state' and "
            f"'param_groups', found {type(base).__name__}. The file is corrupted.",
            path=path,
            rank=rank,
        )
    if not state:
        raise CheckpointFormatError(
            no_state.format(path=f"'{path}'", why="its base optimizer state is empty"), path=path, rank=rank
        )
    return state, pgroups


def flat_group_ids(pgroups: list[Any], groups: tuple[TensorRef, ...], path: Path, rank: int) -> list[tuple[Any, int]]:
    """``(state key, param group)`` of each flat group, in order: one base-optimizer parameter per flat group."""
    ids = [(pid, g) for g, group in enumerate(pgroups) for pid in (group.get("params") or [])]
    if len(ids) != len(groups):
        raise PartitionMismatchError(
            f"'{path}': the base optimizer's param groups list {len(ids)} parameters, the file holds "
            f"{len(groups)} fp32 flat groups. The file is corrupted or was written by another optimizer layout.",
            path=path,
            rank=rank,
            expected=len(groups),
            found=len(ids),
        )
    return ids


def per_element_keys(entry: Any) -> tuple[str, ...]:
    if not isinstance(entry, dict):
        return ()
    return tuple(k for k, v in entry.items() if isinstance(v, TensorRef) and len(v.shape) >= 1)


def require_laid_out(
    state: dict[Any, Any],
    ids: list[tuple[Any, int]],
    groups: tuple[TensorRef, ...],
    whole_keys: set[tuple[int, str]],
    whole: WholeMatrices | None,
    path: Path,
    rank: int,
    what: str,
) -> None:
    """Refuse state laid out neither like the fp32 partitions nor (Muon) over whole matrices: never misread it.

    DeepSpeed's Muon keeps each rank's ``momentum_buffer`` over the whole matrices its partition touches (bf16,
    not partition-sized); readers that do not take it by name (reshard, universal) refuse it here.
    """
    for j, ((pid, _), group) in enumerate(zip(ids, groups)):
        entry = state.get(pid)
        keys = per_element_keys(entry)
        if group.numel == 0 or not keys or not isinstance(entry, dict):
            continue
        for key in keys:
            ref = entry[key]
            if (j, key) in whole_keys and whole is not None:
                expected = whole.totals.get((rank, j), 0)
                if ref.numel == expected and len(ref.shape) == 1:
                    continue
                raise PartitionMismatchError(
                    f"'{path}': Muon's '{key}' of flat group {j} holds {ref.numel} elements (shape "
                    f"{list(ref.shape)}); the whole matrices its fp32 partition touches hold {expected}. The file "
                    "is corrupted or comes from another save.",
                    path=path,
                    rank=rank,
                    expected=expected,
                    found=ref.numel,
                )
            # The last rank's partition is read without its padding: its state may hold the padded size.
            if ref.numel not in (group.numel, group.storage.numel) or len(ref.shape) != 1:
                raise UnsupportedCheckpointError(
                    f"'{path}': optimizer state '{key}' of flat group {j} holds {ref.numel} elements (shape "
                    f"{list(ref.shape)}), its fp32 partition {group.numel}: it is not partitioned like the weights "
                    f"(DeepSpeed's Muon keeps whole matrices), so {what} cannot consolidate it without wrong values. "
                    "The weights can still be read (zeroio.open, zeroio.convert without include_optimizer); "
                    "optimizer_state() and convert(include_optimizer=True) read Muon's momentum.",
                    path=path,
                    rank=rank,
                    name=key,
                )


def require_same_keys(group_keys: tuple[tuple[str, ...], ...], path: Path, what: str) -> None:
    seen: dict[tuple[str, ...], int] = {}
    for j, keys in enumerate(group_keys):
        if keys:
            seen.setdefault(keys, j)
    if len(seen) > 1:
        (a, i), (b, k) = list(seen.items())[:2]
        raise UnsupportedCheckpointError(
            f"'{path}': flat group {i} holds optimizer state {list(a)} and flat group {k} {list(b)}: param groups "
            f"with different optimizers, which {what} does not consolidate yet. The weights can still be read "
            "(zeroio.open, zeroio.convert without include_optimizer); optimizer_state() and "
            "convert(include_optimizer=True) read each group's state by name.",
            path=path,
            name=b[0],
        )


def moments_of_rank(
    state: dict[Any, Any],
    ids: list[tuple[Any, int]],
    groups: tuple[TensorRef, ...],
    group_keys: tuple[tuple[str, ...], ...],
    keys: list[str],
    path: Path,
    rank: int,
    no_state: str,
) -> tuple[dict[str, tuple[TensorRef | None, ...]], list[dict[str, Any]]]:
    """One rank's state tensors per key and flat group (None for an empty group or a key the group lacks), and
    its other state values."""
    moments: dict[str, list[TensorRef | None]] = {key: [] for key in keys}
    scalars: list[dict[str, Any]] = []
    for j, ((pid, _), group) in enumerate(zip(ids, groups)):
        entry = state.get(pid)
        if group.numel == 0 and not entry:
            for refs in moments.values():
                refs.append(None)
            scalars.append({})
            continue
        if not isinstance(entry, dict) or not entry:
            raise CheckpointFormatError(
                no_state.format(path=f"'{path}'", why=f"no state for flat group {j}"), path=path, rank=rank
            )
        for key, refs in moments.items():
            ref = entry.get(key)
            if key not in group_keys[j]:
                refs.append(None)
                continue
            if not isinstance(ref, TensorRef) or len(ref.shape) != 1 or ref.numel < min(group.numel, 1):
                found = (
                    "nothing"
                    if ref is None
                    else (f"shape {list(ref.shape)}" if isinstance(ref, TensorRef) else type(ref).__name__)
                )
                raise PartitionMismatchError(
                    f"'{path}': optimizer state '{key}' of flat group {j} should be a 1-D tensor of at least "
                    f"{group.numel} elements (the fp32 partition), found {found}. The file is corrupted.",
                    path=path,
                    rank=rank,
                    expected=group.numel,
                    found=None if not isinstance(ref, TensorRef) else ref.numel,
                )
            refs.append(ref)
        scalars.append({k: v for k, v in entry.items() if k not in moments})
    return {key: tuple(refs) for key, refs in moments.items()}, scalars
