"""DeepSpeed's own unit tests of its zero_to_fp32 functions, run against zeroio's drop-in (not collected: started by
tests/test_zero_to_fp32_dropin.py under DeepSpeed's launcher, ``DS_ACCELERATOR=cpu deepspeed --num_gpus 2
tests/deepspeed_unit_worker.py --out F``).

Copied from deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (Apache-2.0, DeepSpeed Team):

- ``tests/unit/checkpoint/test_convert_checkpoint.py``: ``TestCheckpointConvert.test_convert_zero_checkpoint_to_fp32_state_dict``
- ``tests/unit/checkpoint/test_shared_weights.py``: ``TestCheckpointSharedWeights.test_checkpoint_shared_weights``
- ``tests/unit/v1/zero/test_zero.py``: ``TestZeroToFP32.test_1_param_group`` and ``test_2_param_groups``, for
  ``zero_stage`` in (2, 3) and ``freeze_params`` in (True, False)
- ``tests/unit/checkpoint/test_universal_checkpoint.py``: 4 cases of ``test_dp_world_size_2to2``
  (tests/deepspeed_unit_universal.py)

Changes, each the least that runs them here: the import line (``zeroio.zero_to_fp32`` for
``deepspeed.utils.zero_to_fp32``); DeepSpeed's ``DistributedTest`` harness (a process per rank per test) is one
DeepSpeed launch that runs every case in turn, each in its own folder, recording pass or the exception; the
``"optimizer": {"type": "Adam"}`` configs get ``"torch_adam": true`` (DeepSpeed's fused Adam is a C++ op built on
first use, minutes on this CPU); ``random_dataloader`` and ``preferred_dtype`` are copied from ``tests/unit/``.
Test bodies are otherwise verbatim. Rank 0 writes ``{case: "ok" | "ExcType: message"}`` as JSON to ``--out``.
"""

# ruff: noqa: B008, PLC0206, PLR0402, SIM118 - DeepSpeed's test code, kept verbatim

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator

from zeroio.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

# --------------------------------------------------------------------------- tests/unit/common.py, simple_model.py


def preferred_dtype():
    if get_accelerator().is_bf16_supported():
        return torch.bfloat16
    elif get_accelerator().is_fp16_supported():
        return torch.float16
    else:
        return torch.float32


def random_dataset(total_samples, hidden_dim, device, dtype=preferred_dtype()):
    train_data = torch.randn(total_samples, hidden_dim, device=device, dtype=dtype)
    train_label = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    train_dataset = torch.utils.data.TensorDataset(train_data, train_label)
    return train_dataset


def random_dataloader(model, total_samples, hidden_dim, device, dtype=preferred_dtype()):
    batch_size = model.train_micro_batch_size_per_gpu()
    train_dataset = random_dataset(total_samples, hidden_dim, device, dtype=dtype)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=batch_size)
    return train_loader


# --------------------------------------------------------------------------- test_convert_checkpoint.py


class ModelWithSharedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer0 = nn.Linear(100, 100)
        self.layer1 = nn.Linear(200, 200)
        self.layer2 = nn.Linear(300, 300)
        # tie layer 1 and layer 2
        self.layer1.weight = self.layer2.weight


def test_convert_zero_checkpoint_to_fp32_state_dict(tmpdir):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3},
    }
    model = ModelWithSharedWeights()
    optimizer = torch.optim.Adam(model.parameters())

    deepspeed_engine, _, _, _ = deepspeed.initialize(
        config=config,
        model=model,
        optimizer=optimizer,
    )
    ds_save_dir = tmpdir / "checkpoint_ds"
    deepspeed_engine.save_checkpoint(ds_save_dir, tag="checkpoint")

    model = ModelWithSharedWeights()

    # save checkpoint
    fp32_save_dir = tmpdir / "checkpoint_fp32"
    convert_zero_checkpoint_to_fp32_state_dict(ds_save_dir, fp32_save_dir)

    # load state_dict from fp32 checkpoint
    state_dict = torch.load(fp32_save_dir / "pytorch_model.bin")

    # check shared tensor
    assert id(state_dict["layer1.weight"]) == id(state_dict["layer2.weight"])

    # load state_dict into model
    model.load_state_dict(state_dict, strict=True)


# --------------------------------------------------------------------------- test_shared_weights.py


def test_checkpoint_shared_weights(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2},
    }
    model = ModelWithSharedWeights()
    optimizer = torch.optim.Adam(model.parameters())

    deepspeed_engine, _, _, _ = deepspeed.initialize(
        config=config,
        model=model,
        optimizer=optimizer,
    )
    filename = tmp_path / "checkpoint.pt"
    deepspeed_engine.save_checkpoint(filename, tag="checkpoint")

    model = ModelWithSharedWeights()
    state_dict = get_fp32_state_dict_from_zero_checkpoint(filename, tag="checkpoint")
    model.load_state_dict(state_dict, strict=True)


# --------------------------------------------------------------------------- test_zero.py: TestZeroToFP32


def test_1_param_group(tmpdir, zero_stage, freeze_params):
    # XXX: ideally refactor with the 2_param_group test as 75% is the same
    # force all params to be partitioned by forcing threshold=0
    config_dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "zero_optimization": {
            "stage": zero_stage,
            "stage3_param_persistence_threshold": 0,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}

    class MyModel(torch.nn.Module):
        def __init__(self, hidden_dim, n_layers, freeze_params):
            super().__init__()
            # to reproduce https://github.com/deepspeedai/DeepSpeed/pull/1372 it is important that
            # the number of total elements is uneven:
            # (1) 4 layers of 3*(3+1)=12 elements each, 48 in total
            self.ll = torch.nn.ModuleList(torch.nn.Linear(hidden_dim, hidden_dim) for i in range(n_layers))
            # (2) the following adds 4+1=5 elements
            self.classifier = torch.nn.Linear(4, 1)
            # total 48+5=53 (uneven as desired) elements
            self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
            if freeze_params:
                self.ll[0].weight.requires_grad = False
                self.ll[0].bias.requires_grad = False

        def forward(self, x, y):
            hidden = x
            for l in self.ll:
                hidden = l(hidden)
            return self.cross_entropy_loss(hidden, y)

    hidden_dim = 3  # do not change

    world_size = dist.get_world_size()
    # we want at least 2x layers as there are gpus to trigger round_robin_fp16_groups reshuffle in zero2
    n_layers = world_size * 2
    model = MyModel(hidden_dim=hidden_dim, n_layers=n_layers, freeze_params=freeze_params)

    model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, model_parameters=model.parameters())
    # Flush zero stage 3 cache
    model.empty_partition_cache()

    data_loader = random_dataloader(model=model, total_samples=16, hidden_dim=hidden_dim, device=model.device)

    for i, batch in enumerate(data_loader):
        loss = model(batch[0], batch[1])
        model.backward(loss)
        model.step()

    model.empty_partition_cache()
    model.save_checkpoint(tmpdir)

    # make sure all sides saved it
    dist.barrier()

    orig_state_dict = {}
    for name, param in model.module.named_parameters():
        if zero_stage == 3:
            with deepspeed.zero.GatheredParameters(param, modifier_rank=None):
                orig_state_dict[name] = param.detach().cpu()
        else:
            orig_state_dict[name] = param.detach().cpu()

    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(model.parameters(), modifier_rank=None):
            fp32_model = load_state_dict_from_zero_checkpoint(model.module, tmpdir)
            fp32_state_dict = fp32_model.state_dict()
    else:
        fp32_model = load_state_dict_from_zero_checkpoint(model.module, tmpdir)
        fp32_state_dict = fp32_model.state_dict()

    # dump_state_dict(fp32_model)

    if dist.get_rank() == 0:
        for name in orig_state_dict.keys():
            # float() workaround for torch<1.6
            assert torch.allclose(orig_state_dict[name].float(), fp32_state_dict[name].float())

    model.destroy()


def test_2_param_groups(tmpdir, zero_stage, freeze_params):
    # TODO:
    # - need to test with multiple param groups
    # force all params to be partitioned by forcing threshold=0
    config_dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "zero_allow_untested_optimizer": 1,
        "zero_optimization": {
            "stage": zero_stage,
            "stage3_param_persistence_threshold": 0,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}

    class MyModel(torch.nn.Module):
        def __init__(self, hidden_dim, n_layers, freeze_params):
            super().__init__()
            self.ll = torch.nn.ModuleList(torch.nn.Linear(hidden_dim, hidden_dim) for i in range(n_layers))
            self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
            if freeze_params:
                self.ll[0].weight.requires_grad = False
                self.ll[0].bias.requires_grad = False

        def forward(self, x, y):
            hidden = x
            for l in self.ll:
                hidden = l(hidden)
            return self.cross_entropy_loss(hidden, y)

    hidden_dim = 3

    world_size = dist.get_world_size()
    n_layers = world_size * 2
    model = MyModel(hidden_dim=hidden_dim, n_layers=n_layers, freeze_params=freeze_params)

    optim_groups = [
        {
            "params": [l.weight for l in model.ll],
            "weight_decay": 0.01,
        },
        {"params": [l.bias for l in model.ll], "weight_decay": 0.0},
    ]
    optim = torch.optim.SGD(optim_groups, lr=0.1)

    model, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=optim,
        config=config_dict,
    )
    model.empty_partition_cache()

    data_loader = random_dataloader(model=model, total_samples=16, hidden_dim=hidden_dim, device=model.device)

    for i, batch in enumerate(data_loader):
        loss = model(batch[0], batch[1])
        model.backward(loss)
        model.step()

    model.empty_partition_cache()
    model.save_checkpoint(tmpdir)

    # make sure all sides saved it
    dist.barrier()

    # dump_state_dict(model)

    orig_state_dict = {}
    for name, param in model.module.named_parameters():
        if zero_stage == 3:
            with deepspeed.zero.GatheredParameters(param, modifier_rank=None):
                orig_state_dict[name] = param.detach().cpu()
        else:
            orig_state_dict[name] = param.detach().cpu()

    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(model.parameters(), modifier_rank=None):
            fp32_model = load_state_dict_from_zero_checkpoint(model.module, tmpdir)
            fp32_state_dict = fp32_model.state_dict()
    else:
        fp32_model = load_state_dict_from_zero_checkpoint(model.module, tmpdir)
        fp32_state_dict = fp32_model.state_dict()

    # dump_state_dict(fp32_model)

    if dist.get_rank() == 0:
        for name in orig_state_dict.keys():
            # float() workaround for torch<1.6
            assert torch.allclose(orig_state_dict[name].float(), fp32_state_dict[name].float())


# --------------------------------------------------------------------------- the harness


def cases():
    yield "test_convert_checkpoint", lambda d: test_convert_zero_checkpoint_to_fp32_state_dict(d)
    yield "test_shared_weights", lambda d: test_checkpoint_shared_weights(d)
    for test in (test_1_param_group, test_2_param_groups):
        for zero_stage in (2, 3):
            for freeze_params in (True, False):
                name = f"TestZeroToFP32.{test.__name__}[{zero_stage}-{freeze_params}]"
                yield name, lambda d, t=test, z=zero_stage, f=freeze_params: t(d, z, f)
    from deepspeed_unit_universal import test_dp_world_size_2to2

    for zero_stage, load_optim, sub_group_size in ((1, True, -1), (1, False, -1), (3, True, -1), (3, True, 100)):
        name = f"TestZeROUniversalCheckpointDP.test_dp_world_size_2to2[fp32-{zero_stage}-torch_adam-{load_optim}-{sub_group_size}]"
        yield name, lambda d, z=zero_stage, o=load_optim, g=sub_group_size: test_dp_world_size_2to2(d, z, o, g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    root = Path(args.out).parent / "cases"
    results = {}
    for index, (name, run) in enumerate(cases()):
        folder = root / str(index)  # the same path on every rank, as DeepSpeed's tmpdir fixture gives
        if rank == 0:
            folder.mkdir(parents=True)
        dist.barrier()
        try:
            run(folder)
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded for the test to show
            results[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip DeepSpeed's CPU comm teardown (tests/reshard_worker.py: exit_skipping_teardown)


if __name__ == "__main__":
    tempfile.tempdir = None
    main()
