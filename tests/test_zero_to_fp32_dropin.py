"""zeroio.zero_to_fp32, the drop-in for ``deepspeed.utils.zero_to_fp32``: DeepSpeed 0.19.8's own functions on the
shipped fixtures give the same keys, dtypes, values, tied tensors and output files, except where DeepSpeed is wrong
(docs/migrating.md); DeepSpeed's own unit tests of these functions pass against it (tests/deepspeed_unit_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from deepspeed.utils import zero_to_fp32 as deepspeed_tool
from fixture_data import FIXTURES
from safetensors.torch import load_file

from zeroio import errors
from zeroio.zero_to_fp32 import (
    LazyTensor,
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    to_torch_tensor,
)

ROOT = Path(__file__).resolve().parent.parent
WITH_REFERENCE = sorted(p.parent.parent.name for p in FIXTURES.glob("*/expected/zero_to_fp32.pt"))
ZERO1 = ("z1_ws2_fp32", "z1_ws3_bf16")  # DeepSpeed's tool drops their frozen parameters


def assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Same keys, dtypes and values bit for bit, and the same names sharing one tensor."""
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    for a, first in theirs.items():
        for b, second in theirs.items():
            assert (first is second) == (ours[a] is ours[b]), (a, b)


@pytest.mark.parametrize("fixture", WITH_REFERENCE)
def test_state_dict_is_deepspeeds(fixture):
    """get_fp32_state_dict_from_zero_checkpoint returns expected/zero_to_fp32.pt (DeepSpeed's own result): fp32
    masters, frozen parameters in the training dtype, fp32 buffers; on ZeRO-1 also the frozen parameters
    DeepSpeed drops, as the engine held them (expected/engine.pt)."""
    theirs = torch.load(FIXTURES / fixture / "expected" / "zero_to_fp32.pt", weights_only=True)
    ours = get_fp32_state_dict_from_zero_checkpoint(FIXTURES / fixture)
    if fixture in ZERO1:
        engine = torch.load(FIXTURES / fixture / "expected" / "engine.pt", weights_only=True)
        for name in ("frozen.weight", "frozen.bias"):
            assert torch.equal(ours.pop(name), engine[name]) and name not in theirs
    assert_same(ours, theirs)


@pytest.mark.parametrize("fixture", ["z3_ws2_bf16", "z2_ws2_bf16"])
def test_lazy_mode_and_to_torch_tensor_are_deepspeeds(fixture):
    """lazy_mode=True, exclude_frozen_parameters and to_torch_tensor(dtype=, return_empty_tensor=) against
    DeepSpeed's functions, live."""
    path = FIXTURES / fixture
    lazy = get_fp32_state_dict_from_zero_checkpoint(path, lazy_mode=True, exclude_frozen_parameters=True)
    reference = deepspeed_tool.get_fp32_state_dict_from_zero_checkpoint(
        str(path), lazy_mode=True, exclude_frozen_parameters=True
    )
    assert all(isinstance(v, LazyTensor) for v in lazy.values()) and lazy["head.weight"] is lazy["emb.weight"]
    assert sorted(lazy) == sorted(reference) and "frozen.weight" not in lazy
    for dtype in (None, "bf16", torch.float16):
        assert_same(to_torch_tensor(lazy, dtype=dtype), deepspeed_tool.to_torch_tensor(reference, dtype=dtype))
    empty = to_torch_tensor(lazy, return_empty_tensor=True, dtype="bf16")
    assert {k: (v.shape, v.dtype) for k, v in empty.items()} == {
        k: (v.shape, v.dtype)
        for k, v in deepspeed_tool.to_torch_tensor(reference, return_empty_tensor=True, dtype="bf16").items()
    }
    with pytest.raises(ValueError, match="Unsupported output dtype 'int8'"):
        to_torch_tensor(lazy, dtype="int8")


@pytest.mark.parametrize("max_shard_size", ["5GB", 500, None])
def test_torch_files_are_deepspeeds(tmp_path, max_shard_size):
    """convert_zero_checkpoint_to_fp32_state_dict writes DeepSpeed's file names, index and tensors: every floating
    tensor fp32, frozen bf16 parameters included; tied names share one tensor in the pickle."""
    src = FIXTURES / "z3_ws2_bf16"
    convert_zero_checkpoint_to_fp32_state_dict(src, tmp_path / "ours", max_shard_size=max_shard_size)
    deepspeed_tool.convert_zero_checkpoint_to_fp32_state_dict(
        str(src), str(tmp_path / "theirs"), max_shard_size=max_shard_size
    )
    names = sorted(os.listdir(tmp_path / "theirs"))
    assert sorted(os.listdir(tmp_path / "ours")) == names
    ours: dict[str, torch.Tensor] = {}
    theirs: dict[str, torch.Tensor] = {}
    for name in names:
        if name.endswith(".json"):
            a, b = (json.loads((tmp_path / d / name).read_text()) for d in ("ours", "theirs"))
            assert sorted(a["weight_map"]) == sorted(b["weight_map"])
            continue
        ours |= torch.load(tmp_path / "ours" / name, weights_only=True)
        theirs |= torch.load(tmp_path / "theirs" / name, weights_only=True)
    assert_same(ours, theirs)
    assert {v.dtype for v in ours.values() if v.is_floating_point()} == {torch.float32}


def test_safetensors_where_deepspeed_fails_on_tied_weights(tmp_path):
    """safe_serialization=True: DeepSpeed's save_file refuses the tied head/embedding; the drop-in writes
    model.safetensors with the tensors DeepSpeed's torch output holds (the alias stored once)."""
    src = FIXTURES / "z2_ws2_bf16"
    with pytest.raises(RuntimeError, match="Some tensors share memory"):
        deepspeed_tool.convert_zero_checkpoint_to_fp32_state_dict(
            str(src), str(tmp_path / "t"), safe_serialization=True
        )
    convert_zero_checkpoint_to_state_dict(src, tmp_path / "ours", dtype="bf16", safe_serialization=True)
    assert sorted(os.listdir(tmp_path / "ours")) == ["model.safetensors"]
    reference = deepspeed_tool.to_torch_tensor(
        deepspeed_tool.get_fp32_state_dict_from_zero_checkpoint(str(src), lazy_mode=True), dtype="bf16"
    )
    written = load_file(tmp_path / "ours" / "model.safetensors")
    assert sorted(written) == sorted(set(reference) - {"head.weight"})
    assert all(torch.equal(written[k], reference[k]) and written[k].dtype == reference[k].dtype for k in written)


def test_existing_output_folder_keeps_its_other_files(tmp_path):
    """As DeepSpeed's makedirs(exist_ok=True): an existing folder's other files stay; same-named files are replaced."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "pytorch_model.bin").write_text("stale")
    convert_zero_checkpoint_to_fp32_state_dict(FIXTURES / "z3_ws2_fp32", out)
    assert sorted(os.listdir(out)) == ["config.json", "pytorch_model.bin"]
    assert (out / "config.json").read_text() == "{}"
    expected = torch.load(FIXTURES / "z3_ws2_fp32" / "expected" / "zero_to_fp32.pt", weights_only=True)
    assert_same(torch.load(out / "pytorch_model.bin", weights_only=True), expected)


def test_load_state_dict_from_zero_checkpoint_moves_and_fills_the_model():
    """The model comes back on the CPU holding the checkpoint's weights (strict=False, as DeepSpeed loads)."""
    reference = deepspeed_tool.get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / "z3_ws2_fp32"), "global_step1")
    holder = torch.nn.Module()
    holder.emb = torch.nn.Embedding(*reference["emb.weight"].shape)
    filled = load_state_dict_from_zero_checkpoint(holder, FIXTURES / "z3_ws2_fp32", tag="global_step1")
    assert filled is holder
    with pytest.raises(errors.CheckpointNotFoundError):
        get_fp32_state_dict_from_zero_checkpoint(FIXTURES / "z3_ws2_fp32", tag="global_step9")
    assert torch.equal(filled.emb.weight.detach(), reference["emb.weight"])


@pytest.mark.slow
def test_deepspeeds_own_unit_tests_pass_against_the_drop_in(tmp_path):
    """DeepSpeed's unit tests of these functions (test_convert_checkpoint.py, test_shared_weights.py, test_zero.py's
    TestZeroToFP32, test_universal_checkpoint.py's 2-to-2 cases on CPU: 14 cases, 2 CPU ranks, ~70 s) pass with
    zeroio.zero_to_fp32 imported in place of DeepSpeed's modules."""
    from test_reshard import _free_ports

    out = tmp_path / "results.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONPATH=str(ROOT))
    cmd = [
        "deepspeed", "--master_port", str(_free_ports(1)[0]), "--num_gpus", "2", "--num_nodes", "1",
        str(ROOT / "tests" / "deepspeed_unit_worker.py"), "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=ROOT / "tests", timeout=600)
    assert proc.returncode == 0 and out.is_file(), (proc.stdout + proc.stderr)[-6000:]
    results = json.loads(out.read_text())
    assert len(results) == 14
    assert {name: outcome for name, outcome in results.items() if outcome != "ok"} == {}
