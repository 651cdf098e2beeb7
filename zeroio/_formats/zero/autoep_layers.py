"""AutoEP (DeepSpeed 0.19.8 ``expert_parallel``) layer records: which expert-parallel rank holds which experts.

Every ZeRO-3 AutoEP rank's model states carry ``ds_autoep_layers``: one entry per MoE layer with the layer's
``expert_key_prefix`` (its stacked expert parameters are ``<prefix>.w1/w2/w3``), ``num_experts``, ``ep_size``, the
rank's own ``ep_rank`` and expert-data-parallel rank, and an ``expert_placement`` descriptor listing, per EP rank,
the global expert ids it holds in local packed order. Here they are checked against each other and lowered to
contiguous runs: "local elements ``[a, a + n)`` of EP rank ``e``'s stack are logical elements ``[b, b + n)``".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._pickles import short_repr
from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError

__all__ = ["AUTOEP_LAYERS", "AutoEPLayer", "Run", "autoep_layers", "rank_layers"]

AUTOEP_LAYERS = "ds_autoep_layers"
_PARTITIONED = "zero3_partitioned"  # checkpoint_format of a ZeRO-3 partition-native AutoEP layer entry
MAX_EXPERTS = 1 << 16
"""Most experts an AutoEP layer may record (MoE models use up to a few hundred): every placement check builds a set
of them, and a recorded 10**12 asked for terabytes."""


@dataclass(frozen=True, slots=True)
class Run:
    """``length`` elements of an EP rank's local stack from ``local``, which are logical elements from ``logical``."""

    local: int
    logical: int
    length: int


@dataclass(frozen=True, slots=True)
class AutoEPLayer:
    """One AutoEP MoE layer as every rank records it (placement checked to cover every expert)."""

    prefix: str
    """``expert_key_prefix``: the layer's expert parameters are ``<prefix>.<w>``, stacked ``[E_local, ...]``."""
    module_path: str
    num_experts: int
    ep_size: int
    placement: tuple[tuple[int, ...], ...]
    """``placement[ep_rank]``: global expert ids held by that EP rank, in local packed order."""
    edp_size: int
    """Expert-data-parallel ranks sharing one EP rank's stack (ZeRO-3 partitions it over them)."""

    def runs(self, ep_rank: int, expert_numel: int) -> list[Run]:
        """Where EP rank ``ep_rank``'s experts go in the logical ``[E, ...]`` tensor.

        An expert held by several EP ranks is taken from the first (lowest) of them, so runs of all ranks cover
        the logical tensor exactly once.
        """
        first_holder: dict[int, int] = {}
        for e, experts in enumerate(self.placement):
            for expert in experts:
                first_holder.setdefault(expert, e)
        runs: list[Run] = []
        for i, expert in enumerate(self.placement[ep_rank]):
            if first_holder[expert] != ep_rank or expert_numel == 0:
                continue
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.local + last.length == i * expert_numel
                and (last.logical + last.length == expert * expert_numel)
            ):
                runs[-1] = Run(last.local, last.logical, last.length + expert_numel)
            else:
                runs.append(Run(i * expert_numel, expert * expert_numel, expert_numel))
        return runs


def _int(value: Any, what: str, path: Path, *, low: int = 0, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (no upper bound without ``high``), else CheckpointFormatError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        within = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise CheckpointFormatError(
            f"'{path}': {AUTOEP_LAYERS} {what} should be an integer {within}, found {short_repr(value)}. The file is "
            "corrupted.",
            path=path,
            name=what,
        )
    return value


def _placement(entry: dict[Any, Any], num_experts: int, ep_size: int, path: Path) -> tuple[tuple[int, ...], ...]:
    """The checked placement descriptor (or DeepSpeed's legacy uniform one when the entry has none)."""
    prefix = entry.get("expert_key_prefix")
    raw = entry.get("expert_placement")
    if raw is None:
        local = _int(entry.get("num_local_experts"), "num_local_experts", path, low=1, high=num_experts)
        if local * ep_size != num_experts:
            raise CheckpointFormatError(
                f"'{path}': AutoEP layer '{prefix}' has no expert_placement and num_local_experts {local} x ep_size "
                f"{ep_size} != num_experts {num_experts}. The file is corrupted.",
                path=path,
                name=prefix,
            )
        return tuple(tuple(range(e * local, (e + 1) * local)) for e in range(ep_size))
    ranks = raw.get("ranks") if isinstance(raw, dict) else None
    if not isinstance(ranks, list) or raw.get("num_experts") != num_experts or raw.get("ep_size") != ep_size:
        raise CheckpointFormatError(
            f"'{path}': AutoEP layer '{prefix}': expert_placement should be a dict with num_experts {num_experts}, "
            f"ep_size {ep_size} and a 'ranks' list. The file is corrupted.",
            path=path,
            name=prefix,
        )
    by_rank: dict[int, tuple[int, ...]] = {}
    for row in ranks:
        rank = _int(row.get("rank") if isinstance(row, dict) else None, "expert_placement rank", path)
        experts = row.get("experts")
        if rank >= ep_size or rank in by_rank or not isinstance(experts, list):
            raise CheckpointFormatError(
                f"'{path}': AutoEP layer '{prefix}': expert_placement lists EP rank {rank} twice, outside "
                f"[0, {ep_size}) or without an experts list. The file is corrupted.",
                path=path,
                name=prefix,
            )
        ids = tuple(_int(x, "expert id", path) for x in experts)
        if any(x >= num_experts for x in ids) or len(set(ids)) != len(ids):
            raise CheckpointFormatError(
                f"'{path}': AutoEP layer '{prefix}': EP rank {rank} lists expert ids {list(ids)}, with a repeat or "
                f"one outside [0, {num_experts}). The file is corrupted.",
                path=path,
                name=prefix,
            )
        by_rank[rank] = ids
    missing_ranks = sorted(set(range(ep_size)) - set(by_rank))
    missing = sorted(set(range(num_experts)) - {x for ids in by_rank.values() for x in ids})
    if missing_ranks or missing:
        raise CheckpointFormatError(
            f"'{path}': AutoEP layer '{prefix}': expert_placement leaves EP rank(s) {missing_ranks} undescribed and "
            f"expert(s) {missing[:8]} of {num_experts} on no rank, so the logical tensors cannot be rebuilt. "
            "The file is corrupted.",
            path=path,
            name=prefix,
        )
    return tuple(by_rank[e] for e in range(ep_size))


def _check_affine_maps(raw: Any, prefix: str, placement: tuple[tuple[int, ...], ...], path: Path) -> None:
    """Refuse ``affine_maps`` (DeepSpeed's persisted lowering of the placement) that place an expert elsewhere."""
    params = raw.get("params") if isinstance(raw, dict) else None
    for name, amap in (params or {}).items() if isinstance(params, dict) else ():
        try:
            logical = [int(x) for x in amap["logical_shape"]]
            expert_numel = 1
            for dim in logical[1:]:
                expert_numel *= dim
            for e, row in amap["ranks"].items():
                for piece in row["pieces"]:
                    run, source, dest = int(piece["shape"][0]), int(piece["source"][0]), int(piece["dest"][0])
                    if expert_numel == 0:
                        continue
                    first_local, first_expert = dest // expert_numel, source // expert_numel
                    agrees = [list(piece["shape"][1:]), dest % expert_numel, source % expert_numel] == [
                        logical[1:],
                        0,
                        0,
                    ] and all(placement[e][first_local + j] == first_expert + j for j in range(run))
                    if not agrees:
                        raise ValueError(f"EP rank {e} piece {piece}")
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointFormatError(
                f"'{path}': AutoEP layer '{prefix}': the affine map of '{name}' disagrees with the expert placement "
                f"({type(exc).__name__}: {str(exc)[:120]}). The file is corrupted.",
                path=path,
                name=str(name),
            ) from None


def rank_layers(tree: dict[Any, Any], path: Path, ranks: int | None = None) -> dict[str, tuple[AutoEPLayer, int, int]]:
    """One rank's ``ds_autoep_layers``: ``{prefix: (layer, ep_rank, expert-data-parallel rank)}``, checked; its
    EP and expert-data-parallel sizes at most ``ranks`` (the rank files there are)."""
    raw = tree.get(AUTOEP_LAYERS)
    if not isinstance(raw, list) or not raw:
        raise CheckpointFormatError(
            f"'{path}' records no {AUTOEP_LAYERS} list while rank 0's does; the folder mixes checkpoints.",
            path=path,
        )
    found: dict[str, tuple[AutoEPLayer, int, int]] = {}
    for entry in raw:
        if not isinstance(entry, dict) or not isinstance(entry.get("expert_key_prefix"), str):
            raise CheckpointFormatError(
                f"'{path}': an {AUTOEP_LAYERS} entry has no expert_key_prefix. The file is corrupted.", path=path
            )
        prefix = entry["expert_key_prefix"]
        if entry.get("checkpoint_format") != _PARTITIONED:
            raise UnsupportedCheckpointError(
                f"'{path}': AutoEP layer '{prefix}' is saved as {short_repr(entry.get('checkpoint_format'))}; zeroio reads "
                f"the ZeRO-3 {_PARTITIONED!r} format only. Use DeepSpeed's ds_to_universal.py for this one.",
                path=path,
                name=prefix,
            )
        num_experts = _int(entry.get("num_experts"), "num_experts", path, low=1, high=MAX_EXPERTS)
        ep_size = _int(entry.get("ep_size"), "ep_size", path, low=1, high=ranks)
        ep_rank = _int(entry.get("ep_rank"), "ep_rank", path)
        edp_rank = _int(entry.get("expert_data_parallel_rank"), "expert_data_parallel_rank", path)
        edp_size = _int(
            entry.get("expert_data_parallel_world_size"), "expert_data_parallel_world_size", path, low=1, high=ranks
        )
        placement = _placement(entry, num_experts, ep_size, path)
        if ep_rank >= ep_size or edp_rank >= edp_size or prefix in found:
            raise CheckpointFormatError(
                f"'{path}': AutoEP layer '{prefix}' is listed twice or records ep_rank {ep_rank} of {ep_size} / "
                f"expert-data-parallel rank {edp_rank} of {edp_size}. The file is corrupted.",
                path=path,
                name=prefix,
            )
        _check_affine_maps(entry.get("affine_maps"), prefix, placement, path)
        layer = AutoEPLayer(prefix, str(entry.get("module_path", prefix)), num_experts, ep_size, placement, edp_size)
        found[prefix] = (layer, ep_rank, edp_rank)
    return found


def autoep_layers(
    model_files: Sequence[Path], model_trees: Sequence[Any]
) -> tuple[dict[str, AutoEPLayer], list[dict[str, tuple[int, int]]]]:
    """Every rank's AutoEP records, checked to agree and to cover each (EP rank, expert-DP rank) once.

    Returns the layers by prefix and, per rank file, ``{prefix: (ep_rank, expert-data-parallel rank)}``.
    """
    layers: dict[str, AutoEPLayer] = {}
    positions: list[dict[str, tuple[int, int]]] = []
    seen: dict[str, dict[tuple[int, int], Path]] = {}
    for path, tree in zip(model_files, model_trees):
        rank = rank_layers(tree, path, len(model_files))
        if layers and set(rank) != set(layers):
            raise CheckpointFormatError(
                f"'{path}' records AutoEP layers {sorted(rank)}, '{model_files[0].name}' {sorted(layers)}; the "
                "folder mixes checkpoints.",
                path=path,
            )
        for prefix, (layer, ep_rank, edp_rank) in rank.items():
            if layers.setdefault(prefix, layer) != layer:
                raise CheckpointFormatError(
                    f"'{path}': AutoEP layer '{prefix}' records another placement than '{model_files[0].name}'; "
                    "the folder mixes checkpoints.",
                    path=path,
                    name=prefix,
                )
            other = seen.setdefault(prefix, {}).setdefault((ep_rank, edp_rank), path)
            if other != path:
                raise CheckpointFormatError(
                    f"'{path}' and '{other.name}' both claim EP rank {ep_rank}, expert-data-parallel rank "
                    f"{edp_rank} of AutoEP layer '{prefix}'; the folder mixes checkpoints.",
                    path=path,
                    name=prefix,
                )
        positions.append({prefix: (ep, edp) for prefix, (_, ep, edp) in rank.items()})
    for prefix, layer in layers.items():
        wanted = {(e, d) for e in range(layer.ep_size) for d in range(layer.edp_size)}
        missing = sorted(wanted - set(seen[prefix]))
        if missing or len(model_files) != layer.ep_size * layer.edp_size:
            raise CheckpointNotFoundError(
                f"'{model_files[0].parent}': AutoEP layer '{prefix}' needs ep_size {layer.ep_size} x expert-data-"
                f"parallel {layer.edp_size} rank files, found {len(model_files)} (missing (EP rank, expert-DP rank) "
                f"{missing[:4]}). Copy the whole tag folder again.",
                path=model_files[0].parent,
                name=prefix,
            )
    return layers, positions
