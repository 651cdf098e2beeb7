"""The facts a Hub model card states about a conversion: where the weights came from and what they are now.

Its own module, below both verbs that need it: ``convert`` records them (``ConvertResult.card_facts``) and
``push_to_hub`` renders them, and ``push_to_hub`` calls ``convert``, so neither may import the other's facts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._metadata import CheckpointMetadata, dtype_name

__all__ = ["card_facts"]


def card_facts(
    source: CheckpointMetadata,
    *,
    fmt: str,
    target: torch.dtype | None,
    out_dtypes: Iterable[torch.dtype],
    excluded: Sequence[str],
    num_params: int,
) -> dict[str, Any]:
    """``ConvertResult.card_facts``: ``source_format``, ``tag``, ``ds_version``, ``zero_stage``, ``world_size``,
    ``global_step``, ``train_dtype``, ``output_dtype``, ``format``, ``num_params``, ``excluded_frozen``.

    ``output_dtype`` is the cast asked for, else the floating dtypes written joined with ``+`` (None if none).
    """
    floating = sorted({dtype_name(d) for d in out_dtypes if d.is_floating_point})
    output_dtype: str | None
    if target is not None:
        output_dtype = dtype_name(target)
    else:
        output_dtype = "+".join(floating) if floating else None
    return {
        "source_format": source.format,
        "tag": source.tag,
        "ds_version": source.ds_version,
        "zero_stage": source.zero_stage,
        "world_size": source.world_size,
        "global_step": source.global_step,
        "train_dtype": dtype_name(source.train_dtype) if source.train_dtype is not None else None,
        "output_dtype": output_dtype,
        "format": fmt,
        "num_params": num_params,
        "excluded_frozen": list(excluded),
    }
