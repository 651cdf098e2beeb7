"""One rank of an FSDP2 job resuming from zeroio's DCP output (tests/test_dcp_write.py).

``tests/dcp_resume_worker.py LAYOUT=DIR ... OUT`` on 2 ranks (torchrun, or its environment variables): for each ``LAYOUT=DIR``
(torchtitan or accelerate) it builds the fixtures' TinyLM, shards it with ``fully_shard`` on a CPU mesh, loads the
checkpoint with ``torch.distributed.checkpoint.load`` plus ``set_model_state_dict``/``set_optimizer_state_dict``,
records the full model and optimizer state (rank 0 saves them to ``OUT/<layout>.pt``), then takes one more
training step and records its loss and the new step.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_checks import _generate


def resume(layout: str, folder: Path, mesh: object) -> dict:
    generate = _generate()
    torch.manual_seed(123)  # different from the checkpoint's values: loading must overwrite every one
    model = generate._build_model({})
    fully_shard(model.mlp_in, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(generate._param_groups(model), lr=0.05)
    flat = StateDictOptions(flatten_optimizer_state_dict=layout == "torchtitan")
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optim, options=flat)
    if layout == "torchtitan":
        state = {**msd, "optimizer": osd, "train_state": {"step": 0}}
        dcp.load(state, checkpoint_id=str(folder))
        step = state["train_state"]["step"]
    else:
        dcp.load({"model": msd}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
        dcp.load({"optimizer": osd}, checkpoint_id=str(folder / "optimizer_0"))
        step = None
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, optim, osd, options=flat)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    record = copy.deepcopy(  # copies: the step below changes the live tensors (the `calls` buffer, the moments)
        {
            "model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, optim, options=full),
            "train_state_step": step,
        }
    )
    ids = torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(7 + dist.get_rank()))
    loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 13), ids.reshape(-1))
    loss.backward()
    optim.step()
    record["loss"] = float(loss)
    record["step_after"] = float(next(iter(optim.state.values()))["step"])
    return record


def main() -> None:
    *pairs, out = sys.argv[1:]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for pair in pairs:
        layout, folder = pair.split("=", 1)
        record = resume(layout, Path(folder), mesh)
        if dist.get_rank() == 0:
            torch.save(record, Path(out) / f"{layout}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
