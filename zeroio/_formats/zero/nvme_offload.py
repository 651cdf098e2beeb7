"""NVMe-offloaded ZeRO-3 optimizer state: the fp32 sub-groups DeepSpeed swapped to disk, read from its swap files.

With ``zero_optimization.offload_optimizer.device: nvme`` DeepSpeed 0.19.8 keeps a ZeRO-3 sub-group's fp32 master
partition and its per-element optimizer state (``exp_avg``, ``exp_avg_sq``) in raw fp32 files under
``<nvme_path>/zero_stage_3/optimizer/rank{N}/``: ``{ds_id}.tensor.swp`` and ``{key}-{ds_id}.tensor.swp``, where
``ds_id`` is ``{first}_{last}`` of the sub-group's parameters' ``ds_id`` (their index in ``module.parameters()``).
The rank file keeps an empty fp32 tensor (and empty moments) in their place, and ``save_checkpoint`` copies the
swap folder (gradient files left out) to ``<tag>/offloaded_tensors/rank{NN}/``, which is what this module reads:
the live swap folder moves on with training. Sub-groups under the swap threshold (1 MiB of fp32 a rank) stay in
memory and are saved like CPU offload."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._dtypes import FLOAT32
from ..._io.confine import confined_path, file_identity, require_regular_file
from ..._pickles.archive import RankFile, Storage, TensorRef
from ...errors import CheckpointFormatError, CheckpointNotFoundError, PartitionMismatchError
from ..partition import zero3_partition_numel, zero3_sub_groups
from ..validate import ModelStates, ParamShapes
from .flat_partitions import OptimizerPartitions

__all__ = ["SwapFiles", "attach_swapped_state", "nvme_path", "swap_rank_folder"]

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed 0.19.8's ``zero_optimization.sub_group_size`` default."""
_MASTER = re.compile(r"^(\d+)_(\d+)\.tensor\.swp$")


@dataclasses.dataclass(frozen=True, slots=True)
class SwapFiles:
    """The optimizer partitions with swapped sub-groups pointing into swap files, and those files (to close)."""

    optim: OptimizerPartitions
    files: tuple[RankFile, ...] = ()
    folder: Path | None = None
    """The ``offloaded_tensors`` folder the swapped state was read from; None when nothing was swapped."""


def _offload_section(ds_config: Any) -> dict[str, Any] | None:
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    section = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if isinstance(section, dict) and str(section.get("device", "")).lower() == "nvme":
        return section
    return None


def nvme_path(ds_config: Any) -> str | None:
    """The ``offload_optimizer.nvme_path`` the run swapped to, or None when the optimizer was not offloaded to NVMe."""
    section = _offload_section(ds_config)
    if section is None:
        return None
    value = section.get("nvme_path")
    return str(value) if isinstance(value, (str, Path)) and str(value) else "<nvme_path>"


def swap_rank_folder(tag_dir: Path, rank: int) -> Path:
    """Where ``save_checkpoint`` copies rank ``rank``'s swap folder: ``<tag>/offloaded_tensors/rank{rank:02d}``."""
    return tag_dir / "offloaded_tensors" / f"rank{rank:02d}"


def _swap_path(tag_dir: Path, rank: int, name: str, source: Path) -> Path:
    """Rank ``rank``'s swap file ``name`` (built from optimizer state keys ``source`` recorded), kept in the tag."""
    folder = swap_rank_folder(tag_dir, rank)
    return confined_path(tag_dir, folder.parent.name, folder.name, name, source=source, what="swap file")


def _require_folder(folder: Path, recorded: str, rank: int) -> None:
    if folder.is_dir():
        return
    live = Path(recorded) / "zero_stage_3" / "optimizer" / f"rank{rank}"
    raise CheckpointNotFoundError(
        f"'{folder}' is missing: DeepSpeed's save_checkpoint copies rank {rank}'s NVMe-swapped optimizer state "
        f"there (from its live swap folder '{live}'). Copy the whole tag folder again; the live folder matches "
        "this tag only if training stopped right after the save.",
        path=folder,
        rank=rank,
    )


def _module_param_ids(states: ModelStates, shapes: ParamShapes) -> dict[str, int]:
    """Each parameter's ``ds_id``: its index in ``module.parameters()`` (state_dict order, buffers and ties out)."""
    buffers = set(states.buffer_names)
    names = [str(n) for n in states.module if n not in buffers and n not in shapes.shared]
    return {name: i for i, name in enumerate(names)}


def _sub_groups(shapes: ParamShapes, world_size: int, ds_config: Any) -> list[tuple[list[str], int]]:
    """``(parameter names, partition numel)`` of each ZeRO-3 sub-group, in fp32 flat group order."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    size = zero.get("sub_group_size") if isinstance(zero, dict) else None
    sub_group_size = int(size) if isinstance(size, (int, float)) and size > 0 else DEFAULT_SUB_GROUP_SIZE
    out = []
    for group in shapes.groups:
        numels = [math.prod(shape) for _, shape in group]
        for members in zero3_sub_groups(numels, world_size, sub_group_size):
            names = [group[i][0] for i in members]
            out.append((names, sum(zero3_partition_numel(numels[i], world_size) for i in members)))
    return out


def _swap_ref(path: Path, numel: int, rank: int) -> tuple[TensorRef, RankFile]:
    """A reference to the first ``numel`` fp32 elements of a raw swap file, checked to be there and long enough."""
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"'{path}' is missing: rank {rank}'s NVMe-swapped optimizer state lives there. Copy the whole nvme_path "
            "folder as it was right after the save.",
            path=path,
            rank=rank,
        )
    require_regular_file(path)
    found = path.stat()  # confined and checked now, read later: a file swapped in between is refused at its read
    size = found.st_size
    if size < numel * 4:
        raise CheckpointFormatError(
            f"'{path}' holds {size} bytes, the swapped sub-group needs {numel * 4} ({numel} fp32 elements). The swap "
            "file is truncated or from another run; copy the nvme_path folder again.",
            path=path,
            rank=rank,
        )
    file = RankFile(path, size=size, legacy_offsets={"swap": 0}, identity=file_identity(found))
    storage = Storage("swap", FLOAT32, size // 4, "nvme")
    return TensorRef(file, storage, 0, (numel,), (1,)), file


def _ds_id_names(
    swapped: list[int], subs: list[tuple[list[str], int]], ids: dict[str, int], folder: Path
) -> dict[int, str]:
    """Swap-file stem of each swapped sub-group, allowing for parameters converted before this model (an id shift)."""
    missing = [name for i in swapped for name in (subs[i][0][0], subs[i][0][-1]) if name not in ids]
    if missing:
        raise CheckpointFormatError(
            f"'{folder}': parameter(s) {missing[:3]} of a swapped sub-group are not in the model states' module, so "
            "their swap file cannot be named. The checkpoint is corrupted.",
            path=folder,
        )
    spans = {i: (ids[subs[i][0][0]], ids[subs[i][0][-1]]) for i in swapped}
    found = set()
    if folder.is_dir():
        found = {(int(m[1]), int(m[2])) for m in map(_MASTER.match, (p.name for p in folder.iterdir())) if m}
    shifts = [0] + sorted({a - lo for a, _ in found for lo, _ in spans.values()} - {0})
    for shift in shifts:
        if all((lo + shift, hi + shift) in found for lo, hi in spans.values()):
            return {i: f"{lo + shift}_{hi + shift}" for i, (lo, hi) in spans.items()}
    i, (lo, hi) = next(iter(spans.items()))
    raise CheckpointNotFoundError(
        f"'{folder / f'{lo}_{hi}.tensor.swp'}' is missing: the fp32 master weights of sub-group {i} (parameters "
        f"'{subs[i][0][0]}' .. '{subs[i][0][-1]}') were swapped to NVMe there. Copy the whole nvme_path folder as "
        "it was right after the save.",
        path=folder / f"{lo}_{hi}.tensor.swp",
    )


def _swapped_moments(
    base: Any, group: int, stem: str, numel: int, rank: int, tag_dir: Path, source: Path
) -> tuple[Any, list[Any]]:
    """``base`` with flat group ``group``'s empty per-element state replaced by its swap files (named by the
    state's keys, recorded in ``source``)."""
    if not isinstance(base, dict) or not isinstance(base.get("state"), dict):
        return base, []
    pids = [pid for pg in base.get("param_groups") or [] if isinstance(pg, dict) for pid in pg.get("params") or []]
    if group >= len(pids) or not isinstance(base["state"].get(pids[group]), dict):
        return base, []
    entry = dict(base["state"][pids[group]])
    files = []
    for key, value in entry.items():
        if isinstance(value, TensorRef) and value.numel == 0 and len(value.shape) == 1:
            path = _swap_path(tag_dir, rank, f"{key}-{stem}.tensor.swp", source)
            entry[key], file = _swap_ref(path, numel, rank)
            files.append(file)
    return {**base, "state": {**base["state"], pids[group]: entry}}, files


def attach_swapped_state(
    optim: OptimizerPartitions, states: ModelStates, shapes: ParamShapes, tag_dir: Path
) -> SwapFiles:
    """Point every swapped (empty) ZeRO-3 sub-group, and its moments, at DeepSpeed's swap files.

    Unchanged when the run did not offload the optimizer to NVMe or nothing was swapped.

    Raises:
        CheckpointNotFoundError: the swap folder or one of its files is missing (the message says where it was).
        CheckpointFormatError: a swap file is shorter than its sub-group.
        PartitionMismatchError: the fp32 flat groups do not match the recorded sub-groups.
    """
    ds_config = states.tree.get(C.DS_CONFIG)
    recorded = nvme_path(ds_config)
    if optim.stage != 3 or recorded is None or not any(ref.numel == 0 for g in optim.flat_groups for ref in g):
        return SwapFiles(optim)  # nothing swapped: read as plain ZeRO-3
    subs = _sub_groups(shapes, optim.world_size, ds_config)
    swapped_by_rank: list[list[int]] = []
    for rank, groups in enumerate(optim.flat_groups):
        if len(groups) != len(subs):
            raise PartitionMismatchError(
                f"'{optim.files[rank]}' holds {len(groups)} fp32 sub-groups, the parameters recorded in "
                f"'{states.path.name}' make {len(subs)}. The rank files come from different runs.",
                path=optim.files[rank],
                rank=rank,
                expected=len(subs),
                found=len(groups),
            )
        swapped_by_rank.append([i for i, ref in enumerate(groups) if ref.numel == 0 and subs[i][1] > 0])
    if not any(swapped_by_rank):
        return SwapFiles(optim)
    ids = _module_param_ids(states, shapes)
    flat_groups: list[tuple[TensorRef, ...]] = []
    base_states = list(optim.base_states)
    files: list[RankFile] = []
    for rank, swapped in enumerate(swapped_by_rank):
        folder = swap_rank_folder(tag_dir, rank)
        if swapped:
            _require_folder(folder, recorded, rank)
        stems = _ds_id_names(swapped, subs, ids, folder) if swapped else {}
        rank_groups = list(optim.flat_groups[rank])
        for i, stem in stems.items():
            source = optim.files[rank]
            path = _swap_path(tag_dir, rank, f"{stem}.tensor.swp", source)
            rank_groups[i], file = _swap_ref(path, subs[i][1], rank)
            base_states[rank], moment_files = _swapped_moments(
                base_states[rank], i, stem, subs[i][1], rank, tag_dir, source
            )
            files += [file, *moment_files]
        flat_groups.append(tuple(rank_groups))
    return SwapFiles(
        dataclasses.replace(optim, flat_groups=flat_groups, base_states=base_states),
        tuple(files),
        tag_dir / "offloaded_tensors",
    )
