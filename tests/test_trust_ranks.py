"""Every failure of a sharded load reaches every rank as a ``ZeroIOError`` within seconds, and ranks agree on one
checkpoint before reading (issue 30, item 3). Two gloo ranks run every case in one spawn (tests/agreement_worker.py)
with a 20 s process-group timeout: before, a rank left in ``all_gather_object`` or ``broadcast`` reported the
backend's timeout (or, for a save landing between the ranks' opens, loaded rows from two steps). The last cases are
the holes the first round left (a model sharded only by the init hook; a non-zero rank failing between broadcasts),
then a healthy load, which shows the ranks still meet in step afterwards. Copies made without keeping modification
times (``cp``, ``rsync`` without ``-t``) are compared by content: an identical one loads, one changed byte is
refused."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixture_data import FIXTURES
from test_distributed import finish, free_port, worker_env

import zeroio

WORKER = Path(__file__).with_name("agreement_worker.py")
DCP = FIXTURES / "dcp" / "dcp_fsdp2_ws2_fp32"  # chunk 0 of each tensor in __0_0.distcp (rank 0's rows), 1 in __1_0
Z3 = FIXTURES / "z3_ws2_fp32"  # global_step1 and global_step2
TIMEOUT = 20
SLOW = 0.5  # seconds rank 0 takes per tensor in the last failure case: its share of 10 tensors takes 5 s


def _flipped_dcp(root: Path, chunk: int) -> Path:
    """The DCP fixture with one bit of ``emb.weight``'s chunk ``chunk`` flipped (its CRC then fails)."""
    folder = root / f"dcp_flipped_{chunk}"
    shutil.copytree(DCP, folder, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    with zeroio.open(folder) as ckpt:
        ranges = ckpt.byte_ranges("emb.weight")
    assert ranges is not None
    source, offset, _ = ranges[chunk]
    data = bytearray(Path(source.name).read_bytes())
    data[offset + 20] ^= 0x10
    Path(source.name).write_bytes(bytes(data))
    return folder


def _copy_with_other_times(root: Path, *, changed: bool = False) -> Path:
    """The DCP fixture copied as ``cp`` copies (times not kept), every file's modification time then set apart.
    ``changed``: one byte changed too, in ``__1_0.distcp``'s last archive, a digit of its ``.data/serialization_id``
    (the id torch.save gives a save, in the file's last 4 KiB; no reader uses it): the same names and sizes."""
    folder = shutil.copytree(DCP, root / f"dcp_other_times_{changed}", copy_function=shutil.copy)
    if changed:
        data = folder / "__1_0.distcp"
        content, name = bytearray(data.read_bytes()), b"archive/.data/serialization_id"
        at = len(content)
        while content[at - 30 : at - 26] != b"PK\x03\x04":  # the last local header naming it, not the directory's
            at = content.rfind(name, 0, at)
            assert at > 0
        name_length, extra_length = struct.unpack("<HH", content[at - 4 : at])
        digit = at + name_length + extra_length
        assert len(content) - digit < 4096 and chr(content[digit]).isdigit()
        content[digit] ^= 0x01
        data.write_bytes(bytes(content))
    for path in folder.rglob("*"):
        os.utime(path, ns=(10**18, 10**18 + path.stat().st_mtime_ns % 1000))
    assert all(p.stat().st_mtime_ns != (DCP / p.relative_to(folder)).stat().st_mtime_ns for p in folder.rglob("*"))
    return folder


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ranks")
    moving = root / "z3"
    shutil.copytree(Z3, moving, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    rank0_rows, rank1_rows = _flipped_dcp(root, 0), _flipped_dcp(root, 1)
    cases = [
        {"id": "open_fails_on_rank_1", "src": [str(DCP), str(root / "missing")], "shard": "fsdp2"},
        {"id": "broadcast_read_fails_on_rank_0", "src": [str(rank0_rows)] * 2, "shard": "fsdp2", "broadcast": True},
        {"id": "fill_fails_on_rank_1", "src": [str(rank1_rows)] * 2, "shard": "fsdp2"},
        {"id": "save_lands_between_opens", "src": [str(moving)] * 2, "shard": "fsdp2",
         "move_latest": str(root / "moved")},
        {"id": "healthy", "src": [str(DCP)] * 2, "shard": "fsdp2"},
        {"id": "staging_abc", "src": [str(DCP)] * 2, "shard": "fsdp2", "staging": "abc"},
        {"id": "staging_16mib", "src": [str(DCP)] * 2, "shard": "fsdp2", "staging": "16MiB"},
        {"id": "open_fails_sharded_in_hook", "src": [str(DCP), str(root / "missing")], "shard": "none",
         "shard_in_hook": "fsdp2"},
        {"id": "broadcast_fails_on_rank_1", "src": [str(DCP)] * 2, "shard": "fsdp2", "broadcast": True,
         "fail_progress_on": [1]},
        {"id": "fill_fails_while_rank_0_reads", "src": [str(DCP)] * 2, "shard": "fsdp2", "fail_progress_on": [1],
         "slow_progress": {"0": SLOW}},
        {"id": "healthy_after_failures", "src": [str(DCP)] * 2, "shard": "fsdp2", "broadcast": True},
        {"id": "copy_with_other_times", "src": [str(DCP), str(_copy_with_other_times(root))], "shard": "fsdp2"},
        {"id": "copy_with_one_byte_changed", "src": [str(DCP), str(_copy_with_other_times(root, changed=True))],
         "shard": "fsdp2"},
    ]  # fmt: skip
    spec = root / "spec.json"
    spec.write_text(json.dumps({"cases": cases, "timeout": TIMEOUT}))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(spec)], env=worker_env(rank, 2, port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    by_case: dict[str, list[dict[str, Any]]] = {c["id"]: [] for c in cases}
    for rank, (_, records, err) in enumerate(finish(procs, timeout=len(cases) * TIMEOUT + 60)):
        assert len(records) == len(cases), f"rank {rank} stopped early:\n{err[-3000:]}"
        for record in records:
            by_case[record["id"]].append(record)
    return by_case


def _fast(records: list[dict[str, Any]]) -> None:
    assert all(r["seconds"] < 10 for r in records), [(r["rank"], r["seconds"], r["error"]) for r in records]


def test_open_failure_on_one_rank_reaches_the_other(results):
    rank0, rank1 = results["open_fails_on_rank_1"]
    assert rank1["error"] == "CheckpointNotFoundError"
    assert rank0["error"] == "ShardedModelError"
    assert rank0["message"].startswith("Rank 1 could not load '") and "(CheckpointNotFoundError)" in rank0["message"]
    _fast([rank0, rank1])


def test_read_error_on_rank_0_under_broadcast_reaches_rank_1(results):
    rank0, rank1 = results["broadcast_read_fails_on_rank_0"]
    assert rank0["error"] == "CheckpointFormatError" and "fails its CRC-32 check" in rank0["message"]
    assert rank1["error"] == "ShardedModelError"
    assert "Rank 0 could not read 'emb.weight'" in rank1["message"] and "fails its CRC-32 check" in rank1["message"]
    _fast([rank0, rank1])


def test_fill_error_on_one_rank_reaches_the_other(results):
    """Rank 1's rows of emb.weight fail their CRC; rank 0's read fine, and rank 0 no longer returns as if loaded."""
    rank0, rank1 = results["fill_fails_on_rank_1"]
    assert rank1["error"] == "CheckpointFormatError" and "fails its CRC-32 check" in rank1["message"]
    assert rank0["error"] == "ShardedModelError" and rank0["message"].startswith("Rank 1 could not load")
    _fast([rank0, rank1])


def test_ranks_that_opened_different_steps_refuse_to_load(results):
    rank0, rank1 = results["save_lands_between_opens"]
    for record in (rank0, rank1):
        assert record["error"] == "ShardedModelError"
        assert "opened different checkpoints" in record["message"]
        assert "tag 'global_step2' vs 'global_step1'" in record["message"]
    _fast([rank0, rank1])


def test_open_failure_reaches_the_others_when_the_hook_shards_the_model(results):
    """Rank 1's open fails before its init hook would shard the model: it still runs the hook (the others may meet in
    its collectives), then sends its error to the plan step the others wait in. Before, rank 0 waited there for the
    group's timeout, as rank 1 had not known its load was sharded."""
    rank0, rank1 = results["open_fails_sharded_in_hook"]
    assert rank1["error"] == "CheckpointNotFoundError"
    assert rank0["error"] == "ShardedModelError", rank0
    assert rank0["message"].startswith("Rank 1 could not load '") and "(CheckpointNotFoundError)" in rank0["message"]
    assert "so no rank loaded anything" in rank0["message"]
    _fast([rank0, rank1])


def test_a_failure_of_rank_1_between_broadcasts_reaches_rank_0(results):
    """Under broadcast_from_rank0, rank 1 fails after its first tensor (its progress callback raises): rank 0, about
    to broadcast the next chunk, learns it in that chunk's step. Before, rank 0 waited in ``broadcast``."""
    rank0, rank1 = results["broadcast_fails_on_rank_1"]
    assert (rank1["error"], rank1["message"]) == ("RuntimeError", "injected failure on rank 1")
    assert rank0["error"] == "ShardedModelError", rank0
    assert rank0["message"].startswith("Rank 1 could not load '") and "(RuntimeError)" in rank0["message"]
    assert "the model is partly filled" in rank0["message"] and rank0["message"].endswith("injected failure on rank 1")
    _fast([rank0, rank1])


def test_a_fill_failure_stops_the_other_ranks_reads_early(results):
    """Rank 1 fails after its first tensor while rank 0 reads a long share (0.5 s a tensor): rank 0 sees rank 1's
    alarm in the job's store between two tensors and raises its error then, not after reading its whole share."""
    rank0, rank1 = results["fill_fails_while_rank_0_reads"]
    assert rank1["error"] == "RuntimeError" and rank1["tensors"] == 1
    assert rank0["error"] == "ShardedModelError" and rank0["message"].startswith("Rank 1 could not load '"), rank0
    assert rank0["tensors"] <= 3, rank0  # of 10: before, every one (5 s)
    _fast([rank0, rank1])


def test_a_healthy_load_still_loads_on_both_ranks(results):
    assert [r["error"] for r in results["healthy"]] == [None, None]
    assert [r["error"] for r in results["healthy_after_failures"]] == [None, None]


def test_staging_bytes_variable_is_checked_by_name(results):
    """``ZEROIO_STAGING_BYTES=abc`` (or ``1e6``) was a bare ``int()`` ValueError; sizes like 16MiB are accepted."""
    for record in results["staging_abc"]:
        assert record["error"] == "ValueError"
        assert record["message"].startswith("ZEROIO_STAGING_BYTES='abc' is not a byte count")
    assert [r["error"] for r in results["staging_16mib"]] == [None, None]


def test_a_copy_with_other_modification_times_loads(results):
    """Rank 1 reads a copy of rank 0's checkpoint whose files have other modification times (a per-node copy made
    without ``rsync -t``): the same checkpoint, so both load. Before, the times differed and the load was refused."""
    assert [(r["error"], r["message"]) for r in results["copy_with_other_times"]] == [(None, None)] * 2


def test_a_copy_with_one_byte_changed_is_refused(results):
    """Rank 1's copy, made without its times, also has one byte of a data file changed (the same names and sizes):
    the ranks opened different checkpoints, and both refuse before reading, naming that file alone."""
    for record in results["copy_with_one_byte_changed"]:
        assert record["error"] == "ShardedModelError", record
        assert "opened different checkpoints" in record["message"]
        assert "(files that differ: __1_0.distcp)" in record["message"]
    _fast(results["copy_with_one_byte_changed"])
