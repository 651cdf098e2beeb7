"""Pipeline-parallel tag folders by file name only: layer files, and per stage its model and optimizer files.

DeepSpeed's ``PipelineEngine`` (0.19.8) writes ``layer_XX-model_states.pt`` per layer that has a ``state_dict``
(``PipelineModule.save_state_dict``), ``mp_rank_SS_model_states.pt`` per stage (``mp_rank`` is the pipeline
stage, ``module`` is None), and ``{bf16_}zero_pp_rank_D_mp_rank_SS_optim_states.pt`` per stage and data-parallel
rank. Nothing here is unpickled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .. import _constants as C
from .._pickles import require_regular_file
from .._text import listing
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError

__all__ = ["LAYER_FILE", "PipelineFiles", "has_layer_files", "is_pipeline", "layer_file_name", "scan_pipeline_dir"]

LAYER_FILE = re.compile(r"^layer_(?P<layer>\d+)-model_states\.pt$")
"""A pipeline layer's weights (``PipelineModule.ckpt_layer_path`` without tensor/model parallelism)."""


def layer_file_name(layer: int) -> str:
    """The file DeepSpeed writes for layer ``layer``."""
    return f"layer_{layer:02d}-model_states.pt"


def _names(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.exists() and not p.is_dir())
    except OSError:
        return []


def has_layer_files(folder: Path) -> bool:
    """True when ``folder`` holds pipeline layer files of a data-parallel pipeline.

    Layer files named with a tensor-parallel rank alone (``layer_XX-model_YY-model_states.pt``) are left to the
    ZeRO reader, which refuses them.
    """
    return any(LAYER_FILE.match(n) for n in _names(folder))


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


def scan_pipeline_dir(tag_dir: Path) -> PipelineFiles:
    """Group the files of a pipeline tag folder by stage; refuse missing stage or rank files by name."""
    names = _names(tag_dir)
    with_tp = [n for n in names if C.PIPELINE_LAYER_FILE.match(n)]
    if with_tp:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' is a pipeline checkpoint with tensor parallelism ({listing(with_tp, limit=3)}); zeroio "
            "merges pipeline stages of data-parallel runs only. Use DeepSpeed's ds_to_universal.py for this one.",
            path=tag_dir,
            found=with_tp,
        )
    layers: dict[int, Path] = {}
    models: dict[int, Path] = {}
    optim: dict[int, dict[int, Path]] = {}
    prefixes: dict[Path, str] = {}
    for name in names:
        path = tag_dir / name
        if m := LAYER_FILE.match(name):
            require_regular_file(path)
            layers[int(m["layer"])] = path
        elif m := C.MODEL_FILE.match(name):
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
    stages = sorted(set(models) | set(optim))
    if not stages:
        raise CheckpointNotFoundError(
            f"'{tag_dir}' holds pipeline layer files but no 'mp_rank_XX_model_states.pt'; copy the whole tag folder.",
            path=tag_dir,
        )
    for stage in range(max(stages) + 1):
        if stage not in models:
            raise _missing(tag_dir, f"mp_rank_{stage:02d}_model_states.pt", f"pipeline stage {stage}'s model states")
    if not optim:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' is a pipeline checkpoint without ZeRO optimizer files ('*_optim_states.pt'); zeroio reads "
            "pipeline checkpoints trained with ZeRO stage 1. Use DeepSpeed's ds_to_universal.py for this one.",
            path=tag_dir,
        )
    dp = max(len(ranks) for ranks in optim.values())
    values = list(prefixes.values())
    one_prefix = max(sorted(set(values)), key=values.count)  # the odd file out is the one named
    per_stage = []
    for stage in range(len(models)):
        ranks = optim.get(stage, {})
        for rank in range(max([dp - 1, *ranks]) + 1):
            if rank not in ranks:
                name = f"{one_prefix}zero_pp_rank_{rank}_mp_rank_{stage:02d}_optim_states.pt"
                raise _missing(tag_dir, name, f"data-parallel rank {rank}'s optimizer state of pipeline stage {stage}")
        per_stage.append(tuple(ranks[r] for r in range(len(ranks))))
    for path, prefix in prefixes.items():
        if prefix != one_prefix:
            raise CheckpointFormatError(
                f"'{path}' is named {'with the ' + repr(prefix) if prefix else 'without a'} prefix, unlike the other "
                "optimizer files: the folder mixes files from different saves; copy the whole tag folder again.",
                path=path,
            )
    return PipelineFiles(tag_dir, dict(sorted(layers.items())), tuple(models[s] for s in range(len(models))),
                         tuple(per_stage))  # fmt: skip
