"""CRC-32 checks in a distributed conversion: a ZeRO-3 record that both processes read parts of is checked by one of
them, with the other's CRCs of what it read; a byte flipped where one process reads and the other checks still fails
every process and leaves nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fixture_data import FIXTURES
from test_crc import _flip
from test_distributed import assert_nothing_left, finish, start

import zeroio
from zeroio._write.sharding import assign_shards

FIXTURE = "z3_ws2_fp32"
SHARD = 300  # max_shard_size: 4 shards, 2 for each process


def _writers(tmp_path: Path) -> dict[str, int]:
    """Which process writes each tensor (the distributed job's assignment of the single-process shards)."""
    single = tmp_path / "single"
    zeroio.convert(FIXTURES / FIXTURE, single, max_shard_size=SHARD, progress=False)
    weight_map = json.loads((single / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    owners = assign_shards([(single / name).stat().st_size for name in files], 2)
    return {tensor: owners[files.index(shard)] for tensor, shard in weight_map.items()}


def _byte_in(copy: Path, writers: dict[str, int], writer: int, rank_file: int) -> tuple[Path, int]:
    """(file in ``copy``, offset) of a byte of a tensor ``writer`` writes, in a flat-group record of rank file
    ``rank_file`` that the other process also writes tensors from (so both read that record in part)."""
    root = (FIXTURES / FIXTURE).resolve()
    with zeroio.open(FIXTURES / FIXTURE) as ckpt:
        pieces = {}  # tensor -> {record: (ref, piece)} in rank file `rank_file`
        for tensor in writers:
            plan = ckpt.read_plan(tensor)  # type: ignore[attr-defined]
            for p in getattr(plan, "pieces", ()):
                ref = plan.groups[p.rank][p.group]
                if p.rank == rank_file and p.length > 1:
                    pieces.setdefault(tensor, {})[(ref.file.path, ref.storage.key)] = (ref, p)
        others = {record for t, by in pieces.items() if writers[t] != writer for record in by}
        ref, piece = next(v for t, by in pieces.items() if writers[t] == writer for r, v in by.items() if r in others)
        offset = ref.file.data_offset(ref.storage.key) + (ref.storage_offset + piece.start + 1) * ref.dtype.itemsize
        return copy / ref.file.path.relative_to(root), offset


@pytest.mark.parametrize(("writer", "rank_file"), [(1, 0), (0, 1)], ids=["rank-1-writes-rank-0-checks", "reverse"])
def test_a_byte_one_process_reads_and_the_other_checks_fails_both(tmp_path, writer, rank_file):
    """Each process reads only its tensors' slices of the two rank files' flat groups; the record of rank file 0 is
    checked by process 0, that of rank file 1 by process 1, each with the other's CRCs. A byte flipped in a tensor
    that ``writer`` writes, in the record the other process checks: the checker fails with the CRC error, the writer
    quotes it, and nothing is left. (tests/test_distributed.py: clean sources convert to the single-process bytes
    with the checks shared.)"""
    writers = _writers(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURES / FIXTURE, copy, symlinks=True)
    _flip(*_byte_in(copy, writers, writer, rank_file))
    out = tmp_path / "out"
    out.mkdir()
    jobs = [{"src": str(copy), "dst": str(out / "bad"), "kwargs": {"max_shard_size": SHARD}, "hook": None}]
    outputs = finish(start(tmp_path, 2, jobs))
    for rank, (code, _, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
    records = [records[0] for _, records, _ in outputs]

    checker = 1 - writer
    own, quoted = records[checker], records[writer]
    assert own["type"] == "CheckpointFormatError", own
    assert "fails its CRC-32 check" in own["message"], own
    assert (quoted["type"], quoted["error_rank"]) == ("OutputError", checker)
    assert quoted["message"] == (
        f"Process {checker} of 2 failed while checking the CRC-32 of the source records it was given, so "
        f"'{out / 'bad'}' was not written. Its error: {own['message']}"
    )
    assert_nothing_left(out, out / "bad")
