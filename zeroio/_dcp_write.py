"""``convert(fmt="dcp")``: a PyTorch Distributed Checkpoint that FSDP2 resumes from, written chunk by chunk.

Each tensor is written as row blocks of at most ``chunk_bytes`` (one ``torch.save`` archive per block, appended to
``__0_0.distcp``, as DCP's ``FileSystemWriter`` appends them), so memory stays near one block whatever the model
size; ``.metadata`` is pickled from torch's own classes last. Nothing here needs ``torch.distributed`` initialised:
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from ._checkpoint import TensorReader
from ._dtypes import DType
from ._formats import open_checkpoint
from ._io.remote_path import RemotePath
from ._metadata import output_dtype
from ._options import ReadOptions
from ._write.atomic import AtomicDir
from ._write.options import WriteOptions
from .errors import UnsupportedCheckpointError

__all__ = ["write_dcp"]
DATA_FILE = "__0_0.distcp"


@dataclass(eq=False)
class _Folder:
    """One DCP folder being written: its data file and the metadata entries of what went into it."""

    path: Path
    fh: IO[bytes]
    entries: dict[str, Any] = field(default_factory=dict)
    storage: dict[Any, Any] = field(default_factory=dict)
    planner: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def create(cls, path: Path) -> _Folder:
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, open(path / DATA_FILE, "xb"))

    def _append(self, fqn: str, write: Any, offsets: tuple[int, ...] | None) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        start = self.fh.tell()
        write(self.fh)
        at = None if offsets is None else torch.Size(offsets)
        self.storage[MetadataIndex(fqn, at, 0)] = _StorageInfo(DATA_FILE, start, self.fh.tell() - start)

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
            self._append(fqn, lambda fh, b=block: torch.save(b, fh), offsets)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(block.shape)))
        self.entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
        self.planner[fqn] = path

    def value(self, fqn: str, path: tuple[str, ...], obj: Any) -> None:
        """Write a non-tensor value as DCP does: ``torch.save(obj)`` bytes (``BytesStorageMetadata``)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        buffer = io.BytesIO()
        torch.save(obj, buffer)
        self._append(fqn, lambda fh: fh.write(buffer.getvalue()), None)
        self.entries[fqn] = BytesStorageMetadata()
        self.planner[fqn] = path

    def finish(self) -> None:
        """Flush the data file, then write ``.metadata`` (DCP's reader needs it last)."""
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        meta = Metadata(self.entries, self.planner, self.storage, StorageMeta(), "1.0.0")
        with open(self.path / ".metadata", "xb") as fh:
            pickle.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())


def _blocks(ckpt: TensorReader, name: str, target: DType | None, chunk_bytes: int) -> Iterable[tuple[int, Any]]:
    """Row blocks of tensor ``name`` of at most ``chunk_bytes`` (at least one row), read as they are written."""
    info = ckpt.info(name)
    stored = ckpt.stored_dtype(name)
    wanted = output_dtype(info, None if target is None else target.torch)
    if not info.shape:
        out = torch.empty(1, dtype=stored)
        ckpt.read_into(ckpt.source_name(name), 0, out)
        yield 0, out.to(wanted).reshape(())
        return
    rows, row = info.shape[0], info.numel // max(1, info.shape[0])
    step = max(1, chunk_bytes // max(1, row * max(stored.itemsize, wanted.itemsize)))
    if rows == 0:
        yield 0, torch.empty(info.shape, dtype=wanted)
        return
    for r in range(0, rows, step):
        n = min(step, rows - r)
        out = torch.empty(n * row, dtype=stored)
        if out.numel():
            ckpt.read_into(ckpt.source_name(name), r * row, out)
        yield r, out.to(wanted).view(n, *info.shape[1:])


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


def write_dcp(
    src: Path | RemotePath, dst: Path, read: ReadOptions, write: WriteOptions
) -> tuple[list[Path], int, int, dict[str, str]]:
    """Write ``src`` as a DCP checkpoint at ``dst``; returns (data files, bytes of model tensors, tensors, tied)."""
    titan = write.dcp_layout == "torchtitan"
    out = AtomicDir(Path(dst), overwrite=write.overwrite)
    out.check()
    with open_checkpoint(src, read) as ckpt:
        trainable = [n for n, i in ckpt.infos.items() if i.kind == "trainable" and n not in ckpt.tied]
        if write.include_optimizer:
            if not trainable:
                raise UnsupportedCheckpointError(
                    f"'{ckpt.metadata.path}' has no parameters with optimizer state; drop include_optimizer.",
                    path=ckpt.metadata.path,
                )
            ckpt.optimizer_state(trainable[0])  # refuse a source without optimizer state before writing
        files: list[Path] = []
        total = 0
        with out as tmp:
            model_dir = tmp if titan else tmp / "pytorch_model_fsdp_0"
            model = _Folder.create(model_dir)
            prefix = "" if titan else "model."
            for name, info in ckpt.infos.items():
                path = (name,) if not prefix else ("model", name)
                wanted = output_dtype(info, None if write.dtype is None else write.dtype.torch)
                blocks = _blocks(ckpt, name, write.dtype, write.chunk_bytes)
                model.tensor(prefix + name, path, info.shape, wanted, blocks)
                total += info.numel * wanted.itemsize
            optim = model
            if write.include_optimizer:
                optim = model if titan else _Folder.create(tmp / "optimizer_0")
                _write_optimizer(ckpt, optim, "optimizer", trainable, titan, write.chunk_bytes)
            if titan:
                model.value("train_state.step", ("train_state", "step"), int(ckpt.metadata.global_step or 0))
            ckpt.finish_crc_checks()
            for folder in dict.fromkeys([model, optim]):
                folder.finish()
                files.append(Path(dst) / folder.path.relative_to(tmp) / DATA_FILE)
        return files, total, len(ckpt.infos), dict(ckpt.tied)
