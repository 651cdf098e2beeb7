"""CheckpointView: a checkpoint whose tensors are read through another open one (renamed, dequantized, merged)."""

from __future__ import annotations

from collections.abc import Sequence

from .._io.integrity import CheckedFile
from .checkpoint import Checkpoint
from .metadata import CheckpointMetadata, TensorInfo

__all__ = ["CheckpointView"]


class CheckpointView(Checkpoint):
    """A :class:`Checkpoint` computed from ``inner``'s reads: the files, and so their CRC checks and their closing,
    are ``inner``'s. A view that kept :attr:`verify_crc` itself would switch nothing (it holds no archive), and
    one that closed only itself would leave ``inner``'s descriptors open."""

    def __init__(
        self, inner: Checkpoint, metadata: CheckpointMetadata, infos: dict[str, TensorInfo], tied: dict[str, str]
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._inner = inner

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

    def checked_files(self) -> Sequence[CheckedFile]:
        self.ensure_open()
        return self._inner.checked_files()

    def _release(self) -> None:
        self._inner.close()
