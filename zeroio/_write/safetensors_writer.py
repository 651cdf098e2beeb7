"""A streaming safetensors writer: the whole file layout from metadata first, then tensor bytes chunk by chunk.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian header length N,
N bytes of JSON ``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``
padded with spaces to a multiple of 8, then the data, little-endian, row-major. Tensors are laid out as
safetensors 0.4-0.8 lays them out (by dtype alignment, largest first, then by name), so a file with the same
tensors and one metadata key is byte-identical to ``safetensors.torch.save_file``.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._constants import SAFETENSORS_MAX_HEADER_SIZE
from .._dtypes import SAFETENSORS_ORDER, DType, as_dtype, find_dtype
from .._io.fileio import pwrite_all, tensor_bytes

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_HEADER_SIZE",
    "SafetensorsLayout",
    "TensorSlot",
    "plan_file",
    "safetensors_dtype",
    "storable",
    "write_chunks",
]

MAX_HEADER_SIZE = SAFETENSORS_MAX_HEADER_SIZE
"""safetensors refuses headers larger than this (``MAX_HEADER_SIZE`` in its Rust crate); shared with the reader."""

_RANK: dict[DType, int] = {d: i for i, d in enumerate(SAFETENSORS_ORDER)}


def _spec(dtype: torch.dtype | DType) -> DType | None:
    spec = find_dtype(dtype)
    return spec if spec in _RANK else None


def storable(dtype: torch.dtype | DType) -> bool:
    """Whether safetensors can store ``dtype`` (torch-free)."""
    return _spec(dtype) is not None


def safetensors_dtype(dtype: torch.dtype | DType) -> str:
    """safetensors' name for a dtype (``torch.bfloat16`` -> ``"BF16"``), torch-free.

    Raises:
        ValueError: the dtype has no safetensors encoding.
    """
    spec = _spec(dtype)
    if spec is None or spec.safetensors is None:
        raise ValueError(f"safetensors cannot store {dtype}; convert with fmt='torch'.") from None
    return spec.safetensors


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor's bytes go in the file."""

    name: str
    """Tensor name (header key)."""
    dtype: torch.dtype | DType
    """dtype of the stored bytes."""
    shape: tuple[int, ...]
    """Shape recorded in the header."""
    begin: int
    """Absolute file offset of the first byte."""
    end: int
    """Absolute file offset one past the last byte."""

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class SafetensorsLayout:
    """A complete file plan: header bytes and every tensor's byte range, computed before any tensor is read."""

    header: bytes
    """The first bytes of the file: 8-byte little-endian length, then the padded JSON header."""
    slots: tuple[TensorSlot, ...]
    """Tensors in file order."""
    size: int
    """Total file size in bytes."""

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (the file minus its header)."""
        return self.size - len(self.header)


def plan_file(
    tensors: Iterable[tuple[str, torch.dtype | DType, Sequence[int]]], *, metadata: Mapping[str, str] | None = None
) -> SafetensorsLayout:
    """Lay out a safetensors file from ``(name, dtype, shape)`` alone.

    Args:
        tensors: every tensor of the file, in any order.
        metadata: the header's ``__metadata__`` (string to string), written in the order given.

    Returns:
        The header bytes and each tensor's absolute byte range.

    Raises:
        ValueError: a name repeats or is ``__metadata__``, a dtype has no safetensors encoding, or the header
            would exceed safetensors' limit (:data:`MAX_HEADER_SIZE`). TypeError: metadata is not ``str -> str``.

    Example:
        >>> layout = plan_file([("w", torch.float32, (2, 2))], metadata={"format": "pt"})
        >>> layout.header[8:].rstrip()
        b'{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}'
    """
    entries = []
    seen = set()
    for name, dtype, shape in tensors:
        if name in seen or name == "__metadata__":
            raise ValueError(f"Cannot write tensor name {name!r} twice (or as '__metadata__') in one safetensors file.")
        seen.add(name)
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        entries.append((name, dtype, shape, numel * dtype.itemsize, safetensors_dtype(dtype)))
    # safetensors' `prepare`: sort by dtype descending (its enum order), then by name ascending.
    entries.sort(key=lambda e: (-_RANK[as_dtype(e[1])], e[0]))
    header: dict[str, object] = {}
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"safetensors metadata must map str to str, got {key!r}: {value!r}.")
        header["__metadata__"] = dict(metadata)
    offset = 0
    relative = []
    for name, dtype, shape, nbytes, st_name in entries:
        header[name] = {"dtype": st_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        relative.append((name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    # serde_json's compact output: no spaces, non-ASCII kept as UTF-8.
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    if len(text) > MAX_HEADER_SIZE:
        raise ValueError(
            f"The safetensors header would be {len(text)} bytes, over the format's limit of {MAX_HEADER_SIZE}; "
            "use a smaller max_shard_size so each file lists fewer tensors."
        )
    head = struct.pack("<Q", len(text)) + text
    base = len(head)
    slots = tuple(TensorSlot(n, d, s, base + b, base + e) for n, d, s, b, e in relative)
    return SafetensorsLayout(head, slots, base + offset)


# --------------------------------------------------------------------------- bytes on disk


def write_chunks(
    fd: int,
    slot: TensorSlot,
    chunks: Iterable[torch.Tensor],
    *,
    on_bytes: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Stream one tensor's chunks to its slot with ``pwrite``: memory is one chunk, whatever the tensor size.

    Args:
        fd: the output file, opened for writing.
        slot: the tensor's byte range from :func:`plan_file`.
        chunks: 1-D contiguous tensors in ``slot.dtype`` whose concatenation is the flattened tensor
            (``Checkpoint.iter_chunks``).
        on_bytes: called with the byte count of each chunk once written.
        stop: when set (another writer failed), return between chunks.

    Raises:
        ValueError: the chunks' dtype or total size disagrees with the slot.
        OSError: the write failed (disk full, file size limit, I/O error).
    """
    if sys.byteorder != "little":  # safetensors data is little-endian; torch tensors are native-endian
        raise ValueError("zeroio writes safetensors on little-endian machines only.")
    offset = slot.begin
    for chunk in chunks:
        if stop is not None and stop.is_set():
            return
        if chunk.dtype != slot.dtype:
            raise ValueError(f"'{slot.name}': chunk dtype {chunk.dtype} differs from the planned {slot.dtype}.")
        chunk = chunk.contiguous()
        nbytes = chunk.numel() * chunk.element_size()
        if offset + nbytes > slot.end:
            raise ValueError(f"'{slot.name}': chunks hold more than the planned {slot.nbytes} bytes.")
        if nbytes:
            pwrite_all(fd, tensor_bytes(chunk), offset)
        offset += nbytes
        del chunk
        if on_bytes is not None and nbytes:
            on_bytes(nbytes)
    if offset != slot.end and not (stop is not None and stop.is_set()):
        raise ValueError(f"'{slot.name}': chunks hold {offset - slot.begin} bytes, the slot {slot.nbytes}.")
