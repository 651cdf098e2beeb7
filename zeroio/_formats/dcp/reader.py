"""PyTorch Distributed Checkpoint (DCP) folders written by FSDP2, FSDP1, torchtitan and accelerate, read lazily.

``open`` reads ``.metadata`` (through zeroio's restricted unpickler, :mod:`zeroio._pickles.dcp_metadata_unpickler`) and the small
pickled values (``train_state``, optimizer ``param_groups``); tensor chunks, each its own ``torch.save`` archive
inside a ``.distcp`` file, are located on first read and read by byte range. Layouts (see docs/dcp.md):

* plain ``dcp.save({"model": ..., "optim": ...})`` (and FSDP1's sharded state dict): ``model.`` is stripped (keys.py);
* torchtitan: a ``step-N/`` folder (or the folder holding them: the largest N, or ``tag``), model keys at the top;
* accelerate: a folder holding ``pytorch_model_fsdp_0/`` (``model.``) and ``optimizer_0/`` is one checkpoint.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._dtypes import FLOAT32, DType
from ..._io.confine import FileIdentity, confined_path, file_identity, hub_cache_blobs, require_regular_file
from ..._io.integrity import CheckedFile
from ..._io.sources import ByteRange, open_source, writable_bytes
from ..._messages import get_logger
from ..._pickles import EmbeddedTensor, global_name, load_dcp_metadata, load_embedded
from ..._pickles.dcp_metadata_unpickler import MAX_METADATA_BYTES
from ...errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    TensorNotFoundError,
    UnsafePickleError,
    UnsupportedCheckpointError,
)
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo
from ..options import ReadOptions
from .chunk_plans import EntryMap, concat_ranges, read_entry_into
from .keys import OPTIM_ROOTS, split_keys
from .metadata import DcpMetadata, TensorEntry, chunk_mismatch, parse_dcp_metadata

if TYPE_CHECKING:
    import torch

    from ..._io.read_ahead import ReadAhead

__all__ = ["DcpCheckpoint", "is_dcp", "open_dcp", "read_dcp_part"]

logger = get_logger(__name__)

METADATA = ".metadata"
ACCELERATE_MODEL = "pytorch_model_fsdp_0"
ACCELERATE_OPTIM = "optimizer_0"
_STEP = re.compile(r"^step-(\d+)$")
MAX_VALUE_BYTES = 16 << 20
"""Largest pickled value read at open (16 MiB); larger ones are listed, not read."""
ARCHIVE_ENDS = 16 << 10
"""Bytes fetched at each end of a chunk's archive from a remote file: its pickle and record headers lead, its zip
directory trails (a chunk's archive has a handful of records)."""
VALUE_SPAN = 4 << 20
"""Neighbouring pickled values of a file are fetched in one read while the span stays under this (4 MiB)."""


def _is_dcp_dir(path: Path) -> bool:
    return (path / METADATA).is_file()


def _steps(path: Path) -> dict[int, Path]:
    found = {}
    for child in path.iterdir():
        m = _STEP.match(child.name)
        if m and _is_dcp_dir(child):
            found[int(m.group(1))] = child
    return found


def is_dcp(path: Path) -> bool:
    """True for a DCP folder (``.metadata``), its ``.metadata`` file, accelerate's FSDP output folder or a torchtitan
    checkpoint folder of ``step-N/`` DCP folders (names only)."""
    if path.name == METADATA and path.is_file():
        return True
    if not path.is_dir():
        return False
    return _is_dcp_dir(path) or _is_dcp_dir(path / ACCELERATE_MODEL) or bool(_steps(path))


@dataclass(eq=False)
class _Part:
    """One DCP folder of the checkpoint: its checked metadata and lazily opened data files."""

    folder: Path
    meta: DcpMetadata
    sizes: dict[str, int]
    identities: dict[str, FileIdentity] = field(default_factory=dict)
    """Each data file's identity when its confinement was checked: a file swapped later is refused at first read."""
    files: dict[str, CheckedFile] = field(default_factory=dict)
    located: dict[tuple[str, int], EmbeddedTensor] = field(default_factory=dict)
    checked: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)  # IO threads: one CheckedFile per file, chunks once
    opened: Callable[[CheckedFile], CheckedFile] = lambda file: file  # the checkpoint's _late_file: CRC checks

    def file(self, name: str) -> CheckedFile:
        with self.lock:
            if name not in self.files:
                source = open_source(self.folder / name, self.sizes[name], self.identities.get(name))
                self.files[name] = self.opened(CheckedFile(source))
            return self.files[name]

    def locate(self, entry: TensorEntry, i: int) -> EmbeddedTensor:
        """Chunk ``i`` of ``entry``: its archive parsed (once), checked against the metadata, its CRC registered."""
        found = self.located.get((entry.fqn, i))
        if found is not None:
            return found
        chunk = entry.chunks[i]
        file = self.file(chunk.file)
        where = self.folder / chunk.file
        self._refuse_safetensors(chunk.file, file)
        prefetch = getattr(file.source, "prefetch", None)
        if prefetch is not None:  # a remote file: the archive's head (pickle) and tail (zip directory), 2 requests
            head = min(chunk.length, ARCHIVE_ENDS)
            prefetch(chunk.offset, chunk.offset + head)
            if chunk.length > head:
                prefetch(chunk.offset + chunk.length - head, chunk.offset + chunk.length)
        tensor = load_embedded(file.read_bytes, where, chunk.offset, chunk.length)
        # the shape too, not only the element count: a transposed chunk's elements would land scrambled
        if not isinstance(tensor, EmbeddedTensor) or tensor.dtype != entry.dtype or tensor.shape != chunk.stored_shape:
            embedded = isinstance(tensor, EmbeddedTensor)
            what = f"a {tensor.dtype.name} tensor of shape {tensor.shape}" if embedded else f"a {type(tensor).__name__}"
            shape = tuple(tensor.shape) if embedded and tensor.dtype == entry.dtype else None
            raise CheckpointFormatError(chunk_mismatch(where, what, shape, entry, i), path=where, name=entry.fqn)
        file.expect(f"{entry.fqn}[{i}]", *tensor.record)
        with self.lock:
            return self.located.setdefault((entry.fqn, i), tensor)

    def _refuse_safetensors(self, name: str, file: CheckedFile) -> None:
        """torch >= 2.8's ``SerializationFormat.SAFETENSORS`` writes each data file as one safetensors file, its
        ``.metadata`` offsets not pointing at archives: refused by name (checked once per file)."""
        if name in self.checked:
            return
        head = file.read_bytes(0, 9)
        if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < file.size:
            raise UnsupportedCheckpointError(
                f"'{self.folder / name}' is a safetensors file: the checkpoint was saved with DCP's "
                "SerializationFormat.SAFETENSORS, which zeroio does not read yet. Save it with the default "
                "serialization (torch_save), or read the files with safetensors.",
                path=self.folder / name,
            )
        self.checked.add(name)

    def place(self, entry: TensorEntry, i: int) -> tuple[CheckedFile, int]:
        """Chunk ``i``'s data file and where the chunk's data starts in it."""
        return self.file(entry.chunks[i].file), self.locate(entry, i).data_offset

    def read_into(self, entry: TensorEntry, start: int, out: torch.Tensor, ahead: ReadAhead | None = None) -> None:
        """``out`` from its chunks; ``ahead``'s window of a chunk's record serves its rows (a chunk split along dim 1)."""

        def read(i: int, first: int, dest: torch.Tensor) -> None:
            file, at = self.place(entry, i)
            at += first * entry.dtype.itemsize
            if ahead is not None and dest.is_contiguous():
                return ahead.read_into(file, at, writable_bytes(dest))
            file.read_into(at, dest)

        read_entry_into(entry, start, out, read)

    def close(self) -> None:
        for file in self.files.values():
            file.close()


class DcpCheckpoint(Checkpoint):
    """A PyTorch Distributed Checkpoint; build it with ``zeroio.open``."""

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        entries: dict[str, tuple[_Part, TensorEntry]],
        optim: dict[str, dict[str, tuple[_Part, TensorEntry]]],
        hyper: dict[str, dict[str, Any]],
        parts: list[_Part],
    ) -> None:
        super().__init__(metadata, infos, {})
        self._entries = entries
        self._optim = optim
        self._hyper = hyper
        self._parts = parts
        for part in parts:  # a data file first read after open is CRC-checked like the ones open already
            part.opened = self._late_file

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        self.read_ahead_into(name, start, out, None)

    def read_ahead_into(self, name: str, start: int, out: torch.Tensor, read_ahead: ReadAhead | None) -> None:
        part, entry = self._entries[name]
        part.read_into(entry, start, out, read_ahead)

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        part, entry = self._entries[name]
        return concat_ranges(entry, lambda i: part.place(entry, i))

    def byte_map(self, name: str) -> EntryMap:
        part, entry = self._entries[name]
        return EntryMap(entry, lambda i: part.place(entry, i))

    def _release(self) -> None:
        for part in self._parts:
            part.close()

    def _checked_files(self) -> list[CheckedFile]:
        return [file for part in self._parts for file in part.files.values()]

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The optimizer state of one parameter (``exp_avg``, ``exp_avg_sq``, ``step`` as stored, and its param
        group's hyper-parameters), reassembled from its chunks."""
        return self._optimizer_state(name, meta=False)

    def optimizer_state_spec(self, name: str) -> dict[str, Any]:
        """:meth:`optimizer_state` with the state tensors on the ``meta`` device (nothing read)."""
        return self._optimizer_state(name, meta=True)

    def _optimizer_state(self, name: str, *, meta: bool) -> dict[str, Any]:
        self._resolve(name)
        states = self._optim.get(name)
        if not states:
            owned = ", ".join(list(self._optim)[:8]) or "none"
            raise TensorNotFoundError(
                f"No optimizer state for '{name}' in '{self._metadata.path}' (parameters with optimizer state: "
                f"{owned}).",
                path=self._metadata.path,
                name=name,
            )
        import torch

        result: dict[str, Any] = {}
        for key, (part, entry) in states.items():
            real = not meta or not entry.shape  # a 0-d value (torch Adam's step) is read even for the spec
            out = torch.empty(entry.numel, dtype=entry.dtype.torch, device=None if real else "meta")
            if entry.numel and real:
                part.read_into(entry, 0, out)
            result[key] = out.view(entry.shape)
        for key, value in self._hyper.get(name, {}).items():
            result.setdefault(key, value)
        return result


# --------------------------------------------------------------------------- opening


def read_dcp_part(folder: Path, trusted: frozenset[str], *, read_values: bool = True) -> tuple[_Part, dict[str, Any]]:
    """Parse and check one DCP folder's ``.metadata``; read its pickled values (unless ``read_values`` is False)."""
    meta_path = folder / METADATA
    try:
        require_regular_file(meta_path)
        size = meta_path.stat().st_size
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"'{meta_path}' does not exist.", path=meta_path) from exc
    if size > MAX_METADATA_BYTES:
        raise CheckpointFormatError(
            f"'{meta_path}' is {size} bytes; zeroio reads DCP metadata up to {MAX_METADATA_BYTES} bytes. The file "
            "is corrupted or hostile.",
            path=meta_path,
        )
    tree = load_dcp_metadata(meta_path, meta_path.read_bytes(), trusted)
    sizes: dict[str, int] = {}
    identities: dict[str, FileIdentity] = {}

    blobs = hub_cache_blobs(folder)  # a Hub cache's snapshot files link there

    def file_size(name: str) -> int:
        data = confined_path(folder, name, source=meta_path, what="data file", links_into=blobs)
        try:
            require_regular_file(data, source=meta_path)
            found = data.stat()  # the file confined: what every later open must find (not a link swapped in)
            sizes[name], identities[name] = found.st_size, file_identity(found)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"'{data}' does not exist, yet '{meta_path}' places data in it. Copy the whole checkpoint folder.",
                path=data,
            ) from exc
        return sizes[name]

    part = _Part(folder, parse_dcp_metadata(meta_path, tree, file_size), sizes, identities)
    values: dict[str, Any] = {}
    spans = _value_spans(part) if read_values else {}
    for fqn, entry in part.meta.values.items() if read_values else ():
        if entry.length > MAX_VALUE_BYTES:
            values[fqn] = f"<{entry.length} bytes, not read>"
            continue
        start, data = spans[fqn]
        blob = data[entry.offset - start : entry.offset - start + entry.length]
        try:
            value = load_embedded(_slicer(blob), folder / entry.file, 0, len(blob), trusted)
        except UnsafePickleError as exc:  # a value naming a class zeroio does not know: the weights stay readable
            logger.warning("%s: not reading the value '%s': %s", folder, fqn, exc)
            values[fqn] = f"<not read: it names {exc.name}, which is not on zeroio's allowlist>"
            continue
        values[fqn] = _plain(value)
    return part, values


def _value_spans(part: _Part) -> dict[str, tuple[int, bytes]]:
    """The bytes around each pickled value, neighbours read together (torch writes them back to back): one read
    per run of values instead of one each, which is what a remote file pays for."""
    found: dict[str, tuple[int, bytes]] = {}
    by_file: dict[str, list[Any]] = {}
    for entry in part.meta.values.values():
        if entry.length <= MAX_VALUE_BYTES:
            by_file.setdefault(entry.file, []).append(entry)
    for name, entries in by_file.items():
        entries.sort(key=lambda e: e.offset)
        run: list[Any] = []
        for entry in [*entries, None]:
            if run and (entry is None or entry.offset + entry.length - run[0].offset > VALUE_SPAN):
                start = run[0].offset
                data = part.file(name).read_bytes(start, max(e.offset + e.length for e in run) - start)
                found.update((e.fqn, (start, data)) for e in run)
                run = []
            if entry is not None:
                run.append(entry)
    return found


def _slicer(blob: bytes) -> Callable[[int, int], bytes]:
    """``pread`` over bytes already read (a value's whole archive, fetched in one request)."""
    return lambda offset, nbytes: blob[offset : offset + nbytes]


MAX_VALUE_NODES = 10_000
"""Largest pickled value shown as metadata, in nodes as written out (shared lists counted at every place)."""


def _nodes(value: Any, memo: dict[int, int], depth: int = 0) -> int:
    """How many nodes ``value`` has written out in full (as JSON would): computed once per shared container, so a
    pickle of 30 lists each holding the one below 10 times costs 30 steps, not 10**30."""
    if not isinstance(value, (list, tuple, dict)):
        return 1
    if depth > 50:
        return MAX_VALUE_NODES + 1
    known = memo.get(id(value))
    if known is None:
        items = value.values() if isinstance(value, dict) else value
        known = memo[id(value)] = 1 + sum(_nodes(v, memo, depth + 1) for v in items)
    return known


def _plain(value: Any) -> Any:
    """A JSON-friendly copy of a pickled value (dtypes by name, other objects by their global's name); values
    over :data:`MAX_VALUE_NODES` nodes are summarised, not copied."""
    size = _nodes(value, {})
    if size > MAX_VALUE_NODES:
        return f"<{type(value).__name__} of {size} nodes, not shown>"
    return _copy(value)


def _copy(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _copy(v) for k, v in value.items()}
    if isinstance(value, DType):
        return value.name
    return f"<{global_name(value) or type(value).__name__}>"


def _roots(path: Path, tag: str | None) -> tuple[list[Path], str | None, str]:
    """The DCP folders of the checkpoint at ``path``, its tag and its layout name."""
    if path.name == METADATA:
        path = path.parent
    if _is_dcp_dir(path / ACCELERATE_MODEL):
        parts = [path / ACCELERATE_MODEL]
        if _is_dcp_dir(path / ACCELERATE_OPTIM):
            parts.append(path / ACCELERATE_OPTIM)
        return parts, None, "accelerate"
    if _is_dcp_dir(path):
        return [path], (path.name if _STEP.match(path.name) else None), "torchtitan" if _STEP.match(path.name) else ""
    steps = _steps(path)
    if tag is not None:
        chosen = path / tag
        if not _is_dcp_dir(chosen):
            raise CheckpointNotFoundError(
                f"'{path}' has no DCP folder '{tag}' (found: {', '.join(p.name for p in steps.values())}).",
                path=chosen,
            )
        return [chosen], tag, "torchtitan"
    last = steps[max(steps)]
    return [last], last.name, "torchtitan"


def _trainer_step(root: Path) -> Any:
    """``global_step`` of the HF Trainer's ``trainer_state.json`` beside accelerate's folders (``checkpoint-N/``)."""
    import json

    state = root / "trainer_state.json"
    try:
        if not state.is_file() or state.stat().st_size > MAX_VALUE_BYTES:
            return None
        return json.loads(state.read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):  # unreadable or not a JSON object: no step, as without the file
        return None


def _split_optimizer(
    fqn: str, entry: TensorEntry, part: _Part, optim: dict[str, dict[str, tuple[_Part, TensorEntry]]]
) -> bool:
    for root in OPTIM_ROOTS:
        if fqn.startswith(root + "state."):
            param, _, key = fqn[len(root) + len("state.") :].rpartition(".")
            if param and key:
                optim.setdefault(param, {})[key] = (part, entry)
                return True
    return False


def _hyper_parameters(values: dict[str, Any], params: set[str]) -> dict[str, dict[str, Any]]:
    """Each parameter's param-group values: from ``param_groups.<i>.<key>`` with its ``params`` list (plain
    ``get_optimizer_state_dict``), or ``param_groups.<fqn>.<key>`` (flattened, torchtitan)."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for fqn, value in values.items():
        for root in OPTIM_ROOTS:
            prefix = root + "param_groups."
            if fqn.startswith(prefix):
                owner, _, key = fqn[len(prefix) :].rpartition(".")
                if owner in params:
                    hyper.setdefault(owner, {})[key] = value
                else:
                    groups.setdefault((root, owner), {})[key] = value
    for group in groups.values():
        members = group.get("params")
        for member in members if isinstance(members, list) else []:
            if isinstance(member, str):
                hyper.setdefault(member, {}).update({k: v for k, v in group.items() if k != "params"})
    return hyper


def open_dcp(path: Path, options: ReadOptions) -> DcpCheckpoint:
    """Open a DCP checkpoint: metadata and pickled values only, no tensor bytes."""
    trusted_globals = options.trusted_globals
    folders, tag, layout = _roots(path, options.tag)
    parts: list[_Part] = []
    values: dict[str, Any] = {}
    for folder in folders:
        part, part_values = read_dcp_part(folder, trusted_globals)
        parts.append(part)
        values.update(part_values)
    tensors = [(fqn, part, entry) for part in parts for fqn, entry in part.meta.tensors.items()]
    prefixed = any(fqn.startswith("model.") for fqn, _, _ in tensors)
    titan = not prefixed and any(k.startswith("train_state.") for k in values)
    layout = layout or ("torchtitan" if titan else "dcp")
    optim: dict[str, dict[str, tuple[_Part, TensorEntry]]] = {}
    rest = [(fqn, (part, entry)) for fqn, part, entry in tensors if not _split_optimizer(fqn, entry, part, optim)]
    entries, skipped, split = split_keys(rest, options.dcp_keys)  # never a tensor dropped silently: said, chosen
    if not entries:
        raise CheckpointFormatError(
            f"'{path}' is a DCP checkpoint without model tensors (keys: {', '.join(list(values)[:5])}).", path=path
        )
    root = path.parent if path.name == METADATA else path
    optim = {name: states for name, states in optim.items() if name in entries}
    infos = {
        name: TensorInfo(
            name,
            entry.shape,
            entry.dtype,
            "trainable" if name in optim else "tensor",
            tuple(dict.fromkeys(part.folder / c.file for c in entry.chunks if c.numel)),
        )
        for name, (part, entry) in entries.items()
    }
    floats = {e.dtype for _, e in entries.values() if e.dtype.is_floating_point}
    train = floats.pop() if len(floats) == 1 else None
    step = values.get("train_state.step")
    if step is None and layout == "accelerate":
        step = _trainer_step(root)
    moments = {k for states in optim.values() for k in states}
    metadata = CheckpointMetadata(
        format="dcp",
        path=root,
        tag=tag,
        train_dtype=train,
        global_step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        has_fp32_master=train == FLOAT32,
        layout=layout,
        optimizer="Adam" if {"exp_avg", "exp_avg_sq"} <= moments else None,
        extra={
            "dcp_folders": [str(p.folder.relative_to(root)) if p.folder != root else "." for p in parts],
            "dcp_version": parts[0].meta.version,
            "save_id": parts[0].meta.save_id,
            "files": sorted({f for p in parts for f in p.meta.files}),
            "values": values,
            "other_tensors": skipped,
            "dcp_keys": split,
        },
    )
    logger.debug("opened %s: dcp (%s), %d tensors", root, layout, len(infos))
    return DcpCheckpoint(metadata, infos, entries, optim, _hyper_parameters(values, set(entries)), parts)
