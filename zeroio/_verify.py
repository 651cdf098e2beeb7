"""``zeroio verify``: compare every tensor of two checkpoints chunk by chunk, bit for bit."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ._dtypes import as_dtype
from ._formats import Checkpoint, dtype_name, parse_dtype, read_options
from ._io.remote_path import as_path, is_url, with_storage_options
from ._messages import get_logger
from ._types import StrPath

if TYPE_CHECKING:
    import torch

    from ._formats import DcpKeys, NamesMode, QuantizedMode

__all__ = ["Mismatch", "VerifyReport", "verify"]

logger = get_logger(__name__)

_CHUNK_BYTES = 16 * 1024 * 1024

MismatchKind = Literal["missing", "extra", "shape", "dtype", "values"]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One tensor that differs between A and B."""

    name: str
    """Tensor name."""
    kind: MismatchKind
    """``missing`` (in A, not in B), ``extra`` (in B, not in A), ``shape``, ``dtype`` or ``values``."""
    detail: str
    """One line saying how it differs."""
    num_different: int = 0
    """For ``values``: how many elements differ."""
    first_index: tuple[int, ...] | None = None
    """For ``values``: index of the first differing element."""


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The result of :func:`verify`: every mismatch, plus what was compared."""

    a: Path
    """First checkpoint (the reference)."""
    b: Path
    """Second checkpoint."""
    num_tensors: int
    """Names compared: the union of A's and B's keys."""
    mismatches: tuple[Mismatch, ...]
    """Every difference, in A's key order then B's extra keys."""
    dtype: torch.dtype | None = None
    """A's floating tensors were cast to this dtype before comparing."""
    max_report: int = 10
    """How many mismatches :meth:`summary` lists."""

    @property
    def ok(self) -> bool:
        """True when every tensor matches."""
        return not self.mismatches

    def summary(self) -> str:
        """Human-readable result: one line when equal, else a line per mismatch (up to ``max_report``).

        Example:
            >>> report = verify("fixtures/z3_ws2_fp32", "fixtures/z3_ws2_fp32")  # doctest: +SKIP
            >>> print(report.summary())  # doctest: +SKIP
            OK: all 11 tensors of 'fixtures/z3_ws2_fp32' and 'fixtures/z3_ws2_fp32' are identical.
        """
        if self.ok:
            how = "identical" if self.dtype is None else f"equal after casting A to {dtype_name(self.dtype)}"
            return f"OK: all {self.num_tensors} tensors of '{self.a}' and '{self.b}' are {how}."
        lines = [
            f"MISMATCH: {len(self.mismatches)} of {self.num_tensors} tensors differ between '{self.a}' (A) and "
            f"'{self.b}' (B)" + (f", A cast to {dtype_name(self.dtype)}:" if self.dtype is not None else ":")
        ]
        for m in self.mismatches[: self.max_report]:
            lines.append(f"  {m.name}: {m.detail}")
        hidden = len(self.mismatches) - self.max_report
        if hidden > 0:
            lines.append(f"  ... and {hidden} more")
        return "\n".join(lines)


def _aligned(a: Iterator[torch.Tensor], b: Iterator[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Re-cut two chunk streams of the same flattened length into pieces of equal length: ``(start, a, b)``."""
    buf_a: torch.Tensor | None = None
    buf_b: torch.Tensor | None = None
    start = 0
    while True:
        if buf_a is None or buf_a.numel() == 0:
            buf_a = next(a, None)
        if buf_b is None or buf_b.numel() == 0:
            buf_b = next(b, None)
        if buf_a is None or buf_b is None:
            return
        n = min(buf_a.numel(), buf_b.numel())
        yield start, buf_a[:n], buf_b[:n]
        start += n
        buf_a, buf_b = buf_a[n:], buf_b[n:]


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size if size else 0)
        flat //= size if size else 1
    return tuple(reversed(index))


def _scalar(t: torch.Tensor) -> str:
    value = t.item()
    return repr(value)


def _compare_values(
    a: Checkpoint, b: Checkpoint, name: str, target: torch.dtype | None, shape: tuple[int, ...]
) -> Mismatch | None:
    """Bitwise comparison, chunk by chunk (NaNs with equal bits match; 0.0 and -0.0 differ).

    The one place verify imports torch: names, shapes and dtypes are compared from metadata alone."""
    import torch

    chunks_a = a.iter_chunks(name, dtype=target, chunk_bytes=_CHUNK_BYTES)
    chunks_b = b.iter_chunks(name, chunk_bytes=_CHUNK_BYTES)
    different = 0
    first: tuple[int, str, str] | None = None
    total = 0
    for start, xa, xb in _aligned(chunks_a, chunks_b):
        total += xa.numel()
        size = xa.element_size()
        bytes_a = xa.contiguous().view(torch.uint8).reshape(-1, size)
        bytes_b = xb.contiguous().view(torch.uint8).reshape(-1, size)
        differs = (bytes_a != bytes_b).any(dim=1)
        count = int(differs.sum())
        if count:
            if first is None:
                i = int(differs.nonzero()[0, 0])
                first = (start + i, _scalar(xa[i]), _scalar(xb[i]))
            different += count
    if first is None:
        return None
    index = _unravel(first[0], shape)
    where = f"[{', '.join(map(str, index))}]"
    numel = 1
    for s in shape:
        numel *= s
    return Mismatch(
        name,
        "values",
        f"{different} of {numel} elements differ; first at {where}: {first[1]} (A) vs {first[2]} (B)",
        num_different=different,
        first_index=index,
    )


def _shape_str(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"


def _compare(ca: Checkpoint, cb: Checkpoint, target: torch.dtype | None) -> tuple[list[str], list[Mismatch]]:
    """Every name of A then B's extra ones, and each difference: names, shapes and dtypes from metadata, values
    chunk by chunk."""
    infos_a, infos_b = ca.infos, cb.infos
    tied_a, tied_b = ca.tied, cb.tied
    keys = list(infos_a) + [n for n in infos_b if n not in infos_a]
    mismatches: list[Mismatch] = []
    for name in keys:
        ia, ib = infos_a.get(name), infos_b.get(name)
        if ib is None:
            mismatches.append(Mismatch(name, "missing", "missing in B"))
            continue
        if ia is None:
            mismatches.append(Mismatch(name, "extra", "not in A (extra in B)"))
            continue
        source = tied_a.get(name)
        if source is not None and source == tied_b.get(name) and source in infos_b:
            continue  # the same tie on both sides: checked through its source
        if ia.shape != ib.shape:
            detail = f"shape {_shape_str(ia.shape)} (A) vs {_shape_str(ib.shape)} (B)"
            mismatches.append(Mismatch(name, "shape", detail))
            continue
        want = as_dtype(target) if (target is not None and ia.dtype_spec.is_floating_point) else ia.dtype_spec
        if want != ib.dtype_spec:
            cast = " after the cast" if want != ia.dtype_spec else ""
            detail = f"dtype {dtype_name(want)} (A{cast}) vs {dtype_name(ib.dtype_spec)} (B)"
            mismatches.append(Mismatch(name, "dtype", detail))
            continue
        found = _compare_values(ca, cb, name, target, ia.shape)
        if found is not None:
            mismatches.append(found)
    return keys, mismatches


def verify(
    a: StrPath,
    b: StrPath,
    *,
    dtype: str | torch.dtype | None = None,
    tag: str | None = None,
    max_report: int = 10,
    verify_crc: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    quantized: QuantizedMode = "dequantize",
    dcp_keys: DcpKeys = "auto",
    names: NamesMode | None = None,
    true_vocab_size: int | None = None,
) -> VerifyReport:
    """Compare every tensor of two checkpoints of any kinds :func:`zeroio.open` reads, streaming.

    Tensors match when shape, dtype and every bit are equal; with ``dtype``, A's floating tensors are first
    cast to it with torch's rounding (``tensor.to(dtype)``), so a converted ``bf16`` copy verifies against its
    fp32 source. A key missing on either side is a mismatch. A tied alias present in both, tied to the same
    source, is checked through its source; an alias stored only as a tie on one side and as a tensor on the
    other is compared by value.

    Args:
        a: the reference checkpoint (e.g. the DeepSpeed checkpoint).
        b: the checkpoint to check (e.g. the converted folder).
        dtype: cast A's floating tensors to this dtype before comparing.
        tag: the DeepSpeed tag of A (default: the one in ``latest``).
        max_report: mismatches listed by :meth:`VerifyReport.summary`.
        verify_crc: check every record read from a torch zip file (``.pt``/``.bin``) against its stored CRC-32 and
            raise CheckpointFormatError on a mismatch (see ``Checkpoint.verify_crc``); False skips the check.
        storage_options: options of the fsspec filesystem of whichever of ``a`` and ``b`` is a URL (docs/remote.md).
        quantized: block-scaled FP8 weights of either side are compared dequantized (``"dequantize"``) or as
            stored (``"raw"``), as for :func:`zeroio.open`.
        dcp_keys: which tensors of either side, when a DCP checkpoint, are the model's (``"auto"``, ``"model"``,
            ``"all"``), as for :func:`zeroio.open`.
        names: ``"hf"`` reads A, a Megatron checkpoint, under transformers' names (docs/formats.md), so the folder
            ``zeroio.convert(A, B, names="hf")`` wrote verifies against it; B is read under its own names.
        true_vocab_size: with ``names="hf"``, A's embedding and output rows, as given to :func:`zeroio.convert`.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when everything matches.

    Example:
        >>> import zeroio
        >>> report = zeroio.verify("fixtures/z3_ws2_fp32", "out/model")  # doctest: +SKIP
        >>> report.ok  # doctest: +SKIP
        True
    """
    from ._formats import open_checkpoint

    target = parse_dtype(dtype)
    if storage_options:
        if not (is_url(a) or is_url(b)):
            raise ValueError(f"storage_options apply to URLs only, but '{a}' and '{b}' are local paths.")
        a = with_storage_options(a, storage_options) if is_url(a) else a
        b = with_storage_options(b, storage_options) if is_url(b) else b
    if isinstance(max_report, bool) or not isinstance(max_report, int) or max_report < 0:
        raise ValueError(f"max_report must be a non-negative int, got {max_report!r}.")
    read_a = read_options(
        tag=tag, verify_crc=verify_crc, quantized=quantized, dcp_keys=dcp_keys, names=names,
        true_vocab_size=true_vocab_size,
    )  # fmt: skip
    read_b = dataclasses.replace(read_a, tag=None, names=None, true_vocab_size=None)
    with open_checkpoint(a, read_a) as ca, open_checkpoint(b, read_b) as cb:
        with ca.reading_in_order(), cb.reading_in_order():  # each file read in a few windows, not a read a piece
            keys, mismatches = _compare(ca, cb, target)
        ca.finish_crc_checks()  # records read in part (flat-group padding)
        cb.finish_crc_checks()
    report = VerifyReport(
        a=as_path(a),
        b=as_path(b),
        num_tensors=len(keys),
        mismatches=tuple(mismatches),
        dtype=target,
        max_report=max_report,
    )
    logger.info("verify %s vs %s: %d tensors, %d mismatches", a, b, len(keys), len(mismatches))
    return report
