"""Frozen value objects describing a checkpoint and its tensors, and validators for raw pickle dicts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .errors import CheckpointFormatError

__all__ = [
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_DTYPE_ORDER",
    "CheckpointMetadata",
    "TensorInfo",
    "dtype_name",
    "output_dtype",
    "parse_dtype",
    "require",
    "require_dict",
]

TensorKind = Literal["trainable", "frozen", "buffer", "tensor"]

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


# safetensors' Dtype enum, in declaration order (its files sort tensors by this rank, descending, then by name).
SAFETENSORS_DTYPE_ORDER: tuple[tuple[str, torch.dtype | None], ...] = (
    ("BOOL", torch.bool),
    ("U8", torch.uint8),
    ("I8", torch.int8),
    ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
    ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
    ("F8_E4M3FNUZ", getattr(torch, "float8_e4m3fnuz", None)),
    ("F8_E5M2FNUZ", getattr(torch, "float8_e5m2fnuz", None)),
    ("I16", torch.int16),
    ("U16", getattr(torch, "uint16", None)),
    ("F16", torch.float16),
    ("BF16", torch.bfloat16),
    ("I32", torch.int32),
    ("U32", getattr(torch, "uint32", None)),
    ("F32", torch.float32),
    ("C64", torch.complex64),
    ("F64", torch.float64),
    ("I64", torch.int64),
    ("U64", getattr(torch, "uint64", None)),
)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {name: dt for name, dt in SAFETENSORS_DTYPE_ORDER if dt is not None}
"""safetensors' dtype names and the torch dtype each holds (those this torch has), in safetensors' enum order."""


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``, ``"torch.float16"`` or a ``torch.dtype`` to a floating ``torch.dtype`` (None stays None)."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ValueError(f"dtype must be a floating type, got {value}.")
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"Unknown dtype {value!r}; use one of fp32, fp16, bf16 (or a torch.dtype).")
    return _DTYPE_NAMES[key]


def output_dtype(info: TensorInfo, target: torch.dtype | None) -> torch.dtype:
    """Floating tensors take the requested dtype; integer and bool tensors keep theirs (DeepSpeed does the same)."""
    return target if (target is not None and info.dtype.is_floating_point) else info.dtype


def dtype_name(dtype: torch.dtype) -> str:
    """Short name used in tables and JSON: ``torch.bfloat16`` -> ``"bf16"``."""
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What zeroio knows about one tensor without reading it."""

    name: str
    """Key in the consolidated state dict."""
    shape: tuple[int, ...]
    """Full (unpartitioned) shape."""
    dtype: torch.dtype
    """dtype the tensor is returned in (fp32 master weights for trainable ZeRO parameters)."""
    kind: TensorKind
    """``trainable`` (from the optimizer's fp32 partitions), ``frozen``, ``buffer``, or plain ``tensor``."""
    files: tuple[Path, ...] = ()
    """Files whose bytes make up the tensor."""
    stored_dtype: torch.dtype | None = None
    """dtype on disk when it differs from ``dtype`` (e.g. fp16 buffers DeepSpeed returns as fp32)."""
    tied_to: str | None = None
    """For a tied alias, the name of the tensor it shares storage with."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Size in bytes in ``dtype``."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """Checkpoint-level facts, all read from metadata only."""

    format: str
    """``zero`` for DeepSpeed checkpoints, ``safetensors`` or ``torch`` for consolidated files."""
    path: Path
    """Folder (or file) the tensors are read from."""
    tag: str | None = None
    """DeepSpeed tag (e.g. ``global_step1200``)."""
    zero_stage: int | None = None
    """ZeRO stage, 0-3."""
    world_size: int | None = None
    """Data-parallel world size (number of partitions)."""
    train_dtype: torch.dtype | None = None
    """dtype the model trained in (fp32, fp16 or bf16)."""
    ds_version: str | None = None
    """DeepSpeed version that wrote the checkpoint."""
    global_step: int | None = None
    """Optimizer steps taken when the checkpoint was saved."""
    has_fp32_master: bool = True
    """False when only 16-bit weights were found (no fp32 master copy)."""
    layout: str | None = None
    """How training split the model, when it is more than data parallel: ``pipeline``, ``tensor-parallel``,
    ``moe``, ``autoep``, ``universal``, ... (None for plain ZeRO data parallelism and consolidated files)."""
    parallel: Mapping[str, int] = field(default_factory=dict)
    """Sizes of the parallel dimensions the files record, e.g. ``{"dp": 2, "pp": 2, "tp": 1, "ep": 1}``."""
    offload: str | None = None
    """Where training kept optimizer state or parameters off the accelerator (``cpu``, ``nvme``), if known."""
    serialization: str | None = None
    """How the rank files are pickled: ``zip`` (torch's default) or ``legacy`` (the pre-1.6 stream)."""
    optimizer: str | None = None
    """Optimizer whose state the files hold (e.g. ``Adam``, ``Muon``, ``SGD``), when it can be told."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Other facts a backend records (e.g. the DeepSpeed config)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view (dtypes as short names, paths as strings)."""
        return {
            "format": self.format,
            "path": str(self.path),
            "tag": self.tag,
            "zero_stage": self.zero_stage,
            "world_size": self.world_size,
            "train_dtype": dtype_name(self.train_dtype) if self.train_dtype is not None else None,
            "ds_version": self.ds_version,
            "global_step": self.global_step,
            "has_fp32_master": self.has_fp32_master,
            "layout": self.layout,
            "parallel": dict(self.parallel),
            "offload": self.offload,
            "serialization": self.serialization,
            "optimizer": self.optimizer,
        }


def require(mapping: Any, key: str, path: Path, what: str = "DeepSpeed checkpoint") -> Any:
    """``mapping[key]``, or a CheckpointFormatError naming the file and the missing key."""
    if not isinstance(mapping, dict):
        raise CheckpointFormatError(
            f"'{path}' does not hold a {what} (its top level is a {type(mapping).__name__}, not a dict). "
            "Point zeroio at files written by DeepSpeed's engine.save_checkpoint().",
            path=path,
        )
    if key not in mapping:
        keys = ", ".join(sorted(map(str, mapping))[:8])
        raise CheckpointFormatError(
            f"'{path}' is not a {what}: key '{key}' is missing (found: {keys}). "
            "Point zeroio at files written by DeepSpeed's engine.save_checkpoint().",
            path=path,
            expected=key,
        )
    return mapping[key]


def require_dict(value: Any, key: str, path: Path) -> dict[Any, Any]:
    """Check that ``value`` (read from ``key``) is a dict."""
    if not isinstance(value, dict):
        raise CheckpointFormatError(
            f"'{path}': '{key}' should be a dict, found {type(value).__name__}. The file is corrupted or not a "
            "DeepSpeed checkpoint.",
            path=path,
            expected="dict",
            found=type(value).__name__,
        )
    return value
