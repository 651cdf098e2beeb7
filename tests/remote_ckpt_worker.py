"""Write a ZeRO-3 fp32 checkpoint of ~36 MB with DeepSpeed on CPU (world size 1), for tests/test_remote_*.py.

Run as a script with the torch.distributed variables set (tests/s3_server.py ``write_big_checkpoint`` does it):
three 1024x1024 linear layers (12 MB of fp32 master weights) and AdamW, so the Adam moments are two thirds of
the optimizer file's bytes.
"""

from __future__ import annotations

import sys

import deepspeed
import torch


def main(out_dir: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(3)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, 1024)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out_dir, tag="step1")


if __name__ == "__main__":
    main(sys.argv[1])
