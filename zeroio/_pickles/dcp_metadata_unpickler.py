"""The restricted unpickler for PyTorch Distributed Checkpoint's ``.metadata``: DCP's own classes only, as inert data.

torch writes ``.metadata`` with ``pickle.dump`` and reads it with plain ``pickle.load`` (every release 2.2-2.14), so
a crafted file runs code in torch's reader. Here the pickle may name only the ``torch.distributed.checkpoint``
metadata classes (and, for files from torch < 2.4, ``TensorProperties``' old home), ``torch.Size``, dtypes, the
layout and memory-format encodings and ``pathlib`` paths; every class becomes an :class:`~.standins.Inert` record
(its constructor never runs) and ``zeroio._formats.dcp.metadata`` checks the tree's shape.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from .._dtypes import BY_NAME
from ..errors import CheckpointFormatError, UnsafePickleError, ZeroIOError
from .allowed import ALLOWED, Sealed, short_repr
from .hash_work import check_hash_work
from .standins import inert_class

__all__ = ["DCP_CLASSES", "MAX_METADATA_BYTES", "load_dcp_metadata"]

MAX_METADATA_BYTES = 1 << 28
"""Largest ``.metadata`` read (256 MiB): a few hundred bytes per chunk, so ample for millions of chunks."""

_METADATA = "torch.distributed.checkpoint.metadata"
DCP_CLASSES = (
    f"{_METADATA}.Metadata",
    f"{_METADATA}.TensorStorageMetadata",
    f"{_METADATA}.BytesStorageMetadata",
    f"{_METADATA}.ChunkStorageMetadata",
    f"{_METADATA}.TensorProperties",
    f"{_METADATA}.StorageMeta",
    f"{_METADATA}.MetadataIndex",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    # torch < 2.4 pickled TensorProperties from its ShardedTensor home.
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
)
"""The classes a ``.metadata`` pickle may instantiate (as inert records)."""

_MEMORY_FORMATS = {0: "contiguous_format", 1: "channels_last", 2: "preserve_format"}
_LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._mkldnn"})


def _memory_format(value: Any) -> str:
    # TensorProperties.__getstate__ pickles the memory format as _MEM_FORMAT_ENCODING(n) (torch.memory_format
    # itself cannot be pickled).
    if isinstance(value, bool) or value not in _MEMORY_FORMATS:
        raise CheckpointFormatError(f"_MEM_FORMAT_ENCODING is given {short_repr(value)}, not 0, 1 or 2.")
    return _MEMORY_FORMATS[value]


def _layout(name: Any) -> str:
    # torch.layout pickles as torch.serialization._get_layout("torch.strided").
    if name not in _LAYOUTS:
        raise CheckpointFormatError(f"_get_layout is given {short_repr(name)}, not a torch layout name.")
    return str(name)


def _allowlist() -> dict[str, Any]:
    allowed: dict[str, Any] = {name: inert_class(name) for name in DCP_CLASSES}
    for enum_home in (_METADATA, "torch.distributed._shard.sharded_tensor.metadata"):
        for enum_name in ("_MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING"):
            qualified = f"{enum_home}.{enum_name}"
            allowed[qualified] = Sealed(qualified, _memory_format)
    allowed["torch.serialization._get_layout"] = Sealed("torch.serialization._get_layout", _layout)
    allowed["torch.Size"] = ALLOWED["torch.Size"]
    allowed["collections.OrderedDict"] = ALLOWED["collections.OrderedDict"]
    for name, value in BY_NAME.items():  # dtypes (values no pickle can change)
        allowed[f"torch.{name}"] = value
    return allowed


_ALLOWED = _allowlist()


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes; no persistent ids (``.metadata`` holds no tensors)."""

    def __init__(self, data: bytes, path: Path, trusted: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._path = path
        self._trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified in _ALLOWED:
            return _ALLOWED[qualified]
        if qualified in self._trusted:
            return inert_class(qualified)
        raise UnsafePickleError(
            f"Refusing to unpickle global {qualified!r} from '{self._path}': a DCP .metadata file names only "
            "torch.distributed.checkpoint's metadata classes. If you trust this file, pass "
            f"trusted_globals=[{qualified!r}] (it is rebuilt as inert data, never called).",
            path=self._path,
            name=qualified,
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(
            f"'{self._path}' holds a persistent id {short_repr(pid)}; DCP's .metadata is a plain pickle without "
            "tensors. The file is corrupted or hostile.",
            path=self._path,
        )


def load_dcp_metadata(path: Path, data: bytes, trusted: frozenset[str] = frozenset()) -> Any:
    """The object tree of a ``.metadata`` pickle (``data``, read from ``path``), every class an inert record."""
    check_hash_work(data, path)  # before any object is built: tuples hashed over and over never return
    try:
        return _MetadataUnpickler(data, path, trusted).load()
    except ZeroIOError as exc:
        if exc.path is not None:
            raise
        raise type(exc)(f"Refusing '{path}': {exc}", path=path, name=exc.name) from None
    except Exception as exc:  # any malformed pickle: never a raw pickle traceback
        raise CheckpointFormatError(
            f"Cannot parse the DCP metadata '{path}' ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}). The file is "
            "corrupted or was not written by torch.distributed.checkpoint; copy it again.",
            path=path,
        ) from exc
