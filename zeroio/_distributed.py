"""``zeroio.convert(..., distributed=True)``: the processes of a torch.distributed job each write their share of shards."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch

from . import _constants as C
from ._atomic import AtomicDir
from ._convert import (
    ConvertResult,
    _card_facts,
    _is_within,
    _Plan,
    _plan_safetensors,
    _plan_torch,
    _write_safetensors,
    _write_torch,
)
from ._fileio import naming, write_new_file
from ._metadata import output_dtype as _output_dtype
from ._sharding import ShardPlan, assign_shards
from ._side_files import copy_side_files
from ._types import ProgressCallback, StrPath
from .errors import OutputError, ZeroIOError

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "TORCHRUN_ENV", "convert_distributed", "torchrun_env"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long a process waits for the others at each synchronisation point before failing the job.

The longest wait is at the end of the writes, for the slowest process: it must finish its shards within this
time of the fastest one. A process that died is noticed at once (its connections close); one that hangs, after
this timeout."""

TIMEOUT_ENV = "ZEROIO_DISTRIBUTED_TIMEOUT"
"""Environment variable overriding :data:`DEFAULT_TIMEOUT`, in seconds."""

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables ``torchrun`` sets that ``init_process_group``'s ``env://`` rendezvous reads."""


def torchrun_env() -> bool:
    """True when the process was started by ``torchrun`` (or with its environment variables set by hand)."""
    return all(os.environ.get(name) for name in TORCHRUN_ENV)


def _timeout() -> timedelta:
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}.")
    return timedelta(seconds=seconds)


# --------------------------------------------------------------------------- the plan (pure)


def _fingerprint(fmt: str, plan: _Plan) -> str:
    """A digest of everything the plan decides, to check that every process planned the same output."""
    digest = hashlib.sha256(fmt.encode())
    digest.update(json.dumps([[f, list(names)] for f, names in plan.shards.shards]).encode())
    for _, layout in plan.layouts:
        digest.update(layout.header)
    digest.update((plan.index or "").encode())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class _Share:
    """One process's part of the plan."""

    plan: _Plan
    """The shards this process writes (no index: rank 0 writes it after everyone finished)."""
    sizes: tuple[int, ...]
    """Bytes of every shard of the whole plan (file bytes for safetensors, tensor bytes for torch)."""
    owners: tuple[int, ...]
    """The rank writing each shard of the whole plan."""


def _share(plan: _Plan, sizes: Sequence[int], rank: int, world_size: int, data_bytes: Sequence[int]) -> _Share:
    owners = assign_shards(sizes, world_size)
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    shards = tuple(plan.shards.shards[i] for i in mine)
    sub = ShardPlan(
        shards=shards,
        weight_map={name: filename for filename, names in shards for name in names},
        total_size=sum(data_bytes[i] for i in mine),
    )
    layouts = tuple(plan.layouts[i] for i in mine) if plan.layouts else ()
    return _Share(_Plan(sub, None, layouts), tuple(sizes), owners)


# --------------------------------------------------------------------------- communication


class _Lost(Exception):
    """A collective call failed: another process died, or did not answer within the timeout."""


def _gloo_detail(exc: BaseException) -> str:
    """The gist of a gloo/c10d error: ``Connection closed by peer [127.0.0.1]:6884``, without the source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")


class _Comm:
    """All-gathers of small JSON documents over a gloo group (CPU tensors only; no pickle crosses processes)."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def all_gather(self, payload: Any) -> list[Any]:
        import torch.distributed as dist

        data = json.dumps(payload).encode("utf-8")
        try:
            length = torch.tensor([len(data)], dtype=torch.int64)
            lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(lengths, length, group=self.group)
            longest = max(int(n.item()) for n in lengths)
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine, group=self.group)
        except RuntimeError as exc:  # DistBackendError, DistNetworkError: a peer closed its connection or timed out
            raise _Lost(_gloo_detail(exc)) from exc
        return [json.loads(bytes(t[: int(n.item())].tolist())) for t, n in zip(gathered, lengths)]


@contextlib.contextmanager
def _process_group(dst: Path, timeout: timedelta) -> Iterator[_Comm]:
    """A gloo group with ``timeout`` over every process: a new group inside an initialised job, or one created
    from torchrun's environment (and destroyed afterwards)."""
    import torch.distributed as dist

    owned = False
    if not dist.is_initialized():
        if not torchrun_env():
            raise ValueError(
                "distributed=True needs an initialised torch.distributed process group or torchrun's environment "
                f"({', '.join(TORCHRUN_ENV)}); launch with `torchrun ... -m zeroio convert SRC DST --distributed` or "
                "call torch.distributed.init_process_group() first."
            )
        try:
            dist.init_process_group(backend="gloo", timeout=timeout)
        except RuntimeError as exc:  # DistNetworkError, DistStoreError: rendezvous failed or timed out
            raise OutputError(
                f"Cannot write '{dst}': could not join the torch.distributed job ({_gloo_detail(exc)}). Check "
                "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and that every process was started.",
                path=dst,
            ) from exc
        owned = True
    group = None
    try:
        # Our own gloo group: CPU collectives even when the job's group is NCCL, and our timeout, not the job's.
        group = None if owned else dist.new_group(backend="gloo", timeout=timeout)
        yield _Comm(group, dist.get_rank(), dist.get_world_size())
    finally:
        try:
            if owned:
                dist.destroy_process_group()
            elif group is not None:
                dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001 - tearing down after a dead peer must not hide the real error
            logger.debug("destroying the process group failed: %s", exc)


class _SigtermAsInterrupt:
    """While converting, SIGTERM (what ``torchrun`` sends the other workers when one fails) raises
    KeyboardInterrupt, so the partial output is removed, except during that removal itself."""

    def __init__(self) -> None:
        self.cleaning = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.cleaning:
            raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[_SigtermAsInterrupt]:
    state = _SigtermAsInterrupt()
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield state
        return
    previous = signal.signal(signal.SIGTERM, state.handle)
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- the job


class _Job:
    """The phases of a distributed conversion; after each one every process learns whether all succeeded."""

    def __init__(self, comm: _Comm, out: AtomicDir, sigterm: _SigtermAsInterrupt, timeout: timedelta) -> None:
        self.comm = comm
        self.out = out
        self.sigterm = sigterm
        self.timeout = timeout
        self.tmp: Path | None = None
        """The shared temporary folder, once rank 0 created it; None again once rank 0 committed or removed it."""

    # -- outcomes

    def _own_line(self, error: BaseException) -> str:
        """The one line this process's own error will say (what the others quote)."""
        if isinstance(error, ZeroIOError):
            return str(error)
        if self.tmp is not None:
            return str(self.out._error(error))
        return f"{type(error).__name__}: {error}"

    def _remove_tmp(self) -> None:
        if self.tmp is None:
            return
        self.sigterm.cleaning = True
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None

    def _raise_own(self, error: BaseException) -> NoReturn:
        if self.tmp is not None:
            self.sigterm.cleaning = True
            self.tmp = None
            self.out.__exit__(type(error), error, error.__traceback__)  # removes the folder, raises OutputError
        raise error

    def settle(self, phase: str, error: BaseException | None, payload: Any = None) -> list[Any]:
        """All-gather every process's outcome of ``phase``; on any failure, clean up and raise on every process.

        Returns every process's ``payload`` when all succeeded.
        """
        n = self.comm.world_size
        try:
            reports = self.comm.all_gather({"error": None if error is None else self._own_line(error), "data": payload})
        except _Lost as lost:
            committing = phase == _COMMIT
            removed = ""
            if not committing and self.tmp is not None:
                self._remove_tmp()
                removed = " Removed the partial output."
            if committing and self.comm.rank != 0:
                fix = f"'{self.out.dst}' exists only if process 0 completed the rename; check it, and process 0's log."
            else:
                fix = (
                    f"A process was killed, crashed or stopped answering (timeout {self.timeout.total_seconds():g} s, "
                    f"set with {TIMEOUT_ENV}): check the other processes' logs and run the conversion again."
                )
            where = phase.replace("its shards", "the shards")
            raise OutputError(
                f"Cannot write '{self.out.dst}': lost contact with the other processes {where} ({lost}).{removed} {fix}",
                path=self.out.dst,
            ) from lost.__cause__
        if error is not None:
            self._raise_own(error)
        failed = [(rank, report["error"]) for rank, report in enumerate(reports) if report["error"] is not None]
        if failed:
            self._remove_tmp()
            rank, line = failed[0]
            others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise OutputError(
                f"Process {rank} of {n}{others} failed {phase}, so '{self.out.dst}' was not written. Its error: {line}",
                path=self.out.dst,
                rank=rank,
            )
        return [report["data"] for report in reports]


_PLAN = "while planning"
_TEMP = "while creating the temporary folder"
_WRITE = "while writing its shards"
_COMMIT = "while writing the index and renaming the output into place"


def convert_distributed(
    src: StrPath,
    dst: Path,
    *,
    fmt: str,
    target: torch.dtype | None,
    limit: int,
    tag: str | None,
    exclude_frozen: bool,
    overwrite: bool,
    workers: int,
    progress: bool | ProgressCallback,
    chunk_bytes: int,
) -> ConvertResult:
    """:func:`zeroio.convert` with ``distributed=True`` (arguments already validated): see ``docs/distributed.md``.

    Every process plans the same files from metadata; each writes the shards :func:`assign_shards` gives it into
    rank 0's temporary folder (a filesystem shared by all, at the same path); rank 0 writes the index last and
    renames the folder into place once every process reported success. Any failure fails every process.
    """
    if fmt not in ("safetensors", "torch"):
        raise ValueError(
            f"distributed=True writes sharded 'safetensors' or 'torch' folders, not fmt={fmt!r} (one file): "
            "convert it in one process."
        )
    timeout = _timeout()
    out = AtomicDir(dst, overwrite=overwrite)
    with _sigterm_as_interrupt() as sigterm, _process_group(out.dst, timeout) as comm:
        return _run(
            _Job(comm, out, sigterm, timeout), src, fmt=fmt, target=target, limit=limit, tag=tag,
            exclude_frozen=exclude_frozen, workers=workers, progress=progress, chunk_bytes=chunk_bytes,
        )  # fmt: skip


def _run(
    job: _Job,
    src: StrPath,
    *,
    fmt: str,
    target: torch.dtype | None,
    limit: int,
    tag: str | None,
    exclude_frozen: bool,
    workers: int,
    progress: bool | ProgressCallback,
    chunk_bytes: int,
) -> ConvertResult:
    from ._loader import open as zeroio_open

    rank, world_size, out = job.comm.rank, job.comm.world_size, job.out
    with contextlib.ExitStack() as stack:
        # 1. Rank 0 refuses an existing destination (and cleans dead conversions' temporary folders) before
        #    anything is read; every process then opens the source and plans every file from metadata alone,
        #    exactly as convert() does in one process.
        error: BaseException | None = None
        fingerprint = None
        try:
            if rank == 0:
                out.check()
                if out.overwrite and os.path.lexists(out.dst) and _is_within(Path(src), out.dst):
                    raise OutputError(
                        f"Refusing to overwrite '{out.dst}': the source '{src}' is inside it. Write to another folder.",
                        path=out.dst,
                    )
            ckpt = stack.enter_context(zeroio_open(src, tag))
            infos = ckpt.infos
            excluded = [n for n, info in infos.items() if exclude_frozen and info.kind == "frozen"]
            names = [n for n in infos if n not in excluded]
            ties = {alias: source for alias, source in ckpt.tied.items() if alias in names and source in names}
            dtypes = {n: _output_dtype(infos[n], target) for n in names}
            if fmt == "safetensors":
                plan = _plan_safetensors(ckpt, names, ties, dtypes, limit)
                sizes = [layout.size for _, layout in plan.layouts]
                data = [layout.data_bytes for _, layout in plan.layouts]
            else:
                plan = _plan_torch(ckpt, names, ties, dtypes, limit)
                data = [
                    sum(infos[n].numel * dtypes[n].itemsize for n in shard if n not in ties)
                    for _, shard in plan.shards.shards
                ]
                sizes = data
            share = _share(plan, sizes, rank, world_size, data)
            fingerprint = _fingerprint(fmt, plan)
        except BaseException as exc:  # noqa: BLE001 - reported to every process, then re-raised
            error = exc
        fingerprints = job.settle(_PLAN, error, fingerprint)
        if len(set(fingerprints)) != 1:
            other = next(r for r, f in enumerate(fingerprints) if f != fingerprints[0])
            raise OutputError(
                f"Cannot write '{out.dst}': processes 0 and {other} planned different outputs from '{src}', so they "
                "read different checkpoints. Put the checkpoint on a filesystem shared by every process, at the "
                "same path, and do not change it during the conversion.",
                path=out.dst,
                rank=other,
            )
        logger.debug(
            "process %d of %d writes %d of %d shards (%d bytes)",
            rank, world_size, len(share.plan.shards.shards), len(plan.shards.shards), share.plan.shards.total_size,
        )  # fmt: skip

        # 2. Rank 0 creates the temporary folder beside dst; everyone learns its path.
        error, tmp_text = None, None
        try:
            if rank == 0:
                job.tmp = out.__enter__()
                tmp_text = str(job.tmp)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        tmp = Path(job.settle(_TEMP, error, tmp_text)[0])
        job.tmp = tmp
        if rank != 0:
            out.tmp = tmp  # so a failure here removes the shared folder and names it "partial output"

        # 3. Each process writes its own shards into the shared folder (fsynced), reading only their tensors'
        #    byte ranges; then everyone reports success or failure (the success flag rank 0 commits on).
        error = None
        try:
            if not tmp.is_dir():
                raise OutputError(
                    f"Cannot write '{out.dst}': process {rank} cannot see the temporary folder '{tmp}' that process "
                    "0 created. A distributed conversion needs the destination on a filesystem shared by every "
                    "process, at the same path.",
                    path=out.dst,
                    rank=rank,
                )
            shown = progress if (rank == 0 or callable(progress)) else False  # one bar per job, not per process
            if fmt == "safetensors":
                _write_safetensors(
                    ckpt, share.plan, tmp, out.dst, target=target, workers=workers, chunk_bytes=chunk_bytes,
                    progress=shown,
                )  # fmt: skip
            else:
                _write_torch(ckpt, share.plan, tmp, out.dst, ties, target=target, workers=workers, progress=shown)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        job.settle(_WRITE, error)

        # 4. Rank 0 checks every shard is there, writes the index last, copies side files and renames the folder
        #    into place; the others wait for its word.
        error, copied = None, []
        if rank == 0:
            try:
                _check_shards(plan, share, tmp, out.dst)
                if plan.index is not None:
                    index_name = C.SAFETENSORS_INDEX if fmt == "safetensors" else C.TORCH_INDEX
                    with naming(out.dst / index_name):
                        write_new_file(tmp / index_name, plan.index)
                copied = list(copy_side_files(Path(src), tmp))
            except BaseException as exc:  # noqa: BLE001
                error = exc
            if error is None:
                job.tmp = None
                try:
                    out.__exit__(None, None, None)  # fsync, rename; on failure removes the folder and raises
                except BaseException as exc:  # noqa: BLE001
                    error = exc
        else:
            job.tmp = None  # rank 0 owns the folder from here: it commits it or removes it
        try:
            copied = job.settle(_COMMIT, error, copied)[0]
        except OutputError as exc:
            if rank != 0 or error is not None or not isinstance(exc.__cause__, RuntimeError):
                raise
            # The output is complete and in place: every process had reported its shards written.
            logger.warning("renamed %s into place, then lost contact with the other processes: %s", out.dst, exc)
        num_params = sum(infos[n].numel for n in names if n not in ties)
        facts = _card_facts(ckpt, fmt, target, [dtypes[n] for n in names], excluded, num_params)

    files = tuple(out.dst / filename for filename, _ in plan.shards.shards)
    num_tensors = len([n for n in names if n not in ties])
    if rank == 0:
        logger.info(
            "wrote %d tensors (%d bytes) in %d file(s) to %s with %d processes",
            num_tensors, plan.shards.total_size, len(files), out.dst, world_size,
        )  # fmt: skip
    index_name = C.SAFETENSORS_INDEX if fmt == "safetensors" else C.TORCH_INDEX
    return ConvertResult(
        files=files,
        index_path=out.dst / index_name if plan.index is not None else None,
        total_size=plan.shards.total_size,
        num_tensors=num_tensors,
        tied=ties,
        card_facts=facts,
        copied=tuple(out.dst / name for name in copied),
    )


def _check_shards(plan: _Plan, share: _Share, tmp: Path, dst: Path) -> None:
    """Every shard is in the shared folder, at its planned size (safetensors), before the index names it."""
    for i, (filename, _) in enumerate(plan.shards.shards):
        path = tmp / filename
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = None
        expected = plan.layouts[i][1].size if plan.layouts else None
        if size is None or (expected is not None and size != expected):
            found = "missing" if size is None else f"{size} bytes, not {expected}"
            raise OutputError(
                f"Cannot write '{dst}': shard '{filename}' that process {share.owners[i]} wrote is {found} in "
                f"'{tmp}' as process 0 sees it. A distributed conversion needs the destination on a filesystem "
                "shared by every process, at the same path.",
                path=dst,
                rank=share.owners[i],
            )
