"""Every rank of a torch.distributed job calls ``zeroio.convert`` (or the zero_to_fp32 drop-in) with one destination,
as code written for DeepSpeed does: one rank writes, the others wait and return its result or raise its error
(gloo jobs of 2 processes, tests/every_rank_worker.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES
from test_distributed import LAUNCH_TIMEOUT, REPO, assert_same_folder, finish, free_port, worker_env

import zeroio

WORKER = Path(__file__).with_name("every_rank_worker.py")


def run_job(tmp_path: Path, jobs: list[dict], **env: str) -> list[tuple[int, list[dict], str]]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    port = free_port()
    command = [sys.executable, str(WORKER), str(spec)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(command, env=worker_env(rank, 2, port, **env), cwd=REPO, **pipes) for rank in range(2)]
    return finish(procs, LAUNCH_TIMEOUT)


def job(call: str, src: str, dst: Path, **kwargs: object) -> dict:
    return {"call": call, "src": str(FIXTURES / src), "dst": str(dst), "kwargs": kwargs}


@pytest.fixture(scope="module")
def every_rank_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[dict]]]:
    """One gloo job of 2 ranks running the scenarios below in order (each process imports torch once)."""
    tmp = tmp_path_factory.mktemp("every_rank")
    (tmp / "existing").mkdir()
    (tmp / "existing" / "config.json").write_text("{}")
    jobs = [
        job("convert", "z3_ws2_bf16", tmp / "out", max_shard_size=500),
        job("convert", "z3_ws2_bf16", tmp / "failed") | {"hook": "raise"},
        job("dropin", "z3_ws2_fp32", tmp / "fp32"),
        job("dropin", "z2_ws2_bf16", tmp / "existing", safe_serialization=True),
        job("convert", "z3_ws2_fp32", tmp / "alone") | {"ranks": [1]},
        job("convert", "z3_ws2_fp32", tmp / "twice"),
        job("convert", "z3_ws2_bf16", tmp / "twice", overwrite=True),  # the second call with a destination
        job("convert", "z3_ws2_fp32", tmp / "killed" / "out") | {"hook": "kill"},  # last: the writer dies
    ]
    outputs = run_job(tmp, jobs, ZEROIO_DISTRIBUTED_TIMEOUT="10")
    killed = [rank for rank, (code, _, _) in enumerate(outputs) if code == -signal.SIGKILL]
    assert len(killed) == 1, [(code, err[-3000:]) for code, _, err in outputs]
    for rank, (code, records, err) in enumerate(outputs):
        expected = len(jobs) - (rank in killed)
        assert (code == 0 or rank in killed) and len(records) == expected, f"rank {rank} exited {code}:\n{err[-3000:]}"
    records = [[outputs[r][1][j] for r in range(2)] for j in range(len(jobs) - 1)]
    return tmp, [*records, [outputs[r][1][-1] for r in range(2) if r not in killed]]


def test_every_rank_returns_the_one_writers_result(every_rank_job, tmp_path):
    """Both ranks return the same ConvertResult; exactly one wrote; the folder holds the single-process bytes."""
    tmp, records = every_rank_job
    a, b = records[0]
    assert a["ok"] and b["ok"], (a, b)
    assert sorted([a["wrote"], b["wrote"]]) == [False, True]
    assert {k: v for k, v in a.items() if k not in ("process", "wrote", "seconds")} == {
        k: v for k, v in b.items() if k not in ("process", "wrote", "seconds")
    }
    single = zeroio.convert(FIXTURES / "z3_ws2_bf16", tmp_path / "single", max_shard_size=500, progress=False)
    assert a["files"] == [str(tmp / "out" / p.name) for p in single.files] and len(single.files) > 1
    assert (a["total_size"], a["num_tensors"], a["tied"]) == (single.total_size, single.num_tensors, single.tied)
    assert_same_folder(tmp_path / "single", tmp / "out")
    assert [p.name for p in sorted(tmp.iterdir()) if ".zeroio-" in p.name] == []


def test_the_second_call_with_a_destination_is_claimed_afresh(every_rank_job):
    """A later call with the same destination is a new claim: both ranks return the overwritten output's result."""
    tmp, records = every_rank_job
    assert all(r["ok"] for r in records[5])
    a, b = records[6]
    assert a["ok"] and b["ok"] and a["files"] == b["files"] == [str(tmp / "twice" / "model.safetensors")]
    with zeroio.open(tmp / "twice") as out, zeroio.open(FIXTURES / "z3_ws2_bf16") as src:
        assert all(torch.equal(out[name], src[name]) for name in src)


def test_an_error_on_the_writer_reaches_every_rank(every_rank_job):
    """The writer's failure is raised on both ranks as a ZeroIOError naming the writer's rank; nothing is left."""
    tmp, records = every_rank_job
    writer, waiter = sorted(records[1], key=lambda r: not r["wrote"])
    assert not writer["ok"] and not waiter["ok"], records[1]
    assert writer["type"] == waiter["type"] == "OutputError"
    assert f"injected failure on rank {writer['process']}" in waiter["message"]
    assert waiter["error_rank"] == writer["process"]
    assert not (tmp / "failed").exists()


def test_a_rank_calling_alone_does_not_wait_for_the_others(every_rank_job):
    """Only rank 1 converts (the usual `if rank == 0:` guard, on another rank): it writes without waiting."""
    tmp, records = every_rank_job
    assert records[4][0] == {"skipped": True, "process": 0}
    assert records[4][1]["ok"] and records[4][1]["wrote"]
    assert (tmp / "alone" / "model.safetensors").is_file()


def test_the_drop_in_on_every_rank_writes_deepspeeds_files(every_rank_job):
    """convert_zero_checkpoint_to_fp32_state_dict on both ranks (DeepSpeed's test_convert_checkpoint.py): one
    pytorch_model.bin; into an existing folder, beside what it held."""
    tmp, records = every_rank_job
    assert all(r["ok"] for r in records[2] + records[3]), records[2:4]
    assert sorted(p.name for p in (tmp / "fp32").iterdir()) == ["pytorch_model.bin"]
    assert sorted(p.name for p in (tmp / "existing").iterdir()) == ["config.json", "model.safetensors"]


def test_a_killed_writer_fails_the_waiter_quickly(every_rank_job):
    """The writer is SIGKILLed mid-write: the other rank raises OutputError within seconds, not a hang
    (ZEROIO_DISTRIBUTED_TIMEOUT=10 s without a heartbeat, or at once when the store's host, rank 0, died)."""
    _, records = every_rank_job
    (waiter,) = records[-1]
    assert not waiter["ok"] and waiter["type"] == "OutputError", waiter
    assert waiter["message"].startswith("Waiting for rank ") and waiter["seconds"] < 60, waiter
