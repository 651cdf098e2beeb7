"""CheckpointView: a checkpoint whose tensors are read through another open one (renamed, dequantized, merged)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._io.integrity import CheckedFile
from .checkpoint import Checkpoint
from .metadata import CheckpointMetadata, TensorInfo

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointView"]


class CheckpointView(Checkpoint):
    """A :class:`Checkpoint` computed from ``inner``'s reads: the files, and so their CRC checks, their read-ahead
    windows and their closing, are ``inner``'s. A view that kept :attr:`verify_crc` itself would switch nothing (it
    holds no archive), one that closed only itself would leave ``inner``'s descriptors open, and one that read
    through ``inner.read_into`` would read a ZeRO-3 parameter a piece per rank, not from windows.

    A view implements :meth:`read_ahead_into` (its :meth:`read_into` is that without windows) and reads ``inner``
    through ``inner.read_ahead_into``, handing on the windows it is given: those of its own pass
    (:meth:`reading_in_order`, over ``inner``'s files) or a conversion's."""

    def __init__(
        self, inner: Checkpoint, metadata: CheckpointMetadata, infos: dict[str, TensorInfo], tied: dict[str, str]
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._inner = inner

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        self.read_ahead_into(name, start, out, None)

    @property
    def verify_crc(self) -> bool:
        """Whether the wrapped reader checks each zip record's CRC-32 as its bytes pass."""
        return self._inner.verify_crc

    @verify_crc.setter
    def verify_crc(self, on: bool) -> None:
        self._inner.verify_crc = on

    def finish_crc_checks(self) -> None:
        self.ensure_open()
        self._inner.finish_crc_checks()

    def _checked_files(self) -> Sequence[CheckedFile]:
        return self._inner._checked_files()

    def _release(self) -> None:
        self._inner.close()
