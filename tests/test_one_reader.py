"""A one-host distributed conversion (one reader per host, the default): process 0 converts alone, the other
process learns the outcome over a Unix socket, and neither imports torch; killing process 0 fails the other at once.
Two local processes with torchrun's environment, no launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixture_data import FIXTURES
from test_distributed import TORCHRUN_ENV, assert_same_folder, finish, free_port

from zeroio import convert

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("one_reader_worker.py")
SRC = FIXTURES / "z3_ws2_fp32"


def _start(tmp_path: Path, spec: dict, **extra_env: str) -> list[subprocess.Popen[str]]:
    """Two processes of tests/one_reader_worker.py on one host, with the environment torchrun gives them."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and k != "ZEROIO_READERS_PER_HOST"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra_env)
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(path)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]


def test_no_process_imports_torch_and_every_one_returns_the_result(tmp_path):
    """Process 0 writes the single-process bytes; both return the same files, and neither imported torch nor left a
    child process: their one exchange crossed a Unix socket, not a gloo group."""
    dst = tmp_path / "dist"
    outputs = finish(_start(tmp_path, {"src": str(SRC), "dst": str(dst), "kwargs": {"max_shard_size": 300}}))
    for rank, (code, _, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
    (reader,), (other,) = (records for _, records, _ in outputs)
    assert reader["ok"] and other["ok"], (reader, other)
    assert [(r["torch_imported"], r["children"]) for r in (reader, other)] == [(False, False)] * 2
    single = convert(SRC, tmp_path / "single", max_shard_size=300, progress=False)
    assert_same_folder(tmp_path / "single", dst)
    assert reader["files"] == other["files"] == [str(dst / p.name) for p in single.files]


def test_killing_process_0_fails_the_other_at_once(tmp_path):
    """Process 0 SIGKILLed at its first written bytes, while process 1 waits for its word: process 1 raises an
    OutputError saying it lost contact with process 0 at once, not after the timeout, and no destination appears."""
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "model"
    spec = {
        "src": str(SRC), "dst": str(dst), "kwargs": {"max_shard_size": 300, "chunk_bytes": 8}, "kill": True,
        "ready": str(tmp_path / "ready"),
    }  # fmt: skip
    outputs = finish(_start(tmp_path, spec, ZEROIO_DISTRIBUTED_TIMEOUT="60"), timeout=120)
    assert outputs[0][0] == -signal.SIGKILL
    code, records, err = outputs[1]
    assert code == 0, err[-3000:]
    ((record),) = records
    assert (record["type"], record["error_rank"]) == ("OutputError", None), record
    assert record["message"] == (
        f"Cannot confirm '{dst}': lost contact with process 0, which writes it (process 0 closed its connection). "
        f"'{dst}' exists only if process 0 completed; check it, and process 0's log."
    )
    assert record["seconds"] < 30  # not the 60 s timeout
    assert not dst.exists()
    # What process 0 leaves when killed: its hidden temporary folder without an index (the next conversion into
    # this folder removes it: its lock died with the process), never anything named like the destination.
    for left in out.iterdir():
        assert left.name.startswith(".model.zeroio-tmp-"), left
        assert not list(left.glob("*.index.json")), list(left.iterdir())


def test_another_process_failing_fails_every_process_and_nothing_appears(tmp_path):
    """Process 1 cannot open the checkpoint (a relative path naming nothing in its working folder): process 0, which
    converted, learns it right before its rename, removes its output and raises, as process 1 does; and when process
    1 opens another checkpoint behind the same path, both refuse the differing plans. No destination appears."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    (tmp_path / "node0" / "ckpt").symlink_to(SRC)
    out = tmp_path / "out"
    out.mkdir()
    missing = {"src": "ckpt", "dst": str(out / "missing"), "kwargs": {}, "chdir": {"0": str(tmp_path / "node0"),
               "1": str(tmp_path / "node1")}}  # fmt: skip
    outputs = finish(_start(tmp_path, missing))
    assert [code for code, _, _ in outputs] == [0, 0], outputs
    (reader,), (other,) = (records for _, records, _ in outputs)
    assert (other["ok"], other["error_rank"]) == (False, None), other
    assert (reader["type"], reader["error_rank"]) == ("OutputError", 1), reader
    assert reader["message"] == (
        f"Process 1 of 2 failed while planning, so '{out / 'missing'}' was not written. Its error: {other['message']}"
    )

    (tmp_path / "node1" / "ckpt").symlink_to(FIXTURES / "z3_ws2_bf16")  # same names and shapes, frozen in bf16
    differ = {**missing, "dst": str(out / "differ")}
    outputs = finish(_start(tmp_path, differ))
    records = [records[0] for _, records, _ in outputs]
    assert [(r["type"], r["error_rank"]) for r in records] == [("OutputError", 1)] * 2, records
    assert (
        records[0]["message"]
        == records[1]["message"]
        == (
            f"Cannot write '{out / 'differ'}': processes 0 and 1 planned different outputs from 'ckpt', so they read "
            "different checkpoints. Put the checkpoint on a filesystem shared by every process, at the same path, and "
            "do not change it during the conversion."
        )
    )
    assert list(out.iterdir()) == []  # no destination, no temporary folder


def test_with_host_sockets_off_the_processes_meet_in_a_gloo_group(tmp_path):
    """ZEROIO_HOST_SOCKETS=0 (processes that share a host but not a network namespace): the same conversion, the
    outcome told through a gloo group that both join, importing torch."""
    dst = tmp_path / "dist"
    spec = {"src": str(SRC), "dst": str(dst), "kwargs": {"max_shard_size": 300}}
    outputs = finish(_start(tmp_path, spec, ZEROIO_HOST_SOCKETS="0"))
    for rank, (code, _, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
    (reader,), (other,) = (records for _, records, _ in outputs)
    assert reader["ok"] and other["ok"], (reader, other)
    assert reader["torch_imported"] and other["torch_imported"]
    convert(SRC, tmp_path / "single", max_shard_size=300, progress=False)
    assert_same_folder(tmp_path / "single", dst)
    assert reader["files"] == other["files"]


def test_a_bad_host_sockets_value_is_refused_by_name(tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port()), "ZEROIO_HOST_SOCKETS": "yes"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ZEROIO_READERS_PER_HOST", raising=False)
    with pytest.raises(ValueError) as excinfo:
        convert(SRC, tmp_path / "out", distributed=True, progress=False)
    assert (
        str(excinfo.value) == "ZEROIO_HOST_SOCKETS must be 0 (a gloo group) or 1 (a Unix socket, on Linux), got 'yes'."
    )
    assert list(tmp_path.iterdir()) == []
