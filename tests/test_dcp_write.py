"""``convert(fmt="dcp")``: FSDP2 resumes from zeroio's DCP output of a DeepSpeed ZeRO-3 checkpoint.

One ``torchrun --nproc_per_node 2`` (tests/dcp_resume_worker.py) loads both layouts into a fully sharded TinyLM on
CPU with ``dcp.load`` + ``set_model_state_dict``/``set_optimizer_state_dict``: parameters must equal the engine's
fp32 masters, ``exp_avg``/``exp_avg_sq``/``step`` zeroio's consolidated optimizer state, and a further step runs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroio
from zeroio.errors import OutputError

ROOT = Path(__file__).resolve().parent.parent
ZERO3 = ROOT / "fixtures" / "z3_ws2_fp32"
WORKER = Path(__file__).with_name("dcp_resume_worker.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    titan, accelerate = tmp / "checkpoint" / "step-2", tmp / "accelerate"
    zeroio.convert(ZERO3, titan, fmt="dcp", include_optimizer=True, dcp_layout="torchtitan", progress=False)
    zeroio.convert(ZERO3, accelerate, fmt="dcp", include_optimizer=True, dcp_layout="accelerate", progress=False)
    # The two ranks started directly with torchrun's environment variables (no elastic agent: seconds saved).
    cmd = [sys.executable, str(WORKER), f"torchtitan={titan}", f"accelerate={accelerate}", str(tmp)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))  # fmt: skip
    procs = [
        subprocess.Popen(
            cmd,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return {layout: torch.load(tmp / f"{layout}.pt", weights_only=True) for layout in ("torchtitan", "accelerate")}


@pytest.mark.parametrize("layout", ["torchtitan", "accelerate"])
def test_fsdp2_resumes_from_zero3(resumed, layout):
    record = resumed[layout]
    engine = torch.load(ZERO3 / "expected" / "engine.pt", weights_only=True)
    masters = engine.get("params", engine)
    assert set(record["model"]) == set(masters)
    for key, value in masters.items():
        assert torch.equal(record["model"][key], value), key
    with zeroio.open(ZERO3) as ckpt:
        trainable = [n for n, i in ckpt.infos.items() if i.kind == "trainable" and n not in ckpt.tied]
        assert set(record["optim"]["state"]) == set(trainable)
        for name in trainable:
            want, got = ckpt.optimizer_state(name), record["optim"]["state"][name]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got[key], want[key]), (name, key)
        groups = {p: g for g in record["optim"]["param_groups"] for p in g["params"]}
        assert {groups[n]["weight_decay"] for n in trainable} == {0.0, 0.1}
        assert all(groups[n]["weight_decay"] == ckpt.optimizer_state(n)["weight_decay"] for n in trainable)
    assert record["train_state_step"] == (2 if layout == "torchtitan" else None)
    assert record["step_after"] == 3.0 and record["loss"] == record["loss"]  # a further step ran (finite loss)


def test_dcp_output_reads_back_bit_for_bit(tmp_path):
    """zeroio's own DCP output opens as a DCP checkpoint with the source's tensors and optimizer state."""
    zeroio.convert(ZERO3, tmp_path / "out", fmt="dcp", include_optimizer=True, dcp_layout="accelerate", progress=False)
    with zeroio.open(ZERO3) as src, zeroio.open(tmp_path / "out") as out:
        assert out.metadata.layout == "accelerate" and list(out) == list(src)
        for key in src:
            assert torch.equal(out[key], src[key]), key
        assert torch.equal(out.optimizer_state("norm.bias")["exp_avg"], src.optimizer_state("norm.bias")["exp_avg"])


def test_small_chunks_split_rows_and_output_is_atomic(tmp_path):
    """chunk_bytes bounds each stored chunk (row blocks); a second write to the same folder is refused."""
    zeroio.convert(ZERO3, tmp_path / "step-2", fmt="dcp", chunk_bytes=64, include_optimizer=True, progress=False)
    with zeroio.open(tmp_path / "step-2") as out, zeroio.open(ZERO3) as src:
        assert out.metadata.extra["files"] == ["__0_0.distcp"]
        for key in src:
            assert torch.equal(out[key], src[key]), key
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(out.optimizer_state("emb.weight")[key], src.optimizer_state("emb.weight")[key])
    with pytest.raises(OutputError, match="already"):
        zeroio.convert(ZERO3, tmp_path / "step-2", fmt="dcp", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]


def test_max_shard_size_splits_data_files_torch_reads(tmp_path):
    """max_shard_size bounds each data file (``__0_N.distcp``); torch's own reader (``dcp_to_torch_save``, no process
    group) and zeroio read the split checkpoint back bit for bit. exp_avg of emb.weight alone is 364 bytes."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "step-2"
    zeroio.convert(ZERO3, out, fmt="dcp", include_optimizer=True, max_shard_size=1000, chunk_bytes=256, progress=False)
    data = sorted(p.name for p in out.glob("*.distcp"))
    assert len(data) > 5 and data[:2] == ["__0_0.distcp", "__0_1.distcp"]
    # A file passes the bound only when one chunk alone does (its torch.save archive adds ~1 KB of framing).
    sizes = [(out / name).stat().st_size for name in data]
    assert all(size < 1000 + 2048 for size in sizes), sizes
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    with zeroio.open(ZERO3) as src, zeroio.open(out) as back:
        for key in src:
            assert torch.equal(whole[key], src[key]) and torch.equal(back[key], src[key]), key
        state = src.optimizer_state("emb.weight")
        assert torch.equal(whole["optimizer"]["state"]["emb.weight"]["exp_avg_sq"], state["exp_avg_sq"])


def test_exclude_frozen_progress_and_workers(tmp_path):
    """exclude_frozen leaves frozen parameters out, progress counts every byte of model tensors written, and the
    read-ahead threads change nothing in the files (workers=1 and workers=4 write the same bytes)."""
    calls: list[tuple[int, int]] = []
    one = zeroio.convert(ZERO3, tmp_path / "one", fmt="dcp", exclude_frozen=True, workers=1, chunk_bytes=64,
                         progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    four = zeroio.convert(ZERO3, tmp_path / "four", fmt="dcp", exclude_frozen=True, workers=4, chunk_bytes=64,
                          progress=False)  # fmt: skip
    with zeroio.open(ZERO3) as src, zeroio.open(tmp_path / "one") as back:
        frozen = [k for k, info in src.infos.items() if info.kind == "frozen"]
        assert frozen and list(back) == [k for k in src if k not in frozen]
        for key in back:
            assert torch.equal(back[key], src[key]), key
        kept = list(back)
        total = sum(src.infos[k].nbytes for k in kept)
    assert one.total_size == four.total_size == total == calls[-1][0] == calls[-1][1]
    assert len(calls) > len(kept) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    for name in (".metadata", "__0_0.distcp"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "four" / name).read_bytes()
