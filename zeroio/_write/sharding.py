"""Shard planning exactly as huggingface_hub splits a state dict: sizes in key order, HF names, HF index."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ShardPlan", "assign_shards", "index_json", "parse_size", "plan_shards"]

# huggingface_hub.serialization._base.SIZE_UNITS: decimal units, as on the Hub and in transformers.
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(value: int | str) -> int:
    """A shard size in bytes: ``"5GB"`` -> 5_000_000_000, ``"1.5GB"``, ``"500MB"``, ``"64KB"`` or an int.

    Units are decimal (1 GB = 10**9 bytes), like ``huggingface_hub.serialization.parse_size_to_int``;
    a string of digits alone is a byte count.

    Raises:
        ValueError: not a positive size with a TB/GB/MB/KB unit. TypeError: neither an int nor a string.

    Example:
        >>> parse_size("1.5GB")
        1500000000
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"max_shard_size must be an int or a string like '5GB', got {value!r}.")
    if isinstance(value, int):
        size = value
    else:
        text = value.strip()
        if text.isdigit():
            size = int(text)
        else:
            unit = text[-2:].upper()
            if unit not in SIZE_UNITS:
                raise ValueError(
                    f"Cannot parse max_shard_size {value!r}: use a number with a unit TB, GB, MB or KB "
                    "(decimal, e.g. '5GB', '500MB') or a byte count."
                )
            try:
                number = float(text[:-2].strip())
            except ValueError:
                raise ValueError(
                    f"Cannot parse max_shard_size {value!r}: {text[:-2].strip()!r} is not a number. Use e.g. '5GB'."
                ) from None
            if not math.isfinite(number):
                raise ValueError(f"max_shard_size must be finite, got {value!r}.")
            size = int(number * SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {value!r}.")
    return size


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which tensor goes to which file, decided from sizes alone (no tensor is read)."""

    shards: tuple[tuple[str, tuple[str, ...]], ...]
    """``(file name, tensor names)`` per shard, in order; names in key order, tied aliases after their shard's keys."""
    weight_map: dict[str, str]
    """``{tensor name: file name}``, in the order huggingface_hub writes it."""
    total_size: int
    """Bytes of all distinct tensors (a tied group counted once): the index's ``metadata.total_size``."""

    @property
    def is_sharded(self) -> bool:
        """True when more than one file is written (and so an index)."""
        return len(self.shards) > 1


def plan_shards(
    sizes: Mapping[str, int],
    *,
    max_shard_size: int,
    filename_pattern: str,
    aliases: Mapping[str, str] | None = None,
) -> ShardPlan:
    """Split tensors into shards the way ``huggingface_hub.split_torch_state_dict_into_shards`` does.

    Tensors are taken in key order; a shard is closed when the next tensor would push it over
    ``max_shard_size``; a tensor larger than the limit gets a shard of its own. Tied aliases
    (``aliases = {alias: source}``; both names in ``sizes``) take no space and are placed in the shard of
    whichever name of their group comes first, as huggingface_hub does for tensors sharing storage.

    Args:
        sizes: ``{name: bytes}`` in key order.
        max_shard_size: limit per shard, in bytes (see :func:`parse_size`).
        filename_pattern: e.g. ``"model{suffix}.safetensors"``; ``{suffix}`` becomes ``""`` for one shard,
            ``"-00001-of-00003"`` otherwise.
        aliases: tied names, ``{alias: source}``.

    Example:
        >>> plan = plan_shards({"a": 6, "b": 6, "c": 2}, max_shard_size=10, filename_pattern="model{suffix}.safetensors")
        >>> plan.shards
        (('model-00001-of-00002.safetensors', ('a',)), ('model-00002-of-00002.safetensors', ('b', 'c')))
    """
    aliases = dict(aliases or {})
    group_of = {name: aliases.get(name, name) for name in sizes}
    first_of_group: dict[str, str] = {}
    followers: dict[str, list[str]] = {}
    shard_list: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    total = 0
    for name, size in sizes.items():
        group = group_of[name]
        if group in first_of_group:
            followers[first_of_group[group]].append(name)
            continue
        first_of_group[group] = name
        followers[name] = []
        if size > max_shard_size:
            total += size
            shard_list.append([name])
            continue
        if current_size + size > max_shard_size:
            shard_list.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
        total += size
    if current or not shard_list:
        shard_list.append(current)
    # Tied names join the shard of their group's first name, appended in key order (huggingface_hub does this).
    for shard in shard_list:
        for name in list(shard):
            shard.extend(followers.get(name, ()))
    count = len(shard_list)
    shards = []
    for i, names in enumerate(shard_list):
        suffix = "" if count == 1 else f"-{i + 1:05d}-of-{count:05d}"
        shards.append((filename_pattern.format(suffix=suffix), tuple(names)))
    weight_map = {name: filename for filename, names in shards for name in names}
    return ShardPlan(tuple(shards), weight_map, total)


def index_json(plan: ShardPlan, *, extra_metadata: Mapping[str, str] | None = None) -> str:
    """The index file's text, byte for byte as ``huggingface_hub.save_torch_state_dict`` writes it.

    ``{"metadata": {"total_size": N, **extra_metadata}, "weight_map": {...}}``, ``json.dump(indent=2)``, no
    trailing newline. huggingface_hub records each dropped tied alias here as ``alias: source``.
    """
    metadata: dict[str, Any] = {"total_size": plan.total_size}
    metadata.update(extra_metadata or {})
    return json.dumps({"metadata": metadata, "weight_map": plan.weight_map}, indent=2)


def assign_shards(sizes: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The process (rank) that writes each shard, balancing bytes: largest shard first, to the least-loaded rank.

    Deterministic (ties go to the lower shard index, then the lower rank), so every process computes the same
    assignment from the same plan without exchanging it.

    Args:
        sizes: bytes of each shard, in shard order.
        world_size: number of processes.

    Returns:
        The owner rank of each shard, in shard order.

    Example:
        >>> assign_shards([5, 5, 3, 2], 2)
        (0, 1, 0, 1)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for shard in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[shard] = rank
        loads[rank] += sizes[shard]
    return tuple(owners)
