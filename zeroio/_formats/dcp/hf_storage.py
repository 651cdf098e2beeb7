"""DCP saved through torch's ``HuggingFaceStorageWriter`` (torchtitan's ``last_save_in_hf``): per-rank safetensors.

Each rank writes ``shard-<rank+1>-model-<K>-of-<N>.safetensors`` files holding its local shards under full names;
the header's ``__metadata__`` records ``DCP_SHARDING_INFO`` = ``{name: {"saved_offsets": [...]}}`` and nothing
else: no ``.metadata``, no index, no global shape. A tensor's shape is the largest ``offset + local size`` over
every file, and its pieces must tile that box exactly (no overlap, no gap) or the folder is refused. Tensor bytes
are read lazily, only the byte ranges asked for (the chunk arithmetic of :mod:`.chunk_plans`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._dtypes import FLOAT32
from ..._io.sources import ByteRange, ByteSource
from ..._messages import get_logger
from ..._pickles import MAX_DIMS, short_repr
from ...errors import CheckpointFormatError, CheckpointNotFoundError
from ..checkpoint import Checkpoint
from ..files.safetensors_reader import parse_safetensors
from ..metadata import CheckpointMetadata, TensorInfo
from ..options import ReadOptions
from .chunk_plans import EntryMap, concat_ranges, read_entry_into
from .metadata import Chunk, TensorEntry, check_tiling

if TYPE_CHECKING:
    import torch

__all__ = ["HfStorageCheckpoint", "is_dcp_hf", "open_dcp_hf"]

logger = get_logger(__name__)

SHARD_FILE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
"""torch's ``_hf_utils.SHARDED_FILE_NAME`` (``shard-{shard_idx}-model-{cpt_idx}-of-{num_files}``, 5 digits)."""
SHARDING_INFO = "DCP_SHARDING_INFO"
SAVED_OFFSETS = "saved_offsets"
SHARDED_DIR = "sharded"
"""Where the writer puts the shards when it also consolidates (``enable_consolidation=True``)."""
_STEP = re.compile(r"^step-(\d+)$")


def _shard_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if SHARD_FILE.match(p.name)) if folder.is_dir() else []


def _holds_shards(folder: Path) -> bool:
    return bool(_shard_files(folder)) or bool(_shard_files(folder / SHARDED_DIR))


def _steps(path: Path) -> dict[int, Path]:
    found = {}
    for child in path.iterdir():
        m = _STEP.match(child.name)
        if m and child.is_dir() and _holds_shards(child):
            found[int(m.group(1))] = child
    return found


def is_dcp_hf(path: Path) -> bool:
    """True for a folder of ``shard-R-model-K-of-N.safetensors`` files (or its ``sharded/`` parent without
    consolidated files beside it), one such file, or a torchtitan folder of ``step-N/`` holding them (names only)."""
    if path.is_file():
        return bool(SHARD_FILE.match(path.name))
    if not path.is_dir():
        return False
    if _shard_files(path):
        return True
    if _shard_files(path / SHARDED_DIR):
        return not any(p.suffix == ".safetensors" for p in path.iterdir())  # consolidated beside: read those
    return bool(_steps(path))


def _folder(path: Path, tag: str | None) -> tuple[Path, str | None]:
    """The folder holding the shard files and its step tag."""
    if path.is_file():
        path = path.parent
    for candidate in (path, path / SHARDED_DIR):
        if _shard_files(candidate):
            step = candidate if _STEP.match(candidate.name) else candidate.parent
            return candidate, step.name if _STEP.match(step.name) else None
    steps = _steps(path)
    chosen = path / tag if tag is not None else steps[max(steps)]
    if not chosen.is_dir() or not _holds_shards(chosen):
        found = ", ".join(p.name for _, p in sorted(steps.items())) or "none"
        raise CheckpointNotFoundError(
            f"'{path}' has no step folder '{tag}' holding shards (found: {found}).", path=chosen
        )
    return _folder(chosen, None)


@dataclass(frozen=True, slots=True)
class _Pieces:
    """A tensor as boxes in shard files: chunk ``i`` lies at ``sources[i]`` from byte ``chunk.offset``."""

    entry: TensorEntry
    sources: tuple[ByteSource, ...]

    def place(self, i: int) -> tuple[ByteSource, int]:
        return self.sources[i], self.entry.chunks[i].offset


class HfStorageCheckpoint(Checkpoint):
    """A DCP saved as per-rank safetensors by ``HuggingFaceStorageWriter``; build it with ``zeroio.open``."""

    def __init__(
        self, metadata: CheckpointMetadata, infos: dict[str, TensorInfo], pieces: dict[str, _Pieces], files: list[Any]
    ) -> None:
        super().__init__(metadata, infos, {})
        self._pieces = pieces
        self._files = files

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        pieces = self._pieces[name]
        each = pieces.entry.dtype.itemsize

        def read(i: int, first: int, dest: torch.Tensor) -> None:
            source, at = pieces.place(i)
            source.read_into(at + first * each, dest)

        read_entry_into(pieces.entry, start, out, read)

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        pieces = self._pieces[name]
        return concat_ranges(pieces.entry, pieces.place)

    def byte_map(self, name: str) -> EntryMap:
        pieces = self._pieces[name]
        return EntryMap(pieces.entry, pieces.place)

    def _release(self) -> None:
        for file in self._files:
            file.close()


def _bad(path: Path, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"'{path}' is not a shard HuggingFaceStorageWriter writes: {what}. Copy the checkpoint folder again from "
        "where it was saved.",
        path=path,
    )


def _offsets(file: Any) -> dict[str, tuple[int, ...]]:
    """``name -> saved offsets`` of one shard file, checked against its header's tensors."""
    raw = file.metadata.get(SHARDING_INFO)
    try:
        info = json.loads(raw) if raw is not None else None
    except ValueError as exc:
        raise _bad(file.path, f"its {SHARDING_INFO} is not JSON ({exc})") from exc
    if not isinstance(info, dict):
        raise _bad(file.path, f"its header's __metadata__ has no {SHARDING_INFO} mapping")
    found: dict[str, tuple[int, ...]] = {}
    for name, entry in file.entries.items():
        record = info.get(name)
        offsets = record.get(SAVED_OFFSETS) if isinstance(record, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != len(entry.shape)
            or len(offsets) > MAX_DIMS
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        ):
            raise _bad(file.path, f"'{name}' of shape {entry.shape} has saved offsets {short_repr(offsets)}")
        found[name] = tuple(offsets)
    return found


def _assemble(folder: Path, files: list[Any]) -> dict[str, _Pieces]:
    """Each tensor's pieces over all files; its shape the largest offset + size; the pieces tile it."""
    parts: dict[str, list[tuple[Any, Any, tuple[int, ...]]]] = {}
    for file in files:
        for name, offsets in _offsets(file).items():
            parts.setdefault(name, []).append((file, file.entries[name], offsets))
    pieces: dict[str, _Pieces] = {}
    for name, found in parts.items():
        dtypes = {entry.dtype for _, entry, _ in found}
        if len(dtypes) != 1:
            kinds = ", ".join(sorted(d.name for d in dtypes))
            raise _bad(found[0][0].path, f"'{name}' is stored as {kinds} in different files")
        ndim = len(found[0][2])
        if any(len(offsets) != ndim for _, _, offsets in found):
            raise _bad(found[0][0].path, f"the pieces of '{name}' have different numbers of dimensions")
        shape = tuple(max(o[d] + e.shape[d] for _, e, o in found) for d in range(ndim))
        each = dtypes.pop().itemsize
        chunks = [Chunk(o, e.shape, f.path.name, e.begin, each * _numel(e.shape)) for f, e, o in found]
        check_tiling(folder, name, shape, chunks)
        entry = TensorEntry(name, found[0][1].dtype, shape, tuple(chunks))
        pieces[name] = _Pieces(entry, tuple(f.source for f, _, _ in found))
    return pieces


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_names(folder: Path, paths: list[Path]) -> None:
    """Shard indices run 1..S without a hole and every file agrees on N: a lost rank's files are named."""
    ranks = sorted({int(SHARD_FILE.match(p.name).group(1)) for p in paths})  # type: ignore[union-attr]
    totals = {int(SHARD_FILE.match(p.name).group(3)) for p in paths}  # type: ignore[union-attr]
    missing = sorted(set(range(1, ranks[-1] + 1)) - set(ranks))
    if missing or len(totals) != 1:
        what = f"no files of shard(s) {missing[:5]}" if missing else f"files saying 'of' {sorted(totals)}"
        raise CheckpointFormatError(
            f"'{folder}' holds {what}: a rank failed to save or files of two saves are mixed. Copy the whole "
            "folder of one save.",
            path=folder,
        )


def open_dcp_hf(path: Path, options: ReadOptions) -> HfStorageCheckpoint:
    """Open a HuggingFaceStorageWriter checkpoint: every shard file's header, no tensor bytes."""
    folder, step = _folder(path, options.tag)
    paths = _shard_files(folder)
    _check_names(folder, paths)
    files: list[Any] = []
    try:
        for p in paths:
            files.append(parse_safetensors(p))
        pieces = _assemble(folder, files)
    except BaseException:
        for file in files:
            file.close()
        raise
    infos = {
        name: TensorInfo(
            name,
            p.entry.shape,
            p.entry.dtype,
            "tensor",
            tuple(dict.fromkeys(folder / c.file for c in p.entry.chunks if c.numel)),
        )
        for name, p in pieces.items()
    }
    floats = {p.entry.dtype for p in pieces.values() if p.entry.dtype.is_floating_point}
    train = floats.pop() if len(floats) == 1 else None
    metadata = CheckpointMetadata(
        format="dcp",
        path=folder,
        tag=step,
        train_dtype=train,
        has_fp32_master=train == FLOAT32,
        layout="hf-storage",
        extra={
            "files": [p.name for p in paths],
            "dcp_version": files[0].metadata.get("DCP_VERSION") if files else None,
        },
    )
    logger.debug("opened %s: DCP as safetensors, %d files, %d tensors", folder, len(paths), len(infos))
    return HfStorageCheckpoint(metadata, infos, pieces, files)
