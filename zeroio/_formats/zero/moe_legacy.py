"""MoE checkpoints of DeepSpeed <= 0.18 at ZeRO-1/2: the records rank 0's model states lack, rebuilt and checked.

Up to 0.18.9, ``engine._save_moe_checkpoint`` saves ``mp_rank_00_model_states.pt`` with ``module`` (without
the experts), the counters and ``num_experts`` only: no ``param_shapes``, ``buffer_names``, ``shared_params`` or
``ds_config``; and each expert-parallel rank writes ``expp_rank_<e>_mp_rank_00_optim_states.pt`` holding
``{"optimizer": None}`` under ZeRO (0.19 writes neither gap). What the reader needs is rebuilt from the rank files:

- ``param_shapes``: each rank's optimizer file records ``param_slice_mappings`` (per param group, the parameters
  overlapping its partition, in flat order); their union in rank order is each group's flat order, the shapes come
  from ``module`` (non-expert parameters) and the expert files (rank 0's local expert ids are global ids);
- ``shared_params``: tied entries of ``module`` are one tensor in the pickle (same storage, offset, shape, stride),
  or, where 0.17+ cloned each entry before saving, an entry no optimizer group holds whose storage record has the
  CRC-32, size, dtype and shape of a trainable parameter's and whose bytes are equal (read whole to confirm);
- ``buffer_names``: unknown. Entries of ``module`` that no optimizer group holds come back as stored, kind
  ``tensor`` (frozen parameter or buffer: the file does not say).

The mappings list parameters in their original order, which is not the flat order under
``round_robin_gradients``, and nothing records that setting here: so every rebuilt master is checked against the
16-bit value DeepSpeed copied from it after the last step (``module`` or the expert file), at both ends, and a
mismatch refuses the checkpoint instead of returning another parameter's values.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._dtypes import FLOAT32
from ..._pickles import TensorRef
from ...errors import CheckpointFormatError, UnsupportedCheckpointError
from ..metadata import TensorInfo, require_dict
from ..partition import Piece
from ..read_plans import FlatPlan, ZeroContents, casts_to, same_bits
from ..validate import numel_of, same_tensor_aliases
from .file_layout import ZeroLayout
from .moe import Experts, parse_experts

__all__ = ["check_legacy_moe", "check_placeholder_optim_files", "complete_legacy_moe", "is_legacy_moe"]

_FIX = "Load it with DeepSpeed and save it again with DeepSpeed >= 0.19, which records param_shapes."


def is_legacy_moe(tree: Any) -> bool:
    """True for rank 0's model states of a DeepSpeed <= 0.18 MoE save: ``num_experts`` but no ``param_shapes``."""
    return isinstance(tree, dict) and "num_experts" in tree and C.PARAM_SHAPES not in tree and C.MODULE in tree


def complete_legacy_moe(layout: ZeroLayout, tree: dict[Any, Any], parse: Callable[[Path], Any]) -> dict[Any, Any]:
    """Rank 0's model states with ``param_shapes``, ``shared_params`` and ``buffer_names`` rebuilt (module doc)."""
    path = layout.model_files[0]
    if not layout.optim_files or not layout.expert_files:
        raise UnsupportedCheckpointError(
            f"'{path}' records MoE layers (num_experts) but no param_shapes, and the folder lacks the ZeRO optimizer "
            f"or expert files to rebuild them from. {_FIX}",
            path=path,
        )
    module = require_dict(tree[C.MODULE], C.MODULE, path)
    experts = parse_experts(layout.expert_files, parse, tree, path)
    optim_trees = [parse(p) for p in layout.optim_files]
    orders = _group_orders(layout.optim_files, optim_trees)
    _complete_by_value(orders, experts, layout.optim_files, optim_trees)
    shapes = []
    for g, names in enumerate(orders):
        group: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        for name in names:
            ref = module.get(name, experts.refs.get(name))
            if not isinstance(ref, TensorRef):
                raise CheckpointFormatError(
                    f"'{layout.optim_files[0].parent}': param group {g} holds '{name}', which neither '{path.name}' "
                    f"nor an expert file stores. The folder mixes files from different saves. {_FIX}",
                    path=path,
                    name=name,
                )
            group[name] = ref.shape
        _check_group_size(g, sum(numel_of(shape) for shape in group.values()), layout.optim_files, optim_trees)
        shapes.append(group)
    trainable = {name for group in shapes for name in group}
    return {
        **tree,
        C.PARAM_SHAPES: shapes,
        C.SHARED_PARAMS: _ties(module, trainable),
        C.BUFFER_NAMES: [],
        C.FROZEN_PARAM_SHAPES: None,
    }


def check_placeholder_optim_files(layout: ZeroLayout, parse: Callable[[Path], Any]) -> None:
    """``expp_rank_*_optim_states.pt`` next to ZeRO optimizer files must be DeepSpeed <= 0.18's empty ones."""
    for placeholder in layout.placeholder_optim_files:
        if parse(placeholder) != {"optimizer": None}:
            raise UnsupportedCheckpointError(
                f"'{placeholder}' holds optimizer state next to the ZeRO optimizer files; zeroio reads the MoE "
                "checkpoints of ZeRO stages 1 and 2, whose expert-parallel optimizer files are empty. Use DeepSpeed's "
                "ds_to_universal.py for this one.",
                path=placeholder,
            )


def _group_orders(files: tuple[Path, ...], trees: list[Any]) -> list[list[str]]:
    """Each param group's parameter names in flat order: every rank's ``param_slice_mappings``, in rank order."""
    orders: list[list[str]] = []
    for path, tree in zip(files, trees):
        osd = tree.get(C.OPTIMIZER_STATE_DICT) if isinstance(tree, dict) else None
        mappings = osd.get(C.PARAM_SLICE_MAPPINGS) if isinstance(osd, dict) else None
        if not isinstance(mappings, (list, tuple)) or not all(isinstance(m, dict) for m in mappings):
            raise UnsupportedCheckpointError(
                f"'{path}' records no param_slice_mappings, and its MoE model states no param_shapes: zeroio cannot "
                f"name the fp32 partitions. {_FIX}",
                path=path,
            )
        if orders and len(mappings) != len(orders):
            raise CheckpointFormatError(
                f"'{path}' records {len(mappings)} param groups, '{files[0].name}' {len(orders)}. The folder mixes "
                "files from different saves; copy the whole tag folder again.",
                path=path,
            )
        orders = orders or [[] for _ in mappings]
        for order, mapping in zip(orders, mappings):
            order.extend(str(n) for n in mapping if str(n) not in order)
    return orders


def _complete_by_value(orders: list[list[str]], experts: Experts, files: tuple[Path, ...], trees: list[Any]) -> None:
    """Before 0.14.5, name the expert parameters the mappings leave out, where each rank holds its experts whole.

    There an expert group's mappings list the parameters in the first 1/ep of the group only. With
    ``partition_count`` 1 rank 0's saved partition is the whole group, its experts' local ids are their global ids,
    and the rest of the group is the parameters not listed, in model order: each next one is the unlisted expert
    parameter whose value (in its expert file, where DeepSpeed copied it from the master) the fp32 elements at that
    offset round to. Equal candidates of one size are one answer; anything else is left for the size check to refuse.
    """
    listed = {name for order in orders for name in order}
    ep = len(trees)  # partition_count 1: every rank is its own expert-parallel rank
    local = {n: ref for n, ref in experts.refs.items() if n not in listed and experts.held_by_first_rank(n, ep)}
    flats = tuple(_flat_groups(files[0], trees[0]))
    for g, order in enumerate(orders):
        exact, count = _group_size(g, files, trees)
        offset = sum(experts.refs[n].numel for n in order if n in experts.refs)
        if count != 1 or not order or not all(n in experts.refs for n in order):
            continue
        while offset < exact:
            fits = [(n, r) for n, r in local.items() if r.numel <= exact - offset]
            plans = {n: FlatPlan((Piece(0, g, offset, r.numel, 0),), (flats,)) for n, r in fits}
            found = [(n, r) for n, r in fits if casts_to(plans[n], r, r.numel, FLOAT32)]
            if not found or any(r.numel != found[0][1].numel or not same_bits(r, found[0][1]) for _, r in found[1:]):
                break
            order.append(found[0][0])
            offset += local.pop(found[0][0]).numel


def _flat_groups(path: Path, tree: Any) -> list[TensorRef]:
    flats = tree[C.OPTIMIZER_STATE_DICT].get(C.SINGLE_PARTITION_OF_FP32_GROUPS)
    if not isinstance(flats, (list, tuple)) or not all(isinstance(f, TensorRef) for f in flats):
        raise CheckpointFormatError(f"'{path}' has no fp32 partitions (single_partition_of_fp32_groups).", path=path)
    return list(flats)


def _group_size(g: int, files: tuple[Path, ...], trees: list[Any]) -> tuple[int, int]:
    """Elements of param group ``g`` (one copy of it) and its ``partition_count``; (-1, 0) where they do not add up.

    DeepSpeed strips each group's padding from its last rank's saved partition, so one copy of the group (the ranks
    of one expert-data-parallel group: ``partition_count`` of them) holds exactly its parameters' elements, and every
    copy the same: all ranks together hold ``world size / partition_count`` copies.
    """
    total, count = 0, None
    for path, tree in zip(files, trees):
        flats = _flat_groups(path, tree)
        if g >= len(flats):
            raise CheckpointFormatError(f"'{path}' has no fp32 partition of param group {g}.", path=path)
        total += flats[g].numel
        counts = tree[C.OPTIMIZER_STATE_DICT].get(C.PARTITION_COUNT)
        count = counts[g] if isinstance(counts, (list, tuple)) and g < len(counts) else counts
    if not isinstance(count, int) or count < 1 or len(trees) % count or total % (len(trees) // count):
        return -1, 0
    return total // (len(trees) // count), count


def _check_group_size(g: int, listed: int, files: tuple[Path, ...], trees: list[Any]) -> None:
    """The parameters named for group ``g`` must fill its fp32 partitions exactly (see :func:`_group_size`)."""
    exact, count = _group_size(g, files, trees)
    if listed != exact:
        raise UnsupportedCheckpointError(
            f"'{files[0]}': the parameters param_slice_mappings list for MoE param group {g} hold {listed} elements, "
            f"its fp32 partitions {exact} a copy (partition_count {count}). DeepSpeed before 0.14.5 sized the expert "
            "groups' mappings by the whole data-parallel world, so they name only part of the group, and these model "
            f"states record no param_shapes: zeroio cannot name the partitions. {_FIX}",
            path=files[0],
        )


def _ties(module: dict[Any, Any], trainable: set[str]) -> dict[str, str]:
    """``{alias: source}``: entries of ``module`` that are one tensor (``state_dict()`` of a tied parameter), or,
    cloned before saving (0.17+), a copy of a trainable parameter's whole storage that no group holds."""
    ties = same_tensor_aliases(module, set())
    copies: dict[tuple[Any, ...], str] = {}
    for name, ref in module.items():
        if not isinstance(ref, TensorRef) or ref.numel == 0 or str(name) in ties:
            continue
        record = ref.file.storage_records.get(ref.storage.key) if ref.numel == ref.storage.numel else None
        content = (record, ref.dtype_spec, ref.shape) if record is not None and ref.is_contiguous else None
        if content is None:
            continue
        if content in copies and str(name) not in trainable and _equal(module[copies[content]], ref):
            ties[str(name)] = copies[content]
        elif str(name) in trainable:
            copies.setdefault(content, str(name))
    return ties


def _equal(a: TensorRef, b: TensorRef) -> bool:
    import torch

    return bool(torch.equal(a.read().view(torch.uint8), b.read().view(torch.uint8)))


def check_legacy_moe(
    contents: ZeroContents, layout: ZeroLayout, tree: dict[Any, Any], parse: Callable[[Path], Any]
) -> ZeroContents:
    """Every rebuilt master must round to its stored 16-bit value; untracked ``module`` entries become ``tensor``."""
    path = layout.model_files[0]
    module = require_dict(tree[C.MODULE], C.MODULE, path)
    experts = parse_experts(layout.expert_files, parse, tree, path)
    infos = {}
    for name, info in contents.infos.items():
        plan = contents.plans.get(name)
        if info.kind == "trainable" and info.tied_to is None:
            low = module.get(name, experts.refs.get(name))
            if not isinstance(plan, FlatPlan) or not isinstance(low, TensorRef) or not casts_to(plan, low, low.numel,
                                                                                               FLOAT32):  # fmt: skip
                raise UnsupportedCheckpointError(
                    f"'{path}' records no param_shapes (DeepSpeed <= 0.18 MoE), and the order rebuilt from "
                    f"param_slice_mappings does not hold '{name}' where its saved value is (round_robin_gradients?). "
                    f"{_FIX}",
                    path=path,
                    name=name,
                )
        elif info.kind == "frozen":
            info = TensorInfo(name, info.shape, info.dtype_spec, "tensor", info.files, info.stored_spec, info.tied_to)
        infos[name] = info
    extra = {**contents.metadata.extra, "rebuilt": "param_shapes from param_slice_mappings (DeepSpeed <= 0.18 MoE)"}
    return dataclasses.replace(contents, infos=infos, metadata=dataclasses.replace(contents.metadata, extra=extra))
