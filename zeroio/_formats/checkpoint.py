"""The format-independent read-only checkpoint view: lifetimes, Mapping access, casting and streaming."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from typing_extensions import Self

from .._dtypes import DType
from .._io.byte_map import ByteMap, ConcatMap
from .._io.integrity import CheckedFile
from .._io.read_ahead import ReadAhead
from .._io.sources import ByteRange
from .._messages import get_logger, redact
from ..errors import CheckpointClosedError, TensorNotFoundError
from .metadata import CheckpointMetadata, TensorInfo, describe_tensors, output_dtype, parse_dtype

if TYPE_CHECKING:
    import torch

    from .read_plans import ReadPlan

__all__ = ["DEFAULT_CHUNK_BYTES", "Checkpoint", "PartitionedCheckpoint", "TensorReader"]

logger = get_logger(__name__)

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""Largest single read when streaming a tensor: memory stays bounded by this, not by tensor size."""


class TensorReader(Protocol):
    """The reader contract: all that load, convert, verify, export and reshard may use of an open checkpoint.

    Every format reader (a :class:`Checkpoint` subclass in ``zeroio._formats``) provides it; verbs depend on
    these members only, never on a reader's own attributes, so a new format needs no change in any verb.
    """

    @property
    def metadata(self) -> CheckpointMetadata: ...

    @property
    def infos(self) -> dict[str, TensorInfo]: ...

    @property
    def tied(self) -> dict[str, str]: ...

    def info(self, name: str) -> TensorInfo: ...

    def source_name(self, name: str) -> str: ...

    def stored_dtype(self, name: str) -> torch.dtype: ...

    def stored_spec(self, name: str) -> DType: ...

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None: ...

    def byte_ranges(self, name: str) -> list[ByteRange] | None: ...

    def byte_map(self, name: str) -> ByteMap | None: ...

    def chunks(
        self,
        name: str,
        target: torch.dtype | None,
        chunk_bytes: int,
        scratch: Callable[[torch.dtype, int], torch.Tensor] | None = None,
        read_ahead: ReadAhead | None = None,
    ) -> Iterator[torch.Tensor]: ...

    def get_tensor(self, name: str, *, dtype: str | torch.dtype | None = None) -> torch.Tensor: ...

    def iter_tensors(self, *, dtype: str | torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]: ...

    def ensure_open(self, name: str | None = None) -> None: ...

    def finish_crc_checks(self) -> None: ...

    def reading_in_order(self, on: bool = True) -> contextlib.AbstractContextManager[None]: ...

    def optimizer_state(self, name: str) -> dict[str, Any]: ...


@runtime_checkable
class PartitionedCheckpoint(Protocol):
    """The data-parallel partitions behind a checkpoint: what reshard, universal output, Lightning output and
    optimizer state reading use beyond :class:`TensorReader`.

    A reader that keeps its tensors as read plans over per-rank files, each rank's optimizer state partitioned
    like them, and the rank files' parsed trees provides it (``ZeroCheckpoint``; one pipeline stage's view for
    optimizer state); the world size is ``metadata.world_size``. Verbs check ``isinstance(ckpt,
    PartitionedCheckpoint)``, never a reader class, so any format that serves these members is accepted.
    """

    @property
    def metadata(self) -> CheckpointMetadata: ...

    @property
    def infos(self) -> dict[str, TensorInfo]: ...

    @property
    def tied(self) -> dict[str, str]: ...

    @property
    def plans(self) -> dict[str, ReadPlan]: ...

    @property
    def optimizer_states(self) -> tuple[Any, ...]: ...

    def info(self, name: str) -> TensorInfo: ...

    def source_name(self, name: str) -> str: ...

    def read_plan(self, name: str) -> ReadPlan: ...

    def file_tree(self, path: Path) -> Any: ...

    def ensure_open(self, name: str | None = None) -> None: ...

    def finish_crc_checks(self) -> None: ...

    def __contains__(self, name: object) -> bool: ...


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Checkpoint(Mapping[str, "torch.Tensor"]):
    """A lazy, read-only ``Mapping[str, torch.Tensor]`` over a checkpoint.

    Keys, shapes and dtypes come from metadata; ``ckpt[name]`` reads only that
    tensor's bytes. Use it as a context manager so file handles are released::

        with zeroio.open("ckpt/") as ckpt:
            print(ckpt.metadata.zero_stage, list(ckpt)[:3])
            weight = ckpt["lm_head.weight"]

    Format readers subclass it and provide :meth:`read_into`, :meth:`byte_ranges` and :meth:`_release`; of the
    public methods below, :class:`TensorReader` lists the ones load, convert, verify, export and reshard use.
    """

    def __init__(self, metadata: CheckpointMetadata, infos: dict[str, TensorInfo], tied: dict[str, str]) -> None:
        self._metadata = metadata
        self._infos = infos
        self._tied = tied
        self._state = _State.OPEN
        self._verify_crc = False  # zeroio.open switches it on (after parsing) unless told not to
        self._read_ahead: ReadAhead | None = None  # during a pass (reading_in_order)

    # ----------------------------------------------------------------- backend interface

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fill the 1-D ``out`` (stored dtype) with flattened elements ``[start, start + out.numel())``.

        ``name`` is a stored name (see :meth:`source_name`); no cast, no open-state check.
        """
        raise NotImplementedError

    def read_ahead_into(self, name: str, start: int, out: torch.Tensor, read_ahead: ReadAhead | None) -> None:
        """:meth:`read_into`, small reads served by ``read_ahead``'s windows (:meth:`reading_in_order`, a conversion)
        in readers of small pieces of local zip records (ZeRO, universal, DCP); the others read as asked. A reader
        reading through others (``CheckpointView``, a tp composite) overrides this and hands ``read_ahead`` on: the
        windows are the outermost reader's, over its inner readers' files (its :meth:`_checked_files`)."""
        self.read_into(name, start, out)

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        """``(source, offset, nbytes)`` ranges whose concatenation is the stored bytes of ``name``, or None.

        Lets a writer copy bytes source to file without a pass through user space (``ByteSource.copy_to``)
        when no cast is needed. ``name`` is a stored name (see :meth:`source_name`).
        """
        return None

    def byte_map(self, name: str) -> ByteMap | None:
        """Where each flattened element of stored tensor ``name`` lies (None: read through :meth:`read_into`).

        Lets a sharded load read a column block, one small piece per row, straight from the byte sources; the
        default is :meth:`byte_ranges` concatenated, readers whose layout is not a concatenation override it.
        """
        ranges = self.byte_ranges(name)
        return None if ranges is None else ConcatMap(ranges, self.stored_spec(name).itemsize)

    def stored_dtype(self, name: str) -> torch.dtype:
        """dtype of the tensor's bytes at rest (what :meth:`read_into` fills)."""
        return self.stored_spec(name).torch

    def stored_spec(self, name: str) -> DType:
        """:meth:`stored_dtype` as a torch-free :class:`~zeroio._dtypes.DType` (what byte-level writers use)."""
        info = self.info(name)
        return info.stored_spec or info.dtype_spec

    def _release(self) -> None:
        """Close file handles."""

    def _checked_files(self) -> Sequence[CheckedFile]:
        """The zip archives read, whose records carry a CRC-32 (none for formats without one, e.g. safetensors)."""
        return ()

    # ----------------------------------------------------------------- integrity

    @property
    def verify_crc(self) -> bool:
        """Whether reads check each zip record's stored CRC-32 (``zeroio.open`` turns it on unless ``verify_crc=False``).

        A record (a storage of a torch ``.pt``/``.bin`` file: a whole tensor, or a ZeRO flat group holding many)
        is checked once every one of its bytes has been read: at once when reads have covered it, otherwise by
        :meth:`finish_crc_checks`, which convert, load, verify and reshard call before they finish (it reads the
        rest of each record read in part, e.g. a ZeRO flat group's padding).
        A mismatch raises :class:`~zeroio.errors.CheckpointFormatError`. Safetensors files carry no checksum.
        """
        return self._verify_crc

    @verify_crc.setter
    def verify_crc(self, on: bool) -> None:
        self._verify_crc = bool(on)
        for file in self._checked_files():
            file.verify = self._verify_crc

    def _late_file(self, file: CheckedFile) -> CheckedFile:
        """``file``, opened after ``zeroio.open`` returned (a DCP data file, a universal optimizer file), checked
        as the files opened before it are: every reader opening a file late passes it through here."""
        file.verify = self._verify_crc
        return file

    def checked_files(self) -> Sequence[CheckedFile]:
        """The zip archives read, whose records carry a CRC-32: for checks shared among processes."""
        self.ensure_open()
        return self._checked_files()

    def finish_crc_checks(self) -> None:
        """Read the unread rest of every record read in part (e.g. a ZeRO flat group's padding) and check its CRC.

        Raises:
            CheckpointFormatError: a record's bytes disagree with its stored CRC-32: the file is corrupted.
        """
        self.ensure_open()
        for file in self._checked_files():
            file.finish()

    @contextlib.contextmanager
    def reading_in_order(self, on: bool = True) -> Iterator[None]:
        """A pass reading many tensors whole, in key order (verify, an unsharded load, :meth:`state_dict`): meanwhile
        :meth:`get_tensor` and :meth:`iter_chunks` serve small reads from a read-ahead window per file, as a
        conversion does (``zeroio._io.read_ahead``: 64 MiB in all, dropped at the end; a ZeRO-3 parameter's piece
        on each of 1,024 ranks is then a copy, not a read). ``on=False``: none (a sharded load reads its slice).
        Opened whatever files are open yet (a DCP reader opens its data files at their first read)."""
        mine = on and self._read_ahead is None
        if mine:
            self._read_ahead = ReadAhead(files=len(self._checked_files()))
        try:
            yield
        finally:
            if mine:
                self._read_ahead = None

    # ----------------------------------------------------------------- lifetime

    def ensure_open(self, name: str | None = None) -> None:
        """Raise :class:`CheckpointClosedError` (naming ``name``) once the checkpoint is closed."""
        if self._state is _State.CLOSED:
            what = f"read '{name}'" if name else "use the checkpoint"
            raise CheckpointClosedError(
                f"Cannot {what}: the checkpoint has been closed. Read tensors inside the `with zeroio.open(...)` "
                "block, or keep the tensors returned by get_tensor().",
                path=self._metadata.path,
                name=name,
            )

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._state is _State.CLOSED

    def close(self) -> None:
        """Release every file handle; idempotent. Tensors already returned stay valid."""
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            self._release()

    def __enter__(self) -> Self:
        self.ensure_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: modules may be gone
            self.close()

    def __repr__(self) -> str:
        meta = self._metadata
        state = "closed" if self.closed else f"{len(self._infos)} tensors"
        stage = f", zero_stage={meta.zero_stage}, world_size={meta.world_size}" if meta.format == "zero" else ""
        return f"<zeroio.Checkpoint {meta.format} '{redact(str(meta.path))}'{stage}, {state}>"

    # ----------------------------------------------------------------- metadata

    @property
    def metadata(self) -> CheckpointMetadata:
        """Checkpoint-level facts: format, ZeRO stage, world size, dtypes, DeepSpeed version, step, tag."""
        return self._metadata

    @property
    def tied(self) -> dict[str, str]:
        """Tied aliases: ``{alias: source}``; both names are keys and share one tensor in :meth:`state_dict`."""
        return dict(self._tied)

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """``{name: TensorInfo}`` for every key, in key order, without reading tensors."""
        return dict(self._infos)

    def info(self, name: str) -> TensorInfo:
        """Shape, dtype, kind and source files of one tensor, without reading it."""
        try:
            return self._infos[name]
        except KeyError:
            raise self._not_found(name) from None

    def _not_found(self, name: str) -> TensorNotFoundError:
        import difflib

        close = difflib.get_close_matches(name, list(self._infos), n=3, cutoff=0.8)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return TensorNotFoundError(
            f"No tensor named '{name}' in '{self._metadata.path}' ({len(self._infos)} tensors).{hint}",
            path=self._metadata.path,
            name=name,
        )

    @property
    def total_bytes(self) -> int:
        """Bytes of all distinct tensors (tied aliases counted once) in their returned dtypes."""
        return sum(info.nbytes for name, info in self._infos.items() if name not in self._tied)

    # ----------------------------------------------------------------- Mapping

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        self.ensure_open()
        return iter(list(self._infos))

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    # ----------------------------------------------------------------- reading

    def _resolve(self, name: str) -> TensorInfo:
        self.ensure_open(name)
        info = self._infos.get(name)
        if info is None:
            raise self._not_found(name)
        return info

    def source_name(self, name: str) -> str:
        """The stored name behind ``name``: its tie source for a tied alias, else ``name`` itself."""
        return self._tied.get(name, name)

    def get_tensor(self, name: str, *, dtype: str | torch.dtype | None = None) -> torch.Tensor:
        """Materialise one tensor, reading only its bytes.

        Args:
            name: a key of the checkpoint.
            dtype: cast floating tensors to this dtype (``"bf16"``, ``torch.float16``, ...); others keep theirs.

        Returns:
            An owned, contiguous CPU tensor, safe to keep after the checkpoint is closed.

        Raises:
            TensorNotFoundError: no such key. CheckpointClosedError: the checkpoint was closed.

        Example:
            >>> with zeroio.open("fixtures/z3_ws2_fp32") as ckpt:  # doctest: +SKIP
            ...     ckpt.get_tensor("emb.weight").shape
            torch.Size([13, 7])
        """
        return self.read_tensor(name, parse_dtype(dtype), self._read_ahead)

    def read_tensor(self, name: str, target: torch.dtype | None, read_ahead: ReadAhead | None) -> torch.Tensor:
        """:meth:`get_tensor` with small reads served by ``read_ahead``'s windows (a reader that reads another
        one's tensors whole, such as a LoRA merge's factors, hands on the windows it was given)."""
        info = self._resolve(name)
        source = self.source_name(name)
        stored = self.stored_dtype(name)
        import torch

        out = torch.empty(info.numel, dtype=stored)
        if info.numel:
            self.read_ahead_into(source, 0, out, read_ahead)  # a record this read completes is checked as it passes
        tensor = out.view(info.shape)
        wanted = output_dtype(info, target)
        return tensor if tensor.dtype == wanted else tensor.to(wanted)

    def iter_chunks(
        self, name: str, *, dtype: str | torch.dtype | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[torch.Tensor]:
        """Yield a tensor's flattened elements as 1-D chunks of at most ``chunk_bytes`` (in the stored dtype).

        Concatenated, the chunks equal ``get_tensor(name, dtype=dtype).reshape(-1)``; peak memory is one chunk.
        """
        return self.chunks(name, parse_dtype(dtype), chunk_bytes)

    def chunks(
        self,
        name: str,
        target: torch.dtype | None,
        chunk_bytes: int,
        scratch: Callable[[torch.dtype, int], torch.Tensor] | None = None,
        read_ahead: ReadAhead | None = None,
    ) -> Iterator[torch.Tensor]:
        """The one chunking loop, behind :meth:`iter_chunks` and the converter (``read_ahead``: the conversion's
        windows; None: those of the pass in progress, if any).

        Without ``scratch`` every chunk is a fresh, owned tensor. With ``scratch(dtype, numel)`` (a 1-D buffer
        of at least ``numel`` elements, reused by the caller) chunks are views of those buffers, valid until the
        next chunk: the converter reuses one buffer per IO thread, because a fresh tensor per chunk makes glibc
        keep freed chunks in per-thread arenas. ``copy_`` rounds exactly as ``.to()`` does.
        """
        info = self._resolve(name)
        wanted = output_dtype(info, target)
        stored = self.stored_dtype(name)
        step = max(1, chunk_bytes // max(stored.itemsize, wanted.itemsize))
        size = min(step, info.numel)
        source = self.source_name(name)
        import torch

        for start in range(0, info.numel, step):
            self.ensure_open(name)
            n = min(step, info.numel - start)
            raw = torch.empty(n, dtype=stored) if scratch is None else scratch(stored, size)[:n]
            self.read_ahead_into(source, start, raw, read_ahead or self._read_ahead)
            if wanted == stored:
                chunk = raw
            elif scratch is None:
                chunk = raw.to(wanted)
            else:
                chunk = scratch(wanted, size)[:n].copy_(raw)
            del raw  # drop our reference before the next allocation: peak stays one chunk
            yield chunk
            del chunk

    def iter_tensors(self, *, dtype: str | torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for every key, one tensor at a time, so memory stays near one tensor.

        A tied alias yields the very tensor object its source yielded. Once every tensor has been yielded, the
        records they came from are checked whole (:meth:`finish_crc_checks`): all of the checkpoint was read.
        """
        targets = set(self._tied.values())
        kept: dict[str, torch.Tensor] = {}
        with self.reading_in_order():
            for name in list(self._infos):
                source = self.source_name(name)
                if source in kept:
                    yield name, kept[source]
                    continue
                tensor = self.get_tensor(source, dtype=dtype)
                if source in targets:
                    kept[source] = tensor
                yield name, tensor
        self.finish_crc_checks()

    def state_dict(self, *, dtype: str | torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Materialise every tensor; tied names share one tensor, as in DeepSpeed's consolidation.

        Args:
            dtype: cast floating tensors only (integer buffers keep their dtype).
        """
        return dict(self.iter_tensors(dtype=dtype))

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """Consolidated optimizer state of one parameter (``exp_avg``, ``exp_avg_sq``, ``step``, hyper-parameters).

        Only DeepSpeed ZeRO-1/2/3 checkpoints carry it; consolidated files raise UnsupportedCheckpointError.
        """
        from ..errors import UnsupportedCheckpointError

        self._resolve(name)
        raise UnsupportedCheckpointError(
            f"'{self._metadata.path}' is a consolidated {self._metadata.format} checkpoint: it holds no optimizer "
            "state. Read optimizer state from the DeepSpeed checkpoint it was converted from.",
            path=self._metadata.path,
            name=name,
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary: metadata, totals and one row per tensor (what ``zeroio inspect --json`` prints)."""
        return describe_tensors(self._metadata, self._infos, self._tied)
