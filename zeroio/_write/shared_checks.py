"""CRC-32 checks of a distributed conversion's source records, each done once for all processes.

A ZeRO-3 rank file holds one record per flat group (656 MB per rank of a 1.3B model), and every process that writes
shards reads a slice of it. Checked by each process alone, every process would read the whole record (6.3-6.7 GB
read per process on the H100 host where its shards held 1.0-1.4 GB). Instead each process reports, with its
end-of-writes outcome (one exchange), the records it read in part with the CRCs of the runs it read
(:meth:`~zeroio._io.integrity.CheckedFile.partial_records`); every process then computes the same assignment: a
record whose runs are disjoint across processes is checked by one of them, which combines the others' CRCs with
its own and reads only what nobody read (a flat group's padding). A record whose runs overlap between processes
(two read the same bytes) is checked whole by each of them, as a single process would: so every byte any process
wrote is covered by the check of the bytes that process read. The outcome of the checks is settled before the
commit, so a corrupted byte fails every process. Torch-free.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from .._io.integrity import CheckedFile, PartialRecord

__all__ = ["MAX_RUNS", "Reports", "check_assigned", "checks_of", "partial_reports"]

Reports = dict[str, list[Any]]
"""One process's records read in part, by file name: ``[name, start, size, crc, [[lo, hi, crc], ...]]`` each."""

_RECORD_COST = 4096
"""Bytes a record's check counts for on top of what it reads (balancing many small records)."""


MAX_RUNS = 256
"""A record this process read in more runs than this is checked here, whole, as alone: its pieces are interleaved
with the other processes' (a 1,024-rank checkpoint of small parameters), so their runs overlap through the
read-ahead windows, and sending them would cost more than reading the record."""


def partial_reports(files: Sequence[CheckedFile]) -> Reports | None:
    """This process's report (None when it read no record in part); records read in more than :data:`MAX_RUNS`
    runs are checked here at once (CheckpointFormatError on a mismatch)."""
    out: Reports = {}
    for file in files:
        records = []
        for name, start, size, crc, runs in file.partial_records():
            if len(runs) > MAX_RUNS:
                file.finish_with((name, start, size, crc, []))
            else:
                records.append([name, start, size, crc, [list(run) for run in runs]])
        if records:
            out[file.name] = records
    return out or None


def _disjoint(runs: list[tuple[int, int, int]]) -> bool:
    ordered = sorted(runs)
    return all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))


def checks_of(reports: Sequence[Reports | None], rank: int) -> list[tuple[str, PartialRecord]]:
    """The records process ``rank`` checks, with the runs it folds in: ``(file name, record)``. The same
    computation on every process (``reports`` in rank order), so no process checks a record another checks."""
    by_record: dict[tuple[str, int], list[tuple[int, list[Any]]]] = {}
    for who, report in enumerate(reports):
        for file, records in (report or {}).items():
            for record in records:
                by_record.setdefault((file, int(record[1])), []).append((who, record))
    load = [0] * len(reports)
    mine: list[tuple[str, PartialRecord]] = []
    for (file, start), seen in sorted(by_record.items()):
        name, _, size, crc, _ = seen[0][1]
        runs = [(int(lo), int(hi), int(c)) for _, record in seen for lo, hi, c in record[4]]
        agree = all((record[2], record[3]) == (size, crc) for _, record in seen)
        if len(seen) > 1 and not (agree and _disjoint(runs)):  # each checks its own whole, as alone
            if any(who == rank for who, _ in seen):
                mine.append((file, (name, start, size, crc, [])))
            continue
        unread = size - sum(hi - lo for lo, hi, _ in runs)
        checker = min((who for who, _ in seen), key=lambda who: (load[who], who))
        load[checker] += unread + _RECORD_COST
        if checker == rank:
            mine.append((file, (name, start, size, crc, runs)))
    return mine


def check_assigned(files: Sequence[CheckedFile], checks: list[tuple[str, PartialRecord]]) -> None:
    """Check this process's share (:func:`checks_of`): raise CheckpointFormatError on the first mismatch."""
    by_name = {file.name: file for file in files}
    for file, record in checks:
        by_name[file].finish_with(record)
