"""Frozen value objects describing a checkpoint and its tensors, and validators for raw pickle dicts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .._dtypes import BY_NAME, DType, as_dtype
from .._io.remote_path import as_path
from ..errors import CheckpointFormatError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointMetadata",
    "TensorInfo",
    "describe_tensors",
    "dtype_name",
    "output_dtype",
    "output_spec",
    "parse_dtype",
    "parse_dtype_spec",
    "require",
    "require_dict",
]

TensorKind = Literal["trainable", "frozen", "buffer", "tensor"]

_DTYPE_NAMES = {
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp64": "float64",
    "float64": "float64",
}
_SHORT_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


def parse_dtype(value: str | torch.dtype | DType | None) -> torch.dtype | None:
    """``"bf16"``, ``"torch.float16"`` or a ``torch.dtype`` to a floating ``torch.dtype`` (None stays None)."""
    spec = parse_dtype_spec(value)
    return None if spec is None else spec.torch


def parse_dtype_spec(value: str | torch.dtype | DType | None) -> DType | None:
    """:func:`parse_dtype` without torch: the floating :class:`DType` asked for (None stays None).

    Raises:
        ValueError: an unknown name, or a dtype that is not floating.
    """
    if value is None:
        return None
    if isinstance(value, DType) or type(value).__name__ == "dtype":  # a DType or a torch.dtype
        spec = as_dtype(value)
        if not spec.is_floating_point:
            raise ValueError(f"dtype must be a floating type, got {value}.")
        return spec
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"Unknown dtype {value!r}; use one of fp32, fp16, bf16 (or a torch.dtype).")
    return BY_NAME[_DTYPE_NAMES[key]]


def output_dtype(info: TensorInfo, target: torch.dtype | DType | None) -> torch.dtype:
    """Floating tensors take the requested dtype; integer and bool tensors keep theirs (DeepSpeed does the same),
    and so do float8 ones: quantized values (read ``quantized="raw"``) mean nothing cast without their scales."""
    return output_spec(info, target).torch


def output_spec(info: TensorInfo, target: torch.dtype | DType | None) -> DType:
    """:func:`output_dtype` as a torch-free :class:`DType`."""
    castable = info.dtype_spec.is_floating_point and not info.dtype_spec.name.startswith("float8")
    return as_dtype(target) if (target is not None and castable) else info.dtype_spec


def dtype_name(dtype: torch.dtype | DType) -> str:
    """Short name used in tables and JSON: ``torch.bfloat16`` -> ``"bf16"``."""
    name = str(dtype).removeprefix("torch.")
    return _SHORT_NAMES.get(name, name)


def _spec(value: torch.dtype | DType | None) -> DType | None:
    return None if value is None else as_dtype(value)


@dataclass(frozen=True, slots=True, init=False, repr=False)
class TensorInfo:
    """What zeroio knows about one tensor without reading it.

    Fields: ``name`` (key in the consolidated state dict), ``shape`` (full, unpartitioned), ``dtype`` (the
    ``torch.dtype`` the tensor is returned in: fp32 master weights for trainable ZeRO parameters), ``kind``
    (``trainable`` from the optimizer's fp32 partitions, ``frozen``, ``buffer``, or plain ``tensor``), ``files``
    (files whose bytes make up the tensor), ``stored_dtype`` (dtype on disk when it differs from ``dtype``, e.g.
    fp16 buffers DeepSpeed returns as fp32) and ``tied_to`` (for a tied alias, the tensor it shares storage with).
    ``dtype`` and ``stored_dtype`` import torch when read; ``dtype_spec`` and ``stored_spec`` are the same
    element types as torch-free :class:`~zeroio._dtypes.DType` values (what metadata-only code uses).
    """

    name: str
    shape: tuple[int, ...]
    dtype_spec: DType
    kind: TensorKind
    files: tuple[Path, ...]
    stored_spec: DType | None
    tied_to: str | None

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype | DType,
        kind: TensorKind,
        files: tuple[Path, ...] = (),
        stored_dtype: torch.dtype | DType | None = None,
        tied_to: str | None = None,
    ) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "dtype_spec", as_dtype(dtype))
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "files", files)
        object.__setattr__(self, "stored_spec", _spec(stored_dtype))
        object.__setattr__(self, "tied_to", tied_to)

    @property
    def dtype(self) -> torch.dtype:
        """dtype the tensor is returned in (fp32 master weights for trainable ZeRO parameters)."""
        return self.dtype_spec.torch

    @property
    def stored_dtype(self) -> torch.dtype | None:
        """dtype on disk when it differs from ``dtype`` (e.g. fp16 buffers DeepSpeed returns as fp32)."""
        return None if self.stored_spec is None else self.stored_spec.torch

    def __repr__(self) -> str:
        return (
            f"TensorInfo(name={self.name!r}, shape={self.shape!r}, dtype={self.dtype_spec}, kind={self.kind!r}, "
            f"files={self.files!r}, stored_dtype={self.stored_spec}, tied_to={self.tied_to!r})"
        )

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
        return self.numel * self.dtype_spec.itemsize


@dataclass(frozen=True, slots=True, init=False)
class CheckpointMetadata:
    """Checkpoint-level facts, all read from metadata only.

    ``train_dtype`` is a ``torch.dtype`` (importing torch when read); ``train_spec`` is the same element type as a
    torch-free :class:`~zeroio._dtypes.DType`.
    """

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
    train_spec: DType | None = None
    """dtype the model trained in (fp32, fp16 or bf16), torch-free."""
    ds_version: str | None = None
    """DeepSpeed version that wrote the checkpoint."""
    global_step: int | None = None
    """Optimizer steps taken when the checkpoint was saved (None when not recorded, or not an int64 >= 0)."""
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

    def __init__(
        self,
        format: str,
        path: Path,
        tag: str | None = None,
        zero_stage: int | None = None,
        world_size: int | None = None,
        train_dtype: torch.dtype | DType | None = None,
        ds_version: str | None = None,
        global_step: int | None = None,
        has_fp32_master: bool = True,
        layout: str | None = None,
        parallel: Mapping[str, int] | None = None,
        offload: str | None = None,
        serialization: str | None = None,
        optimizer: str | None = None,
        extra: Mapping[str, Any] | None = None,
        *,
        train_spec: DType | None = None,
    ) -> None:
        """``train_spec`` is what ``dataclasses.replace`` passes on; ``train_dtype``, when given, wins."""
        values = dict(locals())
        del values["self"]
        values["train_spec"] = _spec(values.pop("train_dtype")) or train_spec
        values["parallel"] = {} if parallel is None else parallel
        if not (isinstance(global_step, int) and 0 <= global_step < 2**63) or isinstance(global_step, bool):
            values["global_step"] = None  # a pickled 10**5000 made every str() of it raise a bare ValueError
        values["extra"] = {} if extra is None else extra
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @property
    def train_dtype(self) -> torch.dtype | None:
        """dtype the model trained in (fp32, fp16 or bf16)."""
        return None if self.train_spec is None else self.train_spec.torch

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view (dtypes as short names, paths as strings)."""
        return {
            "format": self.format,
            "path": str(self.path),
            "tag": self.tag,
            "zero_stage": self.zero_stage,
            "world_size": self.world_size,
            "train_dtype": dtype_name(self.train_spec) if self.train_spec is not None else None,
            "ds_version": self.ds_version,
            "global_step": self.global_step,
            "has_fp32_master": self.has_fp32_master,
            "layout": self.layout,
            "parallel": dict(self.parallel),
            "offload": self.offload,
            "serialization": self.serialization,
            "optimizer": self.optimizer,
            **({"dcp_keys": self.extra["dcp_keys"]} if "dcp_keys" in self.extra else {}),  # DCP: how keys split
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


def describe_tensors(
    metadata: CheckpointMetadata, infos: dict[str, TensorInfo], tied: dict[str, str]
) -> dict[str, Any]:
    """``Checkpoint.describe``: metadata, totals and one row per tensor (what ``zeroio inspect --json`` prints)."""
    rows = []
    names: dict[int, tuple[Any, list[str]]] = {}  # id(files) -> (files, names): ZeRO-3 shares one tuple
    for name, info in infos.items():
        known = names.get(id(info.files))
        if known is None or known[0] is not info.files:
            known = names[id(info.files)] = (info.files, [as_path(f).name for f in info.files])
        rows.append(
            {
                "name": name,
                "shape": list(info.shape),
                "dtype": dtype_name(info.dtype_spec),
                "stored_dtype": dtype_name(info.stored_spec or info.dtype_spec),
                "numel": info.numel,
                "nbytes": info.nbytes,
                "kind": info.kind,
                "tied_to": info.tied_to,
                "files": known[1],
            }
        )
    distinct = [i for n, i in infos.items() if n not in tied]
    return {
        "metadata": metadata.as_dict(),
        "num_tensors": len(infos),
        "num_params": sum(i.numel for i in distinct),
        "total_bytes": sum(i.nbytes for i in distinct),
        "tied": dict(tied),
        "tensors": rows,
    }
