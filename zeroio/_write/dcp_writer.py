"""``convert(fmt="dcp")``: a PyTorch Distributed Checkpoint that FSDP2 resumes from, written chunk by chunk.

Each tensor is written as row blocks of at most ``chunk_bytes`` (one ``torch.save`` archive per block, appended to
``__0_0.distcp``, as DCP's ``FileSystemWriter`` appends them; ``__0_1.distcp`` and on past ``max_shard_size``), so
memory stays near ``workers + 1`` blocks whatever the model size; ``.metadata`` is pickled from torch's own
classes last. Nothing here needs ``torch.distributed`` initialised:
``dcp.load`` only reads ``.metadata`` and the byte ranges it names. Layouts (docs/dcp.md):

* ``torchtitan``: ``dst`` is the DCP folder (name it ``step-N``): model keys at the top level, the optimizer as
  ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` gives it, ``train_state`` = ``{"step": N}``;
* ``accelerate``: ``dst/pytorch_model_fsdp_0/`` = ``{"model": sd}``, ``dst/optimizer_0/`` = ``{"optimizer": osd}``
  (param groups by index, ``params`` as FQN lists).
"""

from __future__ import annotations

import io
import os
import pickle
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import IO, Any

import torch

from .._formats import ReadOptions, TensorReader, open_checkpoint, output_dtype
from .._io.progress import ByteProgress
from .._io.remote_path import RemotePath
from ..errors import UnsupportedCheckpointError
from .atomic import AtomicDir
from .options import WriteOptions
from .result import Written

__all__ = ["write_dcp"]


@dataclass(eq=False)
class _Folder:
    """One DCP folder being written: its data files (``__0_N.distcp``, a new one once ``max_file_bytes`` would be
    passed) and the metadata entries of what went into them."""

    path: Path
    max_file_bytes: int
    files: list[str] = field(default_factory=list)
    entries: dict[str, Any] = field(default_factory=dict)
    storage: dict[Any, Any] = field(default_factory=dict)
    planner: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _fh: IO[bytes] | None = None

    @classmethod
    def create(cls, path: Path, max_file_bytes: int) -> _Folder:
        path.mkdir(parents=True, exist_ok=True)
        folder = cls(path, max_file_bytes)
        folder._next_file()
        return folder

    def _next_file(self) -> IO[bytes]:
        self._close_file()
        self.files.append(f"__0_{len(self.files)}.distcp")
        self._fh = open(self.path / self.files[-1], "xb")  # noqa: SIM115 (closed by _close_file or abandon)
        return self._fh

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def _append(self, fqn: str, write: Any, nbytes: int, offsets: tuple[int, ...] | None) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        fh = self._fh
        assert fh is not None
        start = fh.tell()
        if start and start + nbytes > self.max_file_bytes:
            fh, start = self._next_file(), 0
        write(fh)
        at = None if offsets is None else torch.Size(offsets)
        self.storage[MetadataIndex(fqn, at, 0)] = _StorageInfo(self.files[-1], start, fh.tell() - start)

    def tensor(self, fqn: str, path: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype, blocks: Any) -> None:
        """Write a tensor from ``blocks``: ``(row offset, tensor of those rows)`` in order, covering it."""
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        chunks = []
        for row, block in blocks:
            offsets = (row, *([0] * (len(shape) - 1))) if shape else ()
            self._append(fqn, lambda fh, b=block: torch.save(b, fh), block.numel() * block.element_size(), offsets)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(block.shape)))
        self.entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
        self.planner[fqn] = path

    def value(self, fqn: str, path: tuple[str, ...], obj: Any) -> None:
        """Write a non-tensor value as DCP does: ``torch.save(obj)`` bytes (``BytesStorageMetadata``)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        buffer = io.BytesIO()
        torch.save(obj, buffer)
        self._append(fqn, lambda fh: fh.write(buffer.getvalue()), buffer.tell(), None)
        self.entries[fqn] = BytesStorageMetadata()
        self.planner[fqn] = path

    def abandon(self) -> None:
        """Close the data file being written, if any (an error stopped the write)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def finish(self) -> None:
        """Flush the data files, then write ``.metadata`` (DCP's reader needs it last)."""
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        self._close_file()
        meta = Metadata(self.entries, self.planner, self.storage, StorageMeta(), "1.0.0")
        with open(self.path / ".metadata", "xb") as fh:
            pickle.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())


Block = tuple[str, int, torch.Tensor]
"""``(tensor name, first row, those rows)``: one chunk DCP stores."""


@dataclass(frozen=True, slots=True)
class _BlockRead:
    """Rows ``[at, at + n)`` of one tensor (of ``row`` elements each), read in the stored dtype and cast."""

    ckpt: TensorReader
    name: str
    shape: tuple[int, ...]
    at: int
    n: int
    row: int
    stored: torch.dtype
    wanted: torch.dtype

    def __call__(self) -> Block:
        if not self.shape:  # a scalar
            out = torch.empty(1, dtype=self.stored)
            self.ckpt.read_into(self.ckpt.source_name(self.name), 0, out)
            return self.name, 0, out.to(self.wanted).reshape(())
        out = torch.empty(self.n * self.row, dtype=self.stored)
        if out.numel():
            self.ckpt.read_into(self.ckpt.source_name(self.name), self.at * self.row, out)
        return self.name, self.at, out.to(self.wanted).view(self.n, *self.shape[1:])


def _block_reads(ckpt: TensorReader, wanted: dict[str, torch.dtype], chunk_bytes: int) -> Iterator[_BlockRead]:
    """For each tensor of ``wanted`` (name -> output dtype), in order, the reads of its row blocks of at most
    ``chunk_bytes`` (at least one row; one block for a scalar or a tensor without rows)."""
    for name, out_dtype in wanted.items():
        info = ckpt.info(name)
        stored = ckpt.stored_dtype(name)
        shape = tuple(info.shape)
        rows = shape[0] if shape else 0
        if rows == 0:
            yield _BlockRead(ckpt, name, shape, 0, 0, 0, stored, out_dtype)
            continue
        row = info.numel // rows
        step = max(1, chunk_bytes // max(1, row * max(stored.itemsize, out_dtype.itemsize)))
        for r in range(0, rows, step):
            yield _BlockRead(ckpt, name, shape, r, min(step, rows - r), row, stored, out_dtype)


def _read_ahead(reads: Iterable[_BlockRead], workers: int) -> Iterator[Block]:
    """The blocks of ``reads``, in order, up to ``workers`` of them read (and cast) ahead on as many threads, while
    the caller writes the last one: memory stays near ``workers + 1`` blocks."""
    if workers <= 1:
        yield from (read() for read in reads)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="zeroio-dcp") as pool:
        ahead: deque[Future[Block]] = deque()
        try:
            for read in reads:
                ahead.append(pool.submit(read))
                if len(ahead) > workers:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:
            for future in ahead:
                future.cancel()


def _adam_state(ckpt: TensorReader, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A parameter's per-element state (moments, ``step`` as a 0-d fp32 tensor as torch's Adam keeps it) and its
    param group's hyper-parameters."""
    state = ckpt.optimizer_state(name)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"}
    step = state.get("step")
    if step is not None:
        tensors["step"] = torch.tensor(float(step), dtype=torch.float32)
    hyper = {k: v for k, v in state.items() if k not in tensors and k != "step" and k != "params"}
    return tensors, hyper


def _split(value: torch.Tensor, chunk_bytes: int) -> list[tuple[int, torch.Tensor]]:
    """Row blocks of an in-memory tensor, as :func:`_blocks` cuts stored ones (chunks of at most ``chunk_bytes``)."""
    if not value.shape or value.shape[0] == 0:
        return [(0, value.contiguous())]
    row = max(1, value[0].numel() * value.element_size())
    step = max(1, chunk_bytes // row)
    return [(r, value[r : r + step].clone()) for r in range(0, value.shape[0], step)]  # own storage each


def _write_optimizer(
    ckpt: TensorReader, folder: _Folder, root: str, names: list[str], flat: bool, chunk_bytes: int
) -> None:
    """``optimizer.state.<fqn>.<key>`` and the param groups: per FQN when ``flat`` (torchtitan), else by index with
    ``params`` lists (groups are the distinct hyper-parameter sets, in model order)."""
    groups: list[tuple[dict[str, Any], list[str]]] = []
    for name in names:
        tensors, hyper = _adam_state(ckpt, name)
        for key, value in tensors.items():
            fqn = f"{root}.state.{name}.{key}"
            folder.tensor(fqn, (root, "state", name, key), tuple(value.shape), value.dtype, _split(value, chunk_bytes))
        if flat:
            for key, value in hyper.items():
                folder.value(f"{root}.param_groups.{name}.{key}", (root, "param_groups", name, key), value)
            continue
        for group, members in groups:
            if group == hyper:
                members.append(name)
                break
        else:
            groups.append((hyper, [name]))
    for i, (group, members) in enumerate(groups):
        for key, value in {**group, "params": members}.items():
            folder.value(f"{root}.param_groups.{i}.{key}", (root, "param_groups", str(i), key), value)


def write_dcp(src: Path | RemotePath, dst: Path, read: ReadOptions, write: WriteOptions) -> Written:
    """Write ``src`` as a DCP checkpoint at ``dst`` (the ``WRITERS`` entry of ``fmt="dcp"``): the data files, the
    bytes of model tensors, the tensors and the ties written.

    Honours ``write.dtype``, ``exclude_frozen``, ``max_shard_size`` (per data file), ``chunk_bytes`` (per stored
    chunk), ``workers`` (blocks read ahead) and ``progress`` (bytes of model tensors written).
    """
    titan = write.dcp_layout == "torchtitan"
    out = AtomicDir(Path(dst), source=src, overwrite=write.overwrite)
    out.check()
    with open_checkpoint(src, read) as ckpt:
        infos = ckpt.infos
        names = [n for n, i in infos.items() if not (write.exclude_frozen and i.kind == "frozen")]
        trainable = [n for n in names if infos[n].kind == "trainable" and n not in ckpt.tied]
        if write.include_optimizer:
            if not trainable:
                raise UnsupportedCheckpointError(
                    f"'{ckpt.metadata.path}' has no parameters with optimizer state; drop include_optimizer.",
                    path=ckpt.metadata.path,
                )
            ckpt.optimizer_state(trainable[0])  # refuse a source without optimizer state before writing
        target = None if write.dtype is None else write.dtype.torch
        wanted = {n: output_dtype(infos[n], target) for n in names}
        total = sum(infos[n].numel * wanted[n].itemsize for n in names)
        meter = ByteProgress(write.progress, total, "Writing DCP")
        folders: list[_Folder] = []
        with out as tmp, closing(meter):
            try:
                model = _Folder.create(tmp if titan else tmp / "pytorch_model_fsdp_0", write.max_shard_size)
                folders.append(model)
                prefix = "" if titan else "model."
                blocks = _read_ahead(_block_reads(ckpt, wanted, write.chunk_bytes), write.workers)
                for name, group in groupby(blocks, key=lambda block: block[0]):
                    path = (name,) if titan else ("model", name)
                    model.tensor(prefix + name, path, infos[name].shape, wanted[name], _counted(group, meter))
                optim = model
                if write.include_optimizer:
                    if not titan:
                        optim = _Folder.create(tmp / "optimizer_0", write.max_shard_size)
                        folders.append(optim)
                    _write_optimizer(ckpt, optim, "optimizer", trainable, titan, write.chunk_bytes)
                if titan:
                    model.value("train_state.step", ("train_state", "step"), int(ckpt.metadata.global_step or 0))
                ckpt.finish_crc_checks()
                for folder in folders:
                    folder.finish()
            finally:
                for folder in folders:  # after an error: no handle left open on the discarded folder
                    folder.abandon()
        files = tuple(Path(dst) / f.path.relative_to(tmp) / name for f in folders for name in f.files)
        tied = {a: t for a, t in ckpt.tied.items() if a in names and t in names}
        # DCP stores a tied alias as a key of its own: counted once, as every other format counts it (issue 32).
        return Written(files=files, index_path=None, total_size=total, num_tensors=len(names) - len(tied), tied=tied)


def _counted(blocks: Iterable[Block], meter: ByteProgress) -> Iterator[tuple[int, torch.Tensor]]:
    """``(row, tensor)`` of each block, counting its bytes once it is handed on to be written."""
    for _, row, block in blocks:
        yield row, block
        meter.update(block.numel() * block.element_size())
