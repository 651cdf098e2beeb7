"""What a writer wrote: the one result every entry of ``WRITERS`` returns, whatever the output format."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .._dtypes import DType
from .._formats import CheckpointMetadata

if TYPE_CHECKING:
    import torch

__all__ = ["CardInputs", "Written"]


@dataclass(frozen=True, slots=True)
class CardInputs:
    """What a Hub model card says about an output, as the writer knows it (rendered by the verbs)."""

    source: CheckpointMetadata
    """The source checkpoint's metadata."""
    fmt: str
    """The output format written."""
    target: torch.dtype | DType | None
    """The ``dtype=`` cast asked for, or None (as stored)."""
    out_dtypes: Sequence[torch.dtype | DType]
    """Each written tensor's dtype."""
    excluded: Sequence[str]
    """Names left out (``exclude_frozen``)."""
    num_params: int
    """Elements written, each tied group once."""


@dataclass(frozen=True, slots=True)
class Written:
    """The files a writer wrote into its destination (local; a URL output maps them to the uploaded objects)."""

    files: tuple[Path, ...]
    """Weight files (or every file, for formats without an index), in the order written."""
    index_path: Path | None
    """The index file, or None."""
    total_size: int
    """Bytes of tensor data, each tied group once."""
    num_tensors: int
    """Distinct tensors stored."""
    tied: dict[str, str] = field(default_factory=dict)
    """Tied aliases, ``{alias: source}``."""
    copied: tuple[Path, ...] = ()
    """Config and tokenizer files copied from beside the source."""
    card: CardInputs | None = None
    """Model-card facts, for the formats a Hub card describes (None: no card facts)."""
