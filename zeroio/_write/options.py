"""How to write a checkpoint, as one value: built once by ``convert`` (or ``push_to_hub``) from its keywords."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .._dtypes import DType
from .._formats import parse_dtype_spec
from .._io.progress import Progress, check_progress
from .sharding import parse_size

if TYPE_CHECKING:
    import torch

__all__ = [
    "DCP_LAYOUTS",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_WORKERS",
    "OUTPUT_FORMATS",
    "DcpLayout",
    "OutputFormat",
    "WriteOptions",
    "write_options",
]

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
"""Largest piece of a tensor held in memory per IO thread while converting to safetensors."""

DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
"""IO threads: reads of one tensor overlap writes of another (reads and writes release the GIL)."""

OutputFormat = Literal["safetensors", "torch", "lightning", "universal", "dcp", "peft"]
"""What ``convert(fmt=...)`` writes (the formats zeroio *reads* are ``zeroio._formats.FORMATS``)."""

OUTPUT_FORMATS: tuple[OutputFormat, ...] = ("safetensors", "torch", "lightning", "universal", "dcp", "peft")

DcpLayout = Literal["torchtitan", "accelerate"]
"""Where ``fmt="dcp"`` puts the model and optimizer state (docs/dcp.md)."""

DCP_LAYOUTS: tuple[DcpLayout, ...] = ("torchtitan", "accelerate")


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """The writing keywords of ``convert``, validated (see :func:`write_options`): the write engine, the
    distributed convert and the Lightning and universal writers take this one value, never the keywords."""

    fmt: OutputFormat = "safetensors"
    """The output format."""
    dtype: DType | None = None
    """Cast floating tensors to this dtype (None: as stored)."""
    max_shard_size: int = 5_000_000_000
    """Largest shard in bytes."""
    exclude_frozen: bool = False
    """Leave out frozen parameters."""
    overwrite: bool = False
    """Replace an existing destination that holds only what zeroio writes."""
    workers: int = DEFAULT_WORKERS
    """IO threads."""
    progress: Progress = True
    """A bar (True), silence (False) or ``callable(done, total)`` in bytes."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Largest piece of a tensor read at once, per thread."""
    distributed: bool = False
    """Run as one process of a ``torch.distributed`` job."""
    include_optimizer: bool = False
    """Also write the consolidated optimizer state (``optimizer.safetensors`` + ``optimizer.json``; DCP: the
    ``optimizer`` state dict)."""
    dcp_layout: DcpLayout = "torchtitan"
    """With ``fmt="dcp"``: torchtitan's ``step-N`` folder or accelerate's ``pytorch_model_fsdp_0``/``optimizer_0``."""


def _positive_int(name: str, value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int{what}, got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be a positive int{what}, got {value!r}.")
    return value


def write_options(
    *,
    fmt: OutputFormat = "safetensors",
    dtype: str | torch.dtype | DType | None = None,
    max_shard_size: int | str = "5GB",
    exclude_frozen: bool = False,
    overwrite: bool = False,
    workers: int | None = None,
    progress: Progress = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    distributed: bool = False,
    include_optimizer: bool = False,
    dcp_layout: DcpLayout = "torchtitan",
) -> WriteOptions:
    """Validate the writing keywords a public verb was given, once, without IO, into a :class:`WriteOptions`.

    Raises:
        ValueError: a bad value (format, dtype, shard size, workers, chunk size) or options that do not go
            together (``include_optimizer`` or ``dtype`` where the format cannot honour them).
        TypeError: an argument of the wrong type.
    """
    if fmt not in OUTPUT_FORMATS:
        raise ValueError(f"fmt must be 'safetensors', 'torch', 'lightning', 'universal', 'dcp' or 'peft', got {fmt!r}.")
    if dcp_layout not in DCP_LAYOUTS:
        raise ValueError(f"dcp_layout must be one of {', '.join(DCP_LAYOUTS)}, got {dcp_layout!r}.")
    target = parse_dtype_spec(dtype)  # a torch-free DType: converting without a cast never imports torch
    size = parse_size(max_shard_size)
    n_workers = DEFAULT_WORKERS if workers is None else _positive_int("workers", workers, " (IO threads)")
    _positive_int("chunk_bytes", chunk_bytes, "")
    check_progress(progress)
    if include_optimizer and (fmt not in ("safetensors", "dcp") or distributed):
        raise ValueError(
            "include_optimizer=True writes optimizer.safetensors beside model.safetensors (or the DCP optimizer "
            "state): use fmt='safetensors' or fmt='dcp', without distributed=True."
        )
    if fmt in ("dcp", "peft") and distributed:
        raise ValueError(f"fmt={fmt!r} is written by one process: drop distributed=True.")
    if fmt == "universal" and (target is not None or exclude_frozen or distributed):
        raise ValueError(
            "fmt='universal' writes the fp32 masters and optimizer state DeepSpeed resumes from, as stored: "
            "dtype, exclude_frozen and distributed do not apply."
        )
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {distributed!r}.")
    if fmt == "lightning" and exclude_frozen and not distributed:
        raise ValueError(
            "exclude_frozen=True cannot be used with fmt='lightning': load_from_checkpoint loads strictly and "
            "needs every parameter. Drop exclude_frozen, or write fmt='safetensors'."
        )
    return WriteOptions(
        fmt=fmt,
        dtype=target,
        max_shard_size=size,
        exclude_frozen=exclude_frozen,
        overwrite=overwrite,
        workers=n_workers,
        progress=progress,
        chunk_bytes=chunk_bytes,
        distributed=distributed,
        include_optimizer=include_optimizer,
        dcp_layout=dcp_layout,
    )
