"""Pipeline-parallel tag folders by file name only: layer files, and per stage its model and optimizer files.

DeepSpeed's ``PipelineEngine`` (0.19.8) writes ``layer_XX-model_states.pt`` per layer that has a ``state_dict``
(``PipelineModule.save_state_dict``), ``mp_rank_SS_model_states.pt`` per stage (``mp_rank`` is the pipeline
stage, ``module`` is None), and ``{bf16_}zero_pp_rank_D_mp_rank_SS_optim_states.pt`` per stage and data-parallel
rank. With tensor parallelism (a topology with a ``model`` axis) the layer files are
``layer_XX-model_YY-model_states.pt`` (``YY`` the tp rank) and ``mp_rank_XX`` numbers (stage, tp rank) pipe-major.
Nothing here is unpickled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ... import _constants as C
from ..._io.confine import require_regular_file
from ..._messages import listing
from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError

__all__ = [
    "LAYER_FILE",
    "LAYER_TP_FILE",
    "PipelineFiles",
    "has_layer_files",
    "is_pipeline",
    "layer_file_name",
    "scan_pipeline_dir",
]

LAYER_FILE = re.compile(r"^layer_(?P<layer>\d+)-model_states\.pt$")
"""A pipeline layer's weights (``PipelineModule.ckpt_layer_path`` without tensor/model parallelism)."""
LAYER_TP_FILE = re.compile(r"^layer_(?P<layer>\d+)-model_(?P<tp>\d+)-model_states\.pt$")
"""One tensor-parallel rank's shard of a pipeline layer (the topology's ``model`` axis: ``-model_YY``)."""


def layer_file_name(layer: int, tp_rank: int = 0, tp: int = 1) -> str:
    """The file DeepSpeed writes for layer ``layer`` (of tensor-parallel rank ``tp_rank`` when ``tp > 1``)."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt" if tp > 1 else f"layer_{layer:02d}-model_states.pt"


def _names(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.exists() and not p.is_dir())
    except OSError:
        return []


def has_layer_files(folder: Path) -> bool:
    """True when ``folder`` holds pipeline layer files (``layer_XX-model_states.pt``, or ``layer_XX-model_YY-...``
    with tensor parallelism)."""
    return any(LAYER_FILE.match(n) or LAYER_TP_FILE.match(n) for n in _names(folder))


def is_pipeline(path: Path) -> bool:
    """True when ``path`` (a root, a tag folder or a rank file) holds a pipeline-parallel checkpoint."""
    if path.is_file():
        return has_layer_files(path.parent)
    if not path.is_dir():
        return False
    if has_layer_files(path):
        return True
    try:
        subfolders = [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return False
    return any(has_layer_files(p) for p in subfolders)


@dataclass(frozen=True, slots=True)
class PipelineFiles:
    """The files of one pipeline-parallel tag folder."""

    tag_dir: Path
    layer_files: dict[int, Path]
    """``{layer index: layer_XX-model_states.pt}``, ascending."""
    model_files: tuple[Path, ...]
    """``mp_rank_SS_model_states.pt`` per pipeline stage."""
    optim_files: tuple[tuple[Path, ...], ...]
    """``optim_files[stage][dp rank]``."""

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return len(self.model_files)

    @property
    def dp(self) -> int:
        """Data-parallel replicas of each stage."""
        return len(self.optim_files[0]) if self.optim_files else 0


def _missing(tag_dir: Path, name: str, what: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"'{tag_dir / name}' is missing: {what}. A rank failed to save or the copy is incomplete; copy the whole "
        "tag folder again.",
        path=tag_dir / name,
    )


def _layer_files(tag_dir: Path, names: list[str]) -> tuple[dict[int, dict[int, Path]], int]:
    """``({tp rank: {layer: file}}, tp)`` from the layer file names; refuses a mix or a missing tp rank by name."""
    plain = [n for n in names if LAYER_FILE.match(n)]
    with_tp = [n for n in names if LAYER_TP_FILE.match(n)]
    if plain and with_tp:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' mixes pipeline layer files with and without a tensor parallelism rank "
            f"({listing(with_tp, limit=3)} next to {listing(plain, limit=3)}): the folder mixes saves; copy the "
            "whole tag folder again.",
            path=tag_dir,
            found=with_tp,
        )
    by_tp: dict[int, dict[int, Path]] = {}
    for name in plain or with_tp:
        m = LAYER_FILE.match(name) or LAYER_TP_FILE.match(name)
        assert m is not None
        require_regular_file(tag_dir / name)
        by_tp.setdefault(int(m.groupdict().get("tp") or 0), {})[int(m["layer"])] = tag_dir / name
    tp = max(by_tp) + 1
    layers = sorted({layer for files in by_tp.values() for layer in files})
    for rank in range(tp):
        for layer in layers:
            if layer not in by_tp.get(rank, {}):
                name = layer_file_name(layer, rank, tp)
                raise _missing(tag_dir, name, f"layer {layer} of tensor-parallel rank {rank}")
    return by_tp, tp


def scan_pipeline_dir(tag_dir: Path) -> tuple[PipelineFiles, ...]:
    """The files of a pipeline tag folder, one :class:`PipelineFiles` per tensor-parallel rank (one without tp).

    With tensor parallelism (Megatron-DeepSpeed / GPT-NeoX 3D), stage ``s`` of tp rank ``t`` is model-parallel rank
    ``s * tp + t`` (``mp_rank_XX``): DeepSpeed's ``PipelineParallelGrid`` numbers the model ranks pipe-major.
    Missing stage or rank files are refused by name.
    """
    names = _names(tag_dir)
    by_tp, tp = _layer_files(tag_dir, names)
    models: dict[int, Path] = {}
    optim: dict[int, dict[int, Path]] = {}
    prefixes: dict[Path, str] = {}
    for name in names:
        path = tag_dir / name
        if m := C.MODEL_FILE.match(name):
            require_regular_file(path)
            models[int(m["mp"])] = path
        elif m := C.ZERO_OPTIM_FILE.match(name):
            require_regular_file(path)
            optim.setdefault(int(m["mp"]), {})[int(m["rank"])] = path
            prefixes[path] = m["prefix"] or ""
        elif C.ZERO3_MODEL_FILE.match(name):
            raise UnsupportedCheckpointError(
                f"'{path}' is a ZeRO-3 model states file next to pipeline layer files; DeepSpeed pipelines train "
                "with ZeRO stage 0 or 1 only, so the folder mixes checkpoints.",
                path=path,
            )
    mp_ranks = sorted(set(models) | set(optim))
    if not mp_ranks:
        raise CheckpointNotFoundError(
            f"'{tag_dir}' holds pipeline layer files but no 'mp_rank_XX_model_states.pt'; copy the whole tag folder.",
            path=tag_dir,
        )
    count = -(-(max(mp_ranks) + 1) // tp) * tp  # whole stages of tp ranks
    for mp in range(count):
        if mp not in models:
            stage, rank = divmod(mp, tp)
            what = f"pipeline stage {stage}'s model states" + (f" (tensor-parallel rank {rank})" if tp > 1 else "")
            raise _missing(tag_dir, f"mp_rank_{mp:02d}_model_states.pt", what)
    if not optim:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' is a pipeline checkpoint without ZeRO optimizer files ('*_optim_states.pt'); zeroio reads "
            "pipeline checkpoints trained with ZeRO stage 1. Use DeepSpeed's ds_to_universal.py for this one.",
            path=tag_dir,
        )
    dp = max(len(ranks) for ranks in optim.values())
    values = list(prefixes.values())
    one_prefix = max(sorted(set(values)), key=values.count)  # the odd file out is the one named
    per_mp = []
    for mp in range(count):
        ranks = optim.get(mp, {})
        for rank in range(max([dp - 1, *ranks]) + 1):
            if rank not in ranks:
                name = f"{one_prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"
                stage, tp_rank = divmod(mp, tp)
                of = f"pipeline stage {stage}" + (f", tensor-parallel rank {tp_rank}" if tp > 1 else "")
                raise _missing(tag_dir, name, f"data-parallel rank {rank}'s optimizer state of {of}")
        per_mp.append(tuple(ranks[r] for r in range(len(ranks))))
    for path, prefix in prefixes.items():
        if prefix != one_prefix:
            raise CheckpointFormatError(
                f"'{path}' is named {'with the ' + repr(prefix) if prefix else 'without a'} prefix, unlike the other "
                "optimizer files: the folder mixes files from different saves; copy the whole tag folder again.",
                path=path,
            )
    stages = range(count // tp)
    return tuple(
        PipelineFiles(
            tag_dir,
            dict(sorted(by_tp[rank].items())),
            tuple(models[s * tp + rank] for s in stages),
            tuple(per_mp[s * tp + rank] for s in stages),
        )
        for rank in range(tp)
    )
