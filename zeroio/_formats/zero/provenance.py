"""Check that a tag folder's rank files come from one save, each under its own rank's name (metadata only).

A folder assembled by hand (a rank copied from another step, one rank's file copied over another's, two files
swapped) otherwise consolidates into a model no run ever had. What the files say about themselves:

- the zip archive's root folder: ``torch.save(obj, path)`` names it after the file it wrote, so a rank file
  renamed or copied under another rank's name still records its original name;
- ZeRO-3 model states: ``global_steps``, ``global_samples``, ``skipped_steps``, ``ds_version``, identical on every
  rank of one save; ``shared_params`` filled on rank 0 only;
- optimizer files: the base optimizer's ``step`` counters, identical on every rank of one save (compared through
  the zip records' CRC-32, so no tensor bytes are read); the fp32 partitions, which no two ranks share whole;
- ZeRO-1/2 ``param_slice_mappings``: which slice of each param group a rank holds (see :func:`check_slice_mappings`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._pickles import TensorRef, read_archive, short_repr
from ...errors import CheckpointFormatError

__all__ = [
    "MIXED_SAVES",
    "ArchiveRecords",
    "archive_records",
    "check_archive_names",
    "check_distinct_partitions",
    "check_model_states_agree",
    "check_optimizer_steps",
    "check_slice_mappings",
]

MIXED_SAVES = "the folder mixes files from different saves; copy the whole tag folder again."
"""The end of every message of this module: what happened and the fix."""

_RANK_FILE_PATTERNS = (C.ZERO_OPTIM_FILE, C.ZERO3_MODEL_FILE, C.MODEL_FILE, C.MOE_EXPERT_FILE)
_PROVENANCE_KEYS = ("global_steps", "global_samples", "skipped_steps", C.DS_VERSION)
"""ZeRO-3 model-states entries every rank of one save writes with the same value."""


def _mixed(path: Path, rank: int | None, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"'{path}' {what}: {MIXED_SAVES}", path=path, rank=rank)


@dataclass(frozen=True, slots=True)
class ArchiveRecords:
    """A torch zip archive's central directory: its root folder and each storage record's ``(CRC-32, size)``."""

    root: str | None
    """The archive's root folder (``torch.save`` names it after the file's stem); None when there is no data.pkl."""
    storages: dict[str, tuple[int, int]]
    """``{storage key: (CRC-32, bytes)}`` of the ``<root>/data/<key>`` records."""


def archive_records(path: Path) -> ArchiveRecords:
    """Read ``path``'s zip central directory (no record data), with the rules and limits of every zeroio reading
    of a torch zip (a rank file never parsed, such as a MiCS replica's model states, is read here alone: zipfile on
    its own took a hostile 35 MiB directory into 540,000 objects).

    A legacy (non-zip) stream has neither a recorded name nor CRCs: nothing to compare, so its records are empty.
    """
    archive = read_archive(path, with_pickle=False)
    if archive is None:
        return ArchiveRecords(None, {})
    storages = dict.fromkeys(archive.empty_keys, (0, 0))
    storages.update((key, (int(info.CRC), int(info.file_size))) for key, info in archive.records.items())
    return ArchiveRecords(archive.root, storages)


def check_archive_names(files: Sequence[tuple[int | None, Path]], records: dict[Path, ArchiveRecords]) -> None:
    """Each ``(rank, file)`` whose archive names a DeepSpeed rank file must be that very file.

    Archives written through a file object (some checkpoint engines) are named ``archive``: nothing to compare.
    """
    for rank, path in files:
        root = records[path].root
        saved_as = f"{root}.pt" if root else None
        if saved_as and saved_as != path.name and any(p.match(saved_as) for p in _RANK_FILE_PATTERNS):
            raise _mixed(path, rank, f"was saved as '{saved_as}' (the name recorded inside the file)")


def _odd_one(values: Sequence[Hashable]) -> int | None:
    """The index of the first value that differs from the most common one (rank 0's on a tie), or None."""
    counts = Counter(values)
    top = max(counts.values())
    reference = values[0] if counts[values[0]] == top else next(v for v in values if counts[v] == top)
    return next((i for i, v in enumerate(values) if v != reference), None)


def _counter(value: Any) -> Hashable:
    """What a provenance value is compared by: a plain value itself (typed), anything else by its bounded repr
    (``repr`` of a pickled list holding the level below twice, 40 levels deep, never ends)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    return ("other", short_repr(value))


def _shown(counter: Hashable) -> str:
    if not isinstance(counter, tuple):
        return "None"  # not a dict: no model states tree
    kind, value = counter
    return str(value) if kind == "other" else short_repr(value)


def check_model_states_agree(model_files: Sequence[Path], trees: Sequence[Any]) -> None:
    """ZeRO-3: every rank's model states record one save's counters; only rank 0's records ``shared_params``."""
    for key in _PROVENANCE_KEYS:
        values = [_counter(tree.get(key)) if isinstance(tree, dict) else None for tree in trees]
        odd = _odd_one(values)
        if odd is not None:
            reference = next(v for i, v in enumerate(values) if i != odd)
            raise _mixed(
                model_files[odd],
                odd,
                f"records {key} {_shown(values[odd])}, the other ranks' model states {_shown(reference)}",
            )
    for rank in range(1, len(trees)):
        tree = trees[rank]
        if isinstance(tree, dict) and tree.get(C.SHARED_PARAMS):
            raise _mixed(
                model_files[rank],
                rank,
                "records shared_params, which DeepSpeed writes in rank 0's model states only: it is rank 0's file",
            )


def _step_identity(value: Any, records: ArchiveRecords) -> Hashable:
    """What identifies a ``step`` counter's value: the int, or a 1-element tensor's dtype and record CRC-32."""
    if isinstance(value, TensorRef):
        record = records.storages.get(value.storage.key)
        if value.numel == 1 and value.storage.numel == 1 and record is not None:
            return (str(value.dtype_spec), record)
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def _steps(base_state: Any, records: ArchiveRecords) -> dict[Any, Hashable]:
    state = base_state.get("state") if isinstance(base_state, dict) else None
    if not isinstance(state, dict):
        return {}
    found = {}
    for index, entry in state.items():
        step = _step_identity(entry.get("step"), records) if isinstance(entry, dict) else None
        if step is not None:
            found[index] = step
    return found


def check_optimizer_steps(
    optim_files: Sequence[Path], base_states: Sequence[Any], records: dict[Path, ArchiveRecords]
) -> None:
    """Every rank's optimizer stepped together: its ``step`` counters are the same on every rank of one save."""
    steps = [_steps(state, records[path]) for path, state in zip(optim_files, base_states)]
    shared = set.intersection(*(set(s) for s in steps)) if steps else set()
    for index in sorted(shared, key=repr):
        odd = _odd_one([s[index] for s in steps])
        if odd is not None:
            raise _mixed(
                optim_files[odd],
                odd,
                f"holds a different optimizer step counter (param group {index}) from the other ranks' files",
            )


def check_distinct_partitions(optim_files: Sequence[Path], records: dict[Path, ArchiveRecords]) -> None:
    """No two ranks hold byte-identical optimizer state: each rank holds its own slice of every parameter."""
    seen: dict[tuple[tuple[int, int], ...], int] = {}
    for rank, path in enumerate(optim_files):
        storages = records[path].storages
        if not storages:
            continue
        content = tuple(storages[k] for k in sorted(storages))
        if content in seen:
            raise _mixed(
                path, rank, f"holds the same optimizer partitions as rank {seen[content]}'s: it is a copy of it"
            )
        seen[content] = rank


def check_slice_mappings(
    path: Path,
    rank: int,
    group: int,
    names: Sequence[str],
    offsets: Sequence[int],
    numels: Sequence[int],
    partition_size: int,
    mapping: Any,
) -> None:
    """ZeRO-1/2: a rank's ``param_slice_mappings[group]`` must be the slice ``[rank·P, (rank+1)·P)`` of the group.

    DeepSpeed records, for each parameter overlapping rank r's partition of a group (partition size P, equal on
    every rank before the last rank's padding is stripped), the fragment ``(start in the partition, numel)``.
    """
    if not isinstance(mapping, dict):
        return
    recorded = {}
    for name, address in mapping.items():
        start, numel = getattr(address, "start", None), getattr(address, "numel", None)
        if not isinstance(start, int) or not isinstance(numel, int):
            return  # not DeepSpeed's fragment_address: nothing known to compare
        recorded[str(name)] = (start, numel)
    lo, hi = rank * partition_size, (rank + 1) * partition_size
    expected = {}
    for name, offset, numel in zip(names, offsets, numels):
        first, last = max(offset, lo), min(offset + numel, hi)
        if first < last:
            expected[name] = (first - lo, last - first)
    if recorded != expected:
        raise _mixed(
            path,
            rank,
            f"records param_slice_mappings[{group}] of another rank's slice (not elements [{lo}, {hi}) of param "
            f"group {group})",
        )
