"""The writers and their registry: ``convert`` looks the output format up in ``WRITERS`` and runs its writer.

The mirror of ``zeroio._formats.FORMATS``. Adding an output format takes one writer module, whose writer has the
one signature ``write(src, dst, read, write) -> Written`` (the source's path, the local destination, the validated
``ReadOptions`` and ``WriteOptions``), and one ``Writer`` entry below; no verb changes. A URL destination is written
locally by the same writer, then uploaded (:func:`write_output`), so writers only ever see local folders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .._formats import ReadOptions
from .._io.remote_path import as_path, is_url
from .._types import StrPath
from .options import WriteOptions
from .result import CardInputs, Written

__all__ = ["WRITERS", "CardInputs", "WriteFn", "Writer", "Written", "write_output", "writer_for"]

WriteFn = Callable[[Path, Path, ReadOptions, WriteOptions], Written]
"""A writer: reads ``src`` (opened once, by the writer) and writes ``dst`` all-or-nothing."""


@dataclass(frozen=True, slots=True)
class Writer:
    """One output format zeroio writes."""

    name: str
    """The ``fmt=`` value (``--format``)."""
    load: Callable[[], WriteFn]
    """The writer function, imported on first use: most writers import torch, which a torch-free conversion
    (safetensors or torch output, bytes copied or cast with numpy) must never import."""
    one_file: bool = False
    """The output is one file (a URL destination names the object), not a folder."""
    distributed: bool = False
    """``distributed=True`` runs it over every process of a torch.distributed job."""


def _hf() -> WriteFn:
    from .hf_writer import write_hf

    return write_hf


def _lightning() -> WriteFn:
    from .lightning_writer import write_lightning

    return write_lightning


def _universal() -> WriteFn:
    from .universal_writer import write_universal

    return write_universal


def _dcp() -> WriteFn:
    from .dcp_writer import write_dcp

    return write_dcp


def _peft() -> WriteFn:
    from .peft_writer import write_peft

    def write_adapters(src: Path, dst: Path, read: ReadOptions, write: WriteOptions) -> Written:
        out = write_peft(src, dst, read, write)
        return Written(files=out.files, index_path=None, total_size=out.total_size, num_tensors=out.num_tensors)

    return write_adapters


WRITERS: tuple[Writer, ...] = (
    Writer("safetensors", _hf, distributed=True),
    Writer("torch", _hf, distributed=True),
    Writer("lightning", _lightning, one_file=True),
    Writer("universal", _universal),
    Writer("dcp", _dcp),
    Writer("peft", _peft),
)
"""Every output format, by its ``fmt=`` name (``zeroio/_write/options.py`` validates the name first)."""


def writer_for(write: WriteOptions) -> Writer:
    """The registered writer of ``write.fmt``, refusing ``distributed=True`` where the writer runs in one process."""
    writer = next(w for w in WRITERS if w.name == write.fmt)
    if write.distributed and not writer.distributed:
        raise ValueError(
            f"distributed=True writes sharded 'safetensors' or 'torch' folders, not fmt={write.fmt!r} (one file): "
            "convert it in one process."
        )
    return writer


def write_output(src: StrPath, dst: StrPath, read: ReadOptions, write: WriteOptions) -> Written:
    """Write ``src`` as ``write.fmt`` at ``dst``, a local path or a URL (written locally, then uploaded).

    ``read.storage_options`` configure ``src`` and/or ``dst``, whichever is a URL.
    """
    if not is_url(str(dst)):
        return _write_local(src, Path(dst), read, write)
    if write.distributed:
        raise ValueError("distributed=True writes local folders (each process its shards): write locally, then upload.")
    source_read = read if is_url(str(src)) else dataclasses.replace(read, storage_options=None)
    local_write = dataclasses.replace(write, overwrite=False)

    def write_local(local: Path) -> Written:
        return _write_local(src, local, source_read, local_write)

    from .remote_output import write_file_to_url, write_to_url

    if writer_for(write).one_file:  # one file: the URL names the object
        written, at = write_file_to_url(
            str(dst), read.storage_options, overwrite=write.overwrite, write=write_local, source=src
        )
        return dataclasses.replace(written, files=(at,))
    written, uploaded = write_to_url(
        str(dst), read.storage_options, overwrite=write.overwrite, write=write_local, source=src
    )

    def remote(path: Path) -> Path:
        return uploaded[path.resolve()]

    return dataclasses.replace(
        written, files=tuple(map(remote, written.files)), copied=tuple(map(remote, written.copied)),
        index_path=remote(written.index_path) if written.index_path is not None else None,
    )  # fmt: skip


def _write_local(src: StrPath, dst: Path, read: ReadOptions, write: WriteOptions) -> Written:
    """Look the writer up and run it. The source's one path: a URL's listing, made once, serves the reader and
    the side files alike."""
    source = as_path(src, read.storage_options)
    return writer_for(write).load()(source, dst, read, write)
