"""Safetensors checkpoints (one file or a sharded folder): headers parsed and checked, tensor bytes read lazily."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._constants import SAFETENSORS_MAX_HEADER_SIZE
from ..._dtypes import BY_NAME, BY_SAFETENSORS, SAFETENSORS_ORDER, DType
from ..._io.byte_map import ConcatMap
from ..._io.confine import require_regular_file
from ..._io.sources import ByteSource, open_source
from ..._messages import get_logger
from ..._pickles import MAX_DIMS, too_large
from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError, ZeroIOError
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo
from .shard_index import read_index, shard_paths

if TYPE_CHECKING:
    import torch

__all__ = ["SafetensorsCheckpoint", "open_safetensors", "parse_safetensors"]

logger = get_logger(__name__)

_RESERVED_METADATA = frozenset({"format", "total_size"})
"""Metadata keys that are never tie records (safetensors' ``format``, an index's ``total_size``)."""


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a safetensors header."""

    dtype: DType
    shape: tuple[int, ...]
    begin: int
    """Byte offset of the tensor's data from the start of the file."""


@dataclass(eq=False)
class _SafetensorsFile:
    """One ``.safetensors`` file: its parsed header and lazy access to its bytes."""

    path: Path
    entries: dict[str, _Entry]
    metadata: dict[str, str]
    source: ByteSource = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.source = open_source(self.path)

    def read(self, entry: _Entry, start: int, out: torch.Tensor) -> None:
        self.source.read_into(entry.begin + start * out.element_size(), out)

    def close(self) -> None:
        self.source.close()


def _torch_has(dtype: DType) -> bool:
    """Whether the installed torch has ``dtype`` (every one zeroio names, in the torch it is tested with).

    Answered without importing torch for the dtypes every torch since 2.1 has."""
    if dtype.name in _ALWAYS:
        return True
    import torch

    return hasattr(torch, dtype.name)


_ALWAYS = frozenset({"bool", "uint8", "int8", "int16", "float16", "bfloat16", "int32", "float32", "float64", "int64"})
_ALWAYS |= {"complex64", "float8_e5m2", "float8_e4m3fn"}


def _bad(path: Path, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"'{path}' is not a valid safetensors file: {what}. Re-save it with safetensors.torch.save_file.", path=path
    )


def _truncated(path: Path, what: str) -> CheckpointFormatError:
    """A file shorter than its own header says: a cut-short copy or download, which re-saving would not fix."""
    return CheckpointFormatError(
        f"'{path}' is truncated: {what}. The copy or download was cut short: copy the file again from its source.",
        path=path,
    )


def _parse_safetensors(path: Path) -> _SafetensorsFile:
    """Read and validate a safetensors header (8-byte little-endian length + JSON); no tensor bytes."""
    try:
        require_regular_file(path)  # a FIFO would block the read
        size = path.stat().st_size
        with path.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise _truncated(path, f"it holds {size} bytes, fewer than the 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > SAFETENSORS_MAX_HEADER_SIZE:
                raise _bad(
                    path, f"its header claims {length} bytes, over the format's limit of {SAFETENSORS_MAX_HEADER_SIZE}"
                )
            if length > size - 8:
                raise _truncated(path, f"its header claims {length} bytes, the file holds {size}")
            raw = fh.read(length)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"'{path}' does not exist.", path=path) from exc
    except ZeroIOError:
        raise  # already one line naming the object (a remote source's refusal, timeout or bad response)
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
    spans: list[tuple[int, int, str]] = []
    for name, spec in header.items():
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
            raise _bad(path, f"the entry for '{name}' lacks dtype, shape or data_offsets")
        dtype_name = spec["dtype"]
        dtype = BY_SAFETENSORS.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None or not _torch_has(dtype):
            import torch

            known = ", ".join(d.safetensors or "" for d in SAFETENSORS_ORDER if _torch_has(d))
            raise UnsupportedCheckpointError(
                f"'{path}': tensor '{name}' has dtype {dtype_name!r}, which zeroio cannot read with torch "
                f"{torch.__version__.split('+')[0]} (known: {known}).",
                path=path,
                name=str(name),
                found=dtype_name,
            )
        shape = spec["shape"]
        offsets = spec["data_offsets"]
        if not (
            isinstance(shape, list)
            and len(shape) <= MAX_DIMS
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            and not too_large(tuple(shape))
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
        if begin >= 0 and end - begin == needed and end > data_size:
            raise _truncated(
                path, f"'{name}' ends at byte {end} of the data section, the file holds {data_size} bytes of data"
            )
        if begin < 0 or end - begin != needed:
            raise _bad(
                path,
                f"'{name}' {tuple(shape)} {dtype_name} needs {needed} bytes, its data_offsets are [{begin}, {end}] "
                f"in a data section of {data_size} bytes",
            )
        entries[str(name)] = _Entry(dtype, tuple(shape), data_start + begin)
        spans.append((begin, end, str(name)))
    _check_contiguous(path, spans, data_size)
    # Storage order, so iterating the checkpoint reads each file front to back.
    ordered = dict(sorted(entries.items(), key=lambda item: item[1].begin))
    return _SafetensorsFile(path, ordered, metadata)


def parse_safetensors(path: Path) -> _SafetensorsFile:
    """One file's header parsed and checked (entries in storage order, ``__metadata__``), its bytes lazily
    readable through ``.source``; nothing else read. For readers of layouts made of safetensors files."""
    return _parse_safetensors(path)


def _check_contiguous(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """safetensors' own rules (``Metadata::validate`` and ``read_metadata`` in its Rust crate): sorted by offsets,
    the tensors' byte ranges run back to back from 0, so none overlaps another or leaves a gap, and the last one
    ends exactly at the end of the file. Two names over one range would alias each other's bytes."""
    expected = 0
    for begin, end, name in sorted(spans):
        if begin != expected:
            problem = (
                f"overlaps the tensor before it (which ends at byte {expected})"
                if begin < expected
                else (f"leaves bytes [{expected}, {begin}) that no tensor covers")
            )
            raise CheckpointFormatError(
                f"'{path}' is not a valid safetensors file: tensor '{name}' starts at byte {begin} of the data "
                f"section and {problem}; tensors must be contiguous from byte 0 without overlapping. Re-save it "
                "with safetensors.torch.save_file.",
                path=path,
                name=name,
            )
        expected = end
    if expected != data_size:
        raise _bad(
            path,
            f"its tensors end at byte {expected} of a data section of {data_size} bytes, leaving "
            f"{data_size - expected} bytes that no tensor covers",
        )


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

    def byte_map(self, name: str) -> ConcatMap:
        file, entry = self._locations[name]
        return ConcatMap([(file.source, entry.begin, entry.dtype.itemsize * prod(entry.shape))], entry.dtype.itemsize)

    def _release(self) -> None:
        for file in self._files:
            file.close()


def open_safetensors(path: Path, index_path: Path | None) -> SafetensorsCheckpoint:
    """Open one safetensors file, or the shards ``index_path`` names; headers only, no tensor bytes."""
    # 1. Parse every header (no tensor bytes) and decide which file holds which name.
    if index_path is None:
        files = [_parse_safetensors(path)]
        locations = {name: (files[0], entry) for name, entry in files[0].entries.items()}
        index_meta: dict[str, Any] = {}
    else:
        weight_map, index_meta = read_index(index_path)
        paths_by_shard = shard_paths(index_path, weight_map)
        parsed = {shard: _parse_safetensors(p) for shard, p in paths_by_shard.items()}
        files = list(parsed.values())
        locations = {}
        for name, shard in weight_map.items():
            entry = parsed[shard].entries.get(name)
            if entry is None:
                raise CheckpointFormatError(
                    f"'{index_path}' maps '{name}' to '{shard}', which holds no such tensor. The index and its shards "
                    "come from different saves; write them again together.",
                    path=paths_by_shard[shard],
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
        infos[alias] = TensorInfo(alias, base.shape, base.dtype_spec, base.kind, base.files, None, source)

    where = index_path.parent if index_path is not None else path
    dtypes = {e.dtype for _, e in locations.values() if e.dtype.is_floating_point}
    metadata = CheckpointMetadata(
        format="safetensors",
        path=where,
        train_dtype=dtypes.pop() if len(dtypes) == 1 else None,
        has_fp32_master=BY_NAME["float32"] in {e.dtype for _, e in locations.values()},
        extra={
            "files": [f.path.name for f in files],
            "index": index_path.name if index_path is not None else None,
            "safetensors_metadata": dict(files[0].metadata) if files else {},
            "index_metadata": dict(index_meta),
        },
    )
    logger.debug("opened %s: safetensors, %d files, %d tensors", where, len(files), len(infos))
    return SafetensorsCheckpoint(metadata, infos, usable, locations, files)
