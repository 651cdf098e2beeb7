"""DeepSpeed worker for tests/test_universal_write.py: resume universal checkpoints at this world size.

Run by DeepSpeed's launcher (``DS_ACCELERATOR=cpu deepspeed --num_gpus M tests/universal_worker.py --out F
NAME=FIXTURE:STAGE:DIR ...``). For each item it builds the fixtures' TinyLM with fixture ``FIXTURE``'s config
(``fixtures/generate.py``) at ZeRO stage ``STAGE``, loads ``DIR`` with ``"checkpoint": {"load_universal": true}``
and records the loaded fp32 master weights and Adam moments (``reshard_worker.snapshot``), or the error
``load_checkpoint`` raised. Rank 0 writes
everything to ``F`` (torch.save).
"""

from __future__ import annotations

import argparse

from reshard_worker import exit_skipping_teardown, load_generate, snapshot


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("loads", nargs="+", help="NAME=FIXTURE:STAGE:DIR")
    args = parser.parse_args()

    import deepspeed
    import torch

    gen = load_generate()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results: dict[str, object] = {"world_size": torch.distributed.get_world_size()}
    for item in args.loads:
        name, spec = item.split("=", 1)
        fixture, stage, folder = spec.split(":", 2)
        cfg = dict(gen.FIXTURES[fixture], stage=int(stage))
        torch.manual_seed(1234)
        model = gen._build_model(cfg)
        config = gen._ds_config(cfg)
        config["checkpoint"] = {"load_universal": True}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=gen._param_groups(model), config=config)
        try:
            engine.load_checkpoint(folder)
        except Exception as exc:  # noqa: BLE001 - recorded: the test asserts what DeepSpeed refuses
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            results[name] = snapshot(engine)
        engine.destroy()
    torch.distributed.barrier()
    if rank == 0:
        torch.save(results, args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
