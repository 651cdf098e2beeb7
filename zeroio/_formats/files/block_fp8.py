"""Block-scaled FP8 weights (DeepSeek-V3 layout) read as the logical tensors they stand for, one chunk at a time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._dtypes import BY_NAME, DType
from ..._io.byte_map import ByteMap
from ..._io.sources import ByteRange
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo
from ..view import CheckpointView

if TYPE_CHECKING:
    import torch

    from ..._io.read_ahead import ReadAhead

__all__ = ["BlockFP8Checkpoint", "ScaledWeight", "dequantize_into"]

FP32 = BY_NAME["float32"]


@dataclass(frozen=True, slots=True)
class ScaledWeight:
    """One quantized weight: its float8 tensor, the ``*_scale_inv`` beside it and the block it scales."""

    scale: str
    """Stored name of the float32 ``[ceil(rows / block[0]), ceil(cols / block[1])]`` scale tensor."""
    shape: tuple[int, int]
    """``(rows, cols)`` of the weight."""
    block: tuple[int, int]
    """``weight_block_size``: rows and columns one scale covers (edge blocks are cut by the weight's edges)."""


def dequantize_into(
    weight: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int],
    block: tuple[int, int],
    start: int,
    out: torch.Tensor,
    first_block_row: int = 0,
) -> None:
    """Fill the fp32 ``out`` with ``float32(weight) * scale`` of each element's block, for the flattened elements
    ``[start, start + weight.numel())`` of a ``shape`` weight; ``scale`` holds the block rows from
    ``first_block_row`` on (those the chunk touches).

    DeepSeek-V3's ``weight_dequant`` (``inference/kernel.py``): one fp32 multiply per element by its 128x128
    block's scale, edge blocks cut at the weight's edges. Whole rows are scaled one block row at a time through
    a ``[rows, blocks, block_cols]`` view (no expanded scale tensor: memory stays the chunk); a chunk's partial
    first and last rows are scaled column block by column block, in place in ``out``.
    """
    out.copy_(weight)  # float8 -> fp32 is exact
    cols = shape[1]
    block_rows, block_cols = block
    end = start + out.numel()
    pos = start
    while pos < end:
        row, col = divmod(pos, cols)
        scales = scale[row // block_rows - first_block_row]
        if col or end - pos < cols:  # a partial row: the chunk starts or ends inside it
            stop = min(cols, col + end - pos)
            _scale_columns(out[pos - start : pos - start + stop - col], scales, col, stop, block_cols)
            pos += stop - col
            continue
        rows = min((end - pos) // cols, (row // block_rows + 1) * block_rows - row)  # up to the block row's end
        _scale_rows(out[pos - start : pos - start + rows * cols].view(rows, cols), scales, block_cols)
        pos += rows * cols


def _scale_rows(rows: torch.Tensor, scales: torch.Tensor, block_cols: int) -> None:
    """Whole rows of one block row: full column blocks through a view, the edge block (if any) by its scale."""
    full = rows.shape[1] // block_cols
    if full:
        rows[:, : full * block_cols].view(rows.shape[0], full, block_cols).mul_(scales[:full, None])
    if rows.shape[1] % block_cols:
        rows[:, full * block_cols :].mul_(scales[full])


def _scale_columns(segment: torch.Tensor, scales: torch.Tensor, first: int, stop: int, block_cols: int) -> None:
    """Columns ``[first, stop)`` of one row, block by block."""
    for index in range(first // block_cols, -(-stop // block_cols)):
        a, z = max(first, index * block_cols), min(stop, (index + 1) * block_cols)
        segment[a - first : z - first].mul_(scales[index])


class BlockFP8Checkpoint(CheckpointView):
    """Another reader's checkpoint with each block-scaled FP8 weight presented as its dequantized tensor.

    A quantized weight keeps its name; its ``*_scale_inv`` is no key of its own. :meth:`read_into` fills the
    fp32 products ``float32(x) * s`` (what :meth:`stored_spec` says), so the usual cast to the weight's logical
    dtype (bf16 unless ``config.json`` says otherwise) rounds them once, as DeepSeek's script stores them, and
    ``dtype="fp32"`` returns them unrounded. ``info(name).stored_dtype`` still says what the files hold (float8).
    Every other tensor, and everything else, is the wrapped reader's.
    """

    def __init__(
        self,
        inner: Checkpoint,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        weights: Mapping[str, ScaledWeight],
    ) -> None:
        super().__init__(inner, metadata, infos, tied)
        self._weights = dict(weights)

    def read_ahead_into(self, name: str, start: int, out: torch.Tensor, read_ahead: ReadAhead | None) -> None:
        quantized = self._weights.get(name)
        if quantized is None:
            self._inner.read_ahead_into(name, start, out, read_ahead)
            return
        import torch

        # Only the scale rows this chunk touches: memory stays the chunk's, whatever the block size.
        cols = quantized.shape[1]
        block_rows, block_cols = quantized.block
        first = start // cols // block_rows
        last = (start + out.numel() - 1) // cols // block_rows
        scale = torch.empty((last - first + 1, -(-cols // block_cols)), dtype=torch.float32)
        scale_name = self._inner.source_name(quantized.scale)
        self._inner.read_ahead_into(scale_name, first * scale.shape[1], scale.view(-1), read_ahead)
        raw = torch.empty(out.numel(), dtype=self._inner.stored_dtype(name))
        self._inner.read_ahead_into(name, start, raw, read_ahead)
        dequantize_into(raw, scale, quantized.shape, quantized.block, start, out, first)

    def stored_spec(self, name: str) -> DType:
        return FP32 if self.source_name(name) in self._weights else self._inner.stored_spec(self.source_name(name))

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        return None if name in self._weights else self._inner.byte_ranges(name)

    def byte_map(self, name: str) -> ByteMap | None:
        return None if name in self._weights else self._inner.byte_map(name)

    def optimizer_state(self, name: str) -> dict[str, Any]:
        self._resolve(name)
        return self._inner.optimizer_state(name)
