"""DeepSpeed worker for tests/test_reshard.py: resume ZeRO-3 checkpoints at this world size and take one step.

Run by torchrun or DeepSpeed's launcher (``DS_ACCELERATOR=cpu deepspeed --num_gpus M tests/reshard_worker.py
--out F NAME=DIR ...``). For each ``NAME=DIR`` it builds the fixtures' TinyLM with the fixtures' ZeRO-3 fp32 config
(imported from ``fixtures/generate.py``), loads ``DIR`` with ``engine.load_checkpoint`` (``NAME`` starting with
``universal`` loads a DeepSpeed universal checkpoint), records the loaded fp32 weights and Adam moments, trains
one step on a fixed per-rank batch and records them again (``NAME`` ending in ``_subgroupsK`` sets ZeRO-3's
``sub_group_size`` to K). Rank 0 writes everything to ``F`` (torch.save).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = "z3_ws2_fp32"  # the source checkpoint's configuration: ZeRO-3, fp32, two param groups


def load_generate():
    """fixtures/generate.py as a module (TinyLM, its param groups and the DeepSpeed config)."""
    spec = importlib.util.spec_from_file_location("fixtures_generate", ROOT / "fixtures" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(rank: int):
    """The micro-batch rank ``rank`` trains on in the resumed step (the test rebuilds the same batches)."""
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, 13, (2, 6), generator=generator)


def loss_fn(logits, ids):
    """The fixtures' loss (fixtures/generate.py trains with it)."""
    import torch

    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 13), ids.roll(1, dims=1).reshape(-1))


def snapshot(engine):
    """Full fp32 master weights and Adam moments of every trainable parameter, frozen params and buffers."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}, "global_steps": engine.global_steps}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            out["weights"][name] = safe_get_full_fp32_param(param).detach().clone().cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                out[key][name] = safe_get_full_optimizer_state(param, key).detach().clone().cpu()
        else:
            with deepspeed.zero.GatheredParameters([param]):
                out["weights"][name] = param.detach().clone().cpu()
    for name, buf in engine.module.named_buffers():
        out["weights"][name] = buf.detach().clone().cpu()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("loads", nargs="+", help="NAME=DIR")
    args = parser.parse_args()

    import deepspeed
    import torch

    gen = load_generate()
    cfg = gen.FIXTURES[FIXTURE]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {"world_size": torch.distributed.get_world_size()}
    for item in args.loads:
        name, folder = item.split("=", 1)
        torch.manual_seed(1234)
        model = gen._build_model(cfg)
        config = gen._ds_config(cfg)
        if name.startswith("universal"):
            config["checkpoint"] = {"load_universal": True}
        if "_subgroups" in name:  # e.g. zeroio_subgroups40: ZeRO-3 sub_group_size 40
            config["zero_optimization"]["sub_group_size"] = int(name.rsplit("_subgroups", 1)[1])
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=gen._param_groups(model), config=config)
        engine.load_checkpoint(folder)
        loaded = snapshot(engine)
        ids = batch(rank)
        engine.backward(loss_fn(engine(ids), ids))
        engine.step()
        results[name] = {"loaded": loaded, "stepped": snapshot(engine)}
        engine.destroy()
    torch.distributed.barrier()
    if rank == 0:
        torch.save(results, args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def exit_skipping_teardown() -> None:
    """End a DeepSpeed job's rank once every rank is done and rank 0 has saved, without the interpreter's teardown:
    there DeepSpeed's CPU shared-memory comm op (deepspeed_shm_comm_op) once aborted a rank ("terminate called
    without an active exception", SIGABRT) on a loaded 2-core machine, failing a job whose results were complete."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
