"""zeroio.convert(distributed=True) and `torchrun ... -m zeroio convert --distributed`: local gloo jobs of 2 and 3
processes write the single-process bytes, and any failed, killed or hung process fails the whole job cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES

import zeroio
from zeroio import convert
from zeroio._write.readers import assign_to_readers, reader_ranks
from zeroio._write.sharding import assign_shards
from zeroio.cli import main

# The variables torchrun sets that torch.distributed's env:// rendezvous reads (and zeroio --distributed checks).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("dist_worker.py")
LAUNCH_TIMEOUT = 120  # seconds for a whole local job; each process spends ~5 s importing torch on 2 shared cores


# --------------------------------------------------------------------------- launching local jobs


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, world_size: int, port: int, **extra: str | None) -> dict[str, str]:
    """The environment torchrun gives a worker, for a job on loopback. Every process writes shards (by default one
    per host does for a local source): these jobs exercise the writers' agreement and failures. An ``extra``
    variable given as None is left unset."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
        ZEROIO_READERS_PER_HOST=str(world_size),
    )  # fmt: skip
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def start(tmp_path: Path, world_size: int, jobs: list[dict], **extra_env: str | None) -> list[subprocess.Popen[str]]:
    """Start ``world_size`` processes of tests/dist_worker.py, which run ``jobs`` in order."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(spec)],
            env=worker_env(rank, world_size, port, **extra_env),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float = LAUNCH_TIMEOUT) -> list[tuple[int, list[dict], str]]:
    """Wait for every process: ``(exit code, ZEROIO-RESULT records, stderr)`` per rank; kills all on a hang."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            records = [
                json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("ZEROIO-RESULT ")
            ]
            outputs.append((proc.returncode, records, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outputs


def run_job(tmp_path: Path, world_size: int, jobs: list[dict], **extra_env: str | None) -> list[list[dict]]:
    """Run a job to completion; every process must exit 0. Returns each process's records."""
    outputs = finish(start(tmp_path, world_size, jobs, **extra_env))
    for rank, (code, _, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
    return [records for _, records, _ in outputs]


def job(src: str, dst: Path, hook: dict | None = None, **kwargs) -> dict:
    return {"src": str(FIXTURES / src), "dst": str(dst), "kwargs": kwargs, "hook": hook}


# --------------------------------------------------------------------------- comparisons


def assert_same_folder(single: Path, distributed: Path, *, fmt: str = "safetensors") -> None:
    """Same file names; safetensors files and indexes byte for byte; torch shards load to the same tensors."""
    names = sorted(p.name for p in single.iterdir())
    assert sorted(p.name for p in distributed.iterdir()) == names
    for name in names:
        a, b = (single / name).read_bytes(), (distributed / name).read_bytes()
        if fmt == "torch" and name.endswith(".bin"):
            # torch.save writes a random serialization id: two single-process runs differ there too.
            x, y = torch.load(single / name, weights_only=True), torch.load(distributed / name, weights_only=True)
            assert list(x) == list(y)
            for key in x:
                assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key
        else:
            assert a == b, name


def assert_nothing_left(parent: Path, dst: Path) -> None:
    """No destination and no temporary folder of it: nothing that looks like (part of) an output."""
    assert not dst.exists()
    assert [p.name for p in parent.iterdir() if p.name.startswith(f".{dst.name}.zeroio-")] == []


def assert_result_matches(record: dict, single: zeroio.ConvertResult, dst: Path) -> None:
    assert record["ok"], record
    assert record["files"] == [str(dst / p.name) for p in single.files]
    assert record["index_path"] == (str(dst / single.index_path.name) if single.index_path else None)
    assert (record["total_size"], record["num_tensors"], record["tied"]) == (
        single.total_size, single.num_tensors, single.tied,
    )  # fmt: skip


# --------------------------------------------------------------------------- the plan (pure)


@pytest.mark.parametrize(
    "sizes, world_size, owners",
    [
        pytest.param([5, 5, 3, 2], 2, (0, 1, 0, 1), id="balanced-pairs"),
        pytest.param([10, 1, 1, 1], 2, (0, 1, 1, 1), id="one-big-shard"),
        pytest.param([4], 3, (0,), id="fewer-shards-than-processes"),
        pytest.param([], 2, (), id="no-shards"),
        pytest.param([3, 3, 3, 3, 3, 3], 3, (0, 1, 2, 0, 1, 2), id="equal-sizes"),
        pytest.param([1, 2, 3], 1, (0, 0, 0), id="one-process"),
        pytest.param([7, 6, 5, 4, 3, 2, 1], 3, (0, 1, 2, 2, 1, 0, 0), id="largest-first"),
    ],
)  # fmt: skip
def test_assign_shards_balances_bytes_deterministically(sizes, world_size, owners):
    """Shards go largest first to the least-loaded process (ties: lower shard, lower rank), the same everywhere."""
    assert assign_shards(sizes, world_size) == owners


# --------------------------------------------------------------------------- byte-identical output


def test_two_processes_write_the_single_process_bytes_and_fail_together(tmp_path):
    """2 processes write one process's bytes; one rank's failure or a differing checkpoint fails both cleanly."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "exists").mkdir()
    (out / "exists" / "model.safetensors").write_bytes(b"an earlier output")  # an empty folder would be used
    # "ckpt" names a different checkpoint for each process, as on nodes that do not share a filesystem.
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    (node0 / "ckpt").symlink_to(FIXTURES / "z3_ws2_fp32")
    (node1 / "ckpt").symlink_to(FIXTURES / "z3_ws2_bf16")  # same names and shapes, frozen weights in bf16
    cases = [
        ("sharded", job("z3_ws3_fp32", out / "sharded", max_shard_size=300)),
        ("one-shard", job("z3_ws3_fp32", out / "one-shard")),
        ("bf16-per-tensor", job("z2_ws2_bf16", out / "bf16-per-tensor", max_shard_size=1, dtype="bf16")),
        ("torch", job("z1_ws2_fp32", out / "torch", max_shard_size=300, fmt="torch")),
        ("exists", job("z3_ws2_fp32", out / "exists")),
        ("raises", job("z3_ws3_fp32", out / "raises", hook={"rank": 1, "action": "raise"}, max_shard_size=300)),
        ("mismatch", {**job("-", out / "mismatch"), "src": "ckpt", "chdir": {"0": str(node0), "1": str(node1)}}),
        ("after-failures", job("z2_ws3_fp16", out / "after-failures", max_shard_size=200, chunk_bytes=8)),
    ]
    records = run_job(tmp_path, 2, [spec for _, spec in cases])
    by_case = {name: (records[0][i], records[1][i]) for i, (name, _) in enumerate(cases)}

    for name, spec in cases:
        if name in ("exists", "raises", "mismatch"):
            continue
        single = convert(spec["src"], tmp_path / "single" / name, progress=False, **spec["kwargs"])
        assert_same_folder(tmp_path / "single" / name, out / name, fmt=spec["kwargs"].get("fmt", "safetensors"))
        for record in by_case[name]:
            assert_result_matches(record, single, out / name)
    assert len(list((out / "sharded").glob("*.safetensors"))) == 4  # both processes wrote shards
    assert len(list((out / "bf16-per-tensor").glob("*.safetensors"))) == 10

    # The destination exists: rank 0 refuses it before reading; rank 1 says why.
    exists = f"Output folder '{out / 'exists'}' already exists. Pass overwrite=True (--overwrite) to replace it, or choose another destination."
    r0, r1 = by_case["exists"]
    assert (r0["type"], r0["message"]) == ("OutputError", exists)
    assert (r1["type"], r1["message"], r1["error_rank"]) == (
        "OutputError", f"Process 0 of 2 failed while planning, so '{out / 'exists'}' was not written. Its error: {exists}", 0,
    )  # fmt: skip
    assert list((out / "exists").iterdir()) == [out / "exists" / "model.safetensors"]  # left as it was
    assert (out / "exists" / "model.safetensors").read_bytes() == b"an earlier output"

    # Rank 1 raises mid-write: both fail, rank 1 with its own error, rank 0 quoting it; nothing is left.
    own = (
        f"Cannot write '{out / 'raises'}': RuntimeError: injected failure on rank 1. Removed the partial output. "
        "Fix the cause and run the conversion again."
    )
    r0, r1 = by_case["raises"]
    assert (r1["type"], r1["message"]) == ("OutputError", own)
    assert (r0["type"], r0["message"], r0["error_rank"]) == (
        "OutputError", f"Process 1 of 2 failed while writing its shards, so '{out / 'raises'}' was not written. Its error: {own}", 1,
    )  # fmt: skip
    assert_nothing_left(out, out / "raises")

    # Different checkpoints behind the same path: every process refuses before anything is created.
    mismatch = (
        f"Cannot write '{out / 'mismatch'}': processes 0 and 1 planned different outputs from 'ckpt', so they read "
        "different checkpoints. Put the checkpoint on a filesystem shared by every process, at the same path, and do "
        "not change it during the conversion."
    )
    assert [(r["type"], r["message"], r["error_rank"]) for r in by_case["mismatch"]] == [
        ("OutputError", mismatch, 1)
    ] * 2
    assert_nothing_left(out, out / "mismatch")


def test_three_processes_write_the_single_process_bytes(tmp_path):
    """3 processes: more shards than processes, fewer shards than processes, and ZeRO-2 fp16: the same bytes."""
    out = tmp_path / "out"
    cases = [
        ("four-shards", job("z3_ws3_fp32", out / "four-shards", max_shard_size=300)),
        ("two-shards", job("z3_ws4_fp32", out / "two-shards", max_shard_size=979)),
        ("zero2-many", job("z2_ws3_fp16", out / "zero2-many", max_shard_size=1)),
    ]
    records = run_job(tmp_path, 3, [spec for _, spec in cases])
    for i, (name, spec) in enumerate(cases):
        single = convert(spec["src"], tmp_path / "single" / name, progress=False, **spec["kwargs"])
        assert_same_folder(tmp_path / "single" / name, out / name)
        for rank in range(3):
            assert_result_matches(records[rank][i], single, out / name)
    assert len(list((out / "two-shards").glob("*.safetensors"))) == 2
    assert sorted(p.name for p in out.iterdir()) == ["four-shards", "two-shards", "zero2-many"]


@pytest.mark.parametrize("readers", ["1", "2"], ids=["one-reader", "every-process-reads"])
def test_torchrun_cli_writes_the_single_process_bytes(tmp_path, readers):
    """`torchrun --standalone --nproc-per-node 2 -m zeroio convert SRC DST --distributed` equals one process: with
    one reader (process 0 converts alone), and with both reading (each joins the group on a thread while planning,
    then writes its shards; the records both read parts of are CRC-checked once)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", ZEROIO_READERS_PER_HOST=readers)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "zeroio", "convert", str(FIXTURES / "z3_ws2_fp32"), str(tmp_path / "dist"),
        "--max-shard-size", "300", "--distributed",
    ]  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Only rank 0 reports.
    assert done.stdout == f"Wrote 11 tensors (1 tied, 980 B) in 4 file(s) to {tmp_path / 'dist'}\n"
    convert(FIXTURES / "z3_ws2_fp32", tmp_path / "single", max_shard_size=300, progress=False)
    assert_same_folder(tmp_path / "single", tmp_path / "dist")


LOCAL_SOURCE = str(FIXTURES / "z3_ws2_fp32")


@pytest.mark.parametrize(
    "env, world_size, source, readers",
    [
        pytest.param({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, 4, LOCAL_SOURCE, (0,), id="one-host"),
        pytest.param({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 8, LOCAL_SOURCE, (0, 4), id="two-hosts"),
        pytest.param({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "ZEROIO_READERS_PER_HOST": "2"}, 8, LOCAL_SOURCE,
                     (0, 1, 4, 5), id="two-readers-per-host"),
        pytest.param({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "ZEROIO_READERS_PER_HOST": "9"}, 2, LOCAL_SOURCE,
                     (0, 1), id="more-readers-than-processes"),
        pytest.param({"WORLD_SIZE": "3"}, 3, LOCAL_SOURCE, (0, 1, 2), id="hosts-unknown"),
        pytest.param({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, 6, LOCAL_SOURCE, (0, 1, 2, 3, 4, 5),
                     id="uneven-hosts"),
        pytest.param({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, 1, LOCAL_SOURCE, (0,), id="another-group"),
        # A URL: an object store limits each connection, so every process of a host reads (its own connections)
        pytest.param({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, 4, "s3://bucket/ckpt", (0, 1, 2, 3),
                     id="one-host-object-store"),
        pytest.param({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 8, "hf://user/run@main/ckpt", tuple(range(8)),
                     id="two-hosts-hub"),
        pytest.param({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 2, "https://host/model.safetensors", (0, 1),
                     id="http"),
        pytest.param({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "ZEROIO_READERS_PER_HOST": "1"}, 8,
                     "s3://bucket/ckpt", (0, 4), id="object-store-one-reader-asked"),
        pytest.param({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, 4, "file://" + LOCAL_SOURCE, (0,),
                     id="file-url-is-local"),
    ],
)  # fmt: skip
def test_readers_follow_the_storage_and_hosts_not_the_processes(monkeypatch, env, world_size, source, readers):
    """One reader per host for local files, every process of the host for a URL; ZEROIO_READERS_PER_HOST wins."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ZEROIO_READERS_PER_HOST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert reader_ranks(world_size, source) == readers
    owners = assign_to_readers([5, 4, 3, 2, 1], world_size, source)
    assert set(owners) <= set(readers)
    assert owners == tuple(readers[i] for i in assign_shards([5, 4, 3, 2, 1], len(readers)))


@pytest.fixture(scope="module")
def s3_source():
    """moto's S3 server on localhost (tests/s3_server.py) holding z3_ws3_fp32: ``(url, server)``."""
    pytest.importorskip("s3fs")
    import logging

    from s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server()
    try:
        yield server.upload_tree(FIXTURES / "z3_ws3_fp32", "dist", "z3"), server
    finally:
        server.stop()


def test_a_remote_source_is_read_by_every_process_of_the_host(tmp_path, s3_source):
    """ZEROIO_READERS_PER_HOST unset, 2 processes on one host: from s3:// both read and write shards, from the local
    folder only process 0; the single-process bytes either way."""
    url, server = s3_source
    out = tmp_path / "out"
    cases = [
        ("remote", {"src": url, "dst": str(out / "remote"), "kwargs": {"max_shard_size": 300}, "hook": None}),
        ("local", job("z3_ws3_fp32", out / "local", max_shard_size=300)),
    ]
    records = run_job(tmp_path, 2, [spec for _, spec in cases], ZEROIO_READERS_PER_HOST=None, **server.env())
    single = convert(FIXTURES / "z3_ws3_fp32", tmp_path / "single", max_shard_size=300, progress=False)
    for i, (name, _) in enumerate(cases):
        assert_same_folder(tmp_path / "single", out / name)
        for rank in range(2):
            assert_result_matches(records[rank][i], single, out / name)
    wrote = {name: [records[rank][i]["wrote"] for rank in range(2)] for i, (name, _) in enumerate(cases)}
    assert sum(wrote["remote"]) == sum(wrote["local"]) == wrote["local"][0] > 0
    assert wrote["remote"][1] > 0 and wrote["local"][1] == 0, wrote


def test_torchrun_one_host_process_0_failure_fails_the_others(tmp_path):
    """On one host process 0 converts alone; when it fails (here: the destination exists), the other process says
    so and fails too, and the existing folder is untouched."""
    dst = tmp_path / "dist"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and k != "ZEROIO_READERS_PER_HOST"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "zeroio", "convert", str(FIXTURES / "z3_ws2_fp32"), str(dst), "--distributed", "--quiet",
    ]  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False
    )
    assert done.returncode != 0
    assert "already exists" in done.stderr or "exists" in done.stderr, done.stderr[-3000:]
    assert f"Process 0 of 2 failed, so '{dst}' was not written." in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]


# --------------------------------------------------------------------------- killed and hung processes


LOST = re.compile(
    r"Cannot write '(?P<dst>[^']+)': lost contact with the other processes while writing the shards \((?P<detail>.+)\)\. "
    r"Removed the partial output\. A process was killed, crashed or stopped answering \(timeout (?P<timeout>\S+) s, "
    r"set with ZEROIO_DISTRIBUTED_TIMEOUT\): check the other processes' logs and run the conversion again\."
)


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-owns-the-folder", "rank1"])
def test_a_killed_process_fails_the_others_quickly_and_leaves_nothing(tmp_path, victim):
    """SIGKILL one of 3 processes after its temporary shard exists: the others fail at once, nothing is left."""
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "model"
    hook = {"rank": victim, "action": "kill"}
    procs = start(tmp_path, 3, [job("z3_ws3_fp32", dst, hook, max_shard_size=300, chunk_bytes=8)])
    started = time.monotonic()
    outputs = finish(procs, timeout=60)
    assert outputs[victim][0] == -signal.SIGKILL
    for rank in sorted({0, 1, 2} - {victim}):
        code, records, err = outputs[rank]
        assert code == 0, err[-3000:]  # the worker script reports the error and exits normally
        (record,) = records
        assert record["type"] == "OutputError"
        match = LOST.fullmatch(record["message"])
        assert match, record["message"]
        assert (match["dst"], match["timeout"]) == (str(dst), "1800")
        assert record["seconds"] < 30  # noticed when the connection closed, not after the 30-minute timeout
    assert time.monotonic() - started < 60
    assert_nothing_left(out, dst)


def test_under_torchrun_a_killed_worker_stops_the_others_mid_write(tmp_path):
    """torchrun SIGTERMs the survivors of a killed worker: one still writing stops at once and removes everything."""
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "model"
    # Rank 0 sleeps 0.25 s per 8-byte chunk (~15 s of writing); rank 1 kills itself at its first bytes.
    hooks = [{"rank": 1, "action": "kill"}, {"rank": 0, "action": "slow"}]
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"jobs": [job("z3_ws3_fp32", dst, hooks, max_shard_size=300, chunk_bytes=8, workers=1)]})
    )
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", ZEROIO_READERS_PER_HOST="2")  # both write shards
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        str(spec),
    ]
    done = subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False
    )
    assert done.returncode != 0  # torchrun reports the killed worker
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("ZEROIO-RESULT ")]
    record = json.loads(line.split(" ", 1)[1])
    assert record["process"] == 0 and record["type"] == "OutputError"
    assert LOST.fullmatch(record["message"]), record["message"]
    assert record["seconds"] < 10  # interrupted, not after its ~15 s of writes
    assert_nothing_left(out, dst)


def test_a_hung_process_fails_the_others_after_the_timeout(tmp_path):
    """A process that stops answering fails the others after ZEROIO_DISTRIBUTED_TIMEOUT; nothing is left."""
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "model"
    procs = start(
        tmp_path, 2, [job("z3_ws3_fp32", dst, {"rank": 1, "action": "hang"}, max_shard_size=300)],
        ZEROIO_DISTRIBUTED_TIMEOUT="5",
    )  # fmt: skip
    try:
        ((code, records, err),) = finish(procs[:1], timeout=60)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert code == 0, err[-3000:]
    (record,) = records
    match = LOST.fullmatch(record["message"])
    assert match, record["message"]
    assert match["timeout"] == "5" and "Timed out" in match["detail"]
    assert 4 < record["seconds"] < 30
    assert_nothing_left(out, dst)


# --------------------------------------------------------------------------- misuse (no processes started)


def test_distributed_outside_a_job_is_a_value_error(tmp_path, monkeypatch):
    """distributed=True with no process group and no torchrun environment says how to launch; nothing is written."""
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError) as excinfo:
        convert(FIXTURES / "z3_ws2_fp32", tmp_path / "out", distributed=True, progress=False)
    assert str(excinfo.value) == (
        "distributed=True needs an initialised torch.distributed process group or torchrun's environment "
        "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); launch with `torchrun ... -m zeroio convert SRC DST "
        "--distributed` or call torch.distributed.init_process_group() first."
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs, env, error, message",
    [
        pytest.param({"distributed": "yes"}, None, TypeError, "distributed must be True or False, got 'yes'.", id="type"),
        pytest.param({"distributed": True, "fmt": "lightning"}, None, ValueError, "distributed=True writes sharded 'safetensors' or 'torch' folders, not fmt='lightning' (one file): convert it in one process.", id="lightning"),
        pytest.param({"distributed": True}, "0", ValueError, "ZEROIO_DISTRIBUTED_TIMEOUT must be a positive number of seconds, got '0'.", id="timeout"),
    ],
)  # fmt: skip
def test_bad_distributed_arguments_fail_before_any_io(tmp_path, monkeypatch, kwargs, env, error, message):
    """A non-bool flag, a single-file format or a bad timeout fail before the job or the destination is touched."""
    if env is not None:
        monkeypatch.setenv("ZEROIO_DISTRIBUTED_TIMEOUT", env)
    with pytest.raises(error) as excinfo:
        convert(FIXTURES / "z3_ws2_fp32", tmp_path / "out", progress=False, **kwargs)
    assert str(excinfo.value) == message
    assert list(tmp_path.iterdir()) == []


def test_cli_distributed_without_torchrun_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """`zeroio convert --distributed` outside torchrun exits 2 and shows the torchrun command."""
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as excinfo:
        main(["convert", str(FIXTURES / "z3_ws2_fp32"), str(tmp_path / "out"), "--distributed"])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zeroio: error: --distributed runs under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are "
        "not set): torchrun --nnodes N --nproc-per-node P -m zeroio convert SRC DST --distributed"
    )
    assert list(tmp_path.iterdir()) == []
