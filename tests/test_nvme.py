"""ZeRO-3 with the optimizer state swapped to NVMe: fixtures/layouts/nvme_z3_ws2_bf16 (fixtures/generate_nvme.py).

DeepSpeed keeps each swapped sub-group's fp32 master partition and Adam moments in raw swap files under
``<nvme_path>/zero_stage_3/optimizer/rank{N}/``, saves empty tensors in their place in the rank files, and copies
the swap folder into ``<tag>/offloaded_tensors/rank{NN}/``, which zeroio reads. The fixture was trained with
``nvme_path: "nvme"`` from inside its folder, so the live swap folder sits beside ``global_step2/`` too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from layout_checks import (
    assert_convert_equals_engine,
    assert_load_equals_engine,
    assert_open_equals_engine,
    assert_optimizer_state_equals_engine,
    case,
    expected,
    manifest,
)
from safetensors.torch import load_file

import zeroio
from zeroio import errors

NAME = "nvme_z3_ws2_bf16"
PARAM = "nvme_param_z3_ws2_bf16"  # offload_param: nvme as well; DeepSpeed swaps none of these tiny parameters
SWAPPED_GROUP = 0  # the decay group's sub-group (emb.weight, mlp_in.weight, mlp_out.weight): 82 fp32 a rank
MASTER = "0_5.tensor.swp"  # ds_ids 0 (emb.weight) .. 5 (mlp_out.weight)


def _swap_folder(root: Path, rank: int) -> Path:
    return root / "global_step2" / "offloaded_tensors" / f"rank{rank:02d}"


def _live_swap_folder(root: Path, rank: int) -> Path:
    return root / "nvme" / "zero_stage_3" / "optimizer" / f"rank{rank}"


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / NAME
    shutil.copytree(case(NAME), root, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return root


# --------------------------------------------------------------------------- the layout, as DeepSpeed wrote it


def test_checkpoint_keeps_empty_placeholders_and_the_swap_folder_keeps_the_data():
    """The rank files hold a 0-element fp32 group (and 0-element moments) where the swapped sub-group was; the
    swap files are raw fp32, the sub-group's 82 elements padded to 1 KiB (256 elements)."""
    for rank in range(2):
        osd = torch.load(
            case(NAME) / "global_step2" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            weights_only=False,
        )["optimizer_state_dict"]
        flat = osd["fp32_flat_groups"]
        assert [t.numel() for t in flat] == [0, 11]
        state = osd["optimizer_state_dict"]["state"][SWAPPED_GROUP]
        assert state["exp_avg"].numel() == 0 and state["exp_avg_sq"].numel() == 0
        folder = _swap_folder(case(NAME), rank)
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            f"{s}{MASTER}" for s in ("", "exp_avg-", "exp_avg_sq-")
        )
        for path in folder.iterdir():  # the copy save_checkpoint made of the live swap folder
            assert path.stat().st_size == 1024
            assert path.read_bytes() == (_live_swap_folder(case(NAME), rank) / path.name).read_bytes()
    assert json.loads((case(NAME) / "expected" / "swap.json").read_text())["swapped_sub_groups"] == [SWAPPED_GROUP]
    assert manifest(NAME)["ds_config"]["zero_optimization"]["offload_optimizer"]["nvme_path"] == "nvme"


# --------------------------------------------------------------------------- zeroio reads it


@pytest.mark.parametrize("name", [NAME, PARAM])
def test_open_load_convert_equal_engine(tmp_path: Path, name: str) -> None:
    assert_open_equals_engine(name)
    assert_load_equals_engine(name)
    assert_convert_equals_engine(name, tmp_path)


@pytest.mark.parametrize("name", [NAME, PARAM])
def test_optimizer_state_equals_engine(tmp_path: Path, name: str) -> None:
    assert_optimizer_state_equals_engine(name, ("exp_avg", "exp_avg_sq"))
    out = tmp_path / "out"
    zeroio.convert(case(name), out, include_optimizer=True, progress=False)
    state = load_file(out / "optimizer.safetensors")
    for param, states in expected(name, "optimizer").items():
        for key, value in states.items():
            assert torch.equal(state[f"{param}.{key}"], value), f"{param}.{key}"


def test_offload_param_nvme_swaps_no_tiny_parameter():
    """With offload_param: nvme too, the parameters stay in memory (no file in the param swap folder) and the
    checkpoint is laid out exactly like the optimizer-only case: the same files, the same swapped sub-group."""
    zero = manifest(PARAM)["ds_config"]["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "nvme"}
    assert not [p for p in (case(PARAM) / "nvme" / "zero_stage_3").rglob("*") if p.is_file() and "params" in str(p)]
    names = sorted(f for f in manifest(PARAM)["files"] if f.startswith("global_step2/"))
    assert names == sorted(f for f in manifest(NAME)["files"] if f.startswith("global_step2/"))


def test_metadata_says_nvme_and_where_the_swap_folder_is():
    with zeroio.open(case(NAME)) as ckpt:
        assert ckpt.metadata.offload == "nvme"
        folder = case(NAME) / "global_step2" / "offloaded_tensors"
        assert Path(ckpt.metadata.extra["nvme_swap_folder"]).resolve() == folder.resolve()
        assert [Path(p).name for p, *_ in ckpt.pieces("emb.weight")] == [MASTER, MASTER]


def test_reshard_is_refused(tmp_path: Path) -> None:
    with pytest.raises(errors.UnsupportedCheckpointError, match="offloaded_tensors"):
        zeroio.reshard(case(NAME), tmp_path / "out", world_size=3)


# --------------------------------------------------------------------------- broken swap folders


def test_missing_swap_file_names_it(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (_swap_folder(root, 1) / MASTER).unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match=r"rank01/0_5\.tensor\.swp' is missing"):
        zeroio.open(root)


def test_missing_moment_file_names_it(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (_swap_folder(root, 0) / f"exp_avg_sq-{MASTER}").unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match=r"rank00/exp_avg_sq-0_5\.tensor\.swp' is missing"):
        zeroio.open(root)


def test_short_swap_file_is_refused(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    path = _swap_folder(root, 0) / MASTER
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(errors.CheckpointFormatError, match=r"0_5\.tensor\.swp' holds 100 bytes, .* needs 328"):
        zeroio.open(root)


def test_missing_swap_folder_says_where_deepspeed_put_it(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    shutil.rmtree(_swap_folder(root, 1))
    with pytest.raises(
        errors.CheckpointNotFoundError, match=r"rank01' is missing: .* 'nvme/zero_stage_3/optimizer/rank1'"
    ):
        zeroio.open(root)


def test_swap_files_numbered_after_other_parameters_are_found(tmp_path: Path) -> None:
    """ds_ids count every parameter DeepSpeed converted in the process: a model built after 3 others' parameters
    names its files 3_8; the shift is found from the folder (every swapped sub-group must fit it)."""
    root = _copy(tmp_path)
    for rank in range(2):
        for path in _swap_folder(root, rank).iterdir():
            path.rename(path.with_name(path.name.replace("0_5", "3_8")))
    with zeroio.open(root) as ckpt:
        assert torch.equal(ckpt["emb.weight"], expected(NAME)["emb.weight"])
        assert torch.equal(
            ckpt.optimizer_state("mlp_out.weight")["exp_avg"], expected(NAME, "optimizer")["mlp_out.weight"]["exp_avg"]
        )


def test_the_live_swap_folder_is_not_read(tmp_path: Path) -> None:
    """The nvme_path folder moves on with training: zeroio reads the copy the save made, never the live one."""
    root = _copy(tmp_path)
    for rank in range(2):
        for path in _live_swap_folder(root, rank).iterdir():
            path.write_bytes(bytes(path.stat().st_size))
    with zeroio.open(root) as ckpt:
        assert torch.equal(ckpt["emb.weight"], expected(NAME)["emb.weight"])


# --------------------------------------------------------------------------- DeepSpeed's own tools


@pytest.mark.parametrize("name", [NAME, PARAM])
def test_zero_to_fp32_recorded_outcome(name: str) -> None:
    """DeepSpeed 0.19.8's zero_to_fp32 reads only the rank files, where the swapped group is empty."""
    assert manifest(name)["zero_to_fp32_fails"] is True
    assert (case(name) / "expected" / "zero_to_fp32.error").read_text() == ZERO_TO_FP32_ERROR + "\n"


@pytest.mark.parametrize("name", [NAME, PARAM])
def test_ds_to_universal_recorded_outcome(name: str) -> None:
    """ds_to_universal slices the empty fp32 group (emb.weight's 46 elements on rank 0) and fails."""
    assert json.loads((case(name) / "expected" / "ds_to_universal.json").read_text()) == DS_TO_UNIVERSAL


@pytest.fixture(scope="module")
def live_deepspeed(tmp_path_factory):
    """Run the installed DeepSpeed's zero_to_fp32 on the fixture in a subprocess; returns its error line."""
    pytest.importorskip("deepspeed")
    script = textwrap.dedent(
        """
        import sys, warnings
        warnings.simplefilter("ignore")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        try:
            get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
            print("OK")
        except Exception as exc:
            print(f"{type(exc).__name__}: {str(exc).replace(sys.argv[1], '{fixture}')}")
        """
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(case(NAME))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_live_zero_to_fp32_still_fails(live_deepspeed):
    assert live_deepspeed == ZERO_TO_FP32_ERROR


ZERO_TO_FP32_ERROR = "ValueError: consumed 186 numels out of 22 - something is wrong"
DS_TO_UNIVERSAL = {"returncode": 1, "error": "RuntimeError: start (0) + length (46) exceeds dimension size (0)."}
