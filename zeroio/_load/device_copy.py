"""Filling tensors on an accelerator from a checkpoint: pinned staging, reads overlapped with device copies.

A plain ``cuda_tensor.copy_(cpu_chunk)`` from pageable memory is synchronous: the disk waits while the bus copies
and the bus waits while the disk reads. Here a ring of page-locked (pinned) host buffers is filled by reader
threads (several reads in flight, the CRC of each folded in by the reading thread), each full buffer is copied to
the device with ``non_blocking=True`` and cast there, and a buffer is refilled once the event recorded after its
copy has passed. Host memory stays ``ring x chunk``; device memory gains the same for staging casts, only when something is cast.

Reads are issued in storage order but shipped as they land, in any order: a buffer waits for its own read only,
never for an older one still in flight, so one slow read does not leave the other reader threads without buffers.

The disk gives parallel positioned reads far more than one stream (an H200 host's local disk: docs/benchmarks.md,
"Read limit"), so the reader threads follow the host's CPUs, shared by the ranks of the host (:func:`read_threads`).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .._env import env_bytes, env_positive_int
from .._formats import Checkpoint
from .._io.direct_read import ALIGN, aligned_parts, direct_reads_enabled
from .._io.sources import LocalFile, tensor_bytes
from .pinned_ring import PinnedRing
from .prefetch import StartupPrefetch
from .shard_reads import staging_bytes

__all__ = [
    "HOST_READ_THREADS",
    "READ_BLOCK_BYTES",
    "RING",
    "STAGING_CHUNK_BYTES",
    "DeviceFiller",
    "Ranges",
    "read_block_bytes",
    "read_threads",
]

STAGING_CHUNK_BYTES = 16 * 1024 * 1024
"""Bytes per pinned buffer: large enough that one read and one transfer each run near full speed, small enough
that a ring of one per reader thread pins little (an H200 host, 16 threads: 16 MiB 0.95 s warm vs 32 MiB 1.11 s).
``ZEROIO_STAGING_BYTES`` overrides it (tests use tiny chunks to cross chunk boundaries on small fixtures)."""

RING = 6
"""Fewest pinned buffers: one being copied to the device while the others are read into (``ring - 1`` readers)."""

SPARE_SLOTS = 4
"""Pinned buffers beyond one per reader thread: buffers whose copy to the device is still in flight, so that a
reader never waits for a copy (an H200 host: 16 MiB cross the bus in 0.3 ms, a read of them takes 10-100 ms)."""

HOST_READ_THREADS = 16
"""Reads in flight on one host, over all its ranks (``LOCAL_WORLD_SIZE``), capped by its CPUs: each read also
folds its CRC-32 and copies from the page cache when warm. ``ZEROIO_READ_THREADS`` sets a rank's own count."""


READ_BLOCK_BYTES = STAGING_CHUNK_BYTES
"""Bytes per read: a staging chunk is read as parts of this size, each its own read, taken by the reader threads in
storage order (``ZEROIO_READ_BLOCK``). Parts smaller than a chunk keep the reads in flight close together in the
file, as fastsafetensors reads (512 KiB parts, 16 threads); on the H100 host they were no faster cold (1.26-1.30 s
against 1.23 s for 2.6 GB) and twice as slow warm (each read costs the Python loop), so by default a chunk is one
read (docs/benchmarks.md, "Read patterns")."""


def read_block_bytes() -> int:
    """:data:`READ_BLOCK_BYTES`, or ``ZEROIO_READ_BLOCK`` (a byte count: ``512KiB``)."""
    return max(8, env_bytes("ZEROIO_READ_BLOCK", READ_BLOCK_BYTES))


def read_threads() -> int:
    """Reader threads of this rank's :class:`DeviceFiller` (see :data:`HOST_READ_THREADS`)."""
    override = os.environ.get("ZEROIO_READ_THREADS")
    if override:
        return env_positive_int("ZEROIO_READ_THREADS", override)
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    host = min(HOST_READ_THREADS, os.cpu_count() or 1)
    return max(RING - 1, host // local)


@dataclass(slots=True)
class _Piece:
    """One chunk of one job's tensor: elements ``[source, source + numel)`` of ``name`` into elements
    ``[start, start + numel)`` of ``dest``'s flat view; ``direct``: past the bytes read ahead (so the disk may be
    read directly where the page cache holds none of it)."""

    job: int
    name: str
    dest: torch.Tensor
    start: int
    numel: int
    source: int
    direct: bool = True


Ranges = Sequence[tuple[int, int]] | None
"""The flat ``(start, length)`` ranges of a checkpoint tensor a destination holds, in order (a sharded parameter's
local part); None: the whole tensor."""


@dataclass(eq=False, slots=True)
class _InFlight:
    piece: _Piece
    slot: int
    at: int = 0  # where in the slot's buffer the piece's bytes start
    parts: list[Future[None]] = field(default_factory=list)  # the reads of its parts
    left: int = 0  # parts not yet landed


class _Slots:
    """The pinned ring's buffers, each free, being read into, or being copied to the device (until the event
    recorded after its copy passes: copies on one stream end in the order they were queued)."""

    def __init__(self, take: Callable[[], torch.Tensor], count: int) -> None:
        self._take = take
        self.count = count
        self.host: list[torch.Tensor] = []
        self.staging: list[torch.Tensor | None] = []  # device buffers for casts, made when a slot first casts
        self._free: deque[int] = deque()
        self._copying: deque[tuple[int, torch.cuda.Event]] = deque()

    def acquire(self) -> int | None:
        """A free slot (a new buffer while fewer than ``count`` exist), or None while every one is busy."""
        while self._copying and self._copying[0][1].query():  # type: ignore[no-untyped-call]
            self._free.append(self._copying.popleft()[0])
        if self._free:
            return self._free.popleft()
        if len(self.host) < self.count:
            self.host.append(self._take())
            self.staging.append(None)
            return len(self.host) - 1
        return None

    def copying(self, slot: int, event: torch.cuda.Event) -> None:
        self._copying.append((slot, event))

    def wait_copy(self) -> bool:
        """Wait for the oldest copy in flight and free its slot; False if none is in flight."""
        if not self._copying:
            return False
        slot, event = self._copying.popleft()
        event.synchronize()
        self._free.append(slot)
        return True


class DeviceFiller:
    """Fills contiguous CUDA tensors from a checkpoint through a ring of pinned host buffers."""

    def __init__(self, device: torch.device, chunk_bytes: int | None = None, ring: int | None = None) -> None:
        self.device = device
        wanted = chunk_bytes or staging_bytes(STAGING_CHUNK_BYTES)
        wanted = max(8, wanted - wanted % 8)  # whole elements of every dtype
        self.threads = max(1, (ring - 1) if ring else read_threads())
        self.ring = ring or self.threads + SPARE_SLOTS
        self.direct = direct_reads_enabled()
        block = read_block_bytes()
        # Direct reads need room for the aligned blocks around a chunk: a large chunk gives it up (a 16 MiB pinned
        # buffer stays 16 MiB, where torch's pinned-memory cache rounds 16 MiB + 8 KiB up to 32 MiB).
        room = 3 * ALIGN if self.direct else 0
        self.chunk_bytes = wanted - room if wanted >= 64 * ALIGN else wanted
        self.slot_bytes = self.chunk_bytes + room
        self.read_block = max(ALIGN, block - block % ALIGN) if self.direct else block
        self.depth = self.threads * (2 if self.read_block < self.chunk_bytes else 1)  # parts in flight at most
        self._pinned: PinnedRing | None = None
        self._ahead: StartupPrefetch | None = None

    def prepare(self) -> None:
        """Start making the CUDA context and the pinned ring now, on a thread (see :mod:`.pinned_ring`)."""
        if self._pinned is None:
            self._pinned = PinnedRing(self.device, self.ring, self.slot_bytes)

    def read_ahead(self, ckpt: Checkpoint, names: Sequence[str]) -> None:
        """Have the kernel start reading tensors ``names``, in this order, until :meth:`fill` starts reading them
        itself (see :mod:`.prefetch`)."""
        self._stop_ahead()
        self._ahead = StartupPrefetch(ckpt, names)

    def _stop_ahead(self) -> int:
        """Stop reading ahead; the bytes asked for (the first of the plan, in order)."""
        advised = 0
        if self._ahead is not None:
            self._ahead.stop()
            advised = self._ahead.advised
            self._ahead = None
        return advised

    def close(self) -> None:
        """Stop reading ahead; wait for :meth:`prepare`'s thread, if any."""
        self._stop_ahead()
        if self._pinned is not None:
            self._pinned.close()

    @staticmethod
    def handles(dest: torch.Tensor) -> bool:
        """Whether ``dest`` is a tensor this filler can fill (contiguous, on a CUDA device)."""
        return dest.is_cuda and dest.is_contiguous() and torch.cuda.is_available()

    def _pinned_buffer(self) -> torch.Tensor:
        if self._pinned is not None:
            return self._pinned.take()
        return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)

    def _pieces(
        self, ckpt: Checkpoint, jobs: Sequence[tuple[str, torch.Tensor, Ranges]], advised: int
    ) -> Iterator[_Piece]:
        read = 0  # bytes of the plan before this piece, in the order they were read ahead
        for job, (name, dest, ranges) in enumerate(jobs):
            stored = ckpt.stored_dtype(name)
            step = max(1, self.chunk_bytes // stored.itemsize)
            spans = [(0, dest.numel())] if ranges is None else [(a, n) for a, n in ranges if n]
            total = sum(n for _, n in spans)  # a zero.Init partition's padding past the tensor is left as it is
            if total == 0:
                yield _Piece(job, name, dest, 0, 0, 0)
                continue
            out = 0
            for first, length in spans:
                for at in range(0, length, step):
                    n = min(step, length - at)
                    yield _Piece(job, name, dest, out, n, first + at, read >= advised)
                    out += n
                    read += n * stored.itemsize

    def fill(
        self,
        ckpt: Checkpoint,
        jobs: Iterable[tuple[str, torch.Tensor, Ranges]],
        done: Callable[[str], None] = lambda name: None,
    ) -> None:
        """Copy each checkpoint tensor ``name`` (or its flat ``ranges``, in order) into its device tensor ``dest``
        (casting as ``copy_`` rounds).

        ``done(name)`` is called once all of a tensor's chunks are queued on the device. Returns when every copy
        has completed. Chunks are read in the stored dtype and cast on the device: widening to the checkpoint's
        logical dtype first, as the CPU path does, would change no value (stored dtypes are never wider).
        """
        advised = self._stop_ahead()  # from here the reader threads read, in the same order
        jobs = list(jobs)
        pieces = list(self._pieces(ckpt, jobs, advised))
        left = [0] * len(jobs)  # pieces of each job not yet queued on the device
        for piece in pieces:
            left[piece.job] += 1
        # Pinned lazily, each just before its first read (pinning hundreds of MiB up front delays the first read),
        # or made by prepare()'s thread, as many as there are pieces.
        if self._pinned is not None:
            self._pinned.trim(len(pieces))
        _Fill(self, ckpt, _Slots(self._pinned_buffer, self.ring), jobs, left, done).run(pieces)


class _Fill:
    """One :meth:`DeviceFiller.fill`: reads submitted in order to the reader threads, shipped as they land."""

    def __init__(
        self,
        filler: DeviceFiller,
        ckpt: Checkpoint,
        slots: _Slots,
        jobs: list[tuple[str, torch.Tensor, Ranges]],
        left: list[int],
        done: Callable[[str], None],
    ) -> None:
        self.filler = filler
        self.ckpt = ckpt
        self.slots = slots
        self.jobs = jobs
        self.left = left
        self.done = done
        self.stream = torch.cuda.current_stream(filler.device)
        self.landed: queue.SimpleQueue[_InFlight | None] = queue.SimpleQueue()  # None: one part of a piece landed
        self.reading: set[_InFlight] = set()
        self.parts_in_flight = 0  # reads submitted and not yet landed, over all pieces
        self._lock = threading.Lock()

    def _finished(self, piece: _Piece) -> None:
        self.left[piece.job] -= 1
        if self.left[piece.job] == 0:
            self.done(self.jobs[piece.job][0])

    def _local_range(self, source: str, piece: _Piece) -> tuple[LocalFile, int, int] | None:
        """The one plain local file range holding ``piece`` (a safetensors entry), for :meth:`LocalFile.read_congruent`;
        None for anything else (CRC-checked records, remote objects, pieces spread over files)."""
        where = self.ckpt.byte_map(source) if piece.direct and self.filler.direct else None
        ranges = [] if where is None else where.locate(piece.source, piece.numel)
        if len(ranges) != 1:
            return None
        file, offset, nbytes = ranges[0]
        if not isinstance(file, LocalFile) or offset % self.ckpt.stored_dtype(source).itemsize:
            return None
        return file, offset, nbytes

    def _part_landed(self, entry: _InFlight) -> None:
        with self._lock:
            entry.left -= 1
            self.parts_in_flight -= 1
            last = entry.left == 0
        self.landed.put(entry if last else None)  # None wakes the loop: a reader is free for the next piece

    def _reads(
        self, piece: _Piece, slot: int, entry: _InFlight
    ) -> list[tuple[Callable[..., None], tuple[object, ...]]]:
        """The reads filling ``slot`` with ``piece``, one a part of at most ``read_block`` bytes (sets ``entry.at``)."""
        ckpt = self.ckpt
        source = ckpt.source_name(piece.name)
        host = self.slots.host[slot]
        block = self.filler.read_block
        local = self._local_range(source, piece)
        if local is not None:  # direct where the page cache lacks them: congruent to the file modulo a page
            file, offset, nbytes = local
            window = tensor_bytes(host)
            entry.at = -host.data_ptr() % ALIGN + offset % ALIGN
            parts = aligned_parts(offset, nbytes, block)
            return [(file.read_congruent, (at, n, window, entry.at + at - offset)) for at, n in parts]
        out = host.view(ckpt.stored_dtype(source))[: piece.numel]
        step = max(1, block // out.element_size())
        return [(ckpt.read_into, (source, piece.source + a, out[a : a + step])) for a in range(0, piece.numel, step)]

    def _submit(self, readers: ThreadPoolExecutor, piece: _Piece, slot: int) -> None:
        self.ckpt.ensure_open(piece.name)
        entry = _InFlight(piece, slot)
        reads = self._reads(piece, slot, entry)
        entry.left = len(reads)
        with self._lock:
            self.parts_in_flight += len(reads)
        self.reading.add(entry)
        for fn, args in reads:
            part = readers.submit(fn, *args)
            entry.parts.append(part)
            part.add_done_callback(lambda _, e=entry: self._part_landed(e))  # type: ignore[misc]

    def _ship(self, entry: _InFlight) -> None:
        """Queue a landed read's copy (and cast) on the device; its slot is busy until the copy has passed."""
        self.reading.discard(entry)
        for part in entry.parts:
            part.result()  # re-raises a read's error
        at = entry.at
        piece = entry.piece
        target = piece.dest.view(-1)[piece.start : piece.start + piece.numel]
        stored = self.ckpt.stored_dtype(piece.name)
        host = self.slots.host[entry.slot][at : at + piece.numel * stored.itemsize].view(stored)
        if piece.dest.dtype == stored:
            target.copy_(host, non_blocking=True)
        else:
            staging = self.slots.staging[entry.slot]
            if staging is None:
                staging = torch.empty(self.filler.chunk_bytes, dtype=torch.uint8, device=self.filler.device)
                self.slots.staging[entry.slot] = staging
            staged = staging.view(stored)[: piece.numel]
            staged.copy_(host, non_blocking=True)
            target.copy_(staged)
        self.slots.copying(entry.slot, self.stream.record_event())
        self._finished(piece)

    def _ship_landed(self, block: bool) -> None:
        """Ship every read that has landed (waiting for one first when ``block``)."""
        try:
            entry = self.landed.get(block=block)
        except queue.Empty:
            return
        while True:
            if entry is not None:
                self._ship(entry)
            try:
                entry = self.landed.get_nowait()
            except queue.Empty:
                return

    def run(self, pieces: list[_Piece]) -> None:
        threads, depth = self.filler.threads, self.filler.depth
        todo = deque(pieces)
        with ThreadPoolExecutor(threads, thread_name_prefix="zeroio-read") as readers:
            try:
                while todo or self.reading:
                    self._ship_landed(block=False)
                    if todo and not todo[0].numel:  # an empty tensor: nothing to read
                        self._finished(todo.popleft())
                        continue
                    if todo and self.parts_in_flight < depth:  # a reader is (about to be) idle: give it a buffer
                        slot = self.slots.acquire()
                        if slot is not None:
                            self._submit(readers, todo.popleft(), slot)
                            continue
                        if self.slots.wait_copy():  # every buffer busy: a copy passes in about a millisecond
                            continue
                    if self.reading:  # every reader busy: wait for a read (or a part of one) to land
                        self._ship_landed(block=True)
            finally:
                for entry in self.reading:  # an error: let reads in flight land before their buffers go
                    for part in entry.parts:
                        part.cancel()
                        if not part.cancelled():
                            part.exception()
                self.stream.synchronize()
