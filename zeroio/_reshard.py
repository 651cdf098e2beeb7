"""``zeroio.reshard``: rewrite a DeepSpeed ZeRO-3 checkpoint for another data-parallel world size, streaming."""

from __future__ import annotations

import collections
import enum
import logging
import math
import os
import pickle
import struct
import types
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import _constants as C
from ._atomic import AtomicDir
from ._fileio import pwrite_all
from ._metadata import require, require_dict
from ._optim import OptimizerLayout, moment_source, optimizer_layout
from ._partition import zero3_partition_numel, zero3_sub_groups
from ._types import ProgressCallback, StrPath
from ._unpickle import TensorRef, load_pickle
from .errors import CheckpointFormatError, PartitionMismatchError, UnsupportedCheckpointError

__all__ = ["DEFAULT_CHUNK_BYTES", "ReshardResult", "reshard"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
"""Largest piece of a tensor held in memory while resharding."""

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed 0.19.8's ``zero_optimization.sub_group_size`` default."""

_ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"


@dataclass(frozen=True, slots=True)
class ReshardResult:
    """What :func:`reshard` wrote."""

    path: Path
    """The output checkpoint folder (holds ``latest`` and the tag folder): pass it to ``engine.load_checkpoint``."""
    tag: str
    """The tag folder written (and named in ``latest``)."""
    world_size: int
    """Data-parallel ranks the checkpoint is partitioned for."""
    files: tuple[Path, ...]
    """Every rank file, model states first, then optimizer states, in rank order."""
    total_size: int
    """Bytes of tensor data written."""
    source_world_size: int
    """Data-parallel ranks of the source checkpoint."""


# --------------------------------------------------------------------------- pickling DeepSpeed's classes


def _ds_class(qualified: str) -> type:
    """A local class that pickles as the global ``qualified`` (e.g. DeepSpeed's ``LossScaler``).

    zeroio never imports DeepSpeed: the pickle names the class and DeepSpeed's unpickler resolves it.
    """
    cls = _DS_CLASSES.get(qualified)
    if cls is None:
        cls = _DS_CLASSES[qualified] = type(qualified.rsplit(".", 1)[1], (), {"_zeroio_global": qualified})
    return cls


_DS_CLASSES: dict[str, type] = {}


class _Call:
    """Pickles as ``cls(*args)`` (how ``ZeroStageEnum.weights`` pickles: ``ZeroStageEnum(3)``)."""

    def __init__(self, cls: type, args: tuple[Any, ...]) -> None:
        self.cls = cls
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.cls, self.args)


def _ds_object(qualified: str, state: dict[str, Any]) -> Any:
    """An object that pickles like an instance of ``qualified`` with ``__dict__`` ``state`` (NEWOBJ + BUILD)."""
    obj: Any = object.__new__(_ds_class(qualified))
    obj.__dict__.update(state)
    return obj


_PythonPickler: Any = pickle._Pickler  # the pure-Python pickler: unlike the C one, its save_global can be overridden


class _Pickler(_PythonPickler):  # type: ignore[misc]
    """Writes each :func:`_ds_class` as the global it stands for, without importing it."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        qualified = obj.__dict__.get("_zeroio_global") if isinstance(obj, type) else None
        if qualified is None:
            super().save_global(obj, name)
            return
        module, _, qualname = qualified.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qualname.encode("utf-8") + b"\n")
        self.memoize(obj)


_PICKLE_MODULE = types.ModuleType("zeroio._reshard_pickle")
_PICKLE_MODULE.Pickler = _Pickler  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- rank files: tree, then bytes


Chunks = Callable[[], Iterator[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class _Fill:
    """One tensor of a file being written: where it sits in the object tree and how to produce its bytes."""

    path: tuple[Any, ...]
    numel: int
    dtype: torch.dtype
    chunks: Chunks


class _Buffers:
    """Reused read and zero buffers, one per dtype: memory stays at a chunk or two."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._bufs: dict[tuple[torch.dtype, bool], torch.Tensor] = {}

    def elements(self, dtype: torch.dtype) -> int:
        return max(1, self.chunk_bytes // dtype.itemsize)

    def get(self, dtype: torch.dtype, *, zeros: bool = False) -> torch.Tensor:
        buf = self._bufs.get((dtype, zeros))
        if buf is None:
            n = self.elements(dtype)
            buf = self._bufs[(dtype, zeros)] = torch.zeros(n, dtype=dtype) if zeros else torch.empty(n, dtype=dtype)
        return buf


class _FileBuilder:
    """Builds one rank file's object tree with data-less (fake) tensors, recording how to fill each one."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self._mode = FakeTensorMode()
        self.fills: list[_Fill] = []

    def tensor(self, path: tuple[Any, ...], shape: Sequence[int], dtype: torch.dtype, chunks: Chunks) -> torch.Tensor:
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        with self._mode:
            fake = torch.empty(tuple(shape), dtype=dtype)
        self.fills.append(_Fill(path, numel, dtype, chunks))
        return fake

    @property
    def nbytes(self) -> int:
        return sum(f.numel * f.dtype.itemsize for f in self.fills)


def _walk(tree: Any, path: tuple[Any, ...]) -> Any:
    node = tree
    for key in path:
        node = node[key] if isinstance(node, (dict, list, tuple)) else node.__dict__[key]
    return node


def _central_directory(fd: int, start: int, size: int) -> dict[str, int]:
    """``{record name: offset of its central directory header}``."""
    data = os.pread(fd, size - start, start)
    offsets: dict[str, int] = {}
    pos = 0
    while pos + 46 <= len(data) and struct.unpack_from("<I", data, pos)[0] == 0x02014B50:
        n, m, k = struct.unpack_from("<HHH", data, pos + 28)
        offsets[data[pos + 46 : pos + 46 + n].decode("utf-8")] = start + pos
        pos += 46 + n + m + k
    return offsets


def _save_rank_file(tree: Any, builder: _FileBuilder, path: Path, on_bytes: Callable[[int], None]) -> None:
    """``torch.save`` the tree without tensor bytes, then stream each tensor's bytes into its record.

    ``torch.serialization.skip_data`` writes the archive with every storage record reserved but not filled;
    each record is then written with ``pwrite`` from bounded chunks, and its CRC-32 set in the data
    descriptor and the central directory, so the result is the archive ``torch.save`` would have written.
    """
    # 1. The archive, storage bytes left empty (no tensor is ever materialised).
    with open(path, "xb") as fh, torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(tree, fh, pickle_module=_PICKLE_MODULE)
    # 2. Which record holds which tensor: read back with zeroio's own parser.
    parsed, rank_file = load_pickle(path)
    rank_file.close()
    keys = []
    for fill in builder.fills:
        ref = _walk(parsed, fill.path)
        if not isinstance(ref, TensorRef) or ref.numel != fill.numel or ref.storage_offset != 0:
            raise CheckpointFormatError(f"'{path}': tensor at {fill.path} was not written as planned.", path=path)
        keys.append(ref.storage.key)
    with zipfile.ZipFile(path) as archive:
        records = {info.filename: info for info in archive.infolist()}
        start_dir = archive.start_dir
    root = next(name[: -len("data.pkl")] for name in records if name.endswith("data.pkl"))
    # 3. The bytes, then the CRCs.
    fd = os.open(path, os.O_RDWR)
    try:
        central = _central_directory(fd, start_dir, os.fstat(fd).st_size)
        for fill, key in zip(builder.fills, keys):
            info = records[f"{root}data/{key}"]
            header = os.pread(fd, 30, info.header_offset)
            name_len, extra_len = struct.unpack_from("<HH", header, 26)
            begin = info.header_offset + 30 + name_len + extra_len
            offset, crc = begin, 0
            for chunk in fill.chunks():
                view = memoryview(_bytes(chunk))
                pwrite_all(fd, view, offset)
                crc = zlib.crc32(view, crc)
                offset += len(view)
                on_bytes(len(view))
            if offset - begin != info.file_size:
                raise PartitionMismatchError(
                    f"'{path}': record data/{key} holds {info.file_size} bytes, {offset - begin} were produced.",
                    path=path,
                )
            packed = struct.pack("<I", crc)
            if info.flag_bits & 0x08:  # data descriptor after the data (torch's writer uses one)
                signature = os.pread(fd, 4, offset)
                pwrite_all(fd, packed, offset + 4 if signature == b"PK\x07\x08" else offset)
            else:
                pwrite_all(fd, packed, info.header_offset + 14)
            pwrite_all(fd, packed, central[info.filename] + 16)
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes(chunk: torch.Tensor) -> memoryview:
    import ctypes

    nbytes = chunk.numel() * chunk.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(chunk.data_ptr())).cast("B")


# --------------------------------------------------------------------------- chunk producers


def _ref_chunks(ref: TensorRef, buffers: _Buffers) -> Chunks:
    """A stored tensor, copied in bounded chunks."""

    def run() -> Iterator[torch.Tensor]:
        buf = buffers.get(ref.dtype)
        for start in range(0, ref.numel, buf.numel()):
            n = min(buf.numel(), ref.numel - start)
            ref.read(start, n, buf[:n])
            yield buf[:n]

    return run


def _slices_chunks(reads: list[tuple[Any, int, int, int]], dtype: torch.dtype, buffers: _Buffers) -> Chunks:
    """``(source, start, count, padding)`` rows: ``count`` elements of a consolidated tensor, then zeros."""
    from ._zero import read_plan_into

    def run() -> Iterator[torch.Tensor]:
        buf = buffers.get(dtype)
        zeros = buffers.get(dtype, zeros=True)
        for source, start, count, padding in reads:
            for done in range(0, count, buf.numel()):
                n = min(buf.numel(), count - done)
                read_plan_into(source, start + done, buf[:n])
                yield buf[:n]
            for done in range(0, padding, zeros.numel()):
                yield zeros[: min(zeros.numel(), padding - done)]

    return run


# --------------------------------------------------------------------------- copying plain data


def _rebuild(value: Any, path: tuple[Any, ...], builder: _FileBuilder, buffers: _Buffers, where: Path) -> Any:
    """A value parsed by zeroio's unpickler, made picklable again (tensors become fills, DeepSpeed objects
    pickle under their own class names)."""
    if isinstance(value, TensorRef):
        return builder.tensor(path, value.shape, value.dtype, _ref_chunks(value, buffers))
    if isinstance(value, enum.IntEnum) and type(value).__name__ == "ZeroStageEnum":
        return _Call(_ds_class(_ZERO_STAGE_ENUM), (int(value),))
    qualified = getattr(type(value), "_zeroio_global", None)
    if qualified is not None and qualified != "object":  # an inert stand-in for a class the pickle named
        state = {k: v for k, v in value.__dict__.items() if k not in ("_args", "_kwargs", "_state")}
        if value.__dict__.get("_args") or value.__dict__.get("_kwargs") or "_state" in value.__dict__:
            raise UnsupportedCheckpointError(
                f"'{where}': '{'.'.join(map(str, path))}' holds a {qualified} built from constructor arguments, "
                "which zeroio cannot write back yet. Remove it from the client state before resharding.",
                path=where,
            )
        return _ds_object(qualified, {k: _rebuild(v, path + (k,), builder, buffers, where) for k, v in state.items()})
    if isinstance(value, dict):
        items = {k: _rebuild(v, path + (k,), builder, buffers, where) for k, v in value.items()}
        if type(value) is collections.OrderedDict:
            return collections.OrderedDict(items)
        if type(value) is not dict:
            logger.warning(
                "%s: '%s' (a %s) is written as a plain dict", where, ".".join(map(str, path)), type(value).__name__
            )
        return items
    if isinstance(value, list):
        return [_rebuild(v, path + (i,), builder, buffers, where) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(_rebuild(v, path + (i,), builder, buffers, where) for i, v in enumerate(value))
    return value


# --------------------------------------------------------------------------- progress


class _Meter:
    """Bytes written so far, shown as a tqdm bar (``progress=True``) or passed to ``callable(done, total)``."""

    def __init__(self, progress: bool | ProgressCallback, total: int) -> None:
        self.done, self.total = 0, total
        self.callback = progress if callable(progress) else None
        self.bar: Any = None
        if progress is True:
            from tqdm import tqdm  # type: ignore[import-untyped]  # a huggingface_hub dependency

            # disable=None: no bar when stderr is not a terminal (logs, CI, captured output).
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="Resharding", disable=None, leave=False)
        if self.callback is not None:
            self.callback(0, total)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class _SubGroup:
    param_group: int
    names: tuple[str, ...]
    numels: tuple[int, ...]
    step_group: int
    """The source flat group whose state entry gives this sub-group's ``step``."""


def _param_groups(
    ckpt: Any, layout: OptimizerLayout, param_shapes: list[dict[str, Any]], model0_path: Path
) -> list[list[str]]:
    """Parameter names of each param group, in the flat order (``param_shapes`` holds one dict per sub-group)."""
    if len(param_shapes) != len(layout.param_group):
        raise PartitionMismatchError(
            f"'{model0_path}' records {len(param_shapes)} parameter groups in '{C.PARAM_SHAPES}', the optimizer "
            f"files {len(layout.param_group)} fp32 flat groups. The rank files come from different runs.",
            path=model0_path,
            expected=len(layout.param_group),
            found=len(param_shapes),
        )
    groups: list[list[str]] = [[] for _ in layout.param_groups]
    for j, shapes in enumerate(param_shapes):
        groups[layout.param_group[j]].extend(str(n) for n in shapes)
    return groups


def _sub_groups(
    ckpt: Any, layout: OptimizerLayout, groups: list[list[str]], world_size: int, sub_group_size: int
) -> list[_SubGroup]:
    subs = []
    for g, names in enumerate(groups):
        numels = [ckpt.info(n).numel for n in names]
        for members in zero3_sub_groups(numels, world_size, sub_group_size):
            chosen = tuple(names[i] for i in members)
            first = ckpt.read_plan(chosen[0]) if chosen else None
            step_group = first.pieces[0].group if first is not None and first.pieces else -1
            subs.append(_SubGroup(g, chosen, tuple(numels[i] for i in members), step_group))
    return subs


def _rank_reads(
    sources: Sequence[Any], numels: Sequence[int], world_size: int, rank: int
) -> list[tuple[Any, int, int, int]]:
    """Rank ``rank``'s ZeRO-3 partition of each parameter: elements ``[rank*p, rank*p + count)`` plus padding."""
    reads = []
    for source, numel in zip(sources, numels):
        part = zero3_partition_numel(numel, world_size)
        count = max(0, min(part, numel - rank * part))
        reads.append((source, rank * part, count, part - count))
    return reads


def _config_int(ds_config: Any, key: str) -> int | None:
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    value = zero.get(key) if isinstance(zero, dict) else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# --------------------------------------------------------------------------- the public verb


def reshard(
    src: StrPath,
    dst: StrPath,
    *,
    world_size: int,
    tag: str | None = None,
    output_tag: str | None = None,
    sub_group_size: int | None = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool | ProgressCallback = False,
) -> ReshardResult:
    """Write a DeepSpeed ZeRO-3 checkpoint of ``src`` partitioned for ``world_size`` data-parallel ranks.

    The output is what ``engine.save_checkpoint`` would have written from a run at ``world_size`` ranks in the
    same state: per rank, ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (module placeholders and buffers,
    ``param_shapes``, frozen-parameter fragments, ``shared_params``, step counters, lr scheduler and client
    state) and ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (fp32 master partitions, Adam moments and
    step per sub-group, param groups, loss scaler), with ZeRO-3's padding for ``world_size``; plus ``latest``.
    DeepSpeed resumes from it with ``engine.load_checkpoint(dst)`` at ``world_size`` ranks. zeroio never
    imports DeepSpeed: its classes (``ZeroStageEnum``, ``LossScaler``) are written by name into the pickles.

    Tensors are streamed in chunks of ``chunk_bytes`` straight into their place in each file, so memory stays
    near one chunk whatever the model size. The output is built beside ``dst`` and renamed into place.

    Args:
        src: a DeepSpeed ZeRO-3 checkpoint (root or tag folder) with optimizer state.
        dst: the output checkpoint folder to create.
        world_size: data-parallel ranks of the run that will load it.
        tag: the source tag (default: the one in ``latest``).
        output_tag: the output tag folder (default: the source's tag).
        sub_group_size: ZeRO-3 ``sub_group_size`` of the run that will load it (default: the source's config,
            else DeepSpeed's default 1e9); it decides how many fp32 flat groups each rank has.
        overwrite: replace an existing ``dst``.
        chunk_bytes: largest piece of a tensor read at once.
        progress: ``True`` draws a tqdm bar (bytes), or pass ``callable(done, total)``.

    Returns:
        A :class:`ReshardResult`: output folder, tag, world sizes, files and bytes written.

    Raises:
        UnsupportedCheckpointError: the source is not ZeRO-3 (or uses MiCS / AutoEP partitioning).
        CheckpointFormatError: the source holds no optimizer moments (stripped, or saved before a step).
        OutputError: ``dst`` exists (without ``overwrite``) or cannot be written; nothing partial is left.
        ValueError, TypeError: a bad argument.

    Example:
        >>> import zeroio
        >>> result = zeroio.reshard("fixtures/z3_ws2_fp32", "out/ws3", world_size=3)  # doctest: +SKIP
        >>> [p.name for p in result.files][:2]  # doctest: +SKIP
        ['zero_pp_rank_0_mp_rank_00_model_states.pt', 'zero_pp_rank_1_mp_rank_00_model_states.pt']
    """
    # 1. Arguments, without IO.
    for label, value in (("world_size", world_size), ("chunk_bytes", chunk_bytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be a positive int, got {value!r}.")
        if value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}.")
    if sub_group_size is not None and (
        isinstance(sub_group_size, bool) or not isinstance(sub_group_size, int) or sub_group_size < 0
    ):
        raise ValueError(f"sub_group_size must be a non-negative int, got {sub_group_size!r}.")
    if not (isinstance(progress, bool) or callable(progress)):
        raise TypeError(f"progress must be True, False or a callable(done, total), got {progress!r}.")
    if not hasattr(torch.serialization, "skip_data"):
        raise ImportError("zeroio.reshard needs torch >= 2.6 (torch.serialization.skip_data): pip install -U torch")
    out = AtomicDir(Path(dst), overwrite=overwrite)
    out.check()

    from ._loader import open as zeroio_open
    from ._zero import ZeroCheckpoint

    with zeroio_open(src, tag) as ckpt:
        # 2. The source: ZeRO-3 with optimizer state (fails here, before anything is written).
        meta = ckpt.metadata
        if not isinstance(ckpt, ZeroCheckpoint) or meta.zero_stage != 3:
            what = f"ZeRO stage {meta.zero_stage}" if meta.format == "zero" else f"a consolidated {meta.format} file"
            raise UnsupportedCheckpointError(
                f"'{meta.path}' is {what}; zeroio reshards ZeRO-3 checkpoints only (yet). For ZeRO-1/2 use "
                "DeepSpeed's universal checkpoint (ds_to_universal.py).",
                path=meta.path,
                found=meta.zero_stage,
            )
        layout = optimizer_layout(ckpt, what="reshard()")
        model0_path = meta.path / meta.extra["model_files"][0]
        optim0_path = layout.files[0]
        model0, model_file = load_pickle(model0_path)
        optim0, optim_file = load_pickle(optim0_path)
        try:
            result = _reshard_open(
                ckpt, layout, model0, model0_path, optim0, optim0_path, out,
                world_size=world_size, output_tag=output_tag, sub_group_size=sub_group_size,
                chunk_bytes=chunk_bytes, progress=progress,
            )  # fmt: skip
        finally:
            model_file.close()
            optim_file.close()
    return result


def _reshard_open(
    ckpt: Any,
    layout: OptimizerLayout,
    model0: Any,
    model0_path: Path,
    optim0: Any,
    optim0_path: Path,
    out: AtomicDir,
    *,
    world_size: int,
    output_tag: str | None,
    sub_group_size: int | None,
    chunk_bytes: int,
    progress: bool | ProgressCallback,
) -> ReshardResult:
    meta = ckpt.metadata
    module = require_dict(require(model0, C.MODULE, model0_path), C.MODULE, model0_path)
    buffer_names = {str(b) for b in (model0.get(C.BUFFER_NAMES) or [])}
    ds_config = model0.get(C.DS_CONFIG)
    osd0 = require_dict(require(optim0, C.OPTIMIZER_STATE_DICT, optim0_path), C.OPTIMIZER_STATE_DICT, optim0_path)
    base0 = require_dict(require(osd0, C.OPTIMIZER_STATE_DICT, optim0_path), C.OPTIMIZER_STATE_DICT, optim0_path)
    if (_config_int(ds_config, "mics_shard_size") or 0) > 0 or "ds_zero_partition_groups" in osd0:
        raise UnsupportedCheckpointError(
            f"'{meta.path}' partitions parameters over sub-groups of ranks (MiCS or AutoEP); zeroio reshards plain "
            "ZeRO-3 checkpoints only.",
            path=meta.path,
        )
    if (meta.path / "offloaded_tensors").exists():
        raise UnsupportedCheckpointError(
            f"'{meta.path}' keeps optimizer state in 'offloaded_tensors/' (NVMe offload), which zeroio does not "
            "reshard yet.",
            path=meta.path,
        )
    if sub_group_size is None:
        sub_group_size = _config_int(ds_config, "sub_group_size")
        sub_group_size = DEFAULT_SUB_GROUP_SIZE if sub_group_size is None else sub_group_size
    tag = output_tag or meta.tag or f"global_step{meta.global_step or 0}"
    if os.sep in tag or tag in ("", ".", ".."):
        raise ValueError(f"output_tag must be a folder name, got {tag!r}.")

    # 1. The target layout: param groups -> sub-groups at the new world size (metadata only).
    param_shapes = require(model0, C.PARAM_SHAPES, model0_path)
    groups = _param_groups(ckpt, layout, list(param_shapes), model0_path)
    subs = _sub_groups(ckpt, layout, groups, world_size, sub_group_size)
    flat_dtype = (
        ckpt.info(next(n for s in subs for n in s.names)).dtype if any(s.names for s in subs) else torch.float32
    )
    buffers = _Buffers(chunk_bytes)
    prefix = "bf16_" if optim0_path.name.startswith("bf16_") else ""
    frozen_shapes = model0.get(C.FROZEN_PARAM_SHAPES)
    has_fragments = model0.get(C.FROZEN_PARAM_FRAGMENTS) is not None

    def model_file(rank: int) -> tuple[Any, _FileBuilder]:
        builder = _FileBuilder()
        tree: dict[Any, Any] = {}
        for key, value in model0.items():
            if key == C.MODULE:
                entries: collections.OrderedDict[str, Any] = collections.OrderedDict()
                for name, ref in module.items():
                    if name not in buffer_names and isinstance(ref, TensorRef) and ref.numel == 0:
                        entries[name] = torch.empty(ref.shape, dtype=ref.dtype)  # ZeRO-3 parameter placeholder
                    else:
                        entries[name] = _rebuild(ref, (key, name), builder, buffers, model0_path)
                tree[key] = entries
            elif key == C.FROZEN_PARAM_FRAGMENTS and has_fragments:
                fragments: collections.OrderedDict[str, Any] = collections.OrderedDict()
                for name in frozen_shapes or {}:
                    info = ckpt.info(name)
                    source = ckpt.read_plan(name)
                    reads = _rank_reads([source], [info.numel], world_size, rank)
                    part = zero3_partition_numel(info.numel, world_size)
                    fragments[name] = builder.tensor(
                        (key, name), (part,), info.dtype, _slices_chunks(reads, info.dtype, buffers)
                    )
                tree[key] = fragments
            elif key == C.PARAM_SHAPES:
                tree[key] = [
                    collections.OrderedDict((n, torch.Size(ckpt.info(n).shape)) for n in sub.names) for sub in subs
                ]
            elif key == C.DP_WORLD_SIZE:
                tree[key] = world_size
            elif key == C.SHARED_PARAMS and rank > 0 and isinstance(value, dict):
                tree[key] = type(value)()  # DeepSpeed 0.19.8 records the ties on rank 0 only
            else:
                tree[key] = _rebuild(value, (key,), builder, buffers, model0_path)
        return tree, builder

    def optim_file(rank: int) -> tuple[Any, _FileBuilder]:
        builder = _FileBuilder()
        key_osd = C.OPTIMIZER_STATE_DICT
        state: dict[int, dict[str, Any]] = {}
        flats = []
        pgroups: list[dict[str, Any]] = [{} for _ in layout.param_groups]
        members: list[list[int]] = [[] for _ in layout.param_groups]
        source_entries = base0.get("state") or {}
        for s, sub in enumerate(subs):
            members[sub.param_group].append(s)
            sources = [ckpt.read_plan(n) for n in sub.names]
            reads = _rank_reads(sources, sub.numels, world_size, rank)
            size = sum(zero3_partition_numel(n, world_size) for n in sub.numels)
            flats.append(
                builder.tensor(
                    (key_osd, C.FP32_FLAT_GROUPS, s), (size,), flat_dtype, _slices_chunks(reads, flat_dtype, buffers)
                )
            )
            if not sub.names:
                continue  # an empty sub-group's flat tensor never steps: no state entry
            entry: dict[str, Any] = {}
            original = source_entries.get(layout.entries[sub.step_group], {})
            for k, v in original.items():
                where = (key_osd, key_osd, "state", s, k)
                if k in layout.moments:
                    dtype = v.dtype if isinstance(v, TensorRef) else torch.float32
                    moment_reads = [
                        (moment_source(layout, src, k), start, count, pad)
                        for src, (_, start, count, pad) in zip(sources, reads)
                    ]
                    entry[k] = builder.tensor(where, (size,), dtype, _slices_chunks(moment_reads, dtype, buffers))
                else:
                    entry[k] = _rebuild(v, where, builder, buffers, optim0_path)
            state[s] = entry
        for g, group in enumerate(base0.get("param_groups") or []):
            for k, v in group.items():
                where = (key_osd, key_osd, "param_groups", g, k)
                pgroups[g][k] = members[g] if k == "params" else _rebuild(v, where, builder, buffers, optim0_path)
        osd: dict[str, Any] = {}
        for k, v in osd0.items():
            if k == C.OPTIMIZER_STATE_DICT:
                osd[k] = {"state": state, "param_groups": pgroups}
            elif k == C.FP32_FLAT_GROUPS:
                osd[k] = flats
            elif k == C.PARTITION_COUNT:
                osd[k] = world_size
            else:
                osd[k] = _rebuild(v, (key_osd, k), builder, buffers, optim0_path)
        tree = {k: osd if k == key_osd else _rebuild(v, (k,), builder, buffers, optim0_path) for k, v in optim0.items()}
        return tree, builder

    # 2. Plan every file (trees with data-less tensors) to know the total, then write rank by rank.
    names = [
        (f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        for r in range(world_size)
    ]
    total = sum(model_file(r)[1].nbytes + optim_file(r)[1].nbytes for r in range(world_size))
    meter = _Meter(progress, total)
    files: list[Path] = []
    try:
        with out as tmp:
            folder = tmp / tag
            folder.mkdir()
            for kind, build in ((0, model_file), (1, optim_file)):
                for rank in range(world_size):
                    tree, builder = build(rank)
                    _save_rank_file(tree, builder, folder / names[rank][kind], meter.update)
                    files.append(out.dst / tag / names[rank][kind])
            fd = os.open(tmp / C.LATEST_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                pwrite_all(fd, tag.encode("utf-8"), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        meter.close()
    logger.info("resharded %s (world size %s) to %s for world size %d", meta.path, meta.world_size, out.dst, world_size)
    return ReshardResult(out.dst, tag, world_size, tuple(files), total, int(meta.world_size or 0))
