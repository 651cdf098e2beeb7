"""Filling tensors on an accelerator from a checkpoint: pinned staging, copies overlapped with the next read.

A plain ``cuda_tensor.copy_(cpu_chunk)`` from pageable memory is synchronous: the disk waits while the bus copies
and the bus waits while the disk reads. Here each chunk is read straight into one of two page-locked (pinned)
host buffers, copied to the device with ``non_blocking=True`` and cast there, so the read of chunk ``i + 1``
overlaps the transfer of chunk ``i``. Host memory stays two chunks; device memory gains two staging chunks.
"""

from __future__ import annotations

import os

import torch

from ._checkpoint import Checkpoint

__all__ = ["STAGING_CHUNK_BYTES", "DeviceFiller"]

STAGING_CHUNK_BYTES = 64 * 1024 * 1024
"""Bytes per pinned buffer: large enough that one read and one transfer each run near full speed.
``ZEROIO_STAGING_BYTES`` overrides it (tests use tiny chunks to cross chunk boundaries on small fixtures)."""


class DeviceFiller:
    """Fills contiguous device tensors chunk by chunk through two pinned host buffers (one per chunk in flight).

    Reuse one filler for a whole load: buffers are allocated once, lazily, at the first fill.
    """

    def __init__(self, device: torch.device, chunk_bytes: int | None = None) -> None:
        self.device = device
        override = os.environ.get("ZEROIO_STAGING_BYTES")
        self.chunk_bytes = chunk_bytes or (int(override) if override else STAGING_CHUNK_BYTES)
        self._host: list[torch.Tensor] = []
        self._staging: list[torch.Tensor] = []
        self._freed: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    @staticmethod
    def handles(dest: torch.Tensor) -> bool:
        """Whether ``dest`` is a tensor this filler can fill (contiguous, on a CUDA device)."""
        return dest.is_cuda and dest.is_contiguous() and torch.cuda.is_available()

    def _buffers(self) -> None:
        if not self._host:
            self._host = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._staging = [torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def _scratch(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The next free pinned buffer as ``numel`` elements of ``dtype`` (waits until its last copy is done)."""
        slot = self._next
        event = self._freed[slot]
        if event is not None:
            event.synchronize()
        return self._host[slot].view(dtype)[:numel]

    def fill(self, ckpt: Checkpoint, name: str, dest: torch.Tensor) -> None:
        """Copy checkpoint tensor ``name`` into ``dest``, casting on the device (as ``copy_`` rounds)."""
        self._buffers()
        stored = ckpt.stored_dtype(name)
        flat = dest.view(-1)
        offset = 0
        stream = torch.cuda.current_stream(self.device)
        # Chunks come in the stored dtype (no host-side cast); widening to the checkpoint's logical dtype first,
        # as the pageable path does, changes no value: stored dtypes are never wider than logical ones.
        for chunk in ckpt.chunks(name, stored, self.chunk_bytes, self._scratch):
            slot = self._next
            n = chunk.numel()
            if dest.dtype == stored:
                flat[offset : offset + n].copy_(chunk, non_blocking=True)
            else:
                staged = self._staging[slot].view(stored)[:n]
                staged.copy_(chunk, non_blocking=True)
                flat[offset : offset + n].copy_(staged)
            self._freed[slot] = stream.record_event()
            self._next = 1 - slot
            offset += n

    def synchronize(self) -> None:
        """Wait for every copy in flight: the host buffers and ``dest`` tensors are settled after this."""
        for event in self._freed:
            if event is not None:
                event.synchronize()
