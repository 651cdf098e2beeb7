"""zeroio.load into sharded models on CUDA (issue 24, goal 5): FSDP2 and tensor parallel on a CUDA mesh, each local
shard bit for bit equal to torch's own sharding of the engine's tensors on a CPU mesh.

Skipped without CUDA (CI has no GPU); run on a GPU host with
``python -m pytest -q -p no:cacheprovider tests/test_cuda_sharded.py``. One rank uses NCCL (``cpu:gloo,cuda:nccl``:
the reference lives on a CPU mesh); 2 and 4 ranks share the one GPU over gloo, since NCCL refuses two ranks on one
device (with several GPUs the same code runs one rank per GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES
from test_distributed import finish, free_port, worker_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU host")

WORKER = Path(__file__).with_name("cuda_sharded_worker.py")
Z3 = FIXTURES / "z3_ws2_fp32"
Z3_ENGINE = Z3 / "expected" / "engine.pt"
BF16 = FIXTURES / "z2_ws2_bf16"
# The workers see what this process sees (the GPU host's DeepSpeed is installed with --target beside the image).
PYTHONPATH = os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p
)


def case(id: str, shard: str, build: str = "meta", src: Path = Z3, **kw: Any) -> dict[str, Any]:
    engine = (src / "expected" / "engine.pt") if src != Z3 else Z3_ENGINE
    return {"id": id, "shard": shard, "build": build, "src": str(src), "engine": str(engine), **kw}


CASES = [
    case("fsdp2_meta", "fsdp2"),
    case("fsdp2_meta_bf16", "fsdp2", dtype="bf16"),
    case("fsdp2_to_empty", "fsdp2", build="to_empty"),
    case("fsdp2_built_on_cuda", "fsdp2", build="cuda"),
    case("fsdp2_bf16_source", "fsdp2", src=BF16, dtype="bf16"),
    case("tp_meta", "tp"),
    case("tp_rowemb_built_on_cuda", "tp_rowemb", build="cuda"),
    case("tp_bf16_source", "tp", build="cuda", src=BF16),
    # 64-byte staging: every tensor crosses pinned chunks (copies in flight while the next chunk is read), column
    # blocks in 2-row blocks, casts on the device.
    case("fsdp2_meta_bf16_small_chunks", "fsdp2", dtype="bf16", staging_bytes=64),
    case("tp_meta_small_chunks", "tp", staging_bytes=64),
    case("tp_bf16_small_chunks", "tp", dtype="bf16", staging_bytes=64),
]


def run(tmp_path: Path, world: int, backend: str, cases: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    spec = tmp_path / f"spec{world}.json"
    spec.write_text(json.dumps({"backend": backend, "cases": cases}))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(spec)],
            env={**worker_env(rank, world, port), "LOCAL_RANK": "0", "PYTHONPATH": PYTHONPATH},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    by_case: dict[str, list[dict[str, Any]]] = {c["id"]: [] for c in cases}
    for rank, (code, records, err) in enumerate(finish(procs, timeout=300)):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
        for record in records:
            by_case[record["id"]].append(record)
    return by_case


def check(by_case: dict[str, list[dict[str, Any]]], world: int) -> None:
    for cid, records in by_case.items():
        assert len(records) == world, (cid, records)
        for r in records:
            assert r["ok"], (cid, r)
            assert r["differ"] == [], (cid, r["rank"], r["differ"])
            assert r["devices"] == ["cuda"], (cid, r)
            assert r["same_layout"] and r["tied"], (cid, r)


def test_one_rank_nccl(tmp_path: Path) -> None:
    """FSDP2 and tensor parallel on a 1-rank NCCL mesh on the GPU; zero.Init partitions on the GPU."""
    cases = list(CASES)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass
    else:
        cases.append(case("zero_init", "zero_init"))
        cases.append(case("zero_init_bf16", "zero_init", dtype="bf16"))
    check(run(tmp_path, 1, "cpu:gloo,cuda:nccl", cases), 1)


def test_two_ranks_share_the_gpu(tmp_path: Path) -> None:
    """Uneven FSDP2 shards and column/row-wise TP blocks on 2 ranks (gloo, one GPU shared)."""
    check(run(tmp_path, 2, "gloo", CASES), 2)


def test_four_ranks_2d_mesh(tmp_path: Path) -> None:
    """FSDP2 over tensor parallel (strided shards) on a 2 x 2 CUDA mesh, 4 ranks sharing the GPU."""
    cases = [case("2d_meta", "2d"), case("2d_bf16", "2d", dtype="bf16"), case("fsdp2_meta_4", "fsdp2")]
    check(run(tmp_path, 4, "gloo", cases), 4)
