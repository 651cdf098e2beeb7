"""Hostile DCP folders (issue 30): tiny ``.metadata`` files whose references, not their bytes, ask for gigabytes or
minutes; chunks recorded transposed, sizes past int64, data-file names too long, a Hub cache whose ``blobs`` links
out. Each builder copies the genuine fixture ``fixtures/dcp/dcp_fsdp2_ws2_fp32`` into ``where``, rewrites its
``.metadata`` with torch's own classes (pickle's memo makes every repeated object one reference), and returns
``(root, edited)`` as tests/hostile_folders.py's builders do (the fuzz corpus in tests/test_errors.py damages
``edited`` too)."""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fixture_data import FIXTURES
from hostile_folders import copy_fixture

DCP = FIXTURES / "dcp" / "dcp_fsdp2_ws2_fp32"


def _edit(where: Path, edit: Callable[[Any, Path], None]) -> tuple[Path, Path]:
    root = copy_fixture(DCP, where / "ckpt")
    with open(root / ".metadata", "rb") as fh:
        meta = pickle.load(fh)  # our own genuine fixture, read to be rewritten
    edit(meta, root)
    with open(root / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)
    return root, root / ".metadata"


def shared_list_offsets(where: Path, depth: int = 40) -> tuple[Path, Path]:
    """A chunk offset that is a list of lists, each level holding the one below twice: ``str()`` of it (an error
    message's ``str(value)[:60]``) would write 2**depth leaves; the file is about 7 KB."""

    def edit(meta: Any, root: Path) -> None:
        dag: list[Any] = []
        for _ in range(depth):
            dag = [dag, dag]
        chunk = meta.state_dict_metadata["model.scale"].chunks[0]
        meta.state_dict_metadata["model.scale"].chunks[0] = dataclasses.replace(chunk, offsets=[dag])

    return _edit(where, edit)


def values_on_one_range(where: Path, count: int = 150, size: int = 16 << 20) -> tuple[Path, Path]:
    """``count`` pickled values all stored at one ``size``-byte range of a (sparse) data file: each was read and held
    (150 x 16 MiB = 2.4 GB)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    def edit(meta: Any, root: Path) -> None:
        with open(root / "__9_0.distcp", "wb") as fh:
            fh.truncate(size)  # a hole: no disk used
        info = _StorageInfo(relative_path="__9_0.distcp", offset=0, length=size)
        for i in range(count):
            meta.state_dict_metadata[f"value{i}"] = BytesStorageMetadata()
            meta.storage_data[MetadataIndex(f"value{i}")] = info

    return _edit(where, edit)


def chunk_references(where: Path, references: int = 1_000_000) -> tuple[Path, Path]:
    """``model.scale`` listing its one chunk ``references`` times (1.9 MB for a million references: a chunk object
    per reference took 37-80 s and 0.8 GB at open)."""

    def edit(meta: Any, root: Path) -> None:
        entry = meta.state_dict_metadata["model.scale"]
        entry.chunks[:] = [entry.chunks[0]] * references

    return _edit(where, edit)


def shared_chunk_lists(where: Path, tensors: int = 50) -> tuple[Path, Path]:
    """``tensors`` new tensors all holding the one chunk list of ``model.emb.weight`` (a pickle reference each)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def edit(meta: Any, root: Path) -> None:
        entry = meta.state_dict_metadata["model.emb.weight"]
        for i in range(tensors):
            meta.state_dict_metadata[f"copy{i}"] = dataclasses.replace(entry, chunks=entry.chunks)
            for chunk in entry.chunks:
                meta.storage_data[MetadataIndex(f"copy{i}", chunk.offsets)] = meta.storage_data[
                    MetadataIndex("model.emb.weight", chunk.offsets)
                ]

    return _edit(where, edit)


def _padded_archive(entries: int) -> bytes:
    """A torch.save-like zip archive of one 1-element float tensor and ``entries`` empty records besides."""
    from hostile_files import Ops

    pkl = Ops().tensor((1,), (1,), numel=1).stop()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zipfile.ZipInfo("archive/data.pkl"), pkl)
        zf.writestr(zipfile.ZipInfo("archive/data/0"), bytes(4))
        for i in range(entries):
            zf.writestr(zipfile.ZipInfo(f"archive/pad/{i}"), b"")
    return buf.getvalue()


def one_archive_many_chunks(where: Path, chunks: int = 1000, entries: int = 200_000) -> tuple[Path, Path]:
    """A tensor of ``chunks`` one-element chunks all stored in one archive whose zip directory has ``entries``
    records: the directory was parsed once per chunk (200k entries: 22 minutes for one tensor)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def edit(meta: Any, root: Path) -> None:
        blob = _padded_archive(entries)
        (root / "__9_0.distcp").write_bytes(blob)
        info = _StorageInfo(relative_path="__9_0.distcp", offset=0, length=len(blob))
        boxes = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(chunks)]
        meta.state_dict_metadata["model.big"] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32), size=torch.Size([chunks]), chunks=boxes
        )
        for box in boxes:
            meta.storage_data[MetadataIndex("model.big", box.offsets)] = info

    return _edit(where, edit)


def transposed_chunks(where: Path) -> tuple[Path, Path]:
    """``model.mlp_out.weight`` (7, 5), saved as row blocks (4, 5) and (3, 5), recorded transposed: a (5, 7)
    tensor of column blocks (5, 4) and (5, 3). The chunks still tile the tensor and hold as many elements; each
    archive's (4, 5) tensor was read as (5, 4), scrambled."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def edit(meta: Any, root: Path) -> None:
        entry = meta.state_dict_metadata["model.mlp_out.weight"]
        flipped = []
        for chunk in entry.chunks:
            info = meta.storage_data.pop(MetadataIndex("model.mlp_out.weight", chunk.offsets))
            chunk = dataclasses.replace(
                chunk, offsets=torch.Size(chunk.offsets[::-1]), sizes=torch.Size(chunk.sizes[::-1])
            )
            meta.storage_data[MetadataIndex("model.mlp_out.weight", chunk.offsets)] = info
            flipped.append(chunk)
        entry.chunks[:] = flipped
        entry.size = torch.Size(entry.size[::-1])

    return _edit(where, edit)


def size_past_int64(where: Path, size: tuple[int, ...] = (0, 2**64)) -> tuple[Path, Path]:
    """A tensor ``model.huge`` of ``size`` and no chunks: empty, so no byte backs it, yet no tensor can have that
    shape (torch raised a bare TypeError; ``convert`` wrote a safetensors file safetensors refuses)."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    def edit(meta: Any, root: Path) -> None:
        meta.state_dict_metadata["model.huge"] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32), size=torch.Size(size), chunks=[]
        )

    return _edit(where, edit)


def long_data_file_name(where: Path, length: int = 300) -> tuple[Path, Path]:
    """``model.scale`` stored in a data file whose name has ``length`` characters, longer than file systems allow
    (255 bytes): stat raised a bare OSError (ENAMETOOLONG), a traceback on the CLI."""

    def edit(meta: Any, root: Path) -> None:
        for key, info in list(meta.storage_data.items()):
            if key.fqn == "model.scale":
                meta.storage_data[key] = dataclasses.replace(info, relative_path="x" * length)

    return _edit(where, edit)


def hub_blobs_link_out(where: Path) -> tuple[Path, Path]:
    """A Hugging Face cache snapshot (``models--org--name/snapshots/abc123``) of the fixture whose data files link to
    ``../../blobs/<name>``, as the cache's do, but whose ``blobs`` is itself a link to a folder outside the cache
    (``where/elsewhere``, standing for ``~/.ssh``): links into ``blobs/`` were followed there."""
    elsewhere = where / "elsewhere"
    elsewhere.mkdir()
    repo = where / "cache" / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").symlink_to(os.path.relpath(elsewhere, repo))
    for path in sorted(DCP.iterdir()):
        if path.suffix == ".distcp":
            shutil.copy(path, elsewhere / path.name)
            (snapshot / path.name).symlink_to(os.path.join("..", "..", "blobs", path.name))
        elif path.name == ".metadata":
            shutil.copy(path, snapshot / path.name)
    return snapshot, snapshot / ".metadata"


DCP_ATTACKS: dict[str, Callable[[Path], tuple[Path, Path]]] = {
    "dcp_shared_list_offsets": shared_list_offsets,
    "dcp_values_on_one_range": lambda where: values_on_one_range(where, count=20, size=1 << 20),
    "dcp_chunk_references": lambda where: chunk_references(where, 100_000),
    "dcp_shared_chunk_lists": shared_chunk_lists,
    "dcp_one_archive_many_chunks": lambda where: one_archive_many_chunks(where, 50, 2_000),
    "dcp_transposed_chunks": transposed_chunks,
    "dcp_size_past_int64": size_past_int64,
    "dcp_long_data_file_name": long_data_file_name,
    "dcp_hub_blobs_link_out": hub_blobs_link_out,
}
"""Every hostile DCP folder, by name, at a size the fuzz corpus (tests/test_errors.py) builds in well under a second."""

__all__ = ["DCP_ATTACKS"]


def twin_entry(fixture: Path, where: Path, original: str, twin: str) -> Path:
    """A copy of the DCP or Megatron folder ``fixture`` at ``where`` whose ``.metadata`` also records ``twin``: a
    deep copy of ``original``'s entry, each chunk pointing at its own copy of the bytes, appended to the same data
    file (so nothing but the name tells the two apart). Returns the ``.metadata`` path."""
    shutil.copytree(fixture, where)
    metadata_file = next(where.rglob(".metadata"))
    with open(metadata_file, "rb") as fh:
        metadata = pickle.load(fh)  # the fixture's own DCP metadata, written by torch
    metadata.state_dict_metadata[twin] = copy.deepcopy(metadata.state_dict_metadata[original])
    for index, stored in list(metadata.storage_data.items()):
        if index.fqn == original:
            data_file = metadata_file.parent / stored.relative_path
            data = data_file.read_bytes()
            moved = copy.deepcopy(stored)
            moved.offset = len(data)
            data_file.write_bytes(data + data[stored.offset : stored.offset + stored.length])
            metadata.storage_data[dataclasses.replace(index, fqn=twin)] = moved
    with open(metadata_file, "wb") as fh:
        pickle.dump(metadata, fh)
    return metadata_file
