"""One rank of the sharded-loading job (started by tests/test_sharded_load.py, not collected).

Usage: ``RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/sharded_worker.py SPEC.json``

SPEC is ``{"cases": [{"id", "src", "shard", "build", "dtype", ...}]}``. For each case this rank builds the fixtures'
TinyLM, shards it (FSDP2, tensor parallel, 2-D, zero.Init) as a user's hook would, calls ``zeroio.load`` and
compares its local shards with those of a reference model: the same model holding the engine's tensors
(``expected/engine.pt``) loaded by torch before being sharded the same way, so torch itself computes the expected
slices. Each case prints one line ``ZEROIO-RESULT {json}``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zeroio

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _generate() -> Any:
    spec = importlib.util.spec_from_file_location("fixtures_generate", FIXTURES / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fixtures_generate"] = module
    spec.loader.exec_module(module)
    return module


GEN = _generate()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def io_counter(name: str = "rchar") -> int:
    """This process's /proc/self/io counter: ``rchar``, bytes read through read()/pread() so far (page cache hits
    included), or ``syscr``, read system calls made."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {name}")


def rchar() -> int:
    return io_counter("rchar")


def build(case: dict) -> nn.Module:
    dims = dict(case.get("dims") or {})
    if case.get("mismatch_rank") in (dist.get_rank(), "all"):
        dims["hidden"] = 6  # this rank's model differs from the checkpoint: mlp_in has 6 rows, not 5
    model = GEN._build_model({})
    if dims:
        model = type(model)(**dims)
    if case.get("dtype"):
        model = model.to(DTYPES[case["dtype"]])
    return model


def shard(model: nn.Module, case: dict, world: int, device: str = "cpu") -> nn.Module:
    """The user's sharding hook for each case kind, on a mesh of ``device`` (tests/cuda_sharded_worker.py: cuda)."""
    kind = case["shard"]
    if kind == "fsdp2":
        mesh = init_device_mesh(device, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case.get("mp") else MixedPrecisionPolicy()
        for block in (model.frozen, model.mlp_in, model.mlp_out):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif kind in ("tp", "tp_rowemb"):
        mesh = init_device_mesh(device, (world,))
        _tp(model, mesh, kind)
    elif kind == "2d":
        mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("dp", "tp"))
        _tp(model, mesh["tp"], "tp")
        for block in (model.mlp_in, model.mlp_out):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif kind == "hsdp":  # FSDP2 on a 2-D mesh: replicated over "replicate", sharded over "shard"
        mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for block in (model.mlp_in, model.mlp_out):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "3d":  # HSDP over tensor parallel: a (2, 1, 2) mesh of 4 ranks, (2, 2, 2) of 8
        mesh = init_device_mesh(device, (2, world // 4, 2), mesh_dim_names=("replicate", "shard", "tp"))
        _tp(model, mesh["tp"], "tp")
        for block in (model.mlp_in, model.mlp_out):
            fully_shard(block, mesh=mesh["replicate", "shard"])
        fully_shard(model, mesh=mesh["replicate", "shard"])
    elif kind == "none":
        pass
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        raise ValueError(kind)
    return model


def _tp(model: nn.Module, mesh: Any, kind: str) -> None:
    plan = {
        "mlp_in": ColwiseParallel(),
        "mlp_out": RowwiseParallel(),
        "frozen": ColwiseParallel(),
        # Embedding: Colwise shards the embedding dim (Shard(1)), Rowwise the vocabulary (Shard(0)).
        "emb": RowwiseParallel() if kind == "tp_rowemb" else ColwiseParallel(),
    }
    parallelize_module(model, mesh, plan)
    model.head.weight = model.emb.weight  # the tie, as the user's hook re-ties it
    # Replicate the rest (norm), as a user makes every parameter a DTensor on the mesh.
    for name in ("weight", "bias"):
        p = getattr(model.norm, name)
        setattr(model.norm, name, nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)))


def make_model(case: dict, world: int) -> nn.Module:
    build_on = case.get("build", "normal")
    if build_on == "meta" or build_on == "to_empty":
        with torch.device("meta"):
            model = build(case)
        model = shard(model, case, world)
        if build_on == "to_empty":
            model.to_empty(device="cpu")
        return model
    model = build(case)
    return shard(model, case, world)


def reference_model(case: dict, world: int, engine: dict[str, torch.Tensor]) -> nn.Module:
    ref = GEN._build_model({})
    if case.get("dims"):
        ref = type(ref)(**case["dims"])
    ref.load_state_dict(engine)  # the engine's fp32 tensors (DCP: the live run's), cast below as torch casts
    if case.get("dtype_ref", case.get("dtype")):
        ref = ref.to(DTYPES[case.get("dtype_ref", case.get("dtype"))])
    return shard(ref, case, world)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def describe(model: nn.Module, dtypes: bool = True) -> dict[str, Any]:
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out[name] = {
            "type": type(t).__name__,
            "placements": [str(p) for p in t.placements] if isinstance(t, DTensor) else None,
            "local_shape": list(local(t).shape),
            "dtype": str(local(t).dtype) if dtypes else None,
        }
    return out


def run_zero_init(case: dict, rank: int, world: int) -> dict[str, Any]:
    """A model built under deepspeed.zero.Init: zeroio fills each rank's ds_tensor; GatheredParameters then
    yields the engine's tensors (cast to the model's dtype)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group already initialised
    dtype = DTYPES[case.get("dtype", "fp32")]
    config = {"train_batch_size": world, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype):
        model = build(case)
    params = dict(model.named_parameters())
    before = {n: (tuple(p.shape), tuple(p.ds_tensor.shape), str(p.ds_tensor.dtype)) for n, p in params.items()}
    read0 = rchar()
    with zeroio.open(case["src"], **case.get("open", {})) as ckpt:
        opened = rchar()
        report = zeroio.load(ckpt, model)
        loaded = rchar()
    after = {n: (tuple(p.shape), tuple(p.ds_tensor.shape), str(p.ds_tensor.dtype)) for n, p in params.items()}
    engine = torch.load(case["engine"], weights_only=True)
    differ = []
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, p in model.state_dict(keep_vars=True).items():
            want = engine[name].to(p.dtype) if engine[name].is_floating_point() else engine[name]
            if p.dtype != want.dtype or p.shape != want.shape or not torch.equal(p.detach(), want):
                differ.append(name)
    local_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params.values())
    return {
        "ok": True,
        "differ": differ,
        "same_layout": before == after,
        "tied": model.head.weight is model.emb.weight,
        "missing": list(report.missing_keys),
        "placements": [],
        "open_bytes": opened - read0,
        "load_bytes": loaded - opened,
        "local_bytes": local_bytes,
    }


def _hf_model(case: dict, world: int, device: str, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """transformers' model from the case's config folder (holding ``state`` if given, loaded by torch), then each
    decoder layer and the root sharded by FSDP2."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(case["hf_config"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[case.get("dtype", "fp32")])
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        model.reference_unused = [*missing, *unexpected]
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run_hf_case(case: dict, rank: int, world: int) -> dict[str, Any]:
    """Another framework's checkpoint (verl, Megatron with names="hf") into FSDP2-sharded transformers model built
    on the meta device; the reference is the framework's full state loaded by torch into the same model, sharded
    the same way."""
    model = _hf_model(case, world, "meta")
    report = zeroio.load(case["src"], model, **case.get("open", {}))
    engine = (
        load_file(case["engine"]) if case["engine"].endswith(".safetensors")
        else torch.load(case["engine"], weights_only=True)
    )  # fmt: skip
    ref = _hf_model(case, world, "cpu", engine)
    want, got = ref.state_dict(), model.state_dict()
    differ = [n for n in engine if not torch.equal(local(got[n]), local(want[n]))]
    return {
        "ok": True,
        "differ": differ,
        "compared": len(engine),
        "sharded": sum(isinstance(t, DTensor) for t in got.values()),
        "missing": list(report.missing_keys),
        "meta": sorted(report.meta_keys),
        "reference_unused": ref.reference_unused,
    }


def run_case(case: dict, rank: int, world: int) -> dict[str, Any]:
    if case["shard"] == "zero_init":
        return run_zero_init(case, rank, world)
    if case.get("hf_config"):
        return run_hf_case(case, rank, world)
    src = case["src"]
    engine = torch.load(case["engine"], weights_only=True)
    if case.get("save_dcp"):  # torch writes the source: the reference model, sharded as the case shards it
        import torch.distributed.checkpoint as dcp

        dcp.save(reference_model(case, world, engine).state_dict(), checkpoint_id=src)
        dist.barrier()
    model = make_model(case, world)
    dtypes = "dtype_ref" not in case  # a load with dtype= changes dtypes only
    before = describe(model, dtypes)
    kwargs = case.get("kwargs", {})
    started = time.monotonic()
    read0 = rchar()
    with zeroio.open(src, **case.get("open", {})) as ckpt:
        opened, calls = rchar(), io_counter("syscr")
        report = zeroio.load(ckpt, model, **kwargs)
        loaded, calls = rchar(), io_counter("syscr") - calls
    seconds = time.monotonic() - started
    after = describe(model, dtypes)
    ref = reference_model(case, world, engine)
    want = ref.state_dict()
    got = model.state_dict()
    differ = []
    local_bytes = 0
    for name, w in want.items():
        g = got[name]
        lw, lg = local(w), local(g)
        if lg.dtype != lw.dtype or lg.shape != lw.shape or not torch.equal(lg, lw):
            differ.append(name)
    seen = set()
    for name, g in model.state_dict(keep_vars=True).items():  # the model's own tensors: ties counted once
        if id(g) not in seen:
            seen.add(id(g))
            local_bytes += local(g).numel() * local(g).element_size()
    tied = model.head.weight is model.emb.weight
    result = {
        "ok": True,
        "differ": differ,
        "same_layout": before == after,
        "layout_before": before if before != after else None,
        "layout_after": after if before != after else None,
        "tied": tied,
        "placements": sorted({str(v["placements"]) for v in after.values()}),
        "mlp_in_local_rows": after["mlp_in.weight"]["local_shape"][0],
        "missing": list(report.missing_keys),
        "meta": list(report.meta_keys),
        "open_bytes": opened - read0,
        "load_bytes": loaded - opened,
        "load_reads": calls,
        "local_bytes": local_bytes,
        "seconds": seconds,
    }
    if case.get("forward"):
        ids = torch.arange(6).remainder(13).view(2, 3)
        model.scratch = torch.zeros(3)  # non-persistent buffer: never in a checkpoint
        out = model(ids)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        ref.calls.zero_()
        want_out = ref(ids)
        want_out = want_out.full_tensor() if isinstance(want_out, DTensor) else want_out
        result["forward_equal"] = bool(torch.equal(out, want_out))
    return result


@contextmanager
def staging(nbytes: int | None) -> Iterator[None]:
    """A case's ``staging_bytes``: small staging chunks, so the fixtures' small tensors cross chunk boundaries."""
    if nbytes is None:
        yield
        return
    os.environ["ZEROIO_STAGING_BYTES"] = str(nbytes)
    try:
        yield
    finally:
        del os.environ["ZEROIO_STAGING_BYTES"]


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("docs"):  # docs/loading.md's examples, verbatim, in one namespace: the first one starts the group
        namespace = {"MyModel": type(GEN._build_model({}))}
        for title, block in spec["docs"]:
            exec(compile(block, f"docs/loading.md[{title}]", "exec"), namespace)  # noqa: S102 - the docs' examples
        print("ZEROIO-RESULT " + json.dumps({"id": "docs", "ok": True, "rank": dist.get_rank()}), flush=True)
    else:
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=float(spec.get("timeout", 60))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # ranks build different random weights: only the load makes them agree
    for case in spec["cases"]:
        try:
            with staging(case.get("staging_bytes")):
                outcome = run_case(case, rank, world)
        except zeroio.errors.ZeroIOError as exc:
            outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc), "error_rank": exc.rank}
        outcome["id"] = case["id"]
        outcome["rank"] = rank
        print("ZEROIO-RESULT " + json.dumps(outcome), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
