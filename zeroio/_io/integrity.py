"""CRC-32 checks of the zip records zeroio reads: every byte read is folded into its record's CRC, in any order.

A torch zip archive stores a CRC-32 per record that ``torch.load`` never checks, so a flipped bit in a tensor
converts silently. :class:`CheckedFile` wraps a byte source (local or remote) and knows the archive's records (registered as
their data offsets are looked up) and checks a record once every one of its bytes has been seen:

* reads (``read_into``) are folded in as they happen, from any thread and in any order (CRCs of the pieces are
  combined with :func:`crc32_combine`), so streaming a tensor costs one ``zlib.crc32`` pass over its bytes;
* an in-kernel copy (``copy_to``) first reads the bytes it copies that no read has seen yet, to check them (the
  page cache then serves the copy; bytes a read-ahead window already folded in are not read twice);
* :meth:`CheckedFile.finish` reads what reads left out of a record read in part (the padding at the end of a ZeRO
  flat group, a slice of a big record), so a record zeroio read from is checked in full.

A mismatch raises :class:`CheckpointFormatError` naming the file and the record, then on every later read of it.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import CheckpointFormatError
from .crc32 import crc32_combine
from .sources import ByteSource, Fenced, LocalFile, can_copy_in_kernel, kernel_copy_after_read, writable_bytes

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer  # 4.6+, for type checking only

__all__ = ["CheckedFile", "PartialRecord", "Record"]

PartialRecord = tuple[str, int, int, int, list[tuple[int, int, int]]]
"""A record read in part: its name, data start, size, stored CRC, and the ``(lo, hi, crc32)`` runs read (relative
to its start; sorted, disjoint)."""

_SCRATCH_BYTES = 8 * 2**20
"""Largest read made only to check a CRC (padding, bytes about to be kernel-copied): bounds its memory."""


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """This thread's buffer for reads made only to check CRCs: one for all files (a checkpoint of 1,024 rank files
    held a buffer of ``_SCRATCH_BYTES`` per file, 4 GB), as large as asked, up to ``_SCRATCH_BYTES``.

    A bytearray, not a tensor: a torch-free conversion stays torch-free."""
    buffer: memoryview | None = getattr(_SCRATCH, "buffer", None)
    wanted = min(max(nbytes, 1), _SCRATCH_BYTES)
    if buffer is None or len(buffer) < wanted:
        buffer = _SCRATCH.buffer = memoryview(bytearray(max(wanted, 64 * 1024)))
    return buffer


@dataclass(slots=True)
class Record:
    """One zip record: where its data lies, its stored CRC, and the CRCs of the disjoint runs seen so far."""

    name: str
    start: int
    size: int
    crc: int
    seen: list[tuple[int, int, int]] = field(default_factory=list)
    """Sorted, disjoint, non-adjacent ``(lo, hi, crc32 of bytes [lo, hi))`` runs, relative to ``start``."""
    verified: bool = False
    found: int | None = None
    """The CRC the bytes on disk have, once they are known to disagree with the stored one."""

    def gaps(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of ``[lo, hi)`` not seen yet."""
        out = []
        at = lo
        i = max(0, bisect.bisect_right(self.seen, (lo, 2**63)) - 1)
        for s_lo, s_hi, _ in self.seen[i:]:
            if s_lo >= hi:
                break
            if s_hi <= at:
                continue
            if s_lo > at:
                out.append((at, min(s_lo, hi)))
            at = max(at, s_hi)
            if at >= hi:
                break
        if at < hi:
            out.append((at, hi))
        return out

    def add(self, lo: int, hi: int, crc: int) -> None:
        """Record the unseen run ``[lo, hi)``, merging it with the runs it touches."""
        i = bisect.bisect_left(self.seen, (lo, 0))
        if i > 0 and self.seen[i - 1][1] == lo:
            p_lo, _, p_crc = self.seen.pop(i - 1)
            lo, crc = p_lo, crc32_combine(p_crc, crc, hi - lo)
            i -= 1
        if i < len(self.seen) and self.seen[i][0] == hi:
            _, n_hi, n_crc = self.seen.pop(i)
            crc, hi = crc32_combine(crc, n_crc, n_hi - hi), n_hi
        self.seen.insert(i, (lo, hi, crc))

    def unseen_around(self, lo: int, hi: int) -> tuple[int, int]:
        """The widest ``[a, b)`` holding ``[lo, hi)`` with no byte outside ``[lo, hi)`` seen yet: how far a read of
        ``[lo, hi)`` may reach back and ahead without reading again what was read."""
        i = bisect.bisect_left(self.seen, (hi, 0))  # the first run starting at or after hi
        b = self.seen[i][0] if i < len(self.seen) else self.size
        if i > 0 and self.seen[i - 1][1] > hi:  # a run reaching past hi from inside [lo, hi)
            b = hi
        a = 0
        for s_lo, s_hi, _ in reversed(self.seen[:i]):
            if s_hi <= lo:
                a = s_hi
                break
            if s_lo < lo:  # a run reaching into [lo, hi) from before it: nothing before lo is unseen here
                a = lo
                break
        return a, max(b, hi)

    def run_ending_at(self, lo: int) -> tuple[int, int, int] | None:
        """The seen run that ends at ``lo``, if any."""
        i = bisect.bisect_left(self.seen, (lo, 0)) - 1
        return self.seen[i] if i >= 0 and self.seen[i][1] == lo else None

    def extend(self, run: tuple[int, int, int], hi: int, crc: int) -> bool:
        """Make ``run`` reach ``hi`` with ``crc`` (the CRC from its start), merging a run that starts at ``hi``;
        False when ``run`` is no longer a run as it was (another thread merged it meanwhile)."""
        i = bisect.bisect_left(self.seen, (run[0], 0))
        if i >= len(self.seen) or self.seen[i] != run:
            return False
        if i + 1 < len(self.seen) and self.seen[i + 1][0] == hi:
            _, n_hi, n_crc = self.seen.pop(i + 1)
            crc, hi = crc32_combine(crc, n_crc, n_hi - hi), n_hi
        self.seen[i] = (run[0], hi, crc)
        return True

    def settle(self) -> None:
        """Once every byte is seen: verified, or ``found`` holds the disagreeing CRC."""
        if len(self.seen) == 1 and self.seen[0][:2] == (0, self.size) or self.size == 0:
            got = self.seen[0][2] if self.size else 0
            self.seen.clear()
            if got == self.crc:
                self.verified = True
            else:
                self.found = got


class CheckedFile:
    """A zip archive (any :class:`ByteSource`) whose record reads are checked against the records' CRC-32 (see the module doc).

    Checks start once ``verify`` is set: ``zeroio.open`` sets it after parsing (``verify_crc=True``), so the few
    samples a format reader reads while opening are never checked, and ``verify_crc=False`` means no check at all.
    Records are registered with :meth:`expect` before they are read.
    """

    def __init__(self, source: ByteSource) -> None:
        self.source = source
        """The bytes checked."""
        self._fenced = source if isinstance(source, Fenced) else None  # asked once: a Protocol check costs ~25 us,
        # and a LoRA layout's frozen fragments are a record per parameter and rank (600,000 checks at 256 ranks)
        self.verify = False
        self._records: list[Record] = []
        self._starts: list[int] = []
        self._pending: dict[int, Record] = {}  # read in part, not yet checked, by start
        self._crc_lock = threading.Lock()

    def expect(self, name: str, start: int, size: int, crc: int) -> None:
        """Register the record ``name`` (data at byte ``start``, ``size`` bytes, stored CRC ``crc``); idempotent."""
        with self._crc_lock:
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                return
            self._starts.insert(i, start)
            self._records.insert(i, Record(name, start, size, crc & 0xFFFFFFFF))
        if self._fenced is not None:
            self._fenced.fence(start + size)  # reading ahead past a record could fetch bytes never needed

    # ----------------------------------------------------------------- the ByteSource protocol, delegated

    def __repr__(self) -> str:
        return f"CheckedFile({self.source!r})"

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def size(self) -> int:
        return self.source.size

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        return self.source.read_bytes(offset, nbytes)

    def read_header(self, offset: int, nbytes: int, record_end: int) -> bytes:
        """A record's local header, read just before the record's data (which ends by ``record_end``).

        A read-ahead source (remote) fences ``record_end`` and fetches the header with the data after it in one
        request; a local file reads the header alone.
        """
        if self._fenced is not None:
            self._fenced.fence(record_end)
            return self._fenced.read_ahead(offset, nbytes)
        return self.source.read_bytes(offset, nbytes)

    def record_at(self, offset: int) -> Record | None:
        """The registered record holding byte ``offset``, or None (a read-ahead window stops at its record's end,
        and asks :meth:`raise_if_failed` of it before serving its bytes)."""
        with self._crc_lock:
            i = bisect.bisect_right(self._starts, offset) - 1
            if i >= 0 and offset < self._records[i].start + self._records[i].size:
                return self._records[i]
        return None

    def record_span(self, offset: int) -> tuple[int, int] | None:
        """``(start, end)`` of the registered record holding byte ``offset``, or None."""
        record = self.record_at(offset)
        return None if record is None else (record.start, record.start + record.size)

    def unseen_around(self, record: Record, lo: int, hi: int) -> tuple[int, int]:
        """The widest span of ``record`` holding ``[lo, hi)`` (file offsets) with no byte outside ``[lo, hi)`` read
        yet: what a read-ahead window may read without reading a byte twice (the whole record once it is checked)."""
        with self._crc_lock:
            a, b = record.unseen_around(lo - record.start, hi - record.start)
        return record.start + a, record.start + b

    def raise_if_failed(self, record: Record) -> None:
        """Raise ``record``'s CRC error once its bytes failed their check: bytes of it served from elsewhere (a
        read-ahead window filled before the failure) raise as every later read of it does."""
        self._raise_if_bad(record)

    def will_need(self, offset: int, nbytes: int) -> None:
        """The source's own read-ahead advice (a local file's ``posix_fadvise``), if it takes any."""
        will_need = getattr(self.source, "will_need", None)
        if will_need is not None:
            will_need(offset, nbytes)

    def close(self) -> None:
        self.source.close()

    # ----------------------------------------------------------------- reads

    def read_into(self, offset: int, out: torch.Tensor | Buffer, what: str = "a tensor's data") -> None:
        self.source.read_into(offset, out, what)
        if self.verify:
            view = writable_bytes(out)
            if len(view):
                self._saw(offset, view)

    def read_many(self, pieces: Sequence[tuple[int, memoryview]], what: str = "a tensor's data") -> None:
        """:meth:`read_into` of each ``(offset, bytes view)``, in one call to the source when it can."""
        read_many = getattr(self.source, "read_many", None)
        if read_many is not None:
            read_many(pieces, what)
        else:
            for offset, view in pieces:
                self.source.read_into(offset, view, what)
        if self.verify:
            for offset, view in pieces:
                if len(view):
                    self._saw(offset, view)

    def copy_to(self, fd: int, offset: int, nbytes: int, dst_offset: int) -> int | None:
        if not can_copy_in_kernel(self.source):
            return None  # the caller streams through read_into, which checks as it reads
        if self.verify and isinstance(self.source, LocalFile) and not kernel_copy_after_read(self.source):
            return None  # every byte must reach user space for its CRC: write it from there (pread + pwrite)
        if self.verify:  # the copy below then reads from the page cache
            for lo, hi in self._unseen(offset, offset + nbytes):
                self._read_and_check(lo, hi)
        return self.source.copy_to(fd, offset, nbytes, dst_offset)

    def finish(self) -> None:
        """Read what reads left out of each record read in part and check it; raise on the first mismatch."""
        if not self.verify:
            return
        with self._crc_lock:
            pending = sorted(self._pending.values(), key=lambda r: r.start)
        for record in pending:
            self._finish_record(record)

    def _finish_record(self, record: Record) -> None:
        self._raise_if_bad(record)
        with self._crc_lock:
            gaps = record.gaps(0, record.size) if not record.verified else []
        for lo, hi in gaps:
            self._read_and_check(record.start + lo, record.start + hi)
        self._raise_if_bad(record)
        if not record.verified:  # every byte was seen, yet the runs never settled into one: never a silent pass
            raise CheckpointFormatError(
                f"'{self.name}': record '{record.name}' ({record.size} bytes) could not be checked against its "
                "CRC-32 (its runs do not cover it once); pass verify_crc=False / --no-verify-crc to read it "
                "unchecked, and report this.",
                path=self.name,
            )

    def partial_records(self) -> list[PartialRecord]:
        """The records read in part and not yet checked, with the CRCs of the runs read: what another process
        needs to check them with its own reads (:meth:`finish_with`), instead of reading the rest here."""
        if not self.verify:
            return []
        with self._crc_lock:
            pending = sorted(self._pending.values(), key=lambda r: r.start)
            return [(r.name, r.start, r.size, r.crc, list(r.seen)) for r in pending if not r.verified]

    def finish_with(self, record: PartialRecord) -> None:
        """Check ``record`` (as :meth:`partial_records` gives it, from another process) with its runs folded into
        what this file saw of it: each run whose bytes were not seen here counts with its CRC; the bytes no run
        covers are read here. Raise on a mismatch (or when the record is not the one this file holds there)."""
        name, start, size, crc, runs = record
        bad = next(((lo, hi) for lo, hi, _ in runs if not 0 <= lo < hi <= size), None)
        if bad is not None:  # a run past its record covered every byte without settling: a silent pass before
            raise CheckpointFormatError(
                f"'{self.name}': record '{name}': another process reported bytes [{bad[0]}, {bad[1]}) of it, "
                f"outside its {size} bytes: the processes read different files. Put the checkpoint on a "
                "filesystem shared by every process, at the same path.",
                path=self.name,
            )
        self.expect(name, start, size, crc)
        with self._crc_lock:
            mine = self._records[bisect.bisect_left(self._starts, start)]
            if (mine.size, mine.crc) != (size, crc & 0xFFFFFFFF):
                raise CheckpointFormatError(
                    f"'{self.name}': record '{name}' differs between the processes ({size} bytes, CRC {crc:08x} "
                    f"against {mine.size} bytes, CRC {mine.crc:08x}): they read different files. Put the "
                    "checkpoint on a filesystem shared by every process, at the same path.",
                    path=self.name,
                )
            for lo, hi, run_crc in runs:
                if mine.verified or mine.found is not None:
                    break
                if mine.gaps(lo, hi) == [(lo, hi)]:
                    mine.add(lo, hi, run_crc)
            if not mine.verified and mine.found is None:
                mine.settle()
            if mine.verified:
                self._pending.pop(start, None)
            else:
                self._pending[start] = mine
        self._finish_record(mine)

    # ----------------------------------------------------------------- bookkeeping

    def _overlapping(self, lo: int, hi: int) -> list[Record]:
        with self._crc_lock:
            i = max(0, bisect.bisect_right(self._starts, lo) - 1)
            found = []
            for record in self._records[i:]:
                if record.start >= hi:
                    break
                if record.start + record.size > lo:
                    found.append(record)
            return found

    def _unseen(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The bytes of ``[lo, hi)`` (file offsets) in records not yet checked that no read has seen, merged; a
        record that failed its check raises (every later read of it does)."""
        out: list[tuple[int, int]] = []
        for record in self._overlapping(lo, hi):
            self._raise_if_bad(record)
            r_lo, r_hi = max(lo, record.start) - record.start, min(hi, record.start + record.size) - record.start
            with self._crc_lock:
                gaps = [] if record.verified else record.gaps(r_lo, r_hi)
            for a, b in gaps:
                a, b = record.start + a, record.start + b
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
        return out

    def _read_and_check(self, lo: int, hi: int) -> None:
        """Read ``[lo, hi)`` (file offsets) in bounded pieces only to fold it into the records' CRCs."""
        buffer = _scratch(hi - lo)
        at = lo
        while at < hi:
            piece = buffer[: min(len(buffer), hi - at)]
            self.source.read_into(at, piece, "a tensor record")  # a short source raises, naming itself
            self._saw(at, piece)
            at += len(piece)

    def _saw(self, offset: int, data: memoryview) -> None:
        """Fold the bytes ``data`` read at file ``offset`` into the CRCs of the records they lie in."""
        end = offset + len(data)
        for record in self._overlapping(offset, end):
            lo = max(offset, record.start) - record.start
            hi = min(end, record.start + record.size) - record.start
            base = record.start - offset  # data index of record byte 0
            with self._crc_lock:
                gaps = [] if record.verified or record.found is not None else record.gaps(lo, hi)
                before = record.run_ending_at(gaps[0][0]) if gaps else None
            # Bytes right after a run already seen (reading a record in order) continue its CRC: no combine.
            crcs = [
                (a, b, zlib.crc32(data[base + a : base + b], before[2] if i == 0 and before else 0))
                for i, (a, b) in enumerate(gaps)
            ]  # zlib.crc32 releases the GIL
            with self._crc_lock:
                for i, (a, b, crc) in enumerate(crcs):
                    if record.verified or record.found is not None:
                        break
                    raced = record.gaps(a, b)
                    if raced == [(a, b)] and i == 0 and before is not None:
                        if not record.extend(before, b, crc):  # the run changed meanwhile: add the bytes alone
                            record.add(a, b, zlib.crc32(data[base + a : base + b]))
                    elif raced == [(a, b)]:
                        record.add(a, b, crc)
                    else:  # another thread saw part of it meanwhile
                        for c, d in raced:
                            record.add(c, d, zlib.crc32(data[base + c : base + d]))
                if not record.verified:
                    record.settle()
                if record.verified:
                    self._pending.pop(record.start, None)
                else:
                    self._pending[record.start] = record
            self._raise_if_bad(record)

    def _raise_if_bad(self, record: Record) -> None:
        if record.found is not None:
            raise CheckpointFormatError(
                f"'{self.name}': record '{record.name}' ({record.size} bytes) fails its CRC-32 check (stored "
                f"{record.crc:08x}, read {record.found:08x}): the file is corrupted; copy it again from where it "
                "was saved (or pass verify_crc=False / --no-verify-crc to read it anyway).",
                path=self.name,
            )
