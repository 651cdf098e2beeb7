"""Consolidated checkpoints: safetensors files and folders, torch ``.bin``/``.pt`` state dicts, Lightning ``.ckpt``."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import _constants as C
from ._checkpoint import Checkpoint
from ._metadata import CheckpointMetadata, TensorInfo
from ._pickles import RankFile, TensorRef, load_pickle
from ._storage import LocalFile
from .errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError

__all__ = ["SafetensorsCheckpoint", "TorchCheckpoint", "open_consolidated"]

logger = logging.getLogger(__name__)

# safetensors' dtype names (safetensors 0.8 ``safetensors.torch._TYPES``), resolved lazily where torch lacks one.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit (100 MB)

_RESERVED_METADATA = frozenset({"format", "total_size"})
"""Metadata keys that are never tie records (safetensors' ``format``, an index's ``total_size``)."""

# Where a state dict sits inside a torch file written by a framework: Lightning's .ckpt ("state_dict"),
# common training scripts ("model_state_dict", "model"), DeepSpeed's model_states ("module").
_NESTED_STATE_DICT_KEYS = ("state_dict", "model_state_dict", "module", "model")


# --------------------------------------------------------------------------- byte reading


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a safetensors header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Byte offset of the tensor's data from the start of the file."""


@dataclass(eq=False)
class _SafetensorsFile:
    """One ``.safetensors`` file: its parsed header and lazy access to its bytes."""

    path: Path
    entries: dict[str, _Entry]
    metadata: dict[str, str]
    source: LocalFile = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.source = LocalFile(self.path)

    def read(self, entry: _Entry, start: int, out: torch.Tensor) -> None:
        self.source.read_into(entry.begin + start * out.element_size(), out)

    def close(self) -> None:
        self.source.close()


def _bad(path: Path, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"'{path}' is not a valid safetensors file: {what}. Re-save it with safetensors.torch.save_file.", path=path
    )


def _parse_safetensors(path: Path) -> _SafetensorsFile:
    """Read and validate a safetensors header (8-byte little-endian length + JSON); no tensor bytes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise _bad(path, f"it holds {size} bytes, fewer than the 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_MAX_HEADER_BYTES, size - 8):
                raise _bad(path, f"its header claims {length} bytes, the file holds {size}")
            raw = fh.read(length)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"'{path}' does not exist.", path=path) from exc
    except OSError as exc:
        raise CheckpointFormatError(f"Cannot read '{path}': {exc}.", path=path) from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _bad(path, f"its header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + length
    data_size = size - data_start
    metadata_raw = header.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict):
        raise _bad(path, "'__metadata__' is not an object")
    metadata = {str(k): str(v) for k, v in metadata_raw.items()}
    entries: dict[str, _Entry] = {}
    for name, spec in header.items():
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
            raise _bad(path, f"the entry for '{name}' lacks dtype, shape or data_offsets")
        dtype_name = spec["dtype"]
        torch_name = _SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        dtype = getattr(torch, torch_name, None) if torch_name else None
        if not isinstance(dtype, torch.dtype):
            raise UnsupportedCheckpointError(
                f"'{path}': tensor '{name}' has dtype {dtype_name!r}, which zeroio cannot read with torch "
                f"{torch.__version__.split('+')[0]} (known: {', '.join(_SAFETENSORS_DTYPES)}).",
                path=path,
                name=str(name),
                found=dtype_name,
            )
        shape = spec["shape"]
        offsets = spec["data_offsets"]
        if not (
            isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        ):
            raise _bad(path, f"'{name}' has an invalid shape {shape!r:.60}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise _bad(path, f"'{name}' has invalid data_offsets {offsets!r:.60}")
        begin, end = offsets
        numel = 1
        for s in shape:
            numel *= s
        needed = numel * dtype.itemsize
        if begin < 0 or end - begin != needed or end > data_size:
            raise _bad(
                path,
                f"'{name}' {tuple(shape)} {dtype_name} needs {needed} bytes, its data_offsets are [{begin}, {end}] "
                f"in a data section of {data_size} bytes",
            )
        entries[str(name)] = _Entry(dtype, tuple(shape), data_start + begin)
    # Storage order, so iterating the checkpoint reads each file front to back.
    ordered = dict(sorted(entries.items(), key=lambda item: item[1].begin))
    return _SafetensorsFile(path, ordered, metadata)


def _ties_from(metadata: Mapping[str, Any], stored: Mapping[str, Any]) -> dict[str, str]:
    """Tie records ``{alias: source}`` in safetensors or index metadata.

    safetensors cannot hold two names for one tensor, so ``huggingface_hub.save_torch_state_dict`` (and zeroio's
    converter, which follows it) stores a tied group once, under its first name, and records every dropped alias as
    the metadata entry ``alias: source``: in the file's ``__metadata__``, and in the index's ``metadata`` when
    sharded. An entry counts as a tie only when its value names a stored tensor and its key does not.
    """
    return {
        str(k): v
        for k, v in metadata.items()
        if k not in _RESERVED_METADATA and isinstance(v, str) and v in stored and k not in stored
    }


class SafetensorsCheckpoint(Checkpoint):
    """One safetensors file or a sharded folder (``model.safetensors.index.json``); build it with ``zeroio.open``."""

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        locations: dict[str, tuple[_SafetensorsFile, _Entry]],
        files: list[_SafetensorsFile],
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._locations = locations
        self._files = files

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        file, entry = self._locations[name]
        file.read(entry, start, out)

    def _release(self) -> None:
        for file in self._files:
            file.close()


def _read_index(index_path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """``weight_map`` and ``metadata`` of a Hugging Face index file, validated."""
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"'{index_path}' does not exist.", path=index_path) from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(
            f"Cannot read the index '{index_path}' ({exc}). Write it again (it is JSON with a 'weight_map').",
            path=index_path,
        ) from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointFormatError(
            f"The index '{index_path}' has no 'weight_map' of tensor names to shard files. "
            "Write it as Hugging Face does: {\"metadata\": {...}, \"weight_map\": {name: file}}.",
            path=index_path,
        )
    meta = index.get("metadata") or {}
    return dict(weight_map), meta if isinstance(meta, dict) else {}


def _shard_paths(index_path: Path, weight_map: dict[str, str]) -> dict[str, Path]:
    root = index_path.parent
    shards: dict[str, Path] = {}
    for shard in dict.fromkeys(weight_map.values()):
        shard_path = root / shard
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise CheckpointFormatError(
                f"The index '{index_path}' names shard '{shard}' outside its folder. Shard names must be plain "
                "file names next to the index.",
                path=index_path,
                name=shard,
            )
        if not shard_path.is_file():
            raise CheckpointNotFoundError(
                f"Shard '{shard}' listed in '{index_path}' does not exist. Copy every shard next to the index.",
                path=shard_path,
            )
        shards[shard] = shard_path
    return shards


def _open_safetensors(path: Path, index_path: Path | None) -> SafetensorsCheckpoint:
    # 1. Parse every header (no tensor bytes) and decide which file holds which name.
    if index_path is None:
        files = [_parse_safetensors(path)]
        locations = {name: (files[0], entry) for name, entry in files[0].entries.items()}
        index_meta: dict[str, Any] = {}
    else:
        weight_map, index_meta = _read_index(index_path)
        shard_paths = _shard_paths(index_path, weight_map)
        parsed = {shard: _parse_safetensors(p) for shard, p in shard_paths.items()}
        files = list(parsed.values())
        locations = {}
        for name, shard in weight_map.items():
            entry = parsed[shard].entries.get(name)
            if entry is None:
                raise CheckpointFormatError(
                    f"'{index_path}' maps '{name}' to '{shard}', which holds no such tensor. The index and its shards "
                    "come from different saves; write them again together.",
                    path=shard_paths[shard],
                    name=name,
                )
            locations[name] = (parsed[shard], entry)
        # Storage order: shard by shard, front to back.
        order = {id(f): i for i, f in enumerate(files)}
        locations = dict(sorted(locations.items(), key=lambda item: (order[id(item[1][0])], item[1][1].begin)))

    # 2. Tied aliases: stored once, recorded in the metadata (see _ties_from).
    usable: dict[str, str] = {}
    for file in files:
        usable.update(_ties_from(file.metadata, locations))
    usable.update(_ties_from(index_meta, locations))
    infos: dict[str, TensorInfo] = {
        name: TensorInfo(name, entry.shape, entry.dtype, "tensor", (file.path,))
        for name, (file, entry) in locations.items()
    }
    for alias, source in usable.items():
        base = infos[source]
        infos[alias] = TensorInfo(alias, base.shape, base.dtype, base.kind, base.files, None, source)

    where = index_path.parent if index_path is not None else path
    dtypes = {e.dtype for _, e in locations.values() if e.dtype.is_floating_point}
    metadata = CheckpointMetadata(
        format="safetensors",
        path=where,
        train_dtype=dtypes.pop() if len(dtypes) == 1 else None,
        has_fp32_master=torch.float32 in {e.dtype for _, e in locations.values()},
        extra={
            "files": [f.path.name for f in files],
            "index": index_path.name if index_path is not None else None,
            "safetensors_metadata": dict(files[0].metadata) if files else {},
            "index_metadata": dict(index_meta),
        },
    )
    logger.debug("opened %s: safetensors, %d files, %d tensors", where, len(files), len(infos))
    return SafetensorsCheckpoint(metadata, infos, usable, locations, files)


# --------------------------------------------------------------------------- torch pickles


class TorchCheckpoint(Checkpoint):
    """A ``torch.save``'d state dict (``.bin``/``.pt``/``.pth``, Lightning ``.ckpt``, or a sharded ``.bin`` folder).

    Parsed with zeroio's restricted unpickler only: nothing in the file can run code.
    """

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        refs: dict[str, TensorRef],
        files: list[RankFile],
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._refs = refs
        self._files = files

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        self._refs[name].read(start, out.numel(), out)

    def _release(self) -> None:
        for file in self._files:
            file.close()


def _has_tensors(value: Any) -> bool:
    return isinstance(value, dict) and any(isinstance(v, TensorRef) for v in value.values())


def _find_state_dict(tree: Any, path: Path) -> tuple[dict[Any, Any], str | None]:
    """The state dict inside a torch file and the key it sat under (None for a bare state dict)."""
    if not isinstance(tree, dict):
        raise CheckpointFormatError(
            f"'{path}' holds a {type(tree).__name__}, not a state dict. Save model.state_dict() with torch.save.",
            path=path,
        )
    if _has_tensors(tree):
        return tree, None
    for key in _NESTED_STATE_DICT_KEYS:
        if _has_tensors(tree.get(key)):
            return tree[key], key
    keys = ", ".join(sorted(map(str, tree))[:8])
    raise CheckpointFormatError(
        f"'{path}' holds no tensors at its top level nor under {', '.join(repr(k) for k in _NESTED_STATE_DICT_KEYS)} "
        f"(top-level keys: {keys or 'none'}). Save model.state_dict() with torch.save.",
        path=path,
    )


def _tie_key(ref: TensorRef) -> tuple[Any, ...]:
    return (id(ref.file), ref.storage.key, ref.storage.dtype, ref.storage_offset, ref.shape, ref.stride)


def _open_torch(path: Path, index_path: Path | None, trusted: frozenset[str]) -> TorchCheckpoint:
    # 1. Unpickle each file (restricted, lazy: tensors are references into the archive).
    files: list[RankFile] = []
    refs: dict[str, TensorRef] = {}
    skipped: list[str] = []
    nested_key: str | None = None
    client: dict[str, Any] = {}
    if index_path is None:
        shard_paths = {path.name: path}
        weight_map: dict[str, str] | None = None
    else:
        weight_map, _ = _read_index(index_path)
        shard_paths = _shard_paths(index_path, weight_map)
    try:
        for shard, shard_path in shard_paths.items():
            tree, file = load_pickle(shard_path, trusted_globals=trusted)
            files.append(file)
            state, nested_key = _find_state_dict(tree, shard_path)
            if nested_key is not None:
                client = {str(k): v for k, v in tree.items() if k != nested_key}
            for key, value in state.items():
                if not isinstance(key, str) or not isinstance(value, TensorRef):
                    skipped.append(str(key))  # e.g. a module's `_extra_state`; not a tensor
                    continue
                if weight_map is not None and weight_map.get(key) != shard:
                    continue  # the index is the truth for which shard holds a name (Hugging Face semantics)
                refs[key] = value
        if weight_map is not None:
            absent = [k for k in weight_map if k not in refs]
            if absent:
                raise CheckpointFormatError(
                    f"'{index_path}' maps '{absent[0]}' to '{weight_map[absent[0]]}', which holds no such tensor "
                    f"({len(absent)} names missing). The index and its shards come from different saves.",
                    path=shard_paths[weight_map[absent[0]]],
                    name=absent[0],
                )
    except BaseException:
        for file in files:
            file.close()
        raise

    # 2. Tensors that share one storage view (torch.save keeps ties) become aliases of the first name.
    first: dict[tuple[Any, ...], str] = {}
    tied: dict[str, str] = {}
    infos: dict[str, TensorInfo] = {}
    for name, ref in refs.items():
        source = first.setdefault(_tie_key(ref), name)
        if source != name:
            tied[name] = source
        infos[name] = TensorInfo(
            name, ref.shape, ref.dtype, "tensor", (ref.file.path,), None, source if source != name else None
        )

    step = client.get("global_step")
    dtypes = {r.dtype for r in refs.values() if r.dtype.is_floating_point}
    metadata = CheckpointMetadata(
        format="torch",
        path=index_path.parent if index_path is not None else path,
        global_step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        train_dtype=dtypes.pop() if len(dtypes) == 1 else None,
        has_fp32_master=torch.float32 in {r.dtype for r in refs.values()},
        extra={
            "files": [f.path.name for f in files],
            "index": index_path.name if index_path is not None else None,
            "state_dict_key": nested_key,
            "client_state_keys": sorted(client),
            "lightning_version": client.get("pytorch-lightning_version"),
            "skipped_keys": skipped,
        },
    )
    logger.debug("opened %s: torch, %d files, %d tensors", metadata.path, len(files), len(infos))
    return TorchCheckpoint(metadata, infos, tied, refs, files)


# --------------------------------------------------------------------------- dispatch


def open_consolidated(path: Path, *, trusted_globals: frozenset[str] = frozenset()) -> Checkpoint:
    """Open a consolidated checkpoint lazily: read headers/pickles now, tensor bytes only when asked.

    Args:
        path: a ``.safetensors`` file, a torch ``.bin``/``.pt``/``.pth``/``.ckpt`` file, an index file
            (``*.index.json``), or a folder holding ``model.safetensors``, ``model.safetensors.index.json``,
            ``pytorch_model.bin`` or ``pytorch_model.bin.index.json`` (safetensors first, as transformers does).
        trusted_globals: extra pickle globals to accept in torch files, rebuilt as inert data (never called).

    Returns:
        A :class:`~zeroio.Checkpoint` with ``metadata.format`` ``"safetensors"`` or ``"torch"``.

    Raises:
        CheckpointNotFoundError: the path or a shard is missing.
        CheckpointFormatError: the file is not a checkpoint zeroio can read (subclasses say how).

    Example:
        >>> with zeroio.open("out/model.safetensors") as ckpt:  # doctest: +SKIP
        ...     ckpt.metadata.format, ckpt.tied
        ('safetensors', {'head.weight': 'emb.weight'})
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"Checkpoint path '{path}' does not exist.", path=path)
    if path.is_dir():
        for name in (C.SAFETENSORS_SINGLE, C.SAFETENSORS_INDEX, C.TORCH_SINGLE, C.TORCH_INDEX):
            if (path / name).is_file():
                return open_consolidated(path / name, trusted_globals=trusted_globals)
        raise CheckpointNotFoundError(
            f"'{path}' holds none of {C.SAFETENSORS_SINGLE}, {C.SAFETENSORS_INDEX}, {C.TORCH_SINGLE}, "
            f"{C.TORCH_INDEX}. Pass the checkpoint file itself.",
            path=path,
        )
    if path.name.endswith(".index.json"):
        weight_map, _ = _read_index(path)
        shards = list(dict.fromkeys(weight_map.values()))
        if shards and all(s.endswith(".safetensors") for s in shards):
            return _open_safetensors(path, path)
        return _open_torch(path, path, trusted_globals)
    if path.suffix == ".safetensors":
        return _open_safetensors(path, None)
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic != b"PK" and magic[:1] != b"\x80":
        # Not a torch zip (nor a legacy pickle): maybe a safetensors file under another name.
        try:
            return _open_safetensors(path, None)
        except CheckpointFormatError:
            pass  # load_pickle's message says what the file is not
    return _open_torch(path, None, trusted_globals)
