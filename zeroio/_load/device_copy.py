"""Filling tensors on an accelerator from a checkpoint: pinned staging, reads overlapped with device copies.

A plain ``cuda_tensor.copy_(cpu_chunk)`` from pageable memory is synchronous: the disk waits while the bus copies
and the bus waits while the disk reads. Here a ring of page-locked (pinned) host buffers is filled by reader
threads (several reads in flight, the CRC of each folded in by the reading thread), each full buffer is copied to
the device with ``non_blocking=True`` and cast there, and a buffer is refilled once the event recorded after its
copy has passed. Host memory stays ``ring x chunk``; device memory gains the same for staging casts, only when something is cast.

The disk gives parallel positioned reads far more than one stream (an H200 host's local disk: docs/benchmarks.md,
"Read limit"), so the reader threads follow the host's CPUs, shared by the ranks of the host (:func:`read_threads`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .._formats import Checkpoint
from .pinned_ring import PinnedRing
from .shard_reads import staging_bytes

__all__ = ["HOST_READ_THREADS", "RING", "STAGING_CHUNK_BYTES", "DeviceFiller", "Ranges", "read_threads"]

STAGING_CHUNK_BYTES = 16 * 1024 * 1024
"""Bytes per pinned buffer: large enough that one read and one transfer each run near full speed, small enough
that a ring of one per reader thread pins little (an H200 host, 16 threads: 16 MiB 0.95 s warm vs 32 MiB 1.11 s).
``ZEROIO_STAGING_BYTES`` overrides it (tests use tiny chunks to cross chunk boundaries on small fixtures)."""

RING = 6
"""Fewest pinned buffers: one being copied to the device while the others are read into (``ring - 1`` readers)."""

HOST_READ_THREADS = 16
"""Reads in flight on one host, over all its ranks (``LOCAL_WORLD_SIZE``), capped by its CPUs: each read also
folds its CRC-32 and copies from the page cache when warm. ``ZEROIO_READ_THREADS`` sets a rank's own count."""


def read_threads() -> int:
    """Reader threads of this rank's :class:`DeviceFiller` (see :data:`HOST_READ_THREADS`)."""
    override = os.environ.get("ZEROIO_READ_THREADS")
    if override:
        return max(1, int(override))
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    host = min(HOST_READ_THREADS, os.cpu_count() or 1)
    return max(RING - 1, host // local)


@dataclass(slots=True)
class _Piece:
    """One chunk of one tensor: elements ``[source, source + numel)`` of ``name`` into elements
    ``[start, start + numel)`` of ``dest``'s flat view."""

    name: str
    dest: torch.Tensor
    start: int
    numel: int
    last: bool
    source: int


Ranges = Sequence[tuple[int, int]] | None
"""The flat ``(start, length)`` ranges of a checkpoint tensor a destination holds, in order (a sharded parameter's
local part); None: the whole tensor."""


@dataclass(slots=True)
class _InFlight:
    piece: _Piece
    slot: int
    host: torch.Tensor
    read: Future[None]


class DeviceFiller:
    """Fills contiguous CUDA tensors from a checkpoint through a ring of pinned host buffers."""

    def __init__(self, device: torch.device, chunk_bytes: int | None = None, ring: int | None = None) -> None:
        self.device = device
        wanted = chunk_bytes or staging_bytes(STAGING_CHUNK_BYTES)
        self.chunk_bytes = max(8, wanted - wanted % 8)  # whole elements of every dtype
        self.ring = ring or read_threads() + 1
        self._pinned: PinnedRing | None = None

    def prepare(self) -> None:
        """Start making the CUDA context and the pinned ring now, on a thread (see :mod:`.pinned_ring`)."""
        if self._pinned is None:
            self._pinned = PinnedRing(self.device, self.ring, self.chunk_bytes)

    def close(self) -> None:
        """Wait for :meth:`prepare`'s thread, if any."""
        if self._pinned is not None:
            self._pinned.close()

    @staticmethod
    def handles(dest: torch.Tensor) -> bool:
        """Whether ``dest`` is a tensor this filler can fill (contiguous, on a CUDA device)."""
        return dest.is_cuda and dest.is_contiguous() and torch.cuda.is_available()

    def _pinned_buffer(self) -> torch.Tensor:
        if self._pinned is not None:
            return self._pinned.take()
        return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)

    def _count_pieces(self, ckpt: Checkpoint, jobs: Sequence[tuple[str, torch.Tensor, Ranges]]) -> int:
        count = 0
        for name, dest, ranges in jobs:
            step = max(1, self.chunk_bytes // ckpt.stored_dtype(name).itemsize)
            spans = [dest.numel()] if ranges is None else [n for _, n in ranges if n]
            count += sum(-(-n // step) for n in spans) or 1
        return count

    def _pieces(self, ckpt: Checkpoint, jobs: Iterable[tuple[str, torch.Tensor, Ranges]]) -> Iterator[_Piece]:
        for name, dest, ranges in jobs:
            stored = ckpt.stored_dtype(name)
            step = max(1, self.chunk_bytes // stored.itemsize)
            spans = [(0, dest.numel())] if ranges is None else [(a, n) for a, n in ranges if n]
            total = sum(n for _, n in spans)  # a zero.Init partition's padding past the tensor is left as it is
            if total == 0:
                yield _Piece(name, dest, 0, 0, True, 0)
                continue
            out = 0
            for first, length in spans:
                for at in range(0, length, step):
                    n = min(step, length - at)
                    yield _Piece(name, dest, out, n, out + n == total, first + at)
                    out += n

    def fill(
        self,
        ckpt: Checkpoint,
        jobs: Iterable[tuple[str, torch.Tensor, Ranges]],
        done: Callable[[str], None] = lambda name: None,
    ) -> None:
        """Copy each checkpoint tensor ``name`` (or its flat ``ranges``, in order) into its device tensor ``dest``
        (casting as ``copy_`` rounds).

        ``done(name)`` is called once a tensor's last chunk is queued on the device. Returns when every copy
        has completed. Chunks are read in the stored dtype and cast on the device: widening to the checkpoint's
        logical dtype first, as the CPU path does, would change no value (stored dtypes are never wider).
        """
        # Pinned lazily, each just before its first read (pinning hundreds of MiB up front delays the first read),
        # or made by prepare()'s thread, as many as there are pieces.
        jobs = list(jobs)
        pinned = self._pinned
        if pinned is not None:
            pinned.trim(self._count_pieces(ckpt, jobs))
        host: list[torch.Tensor | None] = [None] * self.ring
        staging: list[torch.Tensor | None] = [None] * self.ring  # device buffers for casts, made when first cast
        copied: list[torch.cuda.Event | None] = [None] * self.ring
        stream = torch.cuda.current_stream(self.device)
        pending: deque[_InFlight] = deque()

        def to_device(entry: _InFlight) -> None:
            entry.read.result()  # re-raises a read's error
            piece = entry.piece
            if piece.numel:
                stored = entry.host.dtype
                target = piece.dest.view(-1)[piece.start : piece.start + piece.numel]
                if piece.dest.dtype == stored:
                    target.copy_(entry.host, non_blocking=True)
                else:
                    slot_buffer = staging[entry.slot]
                    if slot_buffer is None:
                        slot_buffer = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device)
                        staging[entry.slot] = slot_buffer
                    staged = slot_buffer.view(stored)[: piece.numel]
                    staged.copy_(entry.host, non_blocking=True)
                    target.copy_(staged)
                copied[entry.slot] = stream.record_event()
            if piece.last:
                done(piece.name)

        with ThreadPoolExecutor(max(1, self.ring - 1), thread_name_prefix="zeroio-read") as readers:
            try:
                for i, piece in enumerate(self._pieces(ckpt, jobs)):
                    slot = i % self.ring
                    if len(pending) == self.ring:  # the oldest entry holds this slot: ship it, wait its copy
                        to_device(pending.popleft())
                    event = copied[slot]
                    if event is not None:
                        event.synchronize()
                    stored = ckpt.stored_dtype(piece.name)
                    ring_buffer = host[slot]
                    if ring_buffer is None:
                        ring_buffer = host[slot] = self._pinned_buffer()
                    buffer = ring_buffer.view(stored)[: piece.numel]
                    ckpt.ensure_open(piece.name)
                    source = ckpt.source_name(piece.name)
                    read: Future[None] = Future()
                    if piece.numel:
                        read = readers.submit(ckpt.read_into, source, piece.source, buffer)
                    else:
                        read.set_result(None)
                    pending.append(_InFlight(piece, slot, buffer, read))
                while pending:
                    to_device(pending.popleft())
            finally:
                for entry in pending:  # an error: let reads in flight land before their buffers go
                    entry.read.cancel()
                    if not entry.read.cancelled():
                        entry.read.exception()
                stream.synchronize()
