"""A DCP ``.metadata`` tree (inert records, :mod:`zeroio._pickles.dcp_metadata_unpickler`) checked into typed entries.

Every fact a reader later trusts is checked here, before any tensor byte is read: each item's data lies inside a
file of the folder, each tensor's chunks lie inside the tensor, cover it exactly once and fit the bytes stored for
them, and no size is larger than the files can back.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._dtypes import DType
from ..._pickles import MAX_DIMS, Inert, global_name, inert_parts, is_inert, short_repr, too_large
from ...errors import CheckpointFormatError, UnsupportedCheckpointError

__all__ = [
    "BytesEntry",
    "Chunk",
    "DcpMetadata",
    "TensorEntry",
    "check_tiling",
    "chunk_mismatch",
    "parse_dcp_metadata",
]

_HOME = "torch.distributed.checkpoint.metadata"
_TENSOR = f"{_HOME}.TensorStorageMetadata"
_BYTES = f"{_HOME}.BytesStorageMetadata"


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a tensor: a box of the full tensor, saved as its own archive in a data file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    """The data file (a name inside the folder)."""
    offset: int
    length: int
    stored: tuple[int, ...] | None = None
    """The shape of the tensor in the archive when it differs from ``sizes`` (a Megatron layer: ``(1, *sizes)``)."""

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape the chunk's archive must hold: its elements are laid out row-major in it."""
        return self.sizes if self.stored is None else self.stored


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the checkpoint: its full shape and dtype, and its chunks."""

    fqn: str
    dtype: DType
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class BytesEntry:
    """A non-tensor value (``BytesStorageMetadata``): ``torch.save`` bytes at ``[offset, offset + length)``."""

    fqn: str
    file: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class DcpMetadata:
    """What ``.metadata`` says, checked."""

    tensors: dict[str, TensorEntry]
    values: dict[str, BytesEntry]
    version: str | None
    save_id: str | None
    files: tuple[str, ...]


def _bad(path: Path, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"'{path}' is not valid DCP metadata: {what}. The checkpoint is corrupted or hostile; copy it again from "
        "where it was saved.",
        path=path,
    )


def _fields(obj: Any, expected: str, path: Path, where: str) -> dict[str, Any]:
    if not is_inert(obj) or global_name(obj) != expected:
        name = global_name(obj) or type(obj).__name__
        raise _bad(path, f"{where} is a {name}, not a {expected.rsplit('.', 1)[-1]}")
    return inert_parts(obj).state


def _int(value: Any, path: Path, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(path, f"{where} is {short_repr(value)}, not a non-negative int")
    return value


def _dims(value: Any, path: Path, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
        raise _bad(path, f"{where} is not a shape of at most {MAX_DIMS} dimensions")
    return tuple(_int(v, path, where) for v in value)


def _shape(value: Any, path: Path, fqn: str) -> tuple[int, ...]:
    """A tensor's size: a shape whose dimension, or product of non-zero dimensions, passes int64 is refused (an
    empty ``(0, 2**64)`` raised a bare TypeError in torch and made a safetensors file safetensors refuses)."""
    shape = _dims(value, path, f"the size of '{fqn}'")
    if too_large(shape):
        raise _bad(path, f"the size of '{fqn}' is {short_repr(shape)}, larger than any tensor can be (2**63 - 1)")
    return shape


def _dtype(properties: Any, path: Path, fqn: str) -> DType:
    state = _properties_state(properties, path, fqn)
    dtype = state[0] if isinstance(state, tuple) and state else state.get("dtype") if isinstance(state, dict) else None
    if not isinstance(dtype, DType):
        raise _bad(path, f"tensor '{fqn}' has no readable dtype ({short_repr(dtype)})")
    return dtype


def _properties_state(properties: Any, path: Path, fqn: str) -> Any:
    name = global_name(properties)
    if not is_inert(properties) or name is None or not name.endswith(".TensorProperties"):
        raise _bad(path, f"tensor '{fqn}' has properties of type {name or type(properties).__name__}")
    parts = inert_parts(properties)
    return parts.state.get("_state") if parts.opaque_state else parts.state


def _storage_index(storage: Any, path: Path) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    """``(fqn, chunk offsets or None) -> (file, offset, length)`` from ``storage_data``."""
    if not isinstance(storage, dict):
        raise _bad(path, "storage_data is not a mapping")
    found: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for key, info in storage.items():
        index = _fields(key, f"{_HOME}.MetadataIndex", path, "a storage_data key")
        fqn = index.get("fqn")
        if not isinstance(fqn, str):
            raise _bad(path, "a storage_data key has no fqn")
        offset = index.get("offset")
        at = None if offset is None else _dims(offset, path, f"the offset of '{fqn}'")
        fields = _fields(info, "torch.distributed.checkpoint.filesystem._StorageInfo", path, f"storage of '{fqn}'")
        transforms = fields.get("transform_descriptors")
        if transforms:
            raise UnsupportedCheckpointError(
                f"'{path}' stores '{fqn}' through the stream transforms {short_repr(transforms)} (e.g. zstd "
                "compression), which zeroio does not read. Save the checkpoint without a transform extension.",
                path=path,
                name=fqn,
            )
        file = fields.get("relative_path")
        if (
            not isinstance(file, str)
            or not file
            or "/" in file
            or "\\" in file
            or file in (".", "..")
            or "\0" in file
            or file.startswith(".")
        ):
            raise _bad(
                path, f"'{fqn}' names the data file {short_repr(file)}, which is not a file name inside the folder"
            )
        found[(fqn, at)] = (
            file,
            _int(fields.get("offset"), path, f"the offset of '{fqn}'"),
            _int(fields.get("length"), path, f"the length of '{fqn}'"),
        )
    return found


def _refuse_shared_bytes(index: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]], path: Path) -> None:
    """Each item owns its bytes: DCP appends every item to its file once, so two entries whose byte ranges meet are
    refused. 150 values naming one 16 MiB range were each read and held (2.4 GB); chunks sharing one archive had
    its zip directory parsed once per chunk (200k entries, minutes per tensor)."""
    ranges = sorted((file, offset, length, fqn) for (fqn, _), (file, offset, length) in index.items() if length)
    for (file, offset, length, fqn), (file2, offset2, _, fqn2) in itertools.pairwise(ranges):
        if file == file2 and offset + length > offset2:
            raise _bad(path, f"'{fqn}' and '{fqn2}' share the bytes of '{file}' from byte {offset2}")


MAX_GRID_CELLS = 1 << 22
"""Most cells of a tensor's chunk grid checked (4M): a sharded layout (rows, columns, FSDP over TP) has about one
cell per chunk; a grid much larger than its chunks only comes from chunks cut at unrelated places."""


def _check_tiling(path: Path, fqn: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """Chunks lie inside the tensor, do not overlap and together cover it.

    Checked on the grid the chunks' edges cut the tensor into: each chunk marks the cells it spans, a cell marked
    twice is an overlap, a cell never marked a hole. The work is the number of cells (about the number of chunks
    for any sharded layout), never chunk pairs: 50,000 chunks side by side are 50,000 cells, not 10**9 pairs.
    """
    total = 0
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            raise _bad(path, f"a chunk of '{fqn}' has {len(c.offsets)} dimensions, the tensor {len(shape)}")
        if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            raise _bad(path, f"a chunk of '{fqn}' at {c.offsets} of size {c.sizes} reaches outside its shape {shape}")
        total += c.numel
    numel = 1
    for d in shape:
        numel *= d
    live = [c for c in chunks if c.numel]
    edges = [
        sorted({0, n, *(c.offsets[d] for c in live), *(c.offsets[d] + c.sizes[d] for c in live)})
        for d, n in enumerate(shape)
    ]
    cells = 1
    for e in edges:
        cells *= max(1, len(e) - 1)
    if cells > max(MAX_GRID_CELLS, 8 * len(live)):
        raise UnsupportedCheckpointError(
            f"'{path}': the {len(live)} chunks of '{fqn}' cut it into a grid of {cells} cells; zeroio checks grids up "
            f"to {MAX_GRID_CELLS}. Chunks cut at unrelated places are not what DCP writes.",
            path=path,
            name=fqn,
        )
    owner = [0] * (cells if numel else 0)  # 1 + the index of the chunk holding each cell
    for i, c in enumerate(live):
        spans = [range(bisect_left(e, o), bisect_left(e, o + n)) for e, o, n in zip(edges, c.offsets, c.sizes)]
        for cell in _cells(spans, edges):
            if owner[cell]:
                other = live[owner[cell] - 1]
                raise _bad(path, f"chunks of '{fqn}' at {other.offsets} and {c.offsets} overlap")
            owner[cell] = i + 1
    if total != numel or (numel and not all(owner)):
        raise _bad(path, f"the chunks of '{fqn}' hold {total} elements, its shape {shape} has {numel}")


def check_tiling(path: Path, fqn: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """Chunks lie inside the tensor, do not overlap and together cover it (see ``_check_tiling``); raises
    CheckpointFormatError naming ``path`` and ``fqn`` otherwise."""
    _check_tiling(path, fqn, shape, chunks)


def _cells(spans: list[range], edges: list[list[int]]) -> Iterator[int]:
    """Flat indices (row-major over the grid) of the cells in the box ``spans``."""
    flat = [0]
    for span, e in zip(spans, edges):
        width = max(1, len(e) - 1)
        flat = [f * width + j for f in flat for j in span]
    yield from flat


def parse_dcp_metadata(path: Path, tree: Any, file_size: Callable[[str], int]) -> DcpMetadata:
    """Check the ``.metadata`` tree read from ``path``; ``file_size(name)`` is a data file's size (or raises)."""
    top = _fields(tree, f"{_HOME}.Metadata", path, "the top-level object")
    entries = top.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise _bad(path, "state_dict_metadata is not a mapping")
    index = _storage_index(top.get("storage_data"), path)
    sizes: dict[str, int] = {}

    def located(fqn: str, at: tuple[int, ...] | None) -> tuple[str, int, int]:
        found = index.get((fqn, at))
        if found is None:
            raise _bad(path, f"'{fqn}' has a chunk at {at} that storage_data does not place in any file")
        file, offset, length = found
        if file not in sizes:
            sizes[file] = file_size(file)
        if offset + length > sizes[file]:
            raise _bad(
                path,
                f"'{fqn}' lies at bytes [{offset}, {offset + length}) of '{file}', which holds {sizes[file]} bytes",
            )
        return found

    tensors: dict[str, TensorEntry] = {}
    values: dict[str, BytesEntry] = {}
    lists: dict[int, str] = {}  # id of each tensor's chunk list -> its tensor: work stays bounded by the file's bytes
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise _bad(path, f"a key of state_dict_metadata is a {type(fqn).__name__}")
        kind = global_name(entry)
        if kind == _BYTES:
            file, offset, length = located(fqn, None)
            values[fqn] = BytesEntry(fqn, file, offset, length)
            continue
        fields = _fields(entry, _TENSOR, path, f"the entry of '{fqn}'")
        dtype = _dtype(fields.get("properties"), path, fqn)
        shape = _shape(fields.get("size"), path, fqn)
        raw_chunks = fields.get("chunks")
        if not isinstance(raw_chunks, list):
            raise _bad(path, f"the chunks of '{fqn}' are not a list")
        if lists.setdefault(id(raw_chunks), fqn) != fqn:  # a pickle reference: one list for many tensors
            raise _bad(path, f"'{fqn}' and '{lists[id(raw_chunks)]}' share one list of chunks")
        chunks = []
        seen: set[int] = set()
        for raw in raw_chunks:
            if id(raw) in seen:  # the same chunk referenced again (1M references took a minute and 0.8 GB)
                raise _bad(path, f"'{fqn}' lists the same chunk twice")
            seen.add(id(raw))
            c = _fields(raw, f"{_HOME}.ChunkStorageMetadata", path, f"a chunk of '{fqn}'")
            offsets = _dims(c.get("offsets"), path, f"a chunk offset of '{fqn}'")
            csizes = _dims(c.get("sizes"), path, f"a chunk size of '{fqn}'")
            n = 1
            for s in csizes:
                n *= s
            file, offset, length = located(fqn, offsets) if n else ("", 0, 0)
            if n * dtype.itemsize > length:
                raise _bad(
                    path,
                    f"a chunk of '{fqn}' of {n} {dtype.name} elements is stored in {length} bytes, fewer than it needs",
                )
            chunks.append(Chunk(offsets, csizes, file, offset, length))
        _check_tiling(path, fqn, shape, chunks)
        tensors[fqn] = TensorEntry(fqn, dtype, shape, tuple(chunks))
    _refuse_shared_bytes(index, path)  # after the bounds of each item, before any is read
    version = top.get("version")
    storage_meta = top.get("storage_meta")
    save_id = None
    if isinstance(storage_meta, Inert):
        sid = inert_parts(storage_meta).state.get("save_id")
        save_id = sid if isinstance(sid, str) else None
    return DcpMetadata(
        tensors=tensors,
        values=values,
        version=version if isinstance(version, str) else None,
        save_id=save_id,
        files=tuple(sorted(sizes)),
    )


def chunk_mismatch(where: Path, found: str, found_shape: tuple[int, ...] | None, entry: TensorEntry, i: int) -> str:
    """Why chunk ``i`` of ``entry`` is refused: the archive at its place holds ``found``, not the recorded chunk.

    Where one of the two is empty and the other is not, torch itself wrote the wrong place: FSDP2 over tensor-parallel
    shards of the same dim (``_StridedShard``) records an empty shard at the offset of the rank after it and that
    rank's rows past the end (torch 2.13, e.g. 7 rows, tensor parallel 2, data parallel 3); torch's own ``dcp.load``
    fails on such a folder too.
    """
    chunk = entry.chunks[i]
    head = (
        f"'{where}' holds {found} at byte {chunk.offset} where .metadata places a {entry.dtype.name} chunk of "
        f"'{entry.fqn}' of shape {chunk.stored_shape}"
    )
    one_empty = found_shape is not None and (math.prod(found_shape) == 0) != (chunk.numel == 0)
    if one_empty and found_shape is not None and len(found_shape) == len(chunk.stored_shape):
        return (
            f"{head} at offsets {chunk.offsets}: torch recorded a wrong place for an empty shard (FSDP2 over "
            "tensor-parallel shards of one dim, where a dim leaves a rank no rows), and torch's own dcp.load "
            "fails on this folder too. Save the model again from the run with get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True)), or with data- and tensor-parallel sizes that leave "
            "no rank an empty shard."
        )
    return f"{head}. The folder's files come from different saves or were edited; copy the checkpoint again from where it was saved."
