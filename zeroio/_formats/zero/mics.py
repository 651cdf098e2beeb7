"""ZeRO-3 variants named by the ``ds_config`` in the model states: MiCS (read one shard group) and ZeRO++.

MiCS (DeepSpeed <= 0.18, ``zero_optimization.mics_shard_size``) partitions parameters over shard groups of
``mics_shard_size`` consecutive ranks and replicates each partition across the groups. Every rank writes its own
rank files, but ``partition_count`` in them is the shard size: ranks ``0 .. S-1`` hold the whole model once, and
rank ``r`` holds a replica of shard rank ``r % S``'s partition. zeroio reads the first shard group as a ZeRO-3
checkpoint of world size ``S`` and checks, from metadata only, that every other rank file is such a replica.

ZeRO++ (hpZ ``zero_hpz_partition_size``, qwZ ``zero_quantized_weights``, qgZ ``zero_quantized_gradients``)
changes only how ranks communicate: the rank files are plain ZeRO-3 files partitioned over the whole world.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ... import _constants as C
from ..._pickles import TensorRef
from ...errors import CheckpointFormatError, UnsupportedCheckpointError
from ..metadata import CheckpointMetadata
from .file_layout import ZeroLayout
from .provenance import archive_records, check_archive_names

__all__ = ["MicsGroups", "check_mics_replicas", "mics_shard_group", "zero_variant_metadata"]

_ZEROPP_FLAGS = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


def _zero_section(ds_config: Any) -> dict[Any, Any]:
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    return zero if isinstance(zero, dict) else {}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclasses.dataclass(frozen=True)
class MicsGroups:
    """A MiCS checkpoint's rank files: the first shard group (read) and the replica files (checked)."""

    shard_size: int
    world_size: int
    replica_optim_files: tuple[Path, ...]
    replica_model_files: tuple[Path, ...]

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size


def mics_shard_group(layout: ZeroLayout, ds_config: Any, config_path: Path) -> tuple[ZeroLayout, MicsGroups | None]:
    """The layout to read (the first shard group's files) and the MiCS groups; ``(layout, None)`` if not MiCS."""
    shard = _positive_int(_zero_section(ds_config).get("mics_shard_size"))
    if shard is None or not layout.partitioned_model_files:
        return layout, None
    world = len(layout.optim_files)
    if world % shard or len(layout.model_files) != world:
        raise UnsupportedCheckpointError(
            f"'{config_path}' records MiCS (mics_shard_size={shard}) but '{layout.tag_dir}' holds {world} optimizer "
            f"and {len(layout.model_files)} model rank files, not a whole number of shard groups of {shard}. "
            "Copy the whole tag folder again.",
            path=config_path,
            found=world,
        )
    group = dataclasses.replace(layout, optim_files=layout.optim_files[:shard], model_files=layout.model_files[:shard])
    mics = MicsGroups(shard, world, layout.optim_files[shard:], layout.model_files[shard:])
    return group, mics


def _flat_shapes(tree: Any, path: Path, shard: int) -> tuple[tuple[int, ...], ...]:
    osd = tree.get(C.OPTIMIZER_STATE_DICT) if isinstance(tree, dict) else None
    groups = osd.get(C.FP32_FLAT_GROUPS) if isinstance(osd, dict) else None
    if not (
        isinstance(osd, dict)
        and osd.get(C.ZERO_STAGE) == 3
        and osd.get(C.PARTITION_COUNT) == shard
        and isinstance(groups, (list, tuple))
        and all(isinstance(g, TensorRef) for g in groups)
    ):
        raise CheckpointFormatError(
            f"'{path}' is not a MiCS replica: a ZeRO-3 optimizer file with partition_count={shard} and fp32 flat "
            "groups was expected (the first shard group records it). The folder mixes checkpoints; copy the whole "
            "tag folder again.",
            path=path,
        )
    return tuple(tuple(g.shape) for g in groups)


def check_mics_replicas(
    group: ZeroLayout, mics: MicsGroups, trees: dict[Path, Any], parse: Callable[[Path], Any]
) -> None:
    """Every replica rank file agrees with its shard rank's (names, stage, partition count, partition shapes)."""
    replicas: Sequence[Path] = (*mics.replica_optim_files, *mics.replica_model_files)
    records = {p: archive_records(p) for p in replicas}
    ranked = [(mics.shard_size + i, p) for i, p in enumerate(mics.replica_optim_files)]
    ranked += [(mics.shard_size + i, p) for i, p in enumerate(mics.replica_model_files)]
    check_archive_names(ranked, records)
    steps = trees[group.model_files[0]].get(C.GLOBAL_STEPS)
    for i, (opath, mpath) in enumerate(zip(mics.replica_optim_files, mics.replica_model_files)):
        shard_rank = (mics.shard_size + i) % mics.shard_size
        want = _flat_shapes(trees[group.optim_files[shard_rank]], group.optim_files[shard_rank], mics.shard_size)
        if _flat_shapes(parse(opath), opath, mics.shard_size) != want:
            raise CheckpointFormatError(
                f"'{opath}' holds fp32 partitions of other sizes than its MiCS shard rank's "
                f"'{group.optim_files[shard_rank].name}'; the folder mixes checkpoints. Copy the whole tag folder "
                "again.",
                path=opath,
            )
        model = parse(mpath)
        if not isinstance(model, dict) or model.get(C.GLOBAL_STEPS) != steps:
            raise CheckpointFormatError(
                f"'{mpath}' records another global step than '{group.model_files[0].name}'; the folder mixes "
                "saves. Copy the whole tag folder again.",
                path=mpath,
            )


def zero_variant_metadata(metadata: CheckpointMetadata, mics: MicsGroups | None) -> CheckpointMetadata:
    """``metadata`` with ``layout`` ``mics`` or ``zero++`` and their group sizes, as the ``ds_config`` states."""
    if metadata.layout is not None:
        return metadata
    if mics is not None:
        parallel = {"dp": mics.world_size, "mics_shard": mics.shard_size, "mics_replicas": mics.replicas}
        extra = {
            **metadata.extra,
            "mics_replica_files": [p.name for p in (*mics.replica_model_files, *mics.replica_optim_files)],
        }
        return dataclasses.replace(metadata, layout="mics", parallel=parallel, extra=extra)
    zero = _zero_section(metadata.extra.get("ds_config"))
    hpz = _positive_int(zero.get("zero_hpz_partition_size"))
    quantized = [flag for flag in _ZEROPP_FLAGS if zero.get(flag) is True]
    if (hpz is None or hpz == 1) and not quantized:
        return metadata
    parallel = {**metadata.parallel, "hpz": hpz or 1}
    extra = {**metadata.extra, "zeropp_quantized": quantized}
    return dataclasses.replace(metadata, layout="zero++", parallel=parallel, extra=extra)
