"""Quantized checkpoints: block-scaled FP8 presented dequantized, every other quantized layout refused by name.

Runs on every opened checkpoint (names, dtypes and ``config.json`` only; no tensor bytes). A checkpoint with no
``quantization_config``, no float8 tensor and no scale-like names comes back untouched.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from ..._dtypes import BY_NAME, DType
from ..._messages import get_logger
from ...errors import CheckpointFormatError, UnsupportedCheckpointError
from ..checkpoint import Checkpoint
from ..metadata import TensorInfo
from .block_fp8 import BlockFP8Checkpoint, ScaledWeight

__all__ = ["QuantizedMode", "dequantized_dtype", "present_quantized"]

logger = get_logger(__name__)

QuantizedMode = Literal["dequantize", "raw"]

SCALE_SUFFIX = "_scale_inv"
_DEFAULT_BLOCK = (128, 128)
"""DeepSeek-V3's ``weight_block_size``, assumed for ``X`` / ``X_scale_inv`` pairs without a ``config.json``."""
_CONFIG_MAX_BYTES = 16 * 1024 * 1024
_OTHER_SCALES = ("weight_scale", "weight_scale_2", "weight_global_scale", "input_scale", "activation_scale")
"""Scale names of layouts zeroio does not dequantize (per-tensor / per-channel FP8, NVFP4, static activations)."""
_FIX = "Pass quantized='raw' (CLI: --keep-quantized) to read the tensors exactly as stored"


def dequantized_dtype(metadata_extra: Any) -> DType | None:
    """The dtype a dequantized checkpoint's weights are presented in (None: nothing was dequantized)."""
    info = metadata_extra.get("quantization") if hasattr(metadata_extra, "get") else None
    name = info.get("dequantized_to") if isinstance(info, dict) else None
    return BY_NAME.get(name) if isinstance(name, str) else None


def present_quantized(ckpt: Checkpoint, mode: QuantizedMode) -> Checkpoint:
    """``ckpt`` with block-scaled FP8 weights dequantized (``mode="dequantize"``), or as stored (``"raw"``).

    Raises:
        UnsupportedCheckpointError: a quantized layout other than block-scaled FP8, or a float8 tensor without
            a scale (it would be cast blindly).
        CheckpointFormatError: a ``*_scale_inv`` without its weight, or of the wrong dtype or shape.
    """
    if mode == "raw":
        return ckpt
    infos = ckpt.infos
    config_path, config = _quantization_config(ckpt.metadata.path)
    has_float8 = any(_is_float8(i.dtype_spec) for i in infos.values())
    if config is None and not has_float8 and not any(n.endswith(SCALE_SUFFIX) for n in infos):
        _refuse_mxfp4(ckpt, infos)
        return ckpt
    where = config_path if config is not None else ckpt.metadata.path
    block = _block_size(config, where)
    _refuse_mxfp4(ckpt, infos)
    _refuse_other_scales(ckpt, infos)
    weights = _scaled_weights(ckpt, infos, block)
    for name, info in infos.items():
        scaled = ckpt.tied.get(name, name) in weights  # a tied alias of a scaled weight is scaled too
        if _is_float8(info.dtype_spec) and not scaled and not name.endswith(SCALE_SUFFIX):
            raise UnsupportedCheckpointError(
                f"'{ckpt.metadata.path}': tensor '{name}' is {info.dtype_spec.name} without a '{name}{SCALE_SUFFIX}' "
                f"beside it; zeroio will not cast quantized values without their scale. {_FIX}.",
                path=ckpt.metadata.path,
                name=name,
            )
    if not weights:
        return ckpt
    logical = _logical_dtype(config)
    return _wrap(ckpt, infos, weights, logical, config)


def _is_float8(dtype: DType) -> bool:
    return dtype.name.startswith("float8")


def _quantization_config(path: Path) -> tuple[Path, dict[str, Any] | None]:
    """``config.json`` beside the weights and its ``quantization_config`` (None when there is none)."""
    config_path = (path if path.is_dir() else path.parent) / "config.json"
    try:
        if not config_path.is_file():
            return config_path, None
        if config_path.stat().st_size > _CONFIG_MAX_BYTES:
            logger.warning("not reading %s: over %d bytes", config_path, _CONFIG_MAX_BYTES)
            return config_path, None
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        logger.warning("%s is not readable JSON: its quantization_config (if any) is not seen", config_path)
        return config_path, None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant is None:
        return config_path, None
    if not isinstance(quant, dict):
        raise CheckpointFormatError(
            f"'{config_path}': 'quantization_config' is a {type(quant).__name__}, not an object. Fix config.json.",
            path=config_path,
        )
    return config_path, {**quant, "_dtype": config.get("torch_dtype") or config.get("dtype")}


def _block_size(config: dict[str, Any] | None, where: Path) -> tuple[int, int]:
    """The config's ``weight_block_size`` after checking it declares block-scaled e4m3 FP8 (or the default)."""
    if config is None:
        return _DEFAULT_BLOCK
    method = config.get("quant_method")
    if method != "fp8":
        raise UnsupportedCheckpointError(
            f"'{where}' declares quantization_config quant_method {method!r}, which zeroio cannot dequantize (it "
            f"dequantizes block-scaled FP8, quant_method 'fp8'). {_FIX}, or dequantize with the library that "
            "wrote them.",
            path=where,
            found=str(method),
        )
    fmt = config.get("fmt", "e4m3")
    block = config.get("weight_block_size")
    valid = (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 20 for b in block)
    )
    if fmt != "e4m3" or not valid or not isinstance(block, list):
        what = f"fmt {fmt!r}" if fmt != "e4m3" else f"weight_block_size {block!r:.60} (per-tensor or per-channel FP8)"
        raise UnsupportedCheckpointError(
            f"'{where}' declares FP8 with {what}; zeroio dequantizes e4m3 weights with 2-D block scales "
            f"(weight_block_size [rows, cols]). {_FIX}.",
            path=where,
        )
    return int(block[0]), int(block[1])


def _refuse_mxfp4(ckpt: Checkpoint, infos: dict[str, TensorInfo]) -> None:
    """MXFP4 (gpt-oss): ``X_blocks`` packed 4-bit values with ``X_scales`` exponents beside them."""
    for name in infos:
        if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in infos:
            raise UnsupportedCheckpointError(
                f"'{ckpt.metadata.path}': '{name}' and its '_scales' are MXFP4 (packed 4-bit blocks), which zeroio "
                f"cannot dequantize. {_FIX}, or dequantize with transformers (Mxfp4Config(dequantize=True)).",
                path=ckpt.metadata.path,
                name=name,
            )


def _refuse_other_scales(ckpt: Checkpoint, infos: dict[str, TensorInfo]) -> None:
    """Per-tensor / per-channel scales (``weight_scale``, ``input_scale``, ...): not DeepSeek's block layout."""
    for name in infos:
        if name.rpartition(".")[2] in _OTHER_SCALES:
            raise UnsupportedCheckpointError(
                f"'{ckpt.metadata.path}': '{name}' is a per-tensor or per-channel quantization scale, which zeroio "
                f"does not apply (it dequantizes block-scaled FP8 with '*{SCALE_SUFFIX}'). {_FIX}.",
                path=ckpt.metadata.path,
                name=name,
            )


def _scaled_weights(ckpt: Checkpoint, infos: dict[str, TensorInfo], block: tuple[int, int]) -> dict[str, ScaledWeight]:
    """Every ``X`` / ``X_scale_inv`` pair, checked: X float8 e4m3 2-D, the scale float32 with one value per block."""
    path = ckpt.metadata.path
    weights: dict[str, ScaledWeight] = {}
    for scale_name, scale in infos.items():
        if not scale_name.endswith(SCALE_SUFFIX):
            continue
        name = scale_name.removesuffix(SCALE_SUFFIX)
        weight = infos.get(name)
        if weight is None:
            raise CheckpointFormatError(
                f"'{path}': '{scale_name}' scales no tensor: '{name}' is missing. The checkpoint is incomplete; "
                "copy every shard and the index again.",
                path=path,
                name=scale_name,
            )
        if name in ckpt.tied or scale_name in ckpt.tied:
            raise UnsupportedCheckpointError(
                f"'{path}': quantized weight '{name}' is a tied alias; zeroio dequantizes stored weights only. {_FIX}.",
                path=path,
                name=name,
            )
        expected = tuple(-(-s // b) for s, b in zip(weight.shape, block))
        problem = None
        if weight.dtype_spec.name != "float8_e4m3fn" or len(weight.shape) != 2:
            problem = f"'{name}' is {weight.dtype_spec.name} {weight.shape}, not a 2-D float8_e4m3fn weight"
        elif scale.dtype_spec.name != "float32":
            problem = f"'{scale_name}' is {scale.dtype_spec.name}, not float32"
        elif scale.shape != expected:
            problem = (
                f"'{scale_name}' has shape {scale.shape}, but {weight.shape} in {block[0]}x{block[1]} blocks needs "
                f"{expected}"
            )
        if problem is not None:
            raise CheckpointFormatError(
                f"'{path}': {problem}, as block-scaled FP8 (DeepSeek-V3's layout) needs. {_FIX}.",
                path=path,
                name=scale_name,
            )
        weights[name] = ScaledWeight(scale_name, (weight.shape[0], weight.shape[1]), block)
    return weights


def _logical_dtype(config: dict[str, Any] | None) -> DType:
    """What DeepSeek's script stores in: the config's dtype when it is a 16/32-bit float, else bf16."""
    name = config.get("_dtype") if config is not None else None
    dtype = BY_NAME.get(name) if isinstance(name, str) else None
    return dtype if dtype is not None and dtype.name in ("bfloat16", "float16", "float32") else BY_NAME["bfloat16"]


def _wrap(
    ckpt: Checkpoint,
    infos: dict[str, TensorInfo],
    weights: dict[str, ScaledWeight],
    logical: DType,
    config: dict[str, Any] | None,
) -> Checkpoint:
    """The logical view: each weight in ``logical`` (stored float8), no ``*_scale_inv`` key."""
    scales = {w.scale for w in weights.values()}
    shown: dict[str, TensorInfo] = {}
    for name, info in infos.items():
        if name in scales:
            continue
        source = ckpt.tied.get(name, name)  # a tied alias of a quantized weight reads it dequantized too
        if source in weights:
            files = tuple(dict.fromkeys(info.files + infos[weights[source].scale].files))
            info = TensorInfo(name, info.shape, logical, info.kind, files, info.dtype_spec, info.tied_to)
        shown[name] = info
    block = next(iter(weights.values())).block
    quantization = {
        "method": "fp8",
        "weight_block_size": list(block),
        "dequantized_to": logical.name,
        "weights": len(weights),
        "config": {k: v for k, v in (config or {}).items() if k != "_dtype"},
    }
    meta = ckpt.metadata
    metadata = dataclasses.replace(
        meta,
        train_spec=logical,
        extra={**meta.extra, "quantization": quantization},
    )
    tied = {a: s for a, s in ckpt.tied.items() if a in shown}
    logger.debug("%s: %d block-scaled FP8 weights dequantized to %s", meta.path, len(weights), logical.name)
    return BlockFP8Checkpoint(ckpt, metadata, shown, tied, weights)
