"""``zeroio.convert``: plan shards from metadata, then stream tensors into Hugging Face-layout files, atomically."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from . import _constants as C
from ._atomic import AtomicDir
from ._checkpoint import Checkpoint
from ._fileio import ChunkBuffers, create_new, naming, write_new_file
from ._metadata import dtype_name, parse_dtype
from ._metadata import output_dtype as _output_dtype
from ._progress import ByteProgress
from ._safetensors_writer import SafetensorsLayout, TensorSlot, plan_file, preallocate, pwrite_all, write_chunks
from ._sharding import ShardPlan, index_json, parse_size, plan_shards
from ._side_files import copy_side_files
from ._storage import kernel_copy_enabled
from ._types import ProgressCallback, StrPath
from .errors import OutputError

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_WORKERS", "ConvertResult", "convert"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
"""Largest piece of a tensor held in memory per IO thread while converting to safetensors."""

DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
"""IO threads: reads of one tensor overlap writes of another (reads and writes release the GIL)."""

Format = Literal["safetensors", "torch", "lightning"]


@dataclass(frozen=True, slots=True)
class ConvertResult:
    """What :func:`convert` wrote."""

    files: tuple[Path, ...]
    """Weight files in the destination, in shard order."""
    index_path: Path | None
    """``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``, or None for a single file."""
    total_size: int
    """Bytes of tensor data (each tied group once): the index's ``metadata.total_size``."""
    num_tensors: int
    """Distinct tensors stored (a tied alias is not counted: it shares its source's bytes)."""
    tied: dict[str, str] = field(default_factory=dict)
    """Tied aliases, ``{alias: source}``, recorded in the output so loaders re-tie them."""
    card_facts: dict[str, Any] = field(default_factory=dict)
    """Facts for a Hub model card: ``source_format``, ``tag``, ``ds_version``, ``zero_stage``, ``world_size``,
    ``global_step``, ``train_dtype``, ``output_dtype``, ``format``, ``num_params``, ``excluded_frozen``."""
    copied: tuple[Path, ...] = ()
    """Config and tokenizer files copied from beside the source (an HF Trainer ``checkpoint-N/``), in the output."""


# --------------------------------------------------------------------------- helpers


def _workers(workers: int | None) -> int:
    if workers is None:
        return DEFAULT_WORKERS
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise TypeError(f"workers must be a positive int (IO threads), got {workers!r}.")
    if workers < 1:
        raise ValueError(f"workers must be a positive int (IO threads), got {workers!r}.")
    return workers


def _is_within(inner: Path, outer: Path) -> bool:
    try:
        inner.resolve().relative_to(outer.resolve())
    except ValueError:
        return False
    return True


@contextmanager
def _pool(workers: int) -> Iterator[cf.ThreadPoolExecutor | None]:
    if workers == 1:
        yield None
        return
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zeroio-io") as pool:
        yield pool


def _copy_in_kernel(
    ckpt: Checkpoint,
    name: str,
    target: torch.dtype | None,
    fd: int,
    slot: TensorSlot,
    chunk_bytes: int,
    on_bytes: Callable[[int], None],
    stop: threading.Event,
) -> bool:
    """Copy a tensor that needs no cast file to file with ``copy_file_range``; False to fall back to streaming.

    The bytes never enter user space: measured 1.8 s instead of 5.8 s for the 468M benchmark checkpoint's
    fp32 pieces (docs/benchmarks.md). Falling back after a partial copy is safe: streaming rewrites the slot.
    """
    info = ckpt.info(name)
    if not kernel_copy_enabled() or _output_dtype(info, target) != ckpt.stored_dtype(name):
        return False
    ranges = ckpt.byte_ranges(ckpt.source_name(name))
    if ranges is None or sum(n for _, _, n in ranges) != slot.nbytes:
        return False
    offset = slot.begin
    for source, src_offset, nbytes in ranges:
        done = 0
        while done < nbytes:
            if stop.is_set():
                return True
            got = source.copy_to(fd, src_offset + done, min(chunk_bytes, nbytes - done), offset + done)
            if got is None:  # no fast path between this source and the destination
                return False
            if got <= 0:  # the source ended early: let the streaming reader raise its precise error
                return False
            done += got
            on_bytes(got)
        offset += nbytes
    return True


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


def _card_facts(
    ckpt: Checkpoint,
    fmt: str,
    target: torch.dtype | None,
    out_dtypes: list[torch.dtype],
    excluded: list[str],
    num_params: int,
) -> dict[str, Any]:
    meta = ckpt.metadata
    floating = sorted({dtype_name(d) for d in out_dtypes if d.is_floating_point})
    output_dtype: str | None
    if target is not None:
        output_dtype = dtype_name(target)
    else:
        output_dtype = "+".join(floating) if floating else None
    return {
        "source_format": meta.format,
        "tag": meta.tag,
        "ds_version": meta.ds_version,
        "zero_stage": meta.zero_stage,
        "world_size": meta.world_size,
        "global_step": meta.global_step,
        "train_dtype": dtype_name(meta.train_dtype) if meta.train_dtype is not None else None,
        "output_dtype": output_dtype,
        "format": fmt,
        "num_params": num_params,
        "excluded_frozen": excluded,
    }


# --------------------------------------------------------------------------- plans (metadata only)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything to write, decided from metadata before any tensor byte is read."""

    shards: ShardPlan
    index: str | None
    """The index file's text, or None for one file."""
    layouts: tuple[tuple[str, SafetensorsLayout], ...] = ()
    """safetensors only: each file's header and tensor byte ranges."""


def _plan_safetensors(
    ckpt: Checkpoint, names: list[str], ties: dict[str, str], dtypes: dict[str, torch.dtype], limit: int
) -> _Plan:
    infos = ckpt.infos
    # 1. Shards from sizes alone, as huggingface_hub splits (tied aliases are dropped, as it does for safetensors).
    stored = [n for n in names if n not in ties]
    sizes = {n: infos[n].numel * dtypes[n].itemsize for n in stored}
    shards = plan_shards(sizes, max_shard_size=limit, filename_pattern="model{suffix}.safetensors")
    # 2. huggingface_hub's save_torch_state_dict records each dropped alias as `alias: kept name`: in the header of
    #    a single file, in the index's metadata when sharded.
    tie_meta = {alias: ties[alias] for alias in names if alias in ties}
    file_meta = {"format": "pt"} if shards.is_sharded else {"format": "pt", **tie_meta}
    # 3. Every file's header and byte offsets.
    layouts = tuple(
        (filename, plan_file([(n, dtypes[n], infos[n].shape) for n in shard_names], metadata=file_meta))
        for filename, shard_names in shards.shards
    )
    index = index_json(shards, extra_metadata=tie_meta) if shards.is_sharded else None
    return _Plan(shards, index, layouts)


def _plan_torch(
    ckpt: Checkpoint, names: list[str], ties: dict[str, str], dtypes: dict[str, torch.dtype], limit: int
) -> _Plan:
    infos = ckpt.infos
    # Tied names stay as keys sharing one tensor (torch.save stores the storage once), in one shard, as
    # huggingface_hub's save_torch_state_dict(safe_serialization=False) does.
    sizes = {n: infos[n].numel * dtypes[n].itemsize for n in names}
    shards = plan_shards(sizes, max_shard_size=limit, filename_pattern="pytorch_model{suffix}.bin", aliases=ties)
    return _Plan(shards, index_json(shards) if shards.is_sharded else None)


# --------------------------------------------------------------------------- writers


def _write_safetensors(
    ckpt: Checkpoint,
    plan: _Plan,
    tmp: Path,
    dst: Path,
    *,
    target: torch.dtype | None,
    workers: int,
    chunk_bytes: int,
    progress: bool | ProgressCallback,
) -> None:
    # 1. Create and preallocate every file (a full disk fails here, before reading), write the headers.
    meter = ByteProgress(progress, plan.shards.total_size, "Converting")
    fds: list[int] = []
    stop = threading.Event()
    try:
        slot_of = {}
        for filename, layout in plan.layouts:
            with naming(dst / filename):
                fd = create_new(tmp / filename)
                fds.append(fd)
                preallocate(fd, layout.size)
                pwrite_all(fd, layout.header, 0)
            for slot in layout.slots:
                slot_of[slot.name] = (fd, slot, dst / filename)
        meter.start()

        # 2. Stream tensors in source key order (sequential reads of the rank files), each chunk pwritten to its
        #    precomputed offset; `workers` threads overlap one tensor's reads with another's writes.
        buffers = ChunkBuffers()

        def task(name: str) -> Callable[[], None]:
            fd, slot, final = slot_of[name]

            def run() -> None:
                with naming(final):
                    if _copy_in_kernel(ckpt, name, target, fd, slot, chunk_bytes, meter.update, stop):
                        return
                    chunks = ckpt.chunks(name, target, chunk_bytes, buffers.get)
                    write_chunks(fd, slot, chunks, on_bytes=meter.update, stop=stop)

            return run

        order = [name for name in ckpt.infos if name in slot_of]
        with _pool(workers) as pool:
            _run_all(pool, [task(n) for n in order], stop)
        # 3. Durable before the index names them.
        for fd, (filename, _) in zip(fds, plan.layouts):
            with naming(dst / filename):
                os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
        meter.close()
    # 4. The index last.
    if plan.index is not None:
        with naming(dst / C.SAFETENSORS_INDEX):
            write_new_file(tmp / C.SAFETENSORS_INDEX, plan.index)


def _write_torch(
    ckpt: Checkpoint,
    plan: _Plan,
    tmp: Path,
    dst: Path,
    ties: dict[str, str],
    *,
    target: torch.dtype | None,
    workers: int,
    progress: bool | ProgressCallback,
) -> None:
    meter = ByteProgress(progress, plan.shards.total_size, "Converting")
    meter.start()
    stop = threading.Event()

    def loader(name: str, into: dict[str, torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            if not stop.is_set():
                tensor = ckpt.get_tensor(name, dtype=target)
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
    if plan.index is not None:
        with naming(dst / C.TORCH_INDEX):
            write_new_file(tmp / C.TORCH_INDEX, plan.index)


def _convert_lightning(
    src: StrPath, dst: Path, *, tag: str | None, target: torch.dtype | None, overwrite: bool
) -> ConvertResult:
    """``fmt="lightning"``: one consolidated ``.ckpt`` file, written atomically by ``write_lightning_ckpt``."""
    from ._lightning import write_lightning_ckpt
    from ._loader import open as zeroio_open

    # 1. Refuse an existing file (or a file in the way of a parent folder) before reading anything, as for folders;
    #    a folder at dst is refused by write_lightning_ckpt, overwrite or not (a Lightning checkpoint is one file).
    dst = Path(os.path.abspath(dst))
    if not dst.is_dir():
        AtomicDir(dst, overwrite=overwrite).check()
    if overwrite and dst.is_file() and dst.resolve() == Path(src).resolve():
        raise OutputError(f"Refusing to overwrite '{dst}': it is the source. Write to another file.", path=dst)
    with zeroio_open(src, tag) as ckpt:
        # 2. Missing parent folders are created, as convert creates them for an output folder.
        if not dst.is_dir():
            try:
                dst.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputError(
                    f"Cannot write '{dst}': cannot create the folder '{dst.parent}' ({exc.strerror or exc}). "
                    "Check the permissions of the destination's folder or choose another destination.",
                    path=dst,
                ) from exc
        written = write_lightning_ckpt(ckpt, dst, dtype=target, overwrite=overwrite)
        infos = ckpt.infos
        num_params = sum(info.numel for name, info in infos.items() if name not in ckpt.tied)
        facts = _card_facts(
            ckpt, "lightning", target, [_output_dtype(i, target) for i in infos.values()], [], num_params
        )
    logger.info("wrote %d tensors (%d bytes) to %s", written.num_tensors, written.total_size, written.path)
    return ConvertResult(
        files=(written.path,),
        index_path=None,
        total_size=written.total_size,
        num_tensors=written.num_tensors,
        tied=written.tied,
        card_facts=facts,
    )


# --------------------------------------------------------------------------- the public verb


def convert(
    src: StrPath,
    dst: StrPath,
    *,
    fmt: Format = "safetensors",
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    tag: str | None = None,
    exclude_frozen: bool = False,
    overwrite: bool = False,
    workers: int | None = None,
    progress: bool | ProgressCallback = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    distributed: bool = False,
    include_optimizer: bool = False,
) -> ConvertResult:
    """Convert a checkpoint into the files Hugging Face tools load, streaming and all-or-nothing.

    ``fmt="safetensors"`` writes ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` ... plus
    ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size``: the names, shard split,
    header metadata (``{"format": "pt"}``) and index that ``huggingface_hub.save_torch_state_dict`` writes.
    Tied weights are stored once under their source name; each alias is recorded as ``alias: source`` in the
    header metadata (one file) or in the index's ``metadata`` (sharded), as huggingface_hub records them.
    Every offset is computed from metadata before a tensor is read; tensors are then streamed in chunks of
    ``chunk_bytes`` into one reused buffer per IO thread, so memory stays near ``workers * chunk_bytes`` (twice
    that when casting) whatever the model or shard size.

    ``fmt="torch"`` writes ``pytorch_model.bin`` (or ``pytorch_model-0000K-of-0000N.bin`` plus
    ``pytorch_model.bin.index.json``), loadable with ``torch.load(weights_only=True)``; tied names are both
    keys and share one tensor. It holds one shard in memory at a time (``torch.save`` needs whole tensors).

    ``fmt="lightning"`` writes the single consolidated ``.ckpt`` file PyTorch Lightning users deploy (``dst`` is
    that file): ``state_dict`` plus the client state Lightning saved (``epoch``, ``global_step``,
    ``hyper_parameters``, ``loops``, ``callbacks``, ...), loadable with ``LightningModule.load_from_checkpoint``.
    It holds the whole state dict in memory (a torch pickle); ``max_shard_size``, ``workers``, ``chunk_bytes``
    and ``progress`` do not apply.

    ``config.json``, ``generation_config.json`` and tokenizer files found beside the source (the HF Trainer's
    ``checkpoint-N/``, or the parent of a tag folder or file) are copied into a ``safetensors``/``torch``
    output folder, so ``transformers`` loads it as it is; a plain DeepSpeed checkpoint has none.

    The output is built in a temporary folder (file) beside ``dst`` and renamed into place when complete.

    Args:
        src: anything :func:`zeroio.open` reads: a DeepSpeed checkpoint (root or tag folder) or a consolidated
            safetensors/torch checkpoint (to re-shard or cast).
        dst: the output folder to create (the ``.ckpt`` file for ``fmt="lightning"``).
        fmt: ``"safetensors"`` (default), ``"torch"`` or ``"lightning"``.
        dtype: cast floating tensors (``"fp32"``, ``"fp16"``, ``"bf16"`` or a torch dtype), with torch's own
            rounding (``tensor.to(dtype)``); integer buffers keep their dtype. Default: as stored (fp32 master
            weights, frozen parameters in their training dtype).
        max_shard_size: largest shard, ``"5GB"``, ``"500MB"``, ``"1.5GB"`` (decimal units) or bytes. A tensor
            larger than this gets a shard of its own.
        tag: the DeepSpeed tag to read (default: the one in ``latest``).
        exclude_frozen: leave out frozen (``requires_grad=False``) parameters of a DeepSpeed checkpoint
            (consolidated files do not say which parameters were frozen). Not with ``fmt="lightning"``:
            ``load_from_checkpoint`` needs every parameter.
        overwrite: replace an existing ``dst``.
        workers: IO threads (default: up to 4).
        progress: ``True`` draws a tqdm bar in bytes on a terminal, ``False`` is silent, or pass
            ``callable(done, total)`` (bytes; it may be called from IO threads).
        chunk_bytes: largest piece of a tensor read at once, per thread.
        distributed: run as one process of a ``torch.distributed`` job (an initialised process group, or
            ``torchrun``'s environment): every process must call ``convert`` with the same arguments; each writes
            its share of the shards into one folder on a filesystem shared by all, and every process returns the
            same result. See ``docs/distributed.md``.
        include_optimizer: also write the consolidated optimizer state of a DeepSpeed ZeRO-1/2/3 checkpoint:
            ``optimizer.safetensors`` (keys ``<param>.exp_avg``, ``<param>.exp_avg_sq``; sharded like the
            weights) and ``optimizer.json`` (param groups, steps). ``fmt="safetensors"`` only; a source without
            optimizer state fails before anything is written. See ``docs/resharding.md``.

    Returns:
        A :class:`ConvertResult`: files, index path, total size, tensor count, ties, model-card facts and the
        copied config/tokenizer files. For ``fmt="lightning"``: ``files=(dst,)``, ``index_path=None``.

    Raises:
        OutputError: ``dst`` exists (without ``overwrite``) or holds the source, cannot be written, the disk
            filled, or the conversion was interrupted (KeyboardInterrupt); the partial output is removed.
        CheckpointNotFoundError, CheckpointFormatError: the source cannot be read (raised before ``dst`` is
            touched when found in metadata).
        ValueError: an argument has a bad value (format, dtype, shard size, workers), or ``exclude_frozen``
            with ``fmt="lightning"``.
        UnsupportedCheckpointError: ``fmt="lightning"`` and the client state holds an object zeroio cannot
            rebuild.
        TypeError: an argument has the wrong type.

    Example:
        >>> import zeroio
        >>> result = zeroio.convert("fixtures/z3_ws2_bf16", "out/model", dtype="bf16", progress=False)  # doctest: +SKIP
        >>> [p.name for p in result.files]  # doctest: +SKIP
        ['model.safetensors']
    """
    # 1. Arguments, without IO.
    if fmt not in ("safetensors", "torch", "lightning"):
        raise ValueError(f"fmt must be 'safetensors', 'torch' or 'lightning', got {fmt!r}.")
    target = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    n_workers = _workers(workers)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise TypeError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}.")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}.")
    if not (isinstance(progress, bool) or callable(progress)):
        raise TypeError(f"progress must be True, False or a callable(done, total), got {progress!r}.")
    dst_path = Path(dst)
    if include_optimizer and (fmt != "safetensors" or distributed):
        raise ValueError(
            "include_optimizer=True writes optimizer.safetensors beside model.safetensors: use fmt='safetensors' "
            "without distributed=True."
        )
    if distributed is not False:
        if not isinstance(distributed, bool):
            raise TypeError(f"distributed must be True or False, got {distributed!r}.")
        from ._distributed import convert_distributed

        return convert_distributed(
            src, dst_path, fmt=fmt, target=target, limit=limit, tag=tag, exclude_frozen=exclude_frozen,
            overwrite=overwrite, workers=n_workers, progress=progress, chunk_bytes=chunk_bytes,
        )  # fmt: skip
    if fmt == "lightning":
        if exclude_frozen:
            raise ValueError(
                "exclude_frozen=True cannot be used with fmt='lightning': load_from_checkpoint loads strictly and "
                "needs every parameter. Drop exclude_frozen, or write fmt='safetensors'."
            )
        return _convert_lightning(src, dst_path, tag=tag, target=target, overwrite=overwrite)
    out = AtomicDir(dst_path, overwrite=overwrite)

    # 2. Refuse an existing destination before reading anything; clean temporary folders of dead conversions.
    out.check()
    if overwrite and os.path.lexists(dst_path) and _is_within(Path(src), dst_path):
        raise OutputError(
            f"Refusing to overwrite '{out.dst}': the source '{src}' is inside it. Write to another folder.",
            path=out.dst,
        )

    # 3. The source's metadata (no tensor bytes yet): what to write, in which dtype.
    from ._loader import open as zeroio_open

    with zeroio_open(src, tag) as ckpt:
        infos = ckpt.infos
        excluded = [n for n, info in infos.items() if exclude_frozen and info.kind == "frozen"]
        names = [n for n in infos if n not in excluded]
        ties = {alias: source for alias, source in ckpt.tied.items() if alias in names and source in names}
        dtypes = {n: _output_dtype(infos[n], target) for n in names}
        logger.debug("converting %d tensors from %s to %s (%s)", len(names), ckpt.metadata.path, out.dst, fmt)

        # 4. Plan every file from metadata: shards, headers, offsets, index (a dtype safetensors cannot hold
        #    fails here, before anything is created).
        if fmt == "safetensors":
            plan = _plan_safetensors(ckpt, names, ties, dtypes, limit)
        else:
            plan = _plan_torch(ckpt, names, ties, dtypes, limit)
        optim = None
        if include_optimizer:  # optimizer.safetensors + optimizer.json beside the weights (zeroio/_optim.py)
            from ._optim import plan_optimizer_files

            optim = plan_optimizer_files(ckpt, names, max_shard_size=limit)

        # 5. Build everything in a temporary folder beside dst; rename it into place only when complete.
        with out as tmp:
            if fmt == "safetensors":
                _write_safetensors(
                    ckpt, plan, tmp, out.dst, target=target, workers=n_workers, chunk_bytes=chunk_bytes,
                    progress=progress,
                )  # fmt: skip
            else:
                _write_torch(ckpt, plan, tmp, out.dst, ties, target=target, workers=n_workers, progress=progress)
            if optim is not None:
                from ._optim import write_optimizer_files

                write_optimizer_files(ckpt, optim, tmp, chunk_bytes=chunk_bytes)
            copied = copy_side_files(Path(src), tmp, dtype=target)  # HF Trainer checkpoint-N: config and tokenizer files
        num_params = sum(infos[n].numel for n in names if n not in ties)
        facts = _card_facts(ckpt, fmt, target, [dtypes[n] for n in names], excluded, num_params)

    files = tuple(out.dst / filename for filename, _ in plan.shards.shards)
    num_tensors = len([n for n in names if n not in ties])
    total = plan.shards.total_size
    logger.info("wrote %d tensors (%d bytes) in %d file(s) to %s", num_tensors, total, len(files), out.dst)
    index_name = C.SAFETENSORS_INDEX if fmt == "safetensors" else C.TORCH_INDEX
    return ConvertResult(
        files=files,
        index_path=out.dst / index_name if plan.index is not None else None,
        total_size=total,
        num_tensors=num_tensors,
        tied=ties,
        card_facts=facts,
        copied=tuple(out.dst / name for name in copied),
    )
