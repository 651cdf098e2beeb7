"""A drop-in for ``deepspeed.utils.zero_to_fp32`` (DeepSpeed 0.19.8): the same functions, thin calls into zeroio;
and :func:`ds_to_universal` for ``deepspeed.checkpoint.ds_to_universal.main``.

``from zeroio.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint`` replaces
``from deepspeed.utils.zero_to_fp32 import ...``: same names, signatures, defaults, return types, output file names
and dtypes, read by zeroio (no pickle code runs, DeepSpeed need not be installed). Where DeepSpeed's values are
wrong, these return what the trained engine held; docs/migrating.md lists every difference:

- ZeRO-1 checkpoints: DeepSpeed drops frozen parameters; these return them (in their training dtype, as DeepSpeed
  returns ZeRO-2/3 frozen parameters).
- ZeRO stage 0, ``BF16_Optimizer`` and MoE checkpoints, on which DeepSpeed's functions raise, are read.
- Keys come in the model's order (``model.state_dict()``'s), not DeepSpeed's (buffers, frozen, then parameter groups).
- ``convert_zero_checkpoint_to_fp32_state_dict`` writes atomically, stores tied weights once in safetensors
  (DeepSpeed's ``save_file`` refuses them), and, called on every rank of a torch.distributed job, writes once.
  It writes into an existing ``output_dir`` beside the files there, as DeepSpeed does.
- Errors are zeroio's (:mod:`zeroio.errors`): a missing ``latest`` is a ``CheckpointNotFoundError`` (a
  ``FileNotFoundError``), where DeepSpeed raises ``ValueError``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import zeroio

__all__ = [
    "LazyTensor",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "ds_to_universal",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "to_torch_tensor",
]

# DeepSpeed 0.19.8's OUTPUT_DTYPE_NAMES: the dtypes its converter writes, by the names it accepts.
_OUTPUT_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# No max_shard_size (None): DeepSpeed writes one file, however large.
_ONE_FILE = 2**62


def _resolve_output_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """DeepSpeed's ``_resolve_output_dtype``: a name (``"bf16"``, ``"torch.float16"``) or dtype, else ValueError."""
    resolved: Any = dtype
    if isinstance(dtype, str):
        resolved = _OUTPUT_DTYPES.get(dtype.removeprefix("torch.").lower())
    if resolved not in set(_OUTPUT_DTYPES.values()):
        raise ValueError(f"Unsupported output dtype {dtype!r}. Choose one of: {', '.join(sorted(_OUTPUT_DTYPES))}")
    return resolved  # type: ignore[no-any-return]


class _OpenCheckpoint:
    """One open checkpoint shared by the LazyTensors of one state dict; closed when the last of them is gone."""

    def __init__(self, checkpoint: zeroio.Checkpoint) -> None:
        self.checkpoint = checkpoint
        weakref.finalize(self, checkpoint.close)


class LazyTensor:
    """What ``lazy_mode=True`` returns per name (DeepSpeed's ``GatheredTensor``): ``shape`` and ``dtype`` now,
    the tensor's bytes read by ``contiguous()``. Tied names share one object, as DeepSpeed's share one."""

    def __init__(self, handle: _OpenCheckpoint, name: str) -> None:
        self._handle = handle  # the checkpoint stays open while any LazyTensor of it lives
        self.name = name
        info = handle.checkpoint.info(name)
        self.shape = torch.Size(info.shape)
        self.dtype: torch.dtype = info.dtype

    def contiguous(self) -> torch.Tensor:
        """Read the whole tensor (an owned, contiguous CPU tensor)."""
        return self._handle.checkpoint.get_tensor(self.name)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _lazy_state_dict(checkpoint_dir: Any, tag: str | None, exclude_frozen: bool) -> dict[str, LazyTensor]:
    """Every name DeepSpeed's consolidation returns, as lazy tensors over one open checkpoint."""
    ckpt = zeroio.open(checkpoint_dir, tag=tag)
    handle = _OpenCheckpoint(ckpt)
    try:
        infos = ckpt.infos
        frozen = {name for name, info in infos.items() if info.kind == "frozen"} if exclude_frozen else set()
        lazy: dict[str, LazyTensor] = {}
        for name in infos:
            source = ckpt.tied.get(name, name)
            if name in frozen or source in frozen:
                continue
            lazy[name] = lazy[source] if source in lazy else LazyTensor(handle, source)
    except BaseException:
        ckpt.close()
        raise
    return lazy


def to_torch_tensor(
    state_dict: Mapping[str, Any], return_empty_tensor: bool = False, dtype: str | torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Turn a lazy state dict into tensors, tied names sharing one (DeepSpeed's ``to_torch_tensor``).

    Args:
        state_dict: names to :class:`LazyTensor` (``lazy_mode=True``) or to tensors.
        return_empty_tensor: return uninitialised tensors of the right shapes and dtypes, reading nothing.
        dtype: cast floating tensors (``"fp32"``, ``"bf16"``, ``torch.float16``, ...); others keep their dtype.
    """
    target = _resolve_output_dtype(dtype) if dtype is not None else None
    out: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}
    for name, tensor in state_dict.items():
        seen = first_name.get(id(tensor))
        if seen is not None:  # a tied name: the same object as an earlier one
            out[name] = out[seen]
            continue
        first_name[id(tensor)] = name
        cast = target if tensor.dtype.is_floating_point else None
        if return_empty_tensor:
            out[name] = torch.empty(tensor.shape, dtype=cast or tensor.dtype)
        else:
            value = tensor.contiguous()
            out[name] = value.to(dtype=cast) if cast else value
    return out


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The consolidated state dict of a ZeRO checkpoint: fp32 master weights, frozen parameters in their training
    dtype, floating buffers as fp32 (DeepSpeed's dtypes); tied names share one tensor.

    Args:
        checkpoint_dir: the checkpoint root (holding ``latest`` and the tag folders), or a tag folder.
        tag: the tag folder to read (default: the one named in ``latest``).
        exclude_frozen_parameters: leave out frozen (``requires_grad=False``) parameters.
        lazy_mode: return :class:`LazyTensor` values (read by ``.contiguous()`` or :func:`to_torch_tensor`).

    Example:
        >>> sd = get_fp32_state_dict_from_zero_checkpoint("fixtures/z3_ws2_bf16")  # doctest: +SKIP
    """
    lazy = _lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    return dict(lazy) if lazy_mode else to_torch_tensor(lazy)


def _move_once(result: zeroio.ConvertResult, built: Path, output_dir: Path) -> None:
    """Move the weight files and index of ``built`` into ``output_dir`` (replacing files of the same names, leaving
    the others, as DeepSpeed's ``os.makedirs(exist_ok=True)`` + writes do), then remove ``built``.

    Called on every rank of a job (zeroio.convert wrote ``built`` once for all): the first rank to lock ``built``
    moves the files; the others wait for that lock, then find nothing left to move.
    """
    try:
        fd = os.open(built, os.O_RDONLY)
    except FileNotFoundError:  # another rank moved the files already
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not built.is_dir():
            return
        names = [p.name for p in result.files] + ([result.index_path.name] if result.index_path is not None else [])
        for name in names:  # the index last: it names the shards
            os.replace(built / name, output_dir / name)
        shutil.rmtree(built)
    finally:
        os.close(fd)


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: str | torch.dtype = torch.float32,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write ``pytorch_model.bin`` (or ``model.safetensors``; shards and an index above ``max_shard_size``) into
    ``output_dir``, every floating tensor cast to ``dtype`` (DeepSpeed's ``convert_zero_checkpoint_to_state_dict``).

    Args:
        checkpoint_dir: the checkpoint root (holding the tag folders), or a tag folder.
        output_dir: the folder to write the files into (created if missing; other files in it are left alone).
        dtype: ``torch.float32`` (default), ``torch.float16`` or ``torch.bfloat16``, or their names.
        max_shard_size: largest shard (``"5GB"``, bytes); None writes one file.
        safe_serialization: write safetensors instead of torch pickles.
        tag: the tag folder to read (default: the one named in ``latest``).
        exclude_frozen_parameters: leave out frozen parameters.
    """
    target = _resolve_output_dtype(dtype)
    out = Path(output_dir)
    fmt = "safetensors" if safe_serialization else "torch"
    options: dict[str, Any] = {
        "fmt": fmt, "dtype": target, "max_shard_size": _ONE_FILE if max_shard_size is None else max_shard_size,
        "tag": tag, "exclude_frozen": exclude_frozen_parameters, "progress": False,
    }  # fmt: skip
    if not out.is_dir() or not any(out.iterdir()):
        zeroio.convert(checkpoint_dir, out, **options)  # a new folder, atomically
        return
    # An existing folder: build the files beside it, then move them in, as DeepSpeed writes among what is there.
    built = out / f".zeroio-{fmt}-{target}".replace("torch.", "")
    result = zeroio.convert(checkpoint_dir, built, overwrite=True, **options)
    _move_once(result, built, out)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32: every floating tensor, frozen ones included, as fp32.

    Example:
        >>> convert_zero_checkpoint_to_fp32_state_dict("fixtures/z3_ws2_bf16", "out/fp32")  # doctest: +SKIP
    """
    convert_zero_checkpoint_to_state_dict(
        checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size=max_shard_size,
        safe_serialization=safe_serialization, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters,
    )  # fmt: skip


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's consolidated weights into it (``strict=False``, as
    DeepSpeed does); returns the model.

    Example:
        >>> model = load_state_dict_from_zero_checkpoint(model, "fixtures/z3_ws2_fp32")  # doctest: +SKIP
    """
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model


def ds_to_universal(args: Any) -> None:
    """DeepSpeed's ``deepspeed.checkpoint.ds_to_universal.main(args)``: the ZeRO checkpoint in ``args.input_folder``
    (a tag folder) as a universal checkpoint in ``args.output_folder``, named in ``latest_universal`` beside it.

    Reads ``args.input_folder`` and ``args.output_folder`` only: zeroio streams in IO threads and writes no temporary
    slice files, so ``num_extract_workers``, ``num_merge_workers``, ``keep_temp_folder``, ``strict`` and
    ``inject_missing_state`` have nothing to set. ``output_folder`` must not exist or be empty.

    Example:
        >>> ds_to_universal(SimpleNamespace(input_folder="ckpt/global_step2", output_folder="ckpt/step2_universal"))
        ... # doctest: +SKIP
    """
    out = Path(os.path.abspath(args.output_folder))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise zeroio.errors.OutputError(
            f"Output folder '{out}' already exists and is not empty. Remove it or choose another output_folder.",
            path=out,
        )
    staging = out.parent / f".{out.name}.zeroio-universal"  # zeroio's layout: staging/<tag>_universal + latest
    zeroio.convert(args.input_folder, staging, fmt="universal", overwrite=True, progress=False)
    (tag_dir,) = [p for p in staging.iterdir() if p.is_dir()]  # the one <tag>_universal folder
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(tag_dir, out)
    shutil.rmtree(staging)
    (out.parent / "latest_universal").write_text(out.name)
