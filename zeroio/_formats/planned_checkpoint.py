"""The checkpoint view every pickle-based reader shares: tensors served from read plans over parsed rank files."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._io.integrity import CheckedFile
from .._io.sources import ByteRange
from .._pickles import RankFile
from .checkpoint import Checkpoint
from .metadata import CheckpointMetadata, TensorInfo
from .read_plans import ReadPlan, plan_byte_ranges, read_plan_into

if TYPE_CHECKING:
    import torch

    from .._io.read_ahead import ReadAhead

__all__ = ["PlannedCheckpoint"]


class PlannedCheckpoint(Checkpoint):
    """A :class:`Checkpoint` whose stored tensors are read plans over torch zip files (ZeRO, universal).

    It owns the parsed files: their handles are closed, and their records' CRC-32 checked, through it.
    """

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        sources: dict[str, ReadPlan],
        files: list[RankFile],
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._sources = sources
        self._files = files

    def _release(self) -> None:
        for file in self._files:
            file.close()

    def _checked_files(self) -> list[CheckedFile]:
        return [file.source for file in self._files]

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        read_plan_into(self._sources[name], start, out)

    def read_ahead_into(self, name: str, start: int, out: torch.Tensor, read_ahead: ReadAhead | None) -> None:
        read_plan_into(self._sources[name], start, out, read_ahead)

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        return plan_byte_ranges(self._sources[name])
