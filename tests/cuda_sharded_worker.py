"""One rank of the CUDA sharded-loading job (started by tests/test_cuda_sharded.py on a GPU host, not collected).

Usage: ``RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/cuda_sharded_worker.py SPEC.json``

SPEC is ``{"backend": ..., "cases": [...]}`` with tests/sharded_worker.py's case fields. Each case shards the
fixtures' TinyLM on a **CUDA** mesh (built on ``meta``, ``to_empty`` on the GPU, or built on the GPU), calls
``zeroio.load`` (``device="cuda"`` for ``meta``), and compares every local shard, copied back to the host, bit for
bit with the same model holding the engine's tensors sharded the same way on a **CPU** mesh (torch computes the
expected slices on the CPU). Ranks may share one GPU (gloo: NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import sharded_worker as sw
import torch
import torch.distributed as dist
from torch import nn

import zeroio


def cuda_model(case: dict[str, Any], world: int) -> nn.Module:
    build_on = case.get("build", "meta")
    with torch.device("meta" if build_on in ("meta", "to_empty") else "cuda"):
        model = sw.build(case)
    model = sw.shard(model, case, world, device="cuda")
    if build_on == "to_empty":
        model.to_empty(device="cuda")
    return model


def run_zero_init(case: dict[str, Any], world: int) -> dict[str, Any]:
    """A zero.Init model on CUDA: zeroio fills each rank's ds_tensor there; gathered, it equals the engine's."""
    import deepspeed

    deepspeed.init_distributed()  # adopts the process group already initialised
    dtype = torch.bfloat16 if case.get("dtype") == "bf16" else torch.float32
    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": world, "zero_optimization": {"stage": 3}},
                             dtype=dtype):  # fmt: skip
        model = sw.build(case)
    zeroio.load(case["src"], model)
    engine = torch.load(case["engine"], weights_only=True)
    params = list(model.parameters())
    devices = sorted({str(p.ds_tensor.device.type) for p in params})
    differ = []
    with deepspeed.zero.GatheredParameters(params):
        for name, p in model.state_dict(keep_vars=True).items():
            want = engine[name].to(p.dtype) if engine[name].is_floating_point() else engine[name]
            got = p.detach().cpu()
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                differ.append(name)
    return {"ok": True, "differ": differ, "devices": devices, "same_layout": True, "tied": True}


def run_case(case: dict[str, Any], world: int) -> dict[str, Any]:
    if case["shard"] == "zero_init":
        return run_zero_init(case, world)
    model = cuda_model(case, world)
    before = sw.describe(model)
    device = "cuda" if case.get("build", "meta") == "meta" else None
    zeroio.load(case["src"], model, device=device, **case.get("kwargs", {}))
    torch.cuda.synchronize()
    after = sw.describe(model)
    engine = torch.load(case["engine"], weights_only=True)
    want = sw.reference_model(case, world, engine).state_dict()  # sharded on a CPU mesh
    got = model.state_dict()
    differ, devices = [], set()
    for name, w in want.items():
        lg, lw = sw.local(got[name]), sw.local(w)
        devices.add(lg.device.type)
        host = lg.cpu()
        if host.dtype != lw.dtype or host.shape != lw.shape or not torch.equal(host, lw):
            differ.append(name)
    return {
        "ok": True,
        "differ": differ,
        "devices": sorted(devices),
        "same_layout": before == after,
        "tied": model.head.weight is model.emb.weight,
        "placements": sorted({str(v["placements"]) for v in after.values()}),
    }


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group(backend=spec["backend"], timeout=timedelta(seconds=120))
    torch.cuda.set_device(0)  # every rank on the first GPU: ranks may share it
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)
    for case in spec["cases"]:
        try:
            with sw.staging(case.get("staging_bytes")):
                outcome = run_case(case, world)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc)[:2000]}
        outcome.update(id=case["id"], rank=rank)
        print("ZEROIO-RESULT " + json.dumps(outcome), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
