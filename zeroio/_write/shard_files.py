"""Execute a WritePlan's shards: safetensors files (from stored bytes where possible, else torch) or torch.save."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .._formats import Checkpoint
from .._io.fileio import ByteBuffers, ChunkBuffers, WriteBack, create_new, naming, preallocate, pwrite_all
from .._io.integrity import CheckedFile
from .._io.progress import ByteProgress, Progress
from .._io.read_ahead import ReadAhead
from .._io.sources import Fenced
from .byte_writes import copy_in_kernel, copy_through_memory, stored_runs
from .plan import WritePlan
from .safetensors_writer import write_chunks

if TYPE_CHECKING:
    import torch

__all__ = ["conversion_read_ahead", "write_shards"]


def write_shards(
    ckpt: Checkpoint,
    plan: WritePlan,
    tmp: Path,
    dst: Path,
    *,
    workers: int,
    chunk_bytes: int,
    progress: Progress,
    part: bool = False,
) -> None:
    """Write every shard of ``plan`` into the folder ``tmp``, fsynced (not the index: the commit writes it last).

    Errors name the files by their final path in ``dst``. ``part``: ``plan`` is this process's share of a
    distributed conversion: reads stay within its tensors' bytes (the others read the rest).
    """
    if plan.fmt == "safetensors":
        _write_safetensors(ckpt, plan, tmp, dst, workers=workers, chunk_bytes=chunk_bytes, progress=progress, part=part)
    else:
        _write_torch(ckpt, plan, tmp, dst, workers=workers, progress=progress)


@contextmanager
def _pool(workers: int) -> Iterator[cf.ThreadPoolExecutor | None]:
    if workers == 1:
        yield None
        return
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zeroio-io") as pool:
        yield pool


def _run_all(pool: cf.ThreadPoolExecutor | None, tasks: list[Callable[[], None]], stop: threading.Event) -> None:
    """Run tasks (in order when single-threaded); on the first failure or an interrupt, stop the rest and raise."""
    if pool is None:
        for task in tasks:
            task()
        return
    futures = [pool.submit(task) for task in tasks]
    try:
        cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        for future in futures:  # the earliest failure in submission order, for a deterministic error
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
    except BaseException:
        stop.set()
        for future in futures:
            future.cancel()
        raise


def _write_safetensors(
    ckpt: Checkpoint,
    plan: WritePlan,
    tmp: Path,
    dst: Path,
    *,
    workers: int,
    chunk_bytes: int,
    progress: Progress,
    part: bool,
) -> None:
    # 1. Create and preallocate every file (a full disk fails here, before reading), write the headers.
    meter = ByteProgress(progress, plan.shards.total_size, "Converting")
    fds: list[int] = []
    stop = threading.Event()
    writeback: WriteBack | None = None
    try:
        slot_of = {}
        left: dict[int, int] = {}  # fd -> tensors not yet written into it
        for filename, layout in plan.layouts:
            with naming(dst / filename):
                fd = create_new(tmp / filename)
                fds.append(fd)
                preallocate(fd, layout.size)
                pwrite_all(fd, layout.header, 0)
            for slot in layout.slots:
                slot_of[slot.name] = (fd, slot, dst / filename)
            left[fd] = len(layout.slots)
        meter.start()
        flusher = writeback = WriteBack()
        left_lock = threading.Lock()

        # 2. Stream tensors in source key order (sequential reads of the rank files), each chunk pwritten to its
        #    precomputed offset; `workers` threads overlap one tensor's reads with another's writes. Each file is
        #    flushed in the background as it fills (WriteBack), so durability overlaps the rest of the work.
        buffers = ChunkBuffers()
        byte_buffers = ByteBuffers()
        order = [name for name in ckpt.infos if name in slot_of]
        spans = _spans(ckpt, order) if part else None
        read_ahead = conversion_read_ahead(ckpt, order, spans)
        if spans:
            _fence_own_bytes(ckpt, order, spans)
        target = plan.target

        def task(name: str) -> Callable[[], None]:
            fd, slot, final = slot_of[name]

            def on_bytes(nbytes: int) -> None:
                meter.update(nbytes)
                flusher.wrote(fd, nbytes)

            def run() -> None:
                with naming(final):
                    # Bytes as stored (in kernel, else through memory, cast with numpy): no torch. Else torch.
                    runs = stored_runs(ckpt, name)
                    args = (ckpt, name, runs, target, fd, slot, chunk_bytes, on_bytes, stop)
                    if not copy_in_kernel(*args) and not copy_through_memory(*args, byte_buffers, read_ahead):
                        torch_target = None if target is None else target.torch
                        chunks = ckpt.chunks(name, torch_target, chunk_bytes, buffers.get, read_ahead)
                        write_chunks(fd, slot, chunks, on_bytes=on_bytes, stop=stop)
                with left_lock:
                    left[fd] -= 1
                    if left[fd] == 0 and not stop.is_set():
                        flusher.finished(fd)

            return run

        with _pool(workers) as pool:
            _run_all(pool, [task(n) for n in order], stop)
        writeback = None
        with naming(dst):
            flusher.close()
        # 3. Durable before the index names them (each file was flushed as it filled: little is left).
        for fd, (filename, _) in zip(fds, plan.layouts):
            with naming(dst / filename):
                os.fsync(fd)
    finally:
        if writeback is not None:
            try:
                writeback.close()
            except OSError:
                pass  # the error that stopped the writers is the one to report
        for fd in fds:
            os.close(fd)
        meter.close()


def _spans(ckpt: Checkpoint, names: list[str]) -> dict[int, list[tuple[int, int]]]:
    """By ``id(source)``, the sorted, disjoint spans of the stored bytes of ``names`` (whole elements only)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for name in names:
        for source, offset, nbytes in stored_runs(ckpt, name) or ():
            mine = spans.setdefault(id(source), [])
            if mine and mine[-1][1] == offset:  # the next parameter's piece, back to back in its rank file
                mine[-1] = (mine[-1][0], offset + nbytes)
            else:
                mine.append((offset, offset + nbytes))
                if len(mine) > 2 * _MAX_SPANS:  # interleaved with the others' pieces: no cuts, and stop here
                    return {}
    out = {}
    for key, runs in spans.items():
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(runs):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        if len(merged) > _MAX_SPANS:
            return {}  # pieces interleaved with the others' (1,024 ranks): windows as they come
        out[key] = merged
    return out


def conversion_read_ahead(
    ckpt: Checkpoint, names: list[str], spans: dict[int, list[tuple[int, int]]] | None = None
) -> ReadAhead:
    """The read-ahead windows of a conversion reading ``names`` (``spans``: a distributed share's bytes): fenced
    off the long runs, which their own tensors' reads read whole, in whatever order the IO threads come to them."""
    read_ahead = ReadAhead(files=_source_files(ckpt), spans=spans)
    read_ahead.fence(_long_runs(ckpt, names, read_ahead.long_run_bytes()))
    return read_ahead


def _long_runs(ckpt: Checkpoint, names: list[str], longer_than: int) -> dict[int, list[tuple[int, int]]]:
    """By ``id(source)``, the sorted stored runs of ``names`` longer than ``longer_than`` bytes: each is read
    straight from its file by its own tensor's read, so read-ahead windows must not read into it."""
    runs: dict[int, list[tuple[int, int]]] = {}
    for name in names:
        if ckpt.info(name).numel * ckpt.stored_spec(name).itemsize <= longer_than:
            continue  # no run of it can be long (a bias, a norm): skip making its runs
        for source, offset, nbytes in stored_runs(ckpt, name) or ():
            if nbytes > longer_than:
                runs.setdefault(id(source), []).append((offset, offset + nbytes))
    return {key: sorted(spans) for key, spans in runs.items()}


def _fence_own_bytes(ckpt: Checkpoint, names: list[str], spans: dict[int, list[tuple[int, int]]]) -> None:
    """Remote sources (which read ahead on their own) stop reading ahead at the end of each of ``spans``: a process
    writing part of the shards fetches its own tensors' bytes, not the next process's (with two processes reading
    from s3://, 4 MiB windows past their own bytes fetched 1.52x the weights in all)."""
    sources: dict[int, object] = {}
    for name in names:  # a ZeRO-3 tensor has a piece in every rank file: the first names find every source
        sources.update((id(source), source) for source, _, _ in stored_runs(ckpt, name) or ())
        if len(sources) >= len(spans):
            break
    for key, runs in spans.items():
        source = sources.get(key)
        if isinstance(source, CheckedFile):  # the CRC-checking view of a rank file: fence the object it reads
            source = source.source
        if isinstance(source, Fenced):
            for _, end in runs:
                source.fence(end)


_MAX_SPANS = 64
"""Spans of a process in any one file above which its read-ahead windows are not cut (anywhere): a 1,024-rank
checkpoint of small parameters interleaves the processes' few-byte pieces, and a window per piece would be a read per
piece (290,000 reads a process, 4x slower than reading the others' bytes too; each then checks those records whole)."""


def _source_files(ckpt: Checkpoint) -> int:
    """How many files the tensors are read from (a ZeRO-3 checkpoint's trainable tensors share one tuple of them)."""
    tuples = {id(info.files): info.files for info in ckpt.infos.values()}
    return len({path for files in tuples.values() for path in files})


def _write_torch(ckpt: Checkpoint, plan: WritePlan, tmp: Path, dst: Path, *, workers: int, progress: Progress) -> None:
    meter = ByteProgress(progress, plan.shards.total_size, "Converting")
    meter.start()
    stop = threading.Event()
    ties = plan.ties

    import torch

    def loader(name: str, into: dict[str, torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            if not stop.is_set():
                tensor = ckpt.get_tensor(name, dtype=None if plan.target is None else plan.target.torch)
                into[name] = tensor
                meter.update(tensor.numel() * tensor.element_size())

        return run

    try:
        with _pool(workers) as pool:
            for filename, shard_names in plan.shards.shards:
                # One shard in memory at a time: torch.save needs whole tensors. The planner keeps each tied
                # alias in its source's shard, so the alias can share the source's tensor.
                loaded: dict[str, torch.Tensor] = {}
                _run_all(pool, [loader(n, loaded) for n in shard_names if n not in ties], stop)
                shard = {n: loaded[ties.get(n, n)] for n in shard_names}
                with naming(dst / filename), open(tmp / filename, "xb") as fh:
                    torch.save(shard, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                del shard, loaded
    finally:
        meter.close()
