"""Loading into sharded parameters (FSDP2 / tensor-parallel DTensors, DeepSpeed ``zero.Init`` partitions): each rank
reads only the elements its local shard holds, through the reader contract (``read_into``), with no collectives.

torch.distributed is imported only when the model holds a DTensor; DeepSpeed is never imported (a ``zero.Init``
parameter is recognised by its ``ds_tensor``/``ds_shape`` attributes, and its partition group is a plain torch
process group).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._io.byte_map import ByteMap, read_strided
from .._io.sources import tensor_bytes
from .._text import get_logger
from ..errors import ShardedModelError, ZeroIOError
from .shard_slices import Placement, Strided, local_indices, strided_runs

if TYPE_CHECKING:
    from .._checkpoint import TensorReader

__all__ = [
    "READERS",
    "Fill",
    "ShardFills",
    "ShardPlan",
    "ShardTarget",
    "agree",
    "broadcast_segments",
    "check_supported",
    "contiguous_runs",
    "fill_whole",
    "global_shape",
    "is_sharded",
    "plan_agreed",
    "plan_shard",
    "read_segments",
    "readers_per_rank",
    "shard_target",
]

logger = get_logger(__name__)

CHUNK_BYTES = 16 * 1024 * 1024
"""Largest block of elements read at once, and staging buffer (when the local shard's dtype or device differs from
the stored dtype)."""
MAX_ROWS = 8192
"""Most rows of a column block read in one block, so a block's list of byte ranges stays small."""


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (also as an ``nn.Parameter``), recognised without importing it."""
    return any(
        cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed") for cls in type(tensor).__mro__
    )


def _is_zero_init(tensor: torch.Tensor) -> bool:
    """A DeepSpeed ``zero.Init`` partitioned parameter: ``ds_tensor`` holds this rank's flat, padded partition."""
    return getattr(tensor, "ds_tensor", None) is not None and hasattr(tensor, "ds_shape")


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds only a part of its values on this rank (a DTensor or a ``zero.Init`` parameter)."""
    return _is_dtensor(tensor) or _is_zero_init(tensor)


def global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape a checkpoint tensor must have to fill ``tensor`` (``ds_shape`` for a ``zero.Init`` parameter)."""
    if _is_zero_init(tensor):
        return tuple(int(n) for n in getattr(tensor, "ds_shape"))  # noqa: B009 (an attribute torch does not type)
    return tuple(tensor.shape)


def check_supported(model: nn.Module, where: str) -> None:
    """Refuse FSDP1 wrappers: their flat parameters hide the model's own shapes and names from ``state_dict`` keys."""
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__name__ == "FullyShardedDataParallel" and cls.__module__.startswith("torch.distributed.fsdp"):
            shown = f"module '{name}'" if name else "the model"
            raise ShardedModelError(
                f"Cannot load '{where}' into {type(model).__name__}: {shown} is wrapped by FSDP1 "
                "(FullyShardedDataParallel), whose flat parameters zeroio does not fill. Call zeroio.load on the model "
                "before wrapping it, or shard it with FSDP2 (torch.distributed.fsdp.fully_shard), whose DTensor "
                "parameters zeroio fills rank by rank.",
                path=where,
                name=name,
            )


# --------------------------------------------------------------------------- planning (before anything is written)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which flattened elements of the checkpoint tensor this rank's part of one parameter holds."""

    runs: list[Strided]
    """Flat ranges of the global tensor, in the local shard's element order (a column block's rows grouped)."""
    local_shape: tuple[int, ...]
    """Shape of the local part (the DTensor's local tensor, or the flat ``ds_tensor``)."""


def _placement(p: Any, name: str, where: str) -> Placement:
    """A DTensor placement as plain values (see shard_slices); Partial (pending reductions) cannot be loaded."""
    if type(p).__name__ == "_StridedShard":
        return ("strided", int(p.dim), int(p.split_factor))
    if p.is_shard():
        return ("shard", int(p.dim), 1)
    if p.is_replicate():
        return ("replicate", 0, 1)
    raise ShardedModelError(
        f"Cannot load '{name}' from '{where}': its DTensor placement {p} is neither Shard nor Replicate (a Partial "
        "tensor holds pending sums, not values). Redistribute it to Shard or Replicate before loading.",
        path=where,
        name=name,
    )


def plan_shard(tensor: torch.Tensor, name: str, where: str) -> ShardPlan:
    """This rank's slice of ``tensor`` (a DTensor or ``zero.Init`` parameter) as flat ranges of the global tensor.

    Raises:
        ShardedModelError: a placement zeroio cannot fill, or a local shape that disagrees with its placements.
    """
    t: Any = tensor  # a DTensor or a zero.Init parameter: attributes torch.Tensor does not declare
    shape = global_shape(tensor)
    numel = 1
    for n in shape:
        numel *= n
    if _is_zero_init(tensor):
        import torch.distributed as dist

        size = t.ds_tensor.numel()
        # DeepSpeed 0.19.8 (partition_parameters._partition_param): rank r of param.ds_process_group holds
        # flat elements [r * size, (r + 1) * size), the last partitions padded past ds_numel.
        start = dist.get_rank(group=t.ds_process_group) * size
        length = max(0, min(size, numel - start))
        return ShardPlan([(start, length, length, 1)] if length else [], (size,))
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    placements = [_placement(p, name, where) for p in t.placements]
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return ShardPlan([], tuple(t.to_local().shape))
    held = local_indices(shape, tuple(mesh.shape), coordinate, placements)
    local_shape = tuple(len(h) for h in held)
    found = tuple(t.to_local().shape)
    if found != local_shape:
        raise ShardedModelError(
            f"Cannot load '{name}' from '{where}': its local shard has shape {found}, but placements "
            f"{tuple(t.placements)} of shape {shape} on mesh {tuple(mesh.shape)} give {local_shape} at mesh "
            f"coordinate {tuple(coordinate)}. Report this layout to zeroio; load before sharding as a workaround.",
            path=where,
            name=name,
            expected=local_shape,
            found=found,
        )
    return ShardPlan(list(strided_runs(shape, held)), local_shape)


def agree(error: ZeroIOError | None, where: str, *, broadcast: bool = False) -> None:
    """Raise on every rank if any rank failed to plan its load, before any rank writes (one small all_gather).

    A rank whose own check passed raises :class:`ShardedModelError` naming the failing rank, so none is left
    waiting in a later collective. Without an initialised process group, ``error`` is simply raised (and
    ``broadcast``, which needs one, is refused).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        if broadcast:
            raise ShardedModelError(
                f"broadcast_from_rank0=True needs an initialised torch.distributed process group to load '{where}'. "
                "Call torch.distributed.init_process_group first (torchrun sets its variables), or drop the option.",
                path=where,
            )
        return
    mine = None if error is None else (type(error).__name__, str(error))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if error is not None:
        raise error
    for rank, failed in enumerate(gathered):
        if failed is not None:
            kind, message = failed
            raise ShardedModelError(
                f"Rank {rank} could not load '{where}' ({kind}), so no rank loaded anything: {message}",
                path=where,
                rank=rank,
            )


def plan_agreed(
    targets: dict[int, tuple[torch.Tensor, str]], failure: ZeroIOError | None, where: str, broadcast: bool
) -> dict[int, ShardPlan]:
    """Plan each sharded target (``{key: (tensor, name)}``) unless ``failure`` already stopped the load; then all
    ranks agree (:func:`agree`), so an error on any rank is raised on every rank before anything is written."""
    plans: dict[int, ShardPlan] = {}
    try:
        for key, (tensor, name) in targets.items() if failure is None else ():
            if is_sharded(tensor):
                plans[key] = plan_shard(tensor, name, where)
    except ZeroIOError as exc:
        failure = exc
    agree(failure, where, broadcast=broadcast)
    return plans


# --------------------------------------------------------------------------- reading


class _Landing:
    """Where :func:`read_segments` reads a local part's elements before ``dest`` holds them, and how they get there.

    Straight into ``dest`` (a CPU tensor of the stored dtype); through one host buffer, cast by ``copy_`` (a CPU
    tensor of another dtype); or, for a CUDA tensor, through pinned host buffers copied with ``non_blocking=True``
    and cast on the device, so the next read overlaps the copy (a pageable ``copy_`` casts on the CPU and blocks the
    reading thread for the transfer). Pinned buffers come from torch's caching host allocator, which reuses one only
    once the copy recorded on it has completed.
    """

    def __init__(self, flat: torch.Tensor, stored: torch.dtype, step: int) -> None:
        self.flat = flat
        self.out = 0
        self.cap = min(step, max(1, flat.numel()))
        self.cuda = flat.is_cuda
        self.direct = flat.device.type == "cpu" and flat.dtype == stored
        self.stored = stored
        self.host: torch.Tensor | None = None
        if not (self.direct or self.cuda):
            self.host = torch.empty(self.cap, dtype=stored)

    def buffer(self, n: int) -> torch.Tensor:
        """Where the next ``n`` (at most one step of) elements are read."""
        if self.direct:
            return self.flat[self.out : self.out + n]
        if self.cuda:  # a fresh block per chunk: the last one may still be on its way to the device
            self.host = torch.empty(self.cap, dtype=self.stored, pin_memory=True)
        assert self.host is not None
        return self.host[:n]

    def place(self, n: int) -> None:
        """Move the ``n`` elements just read into ``dest``."""
        target = self.flat[self.out : self.out + n]
        if self.host is not None:
            read = self.host[:n]
            if not self.cuda:
                target.copy_(read)
            elif target.dtype == self.stored:
                target.copy_(read, non_blocking=True)
            else:  # copied in the stored dtype, cast by the device
                target.copy_(read.to(target.device, non_blocking=True))
            if self.cuda:
                self.host = None  # back to the allocator, reused once this copy has completed
        self.out += n

    def finish(self) -> None:
        """Wait for the copies in flight: ``dest`` is whole when :func:`read_segments` returns."""
        if self.cuda:
            torch.cuda.current_stream(self.flat.device).synchronize()


def staging_bytes() -> int:
    """:data:`CHUNK_BYTES`, or ``ZEROIO_STAGING_BYTES`` (tests cross chunk boundaries with small fixtures)."""
    override = os.environ.get("ZEROIO_STAGING_BYTES")
    return max(8, int(override)) if override else CHUNK_BYTES


def read_segments(
    ckpt: TensorReader, name: str, parts: Iterable[Strided], dest: torch.Tensor, chunk_bytes: int | None = None
) -> None:
    """Fill the contiguous ``dest`` (flattened) with the elements of checkpoint tensor ``name`` at ``parts``.

    Reads straight into ``dest`` when it is a CPU tensor of the stored dtype; otherwise through staging buffers of
    at most ``chunk_bytes`` (:class:`_Landing`; cast by ``copy_``, rounding as ``load_state_dict`` does). A run of
    rows (a ``Shard(1)`` column block) is read in blocks of up to ``chunk_bytes`` and :data:`MAX_ROWS` rows through
    the reader's :meth:`~zeroio._checkpoint.Checkpoint.byte_map`, straight from the files: one read per block where
    the rows' ranges touch in storage (a column-sharded DCP chunk), else one call per block reading each row's
    own bytes (nothing between them).
    """
    source = ckpt.source_name(name)
    stored = ckpt.stored_dtype(name)
    step = max(1, (chunk_bytes or staging_bytes()) // stored.itemsize)
    landing = _Landing(dest.view(-1), stored, step)
    where: ByteMap | None = None  # the byte map, asked for by the first run of several rows
    asked = False
    for start, length, stride, count in parts:
        rows = min(MAX_ROWS, step // length) if length else 0
        if count == 1 or rows < 2:  # one row at a time, each cut into reads of at most `step` elements
            for k in range(count):
                for at in range(0, length, step):
                    n = min(step, length - at)
                    ckpt.read_into(source, start + k * stride + at, landing.buffer(n))
                    landing.place(n)
            continue
        if not asked:
            where, asked = ckpt.byte_map(source), True
        for k in range(0, count, rows):
            m = min(rows, count - k)
            block = landing.buffer(m * length)
            if where is not None:
                read_strided(where, start + k * stride, length, stride, m, tensor_bytes(block))
            else:
                for j in range(m):
                    ckpt.read_into(source, start + (k + j) * stride, block[j * length : (j + 1) * length])
            landing.place(m * length)
    landing.finish()


def _segments(parts: Iterable[Strided]) -> Iterator[tuple[int, int]]:
    for start, length, stride, count in parts:
        for k in range(count):
            yield start + k * stride, length


def broadcast_segments(
    ckpt: TensorReader, name: str, parts: Iterable[Strided], dest: torch.Tensor, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """:func:`read_segments` for ``broadcast_from_rank0``: rank 0 alone reads the whole tensor, chunk by chunk, and
    broadcasts each chunk; every rank keeps the elements of its ``parts``. All ranks call it for the same tensors
    in the same order (the plan is built from checkpoint keys, in checkpoint order, after the ranks agreed)."""
    import torch.distributed as dist

    info = ckpt.info(name)
    source = ckpt.source_name(name)
    stored = ckpt.stored_dtype(name)
    # NCCL broadcasts device memory only; gloo host memory.
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    step = max(1, chunk_bytes // stored.itemsize)
    buffer = torch.empty(min(step, max(1, info.numel)), dtype=stored, device=on)
    host = buffer if on.type == "cpu" else torch.empty(buffer.numel(), dtype=stored)
    flat = dest.view(-1)
    placed: list[tuple[int, int, int]] = []  # (global start, length, local start), in global order
    local = 0
    for start, length in _segments(parts):
        placed.append((start, length, local))
        local += length
    placed.sort()
    first = 0  # the first placed range that may still overlap the next chunk
    rank = dist.get_rank()
    for lo in range(0, info.numel, step):
        n = min(step, info.numel - lo)
        if rank == 0:
            ckpt.read_into(source, lo, host[:n])
            if host is not buffer:
                buffer[:n].copy_(host[:n])
        dist.broadcast(buffer[:n], src=0)
        hi = lo + n
        while first < len(placed) and placed[first][0] + placed[first][1] <= lo:
            first += 1
        for start, length, at in placed[first:]:
            if start >= hi:
                break
            a, b = max(start, lo), min(start + length, hi)
            flat[at + a - start : at + b - start].copy_(buffer[a - lo : b - lo])


Fill = Callable[["TensorReader", str, Sequence[Strided], torch.Tensor], None]
"""How a local part is filled: :func:`read_segments` (each rank reads) or :func:`broadcast_segments`."""


def fill_whole(ckpt: TensorReader, name: str, dest: torch.Tensor, fill: Fill) -> None:
    """Fill an unsharded ``dest`` with all of checkpoint tensor ``name`` (``broadcast_from_rank0`` loads)."""
    numel = ckpt.info(name).numel
    whole = [(0, numel, numel, 1)] if dest.numel() else []
    if dest.is_contiguous():
        fill(ckpt, name, whole, dest)
    else:
        staged = torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
        fill(ckpt, name, whole, staged)
        dest.copy_(staged)


def _mesh_device(tensor: torch.Tensor) -> torch.device:
    """Where a meta DTensor's shard belongs: its mesh's device type (this process's current CUDA device for
    ``"cuda"``, as FSDP2 and DeviceMesh place it), not the CPU a meta tensor of a whole model defaults to."""
    kind = getattr(tensor, "device_mesh").device_type  # noqa: B009 (an attribute torch does not type)
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    t: Any = tensor
    local: torch.Tensor = t.ds_tensor if _is_zero_init(tensor) else t.to_local()
    return local


@dataclass(slots=True)
class ShardTarget:
    """Where this rank's part of one sharded parameter is filled (``dest``, contiguous) and how it is put in place
    once filled (:meth:`finish`)."""

    tensor: torch.Tensor
    local: torch.Tensor
    dest: torch.Tensor
    new: bool
    """Whether ``dest`` becomes a new DTensor (the old local part is ``meta``, or of another dtype or device)."""

    def finish(self) -> torch.Tensor | None:
        """Put the filled ``dest`` in place: copied into the old local part (FSDP2 and DeepSpeed keep references
        to it), or returned as a new DTensor with the same mesh, placements and global shape, for the caller to
        register in place of ``tensor``."""
        if not self.new:
            if self.dest is not self.local:
                self.local.copy_(self.dest)
            return None
        from torch.distributed.tensor import DTensor

        t: Any = self.tensor
        return DTensor.from_local(
            self.dest, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )


def shard_target(
    tensor: torch.Tensor, plan: ShardPlan, dtype: torch.dtype | None, device: torch.device | None
) -> ShardTarget:
    """Where to fill this rank's part of ``tensor``: in place when the local part is materialised and already of
    the wanted dtype and device (or a ``zero.Init`` partition), else a new local shard allocated at its final size
    only (never the full tensor)."""
    local = _local(tensor)
    want_dtype = dtype if (dtype is not None and local.is_floating_point()) else local.dtype
    want_device = device or (_mesh_device(tensor) if local.is_meta else local.device)
    if _is_zero_init(tensor) or (not local.is_meta and local.dtype == want_dtype and local.device == want_device):
        dest = local if local.is_contiguous() else torch.empty(local.shape, dtype=local.dtype, device=local.device)
        return ShardTarget(tensor, local, dest, new=False)
    return ShardTarget(tensor, local, torch.empty(plan.local_shape, dtype=want_dtype, device=want_device), new=True)


def contiguous_runs(plan: ShardPlan) -> list[tuple[int, int]] | None:
    """The plan's flat ranges as ``(start, length)`` when each is one contiguous range (row blocks: FSDP2's
    ``Shard(0)``, its strided form over tensor parallel, ``zero.Init`` partitions), else None (column blocks,
    read in blocks of rows by :func:`read_segments`)."""
    if any(count > 1 for _, _, _, count in plan.runs):
        return None
    return [(start, length) for start, length, _, _ in plan.runs]


# --------------------------------------------------------------------------- several tensors at once

HOST_READERS = 8
"""Tensors filled at once on one host, over all its ranks, when each rank reads its own slices. Reads and casts
release the GIL, so one tensor at a time per rank left the disk idle (1.31B model, cold, one H200 host's disk:
2 ranks 4.14 s with 1 thread each, 2.98 s with 4, 3.01 s with 8; 1 CUDA rank 5.81 s, 4.46 s, 4.03 s), while
4 ranks of 4 threads each crowded it (4.31 s, against 2.76 s with 1 each): docs/benchmarks.md."""

READERS: int | None = None
"""Threads per rank; None: ``HOST_READERS`` shared by the ranks of this host (``LOCAL_WORLD_SIZE``)."""


def readers_per_rank() -> int:
    """How many tensors this rank fills at once (see ``HOST_READERS``)."""
    if READERS is not None:
        return READERS
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, HOST_READERS // max(1, local))


Done = Callable[[torch.Tensor | None], None]


class ShardFills:
    """Runs sharded fill jobs on ``workers`` threads (1: in the calling thread, as ``broadcast_from_rank0``
    needs: every rank must reach the same collectives in the same order). Each job's ``done`` (installing the new
    tensor, progress) runs in the calling thread, in submission order. :meth:`close` waits for every running job,
    so no thread writes into the model after ``load`` returns or raises."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="zeroio-shard") if workers > 1 else None
        self._pending: deque[tuple[Future[torch.Tensor | None], Done]] = deque()
        # Worker threads start on CUDA device 0 whatever this rank chose with torch.cuda.set_device.
        self._cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    def run(self, job: Callable[[], torch.Tensor | None], done: Done) -> None:
        if self._pool is None:
            done(job())
            return
        self._pending.append((self._pool.submit(self._call, job), done))
        while len(self._pending) > 2 * self._workers:  # bounded: a few tensors ahead, not the whole model
            self._finish_one()

    def _call(self, job: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        if self._cuda is not None:
            torch.cuda.set_device(self._cuda)
        with torch.no_grad():  # grad mode is per thread: in-place fills of parameters need it off here too
            return job()

    def _finish_one(self) -> None:
        future, done = self._pending.popleft()
        done(future.result())

    def finish(self) -> None:
        """Wait for every job, running each ``done``; the first failure is raised."""
        while self._pending:
            self._finish_one()

    def close(self) -> None:
        for future, _ in self._pending:
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
