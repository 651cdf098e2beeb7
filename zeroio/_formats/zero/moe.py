"""DeepSpeed MoE expert files (ZeRO-1/2): expert tensors by global name, and which rank order holds them."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from ..._dtypes import FLOAT32
from ..._pickles import TensorRef
from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError
from ..metadata import require_dict
from ..partition import Piece
from ..read_plans import FlatPlan, casts_to
from ..validate import tensor_ref

__all__ = [
    "Experts",
    "Placement",
    "PlannedParam",
    "expert_group_layouts",
    "insert_experts",
    "is_expert_param",
    "parse_experts",
    "plan_matches_experts",
]

# DeepSpeed 0.19.8 deepspeed.moe.layer.MoE parameter names: <prefix>.deepspeed_moe.experts.deepspeed_experts.<id>.<rest>
_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*?)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<id>\d+)\.(?P<rest>.+)$")
_EXPERT_FILE = re.compile(r"^(?:layer_(?P<layer>\d+)_)?expert_(?P<expert>\d+)_mp_rank_\d+_model_states\.pt$")


@dataclass(frozen=True, slots=True)
class Experts:
    """The expert files of a MoE checkpoint: every expert's tensors under its global name."""

    refs: dict[str, TensorRef]
    files: dict[str, Path]
    layer_of: dict[str, int]
    num_experts: tuple[int, ...]

    def held_by_first_rank(self, name: str, ep_size: int) -> bool:
        """True for a parameter of expert-parallel rank 0's experts (whose local ids are their global ids)."""
        m = _EXPERT_PARAM.match(name)
        if m is None or m["prefix"] not in self.layer_of:
            return False
        return int(m["id"]) < self.num_experts[self.layer_of[m["prefix"]]] // ep_size

    def global_name(self, local_name: str, ep_rank: int, ep_size: int) -> str | None:
        """Name of a rank's local expert parameter under its global expert id (as in the expert files)."""
        m = _EXPERT_PARAM.match(local_name)
        if m is None or m["prefix"] not in self.layer_of:
            return None
        num_local = self.num_experts[self.layer_of[m["prefix"]]] // ep_size
        return f"{m['prefix']}.deepspeed_moe.experts.deepspeed_experts.{ep_rank * num_local + int(m['id'])}.{m['rest']}"


def parse_experts(
    paths: Sequence[Path], parse: Callable[[Path], Any], model0: dict[str, Any], model0_path: Path
) -> Experts:
    """Every expert file's tensors under their global names, checking that no expert of a layer is missing."""
    refs: dict[str, TensorRef] = {}
    files: dict[str, Path] = {}
    layer_of: dict[str, int] = {}
    seen: dict[int, set[int]] = {}
    for path in paths:
        fm = _EXPERT_FILE.match(path.name)
        if fm is None:  # _layout matched it with a looser pattern
            raise UnsupportedCheckpointError(f"'{path}': unrecognised MoE expert file name.", path=path)
        layer, expert = int(fm["layer"] or 0), int(fm["expert"])
        seen.setdefault(layer, set()).add(expert)
        tree = require_dict(parse(path), path.name, path)
        for key, value in tree.items():
            name = str(key)
            pm = _EXPERT_PARAM.match(name)
            if pm is None or int(pm["id"]) != expert or layer_of.setdefault(pm["prefix"], layer) != layer:
                raise CheckpointFormatError(
                    f"'{path}' holds '{name}', which is not a parameter of expert {expert} of MoE layer {layer} "
                    "(expected '<module>.deepspeed_moe.experts.deepspeed_experts.<expert>.<param>').",
                    path=path,
                    name=name,
                )
            refs[name] = tensor_ref(value, f"expert tensor '{name}'", path)
            files[name] = path
    raw = model0.get("num_experts")  # one count per MoE layer (DeepSpeed 0.19.8 engine.num_experts)
    num_experts = tuple(n if isinstance(n, int) else -1 for n in raw) if isinstance(raw, (list, tuple)) else ()
    if any(layer >= len(num_experts) or num_experts[layer] < 1 for layer in seen):
        if max(seen) >= len(paths):  # a layer number from a file name past what the files can fill (10**12)
            gap = next(layer for layer in range(max(seen)) if layer not in seen)
            name = f"layer_{gap}_expert_0_mp_rank_00_model_states.pt"
            raise CheckpointNotFoundError(
                f"Missing MoE expert files of layer {gap} in '{model0_path.parent}' (files of layer {max(seen)} are "
                f"there): '{name}'. Copy the whole tag folder again.",
                path=model0_path.parent / name,
            )
        num_experts = tuple(max(seen.get(layer, {-1})) + 1 for layer in range(max(seen) + 1))
    for layer, experts in seen.items():
        missing = list(itertools.islice((e for e in range(num_experts[layer]) if e not in experts), 5))  # 10**12
        if missing:
            name = f"layer_{layer}_expert_{missing[0]}_mp_rank_00_model_states.pt"
            raise CheckpointNotFoundError(
                f"Missing MoE expert file(s) for layer {layer}, expert(s) {missing[:5]} in '{model0_path.parent}' "
                f"('{model0_path.name}' records {num_experts[layer]} experts): '{name}'. Copy the whole tag folder "
                "again.",
                path=model0_path.parent / name,
            )
    return Experts(refs, files, layer_of, num_experts)


def _expert_rank_sets(count: int, world_size: int, *, expert_major: bool) -> list[list[int]]:
    """Data-parallel ranks holding each expert-parallel rank's partitions of an expert param group.

    DeepSpeed 0.19.8 groups.py: by default expert-data-parallel group ``e`` is ranks ``e, e + ep, ...``;
    with ``use_data_before_expert_parallel_`` it is ``e * count, ..., e * count + count - 1``.
    """
    ep = world_size // count
    if expert_major:
        return [[e + k * ep for k in range(count)] for e in range(ep)]
    return [[e * count + k for k in range(count)] for e in range(ep)]


def insert_experts(names: list[str], experts: Experts) -> list[str]:
    """Place each MoE layer's expert tensors after that layer's gate, as model.state_dict() orders them."""
    by_prefix: dict[str, list[tuple[int, int, str]]] = {}
    for position, name in enumerate(experts.refs):
        m = _EXPERT_PARAM.match(name)
        if m is not None:  # always, checked in parse_experts
            by_prefix.setdefault(m["prefix"], []).append((int(m["id"]), position, name))
    rest = [n for n in names if not _EXPERT_PARAM.match(n)]
    for prefix, rows in by_prefix.items():
        block = [name for _, _, name in sorted(rows)]
        anchor = [i for i, n in enumerate(rest) if n.startswith(f"{prefix}.deepspeed_moe.")]
        at = anchor[-1] + 1 if anchor else len(rest)
        rest[at:at] = block
    return rest


Placement: TypeAlias = list[tuple[list[int], list[str]]]
"""Per copy of a param group: the data-parallel ranks holding its partitions, and its parameters' names."""

PlannedParam: TypeAlias = tuple[str, tuple[int, ...], list[Piece]]
"""One parameter of a ZeRO-1/2 param group: its name, shape and the pieces that rebuild it."""


def is_expert_param(name: str) -> bool:
    """True for a deepspeed.moe expert parameter name (``<prefix>.deepspeed_moe.experts.deepspeed_experts.<id>...``)."""
    return _EXPERT_PARAM.match(name) is not None


def expert_group_layouts(
    g: int,
    group: list[tuple[str, tuple[int, ...]]],
    count: int,
    world_size: int,
    experts: Experts | None,
    tag_dir: Path,
) -> list[Placement]:
    """Candidate placements of a MoE expert param group (one per rank order DeepSpeed may have used)."""
    if experts is None or count < 1 or world_size % count:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}': param group {g} is partitioned over {count} of {world_size} ranks, and the folder has "
            "no MoE expert files to name its parameters; zeroio cannot place it.",
            path=tag_dir,
            expected=world_size,
            found=count,
        )
    ep = world_size // count
    layouts = []
    for expert_major in [True] if count == 1 else [True, False]:
        placement: Placement = []
        for e, ranks in enumerate(_expert_rank_sets(count, world_size, expert_major=expert_major)):
            names = []
            for name, _ in group:
                global_name = experts.global_name(name, e, ep)
                if global_name is None:
                    raise UnsupportedCheckpointError(
                        f"'{tag_dir}': param group {g} is partitioned over {count} of {world_size} ranks (an expert "
                        f"group) but holds '{name}', which is not a deepspeed.moe expert parameter.",
                        path=tag_dir,
                        name=name,
                    )
                names.append(global_name)
            placement.append((ranks, names))
        layouts.append(placement)
    return layouts


def plan_matches_experts(
    planned: list[PlannedParam],
    flat_groups: list[tuple[TensorRef, ...]],
    experts: Experts | None,
) -> bool:
    """True when every planned expert master rounds to the tensor in its expert file (ZeRO-1/2 copy the
    fp32 partition into the training-dtype parameter after each step)."""
    if experts is None:
        return False
    groups = tuple(flat_groups)
    for name, _, pieces in planned:
        low = experts.refs.get(name)
        if low is None or not casts_to(FlatPlan(tuple(pieces), groups), low, low.numel, FLOAT32):
            return False
    return True
