"""Loading into sharded parameters (FSDP2 / tensor-parallel DTensors, DeepSpeed ``zero.Init`` partitions): which
elements each rank's local part holds (planned, then agreed on by all ranks before any writes), where they are
filled, and several filled at once. Each rank reads only its elements (shard_reads.py), with no collectives.

torch.distributed is imported only when the model holds a DTensor; DeepSpeed is never imported (a ``zero.Init``
parameter is recognised by its ``ds_tensor``/``ds_shape`` attributes, and its partition group is a plain torch
process group).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ShardedModelError, ZeroIOError
from . import rank_agreement
from .shard_reads import staging_bytes
from .shard_slices import Placement, Strided, local_indices, strided_runs

__all__ = [
    "READERS",
    "ShardFills",
    "ShardPlan",
    "ShardTarget",
    "agree",
    "check_supported",
    "contiguous_runs",
    "global_shape",
    "is_sharded",
    "plan_agreed",
    "plan_shard",
    "readers_per_rank",
    "shard_target",
]


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


def agree(error: BaseException | None, where: str, *, broadcast: bool = False, checkpoint: Any = None) -> None:
    """Raise on every rank if any rank failed to plan its load, or ranks opened different checkpoints
    (``checkpoint``: this rank's ``rank_agreement.fingerprint``), before any rank reads or writes: the plan
    step (:func:`zeroio._load.rank_agreement.agree`). Without an initialised process group, ``error`` is
    simply raised (and ``broadcast``, which needs one, is refused).
    """
    import torch.distributed as dist

    if broadcast and error is None and not (dist.is_available() and dist.is_initialized()):
        raise ShardedModelError(
            f"broadcast_from_rank0=True needs an initialised torch.distributed process group to load '{where}'. "
            "Call torch.distributed.init_process_group first (torchrun sets its variables), or drop the option.",
            path=where,
        )
    rank_agreement.agree(error, where, checkpoint)


def plan_agreed(
    targets: dict[int, tuple[torch.Tensor, str]],
    failure: ZeroIOError | None,
    where: str,
    broadcast: bool,
    ckpt: Any = None,
) -> dict[int, ShardPlan]:
    """Plan each sharded target (``{key: (tensor, name)}``) unless ``failure`` already stopped the load; then all
    ranks agree (:func:`agree`), so an error on any rank is raised on every rank before anything is written, and
    ranks that opened different checkpoints (``ckpt``'s fingerprint: tag, files) refuse before any reads."""
    plans: dict[int, ShardPlan] = {}
    seen = None
    agreed_failure: BaseException | None = failure
    try:
        if failure is None:
            staging_bytes()  # a bad ZEROIO_STAGING_BYTES is this step's failure on every rank, not a later read's
        for key, (tensor, name) in targets.items() if failure is None else ():
            if is_sharded(tensor):
                plans[key] = plan_shard(tensor, name, where)
        if ckpt is not None and failure is None and rank_agreement.in_process_group():
            seen = rank_agreement.fingerprint(ckpt)
    except (ZeroIOError, ValueError) as exc:
        agreed_failure = exc
    agree(agreed_failure, where, broadcast=broadcast, checkpoint=seen)
    return plans


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
