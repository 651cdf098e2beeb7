"""DeepSpeed's ``tests/unit/checkpoint/test_universal_checkpoint.py`` (``TestZeROUniversalCheckpointDP``,
``test_dp_world_size_2to2``), run against zeroio's ``ds_to_universal`` (imported by tests/deepspeed_unit_worker.py,
not collected).

Copied from deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (Apache-2.0, DeepSpeed Team),
with ``SimpleModel`` (tests/unit/simple_model.py) and ``compare_state_dicts`` / ``compare_opt_state_dicts``
(tests/unit/checkpoint/common.py). Changes: ``convert_to_universal`` is ``zeroio.zero_to_fp32.ds_to_universal``; the
baseline fixture and the test run in one process group, one after the other (DeepSpeed's harness runs them as two
jobs of 2 ranks); only the cases that run on CPU: fp32 (its bf16/fp16 cases need CUDA), ``use_torch_adam=True``
(DeepSpeed's fused Adam is a C++ op built on first use). Bodies are otherwise verbatim.
"""

# ruff: noqa: B006, C401, SIM118 - DeepSpeed's test code, kept verbatim

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.utils.torch import required_torch_version
from torch.utils._pytree import tree_map

from zeroio.zero_to_fp32 import ds_to_universal as convert_to_universal


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim, empty_grad=False, nlayers=1):
        super(SimpleModel, self).__init__()  # noqa: UP008
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim) for i in range(nlayers)])
        if empty_grad:
            self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        self.empty_grad = empty_grad

    def forward(self, x, y):
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, l in enumerate(self.linears):
                x = self.linears[i // 2](x) + l(x)
        return self.cross_entropy_loss(x, y)


def compare_state_dicts(state0, state1, expected_mismatch_keys=[]):
    key_set0 = set(k for k in state0.keys() if k not in expected_mismatch_keys)
    key_set1 = set(k for k in state1.keys() if k not in expected_mismatch_keys)
    assert key_set0 == key_set1, f"failure due to key mismatch {key_set0} != {key_set1}"

    for k in key_set0:
        s0 = state0[k]
        s1 = state1[k]
        if k in expected_mismatch_keys:
            continue
        if isinstance(s0, torch.Tensor) and isinstance(s1, torch.Tensor):
            assert id(s0) != id(s1), f"Comparing optimizer state tensor against itself: {id(s0)} <====> {id(s1)}"
            assert torch.equal(s0.to("cpu"), s1.to("cpu"))
        else:
            assert s0 == s1, f"failures with keys = {k}, {k}, values = {s0} and {s1}"


def compare_opt_state_dicts(state0, state1, expected_mismatch_keys=[]):
    for param_group0, saved_param_group1 in zip(state0["param_groups"], state1["param_groups"]):
        compare_state_dicts(param_group0, saved_param_group1, expected_mismatch_keys)

    assert "state" in state0
    assert "state" in state1
    assert len([state0["state"].keys()]) == len([state1["state"].keys()])

    for (k0, s0), (k1, s1) in zip(state0["state"].items(), state1["state"].items()):
        assert k0 == k1, f"failure due to key mismatch {k0} != {k1}"
        compare_state_dicts(s0, s1, expected_mismatch_keys)


def get_expected_mismatch_keys():
    # torch 1.2.* stores raw tensor id numbers in checkpoint state which leads to
    # false positive mismatches in checkpoint state comparisons.
    # Newer torch versions store tensor ids as 0, 1, 2, ...
    return [] if required_torch_version(min_version=1.4) else ["params"]


def maybe_step(t):
    return not torch.is_tensor(t) or (t.device.type == "cpu" and t.numel() == 1)


def gather_opt_state(optimizer_state):
    def gather_tensor(t):
        if maybe_step(t):
            return t
        else:
            buffer = [torch.zeros_like(t.flatten()) for _ in range(dist.get_world_size())]
            dist.all_gather(buffer, t.flatten())
            return torch.cat(buffer)

    return tree_map(gather_tensor, optimizer_state)


def remove_pad_in_opt_state(optimizer_state, num_params):
    def remove_pad(t):
        if maybe_step(t):
            return t
        else:
            return t[:num_params]

    return tree_map(remove_pad, optimizer_state)


CP_TAG = "test_tag"


def init_ds_engine(model, ds_config, use_torch_adam):
    if use_torch_adam:
        ds_optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        del ds_config["optimizer"]
        model, _, _, _ = deepspeed.initialize(config=ds_config, model=model, optimizer=ds_optimizer)
    else:
        model, _, _, _ = deepspeed.initialize(config=ds_config, model=model, model_parameters=model.parameters())

    return model


def random_dataloader(model, total_samples, hidden_dim, device, dtype):
    from deepspeed_unit_worker import random_dataloader as copied

    return copied(model, total_samples, hidden_dim, device, dtype=dtype)


def train_save_convert(ds_config, hidden_dim, load_optim, use_torch_adam, dtype, tmpdir, world_size):
    test_step = 8

    model = SimpleModel(hidden_dim, nlayers=2)
    model = init_ds_engine(model, ds_config, use_torch_adam)
    data_loader = random_dataloader(
        model=model, total_samples=test_step, hidden_dim=hidden_dim, device=model.device, dtype=dtype
    )
    for batch in data_loader:
        loss = model(batch[0], batch[1])
        model.backward(loss)
        model.step()

    if ds_config["zero_optimization"]["stage"] == 3:
        model.optimizer._set_fp32_optimizer_param_groups()
        sd = model.optimizer.optimizer.state_dict() if load_optim else None
        model.optimizer._clear_fp32_optimizer_param_groups()
    else:
        sd = model.optimizer.optimizer.state_dict() if load_optim else None  # noqa: F841

    client_state = {}
    client_state[UNIVERSAL_CHECKPOINT_INFO] = {}
    client_state["iteration"] = test_step
    model.save_checkpoint(tmpdir, tag=CP_TAG, client_state=client_state)

    cp_dir = os.path.join(tmpdir, CP_TAG)
    univ_cp_dir = f"{cp_dir}_universal"

    args = SimpleNamespace(
        input_folder=cp_dir,
        output_folder=univ_cp_dir,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )

    dist.barrier()
    if dist.get_rank() == 0:
        convert_to_universal(args)

    model_state = model.state_dict()
    optimizer_state = None
    if load_optim:
        if ds_config["zero_optimization"]["stage"] == 3:
            model.optimizer._set_fp32_optimizer_param_groups()
            optimizer_state = gather_opt_state(model.optimizer.optimizer.state_dict())
            model.optimizer._clear_fp32_optimizer_param_groups()
            update_gathered_stage3_optimizer(optimizer_state, model._get_zero_param_shapes(), world_size)
        else:
            optimizer_state = gather_opt_state(model.optimizer.optimizer.state_dict())

    if dist.get_rank() == 0:
        torch.save((model_state, optimizer_state), os.path.join(tmpdir, "baseline_state.pt"))

    dist.barrier()
    model.destroy()


def make_ds_config(zero_stage, dtype, sub_group_size):
    ds_config = {
        "train_batch_size": 8,
        "optimizer": {"type": "Adam"},
        "zero_optimization": {
            "stage": zero_stage,
        },
    }
    if dtype == torch.float16:
        ds_config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == torch.bfloat16:
        ds_config["bf16"] = {"enabled": True}
    if sub_group_size > 0:
        ds_config["zero_optimization"]["sub_group_size"] = sub_group_size
    return ds_config


# Stage3 use shard parameter, need to reorganize the optimizer parameters.
def update_gathered_stage3_optimizer(optimizer_state, param_shapes, world_size):
    for sub_group_id, group in enumerate(optimizer_state["param_groups"]):
        group["params"] = None

    new_state = {}
    for sub_group_id, sub_group_param_shape in enumerate(param_shapes):
        total_numel = optimizer_state["state"][sub_group_id]["exp_avg"].numel()
        assert total_numel % world_size == 0
        numel_per_rank = total_numel // world_size
        param_offset_in_current_rank = 0
        for param_name, param_shape in sub_group_param_shape.items():
            param_numel = param_shape.numel()
            param_partition_numel = math.ceil(param_numel / world_size)
            param_optimizer_tensor = {
                "exp_avg": torch.zeros(param_numel),
                "exp_avg_sq": torch.zeros(param_numel),
                "step": optimizer_state["state"][sub_group_id]["step"],
            }
            for key in ["exp_avg", "exp_avg_sq"]:
                write_offset = 0
                for rank in range(world_size):
                    offset = param_offset_in_current_rank + rank * numel_per_rank
                    length = min(param_partition_numel, param_numel - rank * param_partition_numel)
                    tmp = optimizer_state["state"][sub_group_id][key].narrow(0, offset, length)
                    param_optimizer_tensor[key].narrow(0, write_offset, length).copy_(tmp)
                    write_offset += length
            param_offset_in_current_rank += param_partition_numel
            new_state[param_name] = param_optimizer_tensor
    optimizer_state["state"] = new_state


def _run_test(tmpdir, dtype, ds_config, load_optim, use_torch_adam, world_size):
    hidden_dim = 10
    loaded_model_state, loaded_optimizer_state = torch.load(f"{tmpdir}/baseline_state.pt", weights_only=False)

    ds_config["checkpoint"] = {"load_universal": True}
    univ_model = SimpleModel(hidden_dim, nlayers=2)
    univ_model = init_ds_engine(univ_model, ds_config, use_torch_adam)
    univ_model.load_checkpoint(tmpdir, tag=f"{CP_TAG}_universal", load_optimizer_states=load_optim)

    model_state = univ_model.state_dict()
    compare_state_dicts(model_state, loaded_model_state)

    if load_optim:
        if ds_config["zero_optimization"]["stage"] == 3:
            univ_model.optimizer._set_fp32_optimizer_param_groups()
            optimizer_state = gather_opt_state(univ_model.optimizer.optimizer.state_dict())
            univ_model.optimizer._clear_fp32_optimizer_param_groups()
            update_gathered_stage3_optimizer(optimizer_state, univ_model._get_zero_param_shapes(), world_size)
        else:
            optimizer_state = gather_opt_state(univ_model.optimizer.optimizer.state_dict())
        # padding sizes may differ when dp sizes are different
        param_count = sum(p.numel() for p in univ_model.parameters())
        optimizer_state = remove_pad_in_opt_state(optimizer_state, param_count)
        loaded_optimizer_state = remove_pad_in_opt_state(loaded_optimizer_state, param_count)

        compare_opt_state_dicts(optimizer_state, loaded_optimizer_state, get_expected_mismatch_keys())

    # Run training again to verify that the optimizer has necessary states
    test_step = 8
    data_loader = random_dataloader(
        model=univ_model, total_samples=test_step, hidden_dim=hidden_dim, device=univ_model.device, dtype=dtype
    )
    for batch in data_loader:
        loss = univ_model(batch[0], batch[1])
        univ_model.backward(loss)
        univ_model.step()

    univ_model.destroy()


def test_dp_world_size_2to2(tmpdir, zero_stage, load_optim, sub_group_size, dtype=torch.float32, use_torch_adam=True):
    """The baseline fixture (``baseline_ws2``) then the test, with fresh configs as pytest's fixtures give."""
    train_save_convert(
        make_ds_config(zero_stage, dtype, sub_group_size), 10, load_optim, use_torch_adam, dtype, str(tmpdir), 2
    )
    _run_test(str(tmpdir), dtype, make_ds_config(zero_stage, dtype, sub_group_size), load_optim, use_torch_adam, 2)
