"""A DTensor record of one rank file (:mod:`zeroio._pickles.dtensor`) checked, and where its local piece lies.

FSDP2 (``fully_shard``) cuts a parameter with ``torch.chunk`` along its ``Shard`` dim: each rank holds
``ceil(n / W)`` rows, the last ones fewer or none. Placements, global shape and dtype come from the pickled
``DTensorSpec`` (``tensor_meta``); the local tensor must be exactly the piece they give the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._dtypes import DType
from ..._pickles import Inert, TensorRef, global_name, inert_parts, is_inert, short_repr
from ...errors import CheckpointFormatError, UnsupportedCheckpointError
from ..dcp.metadata import Chunk, TensorEntry

__all__ = ["Assembled", "LocalPiece", "assemble", "chunk_box", "is_dtensor", "parse_dtensor"]

_DTENSOR = "torch.distributed.tensor.DTensor"


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """One rank's piece of a DTensor: where it lies in the full tensor, and where its bytes are."""

    dtype: DType
    shape: tuple[int, ...]
    """The full tensor's shape (``DTensorSpec.tensor_meta``)."""
    chunk: Chunk
    """The box of the full tensor this rank holds (offsets, sizes; ``file`` names the rank file)."""
    local: TensorRef
    replicated: bool
    """Every rank holds the whole tensor (``Replicate()``)."""


def is_dtensor(value: Any) -> bool:
    """True for a DTensor record rebuilt by zeroio's unpickler."""
    return is_inert(value) and global_name(value) == _DTENSOR


def chunk_box(shape: tuple[int, ...], dim: int, world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes of ``torch.chunk(t, world, dim)[rank]`` (an empty box past the last chunk)."""
    n = shape[dim]
    each = -(-n // world) if n else 0
    start = min(n, rank * each)
    stop = min(n, start + each)
    offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(stop - start if d == dim else s for d, s in enumerate(shape))
    return offsets, sizes


def _bad(path: Path, name: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"'{path}': the DTensor '{name}' {what}. The file is corrupted or hostile; copy it again from the run.",
        path=path,
        name=name,
    )


def _placement(value: Any, ndim: int, path: Path, name: str) -> int | None:
    """The sharded dim of one placement (None for ``Replicate``)."""
    kind = (global_name(value) or type(value).__name__).rsplit(".", 1)[-1]
    if kind == "Replicate" and is_inert(value):
        return None
    if kind == "Shard" and is_inert(value):
        dim = inert_parts(value).state.get("dim")
        if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < max(ndim, 1):
            raise _bad(path, name, f"is sharded along dim {short_repr(dim)!r} of a {ndim}-d tensor")
        return dim % ndim
    raise UnsupportedCheckpointError(
        f"'{path}': the DTensor '{name}' has placement {kind}; zeroio reads Shard(dim) and Replicate() on a 1-D "
        "mesh (what verl's FSDP2 saves). Consolidate it with torch's get_model_state_dict(full_state_dict=True).",
        path=path,
        name=name,
        found=kind,
    )


def parse_dtensor(value: Any, path: Path, name: str, world: int, rank: int) -> LocalPiece:
    """Check a DTensor record of rank ``rank``'s file against its spec and ``torch.chunk``."""
    parts = inert_parts(value)
    local = parts.state.get("_local_tensor")
    spec = parts.state.get("_spec")
    if not isinstance(local, TensorRef) or not isinstance(spec, Inert):
        raise _bad(path, name, "lacks its local tensor or its spec")
    spec_state = inert_parts(spec).state
    meta = spec_state.get("tensor_meta")
    meta_args = inert_parts(meta).args if isinstance(meta, Inert) else ()
    if len(meta_args) != 3:
        raise _bad(path, name, "has no tensor_meta (global shape, stride, dtype)")
    shape, _, dtype = meta_args
    if not isinstance(dtype, DType) or not isinstance(shape, tuple):
        raise _bad(path, name, f"has tensor_meta {short_repr(meta_args)}")
    if parts.args[:2] != (dtype, shape):
        raise _bad(
            path, name, f"is pickled as {short_repr(parts.args[:2])} but its spec says {short_repr((dtype, shape))}"
        )
    placements = spec_state.get("placements")
    if not isinstance(placements, tuple) or len(placements) != 1:
        count = len(placements) if isinstance(placements, tuple) else "no"
        raise UnsupportedCheckpointError(
            f"'{path}': the DTensor '{name}' lies on a mesh of {count} dimensions; zeroio reads verl checkpoints "
            "sharded over a 1-D mesh (FSDP2 without HSDP or tensor parallel).",
            path=path,
            name=name,
        )
    dim = _placement(placements[0], len(shape), path, name)
    if dim is None:
        offsets, sizes = (0,) * len(shape), tuple(shape)
    else:
        offsets, sizes = chunk_box(tuple(shape), dim, world, rank)
    if local.dtype_spec != dtype or tuple(local.shape) != sizes:
        raise _bad(
            path,
            name,
            f"holds a {local.dtype_spec.name} piece of shape {tuple(local.shape)} on rank {rank}; its spec "
            f"({dtype.name} {tuple(shape)}) and torch.chunk over {world} ranks give {sizes}",
        )
    chunk = Chunk(offsets, sizes, path.name, 0, 0)
    return LocalPiece(dtype, tuple(shape), chunk, local, dim is None)


@dataclass(frozen=True, slots=True)
class Assembled:
    """A full tensor as the rank pieces that hold it (chunk ``i`` is read from ``refs[i]``)."""

    entry: TensorEntry
    refs: tuple[TensorRef, ...]

    @property
    def contiguous(self) -> bool:
        """Every piece is one run of its rank file's storage (then byte ranges can be handed out)."""
        return all(ref.is_contiguous for ref in self.refs)


def assemble(name: str, values: list[Any], paths: tuple[Path, ...]) -> Assembled:
    """The full tensor ``name`` from its value in each rank's file: DTensor pieces (checked to agree and tile),
    or a plain tensor every rank holds whole (a buffer: rank 0's copy)."""
    world = len(paths)
    if not is_dtensor(values[0]):
        ref = values[0]
        if not isinstance(ref, TensorRef):
            raise _bad(paths[0], name, f"is a {type(ref).__name__}, not a tensor")
        shape = tuple(ref.shape)
        chunk = Chunk((0,) * len(shape), shape, paths[0].name, 0, 0)
        return Assembled(TensorEntry(name, ref.dtype_spec, shape, (chunk,)), (ref,))
    pieces: list[LocalPiece] = []
    for rank, (value, path) in enumerate(zip(values, paths)):
        if not is_dtensor(value):
            raise _bad(path, name, f"is a {type(value).__name__} on rank {rank} but a DTensor on rank 0")
        piece = parse_dtensor(value, path, name, world, rank)
        if pieces and (piece.dtype, piece.shape, piece.replicated) != (
            pieces[0].dtype,
            pieces[0].shape,
            pieces[0].replicated,
        ):
            raise _bad(
                path,
                name,
                f"is a {piece.dtype.name} {piece.shape} on rank {rank} but a {pieces[0].dtype.name} "
                f"{pieces[0].shape} on rank 0 (the rank files come from different saves)",
            )
        pieces.append(piece)
    kept = pieces[:1] if pieces[0].replicated else pieces
    entry = TensorEntry(name, pieces[0].dtype, pieces[0].shape, tuple(p.chunk for p in kept))
    return Assembled(entry, tuple(p.local for p in kept))
