"""Consolidated optimizer state: ``ckpt.optimizer_state(name)`` and ``convert(include_optimizer=True)``.

The references are DeepSpeed's own: its zero_to_fp32 merge functions applied to the per-rank Adam moments
(fast), and its universal-checkpoint converter ``ds_to_universal`` run on each fixture (slow).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES, fixture_names, manifest
from safetensors import safe_open

import zeroio
from zeroio import convert, errors

# ZeRO-1/2/3 fixtures DeepSpeed's merge reads (its tool fails on stage 0, BF16_Optimizer and MoE folders).
MERGEABLE = [n for n in fixture_names() if manifest(n)["stage"] in (1, 2, 3) and not manifest(n)["zero_to_fp32_fails"]]
# Every fixture ds_to_universal converts (MoE with expert parallelism > 1 breaks it: "shape '[7]' is invalid").
UNIVERSAL = [n for n in fixture_names() if manifest(n)["stage"] in (1, 2, 3) and manifest(n).get("ep_size", 1) == 1]
MOMENTS = ("exp_avg", "exp_avg_sq")


def _trainable(ckpt: zeroio.Checkpoint) -> list[str]:
    return [n for n, i in ckpt.infos.items() if i.kind == "trainable" and n not in ckpt.tied]


def _deepspeed_merge(name: str, key: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 reconstruction, fed each rank's ``key`` moments instead of its fp32 partitions."""
    from deepspeed.utils import zero_to_fp32 as z

    tag_dir = FIXTURES / name / "global_step2"
    stage = manifest(name)["stage"]
    optim_files = z.get_optim_files(str(tag_dir))
    model_files = z.get_model_state_files(str(tag_dir))
    model_states = z.parse_model_states(model_files)
    per_rank = []
    for path in optim_files:
        osd = torch.load(path, weights_only=False)["optimizer_state_dict"]
        base = osd["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
        order = [pid for group in base["param_groups"] for pid in group["params"]]
        per_rank.append([base["state"][pid][key] for pid in order])
    merged: dict[str, torch.Tensor] = {}
    if stage == 3:
        z._zero3_merge_trainable_params(merged, len(per_rank), per_rank, model_states)
        return {k: v.contiguous() for k, v in merged.items()}
    paddings = torch.load(optim_files[0], weights_only=False)["optimizer_state_dict"].get("param_alignment_paddings")
    z._zero2_merge_trainable_params(merged, len(per_rank), per_rank, model_states, paddings)
    return merged


@pytest.mark.parametrize("name", MERGEABLE)
def test_moments_equal_deepspeed_merge_of_rank_partitions(name: str) -> None:
    """exp_avg/exp_avg_sq equal DeepSpeed's own reconstruction of the per-rank moments, bit for bit."""
    with zeroio.open(FIXTURES / name) as ckpt:
        states = {n: ckpt.optimizer_state(n) for n in _trainable(ckpt)}
    for key in MOMENTS:
        expected = _deepspeed_merge(name, key)
        assert sorted(expected) == sorted(states)
        for param, want in expected.items():
            got = states[param][key]
            assert got.dtype == torch.float32 and got.shape == want.shape, param
            assert torch.equal(got, want), f"{name} {param} {key}"


@pytest.mark.parametrize("name", [n for n in fixture_names() if manifest(n)["stage"] in (1, 2, 3)])
def test_every_trainable_parameter_has_full_shape_moments(name: str) -> None:
    """Every fixture (MoE expert groups, BF16_Optimizer included): full-shape fp32 moments, v >= 0, a step of 2."""
    with zeroio.open(FIXTURES / name) as ckpt:
        for param in _trainable(ckpt):
            state = ckpt.optimizer_state(param)
            for key in MOMENTS:
                assert state[key].shape == ckpt.info(param).shape and state[key].dtype == torch.float32
            assert bool((state["exp_avg_sq"] >= 0).all()) and bool(state["exp_avg_sq"].any()), param
            assert float(state["step"]) == 2.0


def test_step_and_hyperparameters_come_from_the_params_group() -> None:
    """step is the state's tensor; lr, betas, eps, weight_decay, ... are the parameter's own param group's."""
    raw = torch.load(
        FIXTURES / "z3_ws2_fp32/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False
    )
    groups = raw["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as ckpt:
        decay = ckpt.optimizer_state("emb.weight")
        no_decay = ckpt.optimizer_state("norm.bias")
    assert list(decay)[:3] == ["exp_avg", "exp_avg_sq", "step"]
    assert torch.equal(decay["step"], torch.tensor(2.0)) and decay["step"].shape == ()
    for state, group in ((decay, groups[0]), (no_decay, groups[1])):
        assert {k: v for k, v in state.items() if k not in ("exp_avg", "exp_avg_sq", "step")} == {
            k: v for k, v in group.items() if k != "params"
        }
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert decay["betas"] == (0.9, 0.999) and decay["lr"] == 0.05 and decay["eps"] == 1e-8


def test_tied_alias_gives_its_sources_state() -> None:
    """head.weight (tied to emb.weight) has emb.weight's moments."""
    with zeroio.open(FIXTURES / "z3_ws3_bf16") as ckpt:
        alias, source = ckpt.optimizer_state("head.weight"), ckpt.optimizer_state("emb.weight")
    assert torch.equal(alias["exp_avg"], source["exp_avg"]) and alias["exp_avg"].shape == (13, 7)


def test_frozen_parameter_and_buffer_have_no_optimizer_state() -> None:
    """A frozen parameter or a buffer raises TensorNotFoundError saying why and listing what has state."""
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as ckpt:
        for name, what in (("frozen.weight", "a frozen parameter"), ("scale", "a buffer")):
            with pytest.raises(errors.TensorNotFoundError) as info:
                ckpt.optimizer_state(name)
            assert str(info.value) == (
                f"No optimizer state for '{name}' in '{ckpt.metadata.path}': it is {what}, which the optimizer "
                "does not own. Parameters with optimizer state: emb.weight, mlp_in.weight, mlp_in.bias, "
                "mlp_out.weight, norm.weight ... and 1 more."
            )
        with pytest.raises(errors.TensorNotFoundError, match="No tensor named 'nope'"):
            ckpt.optimizer_state("nope")


def test_stage0_optimizer_state_is_unsupported() -> None:
    """ZeRO stage 0 keeps unnamed optimizer state in model_states; optimizer_state says so, weights still read."""
    with zeroio.open(FIXTURES / "z0_ws2_fp32") as ckpt:
        with pytest.raises(errors.UnsupportedCheckpointError) as info:
            ckpt.optimizer_state("emb.weight")
        assert str(info.value) == (
            f"'{ckpt.metadata.path}' is a ZeRO stage 0 checkpoint: DeepSpeed keeps its optimizer state unnamed in "
            "model_states['optimizer'], which zeroio does not read yet; optimizer_state() needs ZeRO stage 1-3. The "
            "weights can still be read with zeroio.open()."
        )
        assert ckpt["emb.weight"].shape == (13, 7)


def test_optimizer_state_after_close_raises() -> None:
    """Reading optimizer state of a closed checkpoint raises CheckpointClosedError."""
    ckpt = zeroio.open(FIXTURES / "z3_ws2_fp32")
    ckpt.close()
    with pytest.raises(errors.CheckpointClosedError):
        ckpt.optimizer_state("emb.weight")


def _rchar() -> int:
    """Bytes this process has read through read()/pread() so far (page-cache hits included)."""
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar:")).split()[1])


def test_reading_one_parameters_state_reads_only_its_moments() -> None:
    """optimizer_state(name) reads that parameter's moment bytes and its step, not the whole optimizer files."""
    with zeroio.open(FIXTURES / "z2_ws2_fp32") as ckpt:
        ckpt.optimizer_state("norm.bias")  # warm up: files opened, zip header offsets cached
        first = _rchar()
        overhead = _rchar() - first  # what reading /proc/self/io itself costs
        before = _rchar()
        state = ckpt.optimizer_state("norm.bias")
        read = _rchar() - before - overhead
    assert read == 2 * state["exp_avg"].numel() * 4 + 4  # two fp32 moments + the 4-byte step tensor


# --------------------------------------------------------------------------- a checkpoint without optimizer state


def _stripped_copy(tmp_path: Path, *, empty: bool) -> Path:
    """z3_ws2_fp32 with the base optimizer state removed (``empty``: kept but emptied) from every optim file."""
    dst = tmp_path / "stripped"
    shutil.copytree(FIXTURES / "z3_ws2_fp32", dst)
    for path in sorted((dst / "global_step2").glob("*_optim_states.pt")):
        tree = torch.load(path, weights_only=False)
        osd = tree["optimizer_state_dict"]
        if empty:
            osd["optimizer_state_dict"]["state"] = {}
        else:
            del osd["optimizer_state_dict"]
        torch.save(tree, path)
    return dst


@pytest.mark.parametrize("empty", [False, True], ids=["removed", "emptied"])
def test_checkpoint_without_optimizer_state_gives_a_clear_error(tmp_path: Path, empty: bool) -> None:
    """Stripped optimizer state: optimizer_state and include_optimizer fail clearly, the weights still read."""
    src = _stripped_copy(tmp_path, empty=empty)
    why = "its base optimizer state is empty" if empty else "its base optimizer state is missing"
    optim0 = src / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with zeroio.open(src) as ckpt, zeroio.open(FIXTURES / "z3_ws2_fp32") as original:
        with pytest.raises(errors.CheckpointFormatError) as info:
            ckpt.optimizer_state("emb.weight")
        assert str(info.value) == (
            f"'{optim0}' holds no optimizer moments ({why}): it was stripped, or saved before the optimizer's first "
            "step, so optimizer_state() cannot proceed. The weights can still be read (zeroio.open, zeroio.convert "
            "without include_optimizer)."
        )
        assert info.value.path == optim0
        stripped, full = ckpt.state_dict(), original.state_dict()
        assert all(torch.equal(stripped[k], full[k]) for k in full) and sorted(stripped) == sorted(full)
    with pytest.raises(errors.CheckpointFormatError, match=r"so include_optimizer=True cannot proceed"):
        convert(src, tmp_path / "out", include_optimizer=True, progress=False)
    assert not (tmp_path / "out").exists()
    convert(src, tmp_path / "weights", progress=False)
    assert sorted(os.listdir(tmp_path / "weights")) == ["model.safetensors"]


# --------------------------------------------------------------------------- convert(include_optimizer=True)


def test_convert_writes_optimizer_files_beside_the_weights(tmp_path: Path) -> None:
    """optimizer.safetensors holds <param>.exp_avg/.exp_avg_sq equal to optimizer_state; optimizer.json is golden."""
    convert(FIXTURES / "z3_ws2_fp32", tmp_path / "out", include_optimizer=True, progress=False)
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["model.safetensors", "optimizer.json", "optimizer.safetensors"]
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as ckpt, safe_open(out / "optimizer.safetensors", "pt") as f:
        names = _trainable(ckpt)
        assert sorted(f.keys()) == sorted(f"{n}.{k}" for n in names for k in MOMENTS)
        assert f.metadata() == {"format": "pt"}
        for n in names:
            state = ckpt.optimizer_state(n)
            for k in MOMENTS:
                assert torch.equal(f.get_tensor(f"{n}.{k}"), state[k])
    hyper = {
        "lr": 0.05, "betas": [0.9, 0.999], "eps": 1e-08, "amsgrad": False, "maximize": False, "foreach": None,
        "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
    }  # fmt: skip
    assert json.loads((out / "optimizer.json").read_text()) == {
        "format": "zeroio.optimizer.v1",
        "state_keys": ["exp_avg", "exp_avg_sq"],
        "tensor_key": "<parameter name>.<state key>",
        "files": ["optimizer.safetensors"],
        "param_groups": [
            {"params": ["emb.weight", "mlp_in.weight", "mlp_out.weight"], "step": 2, "weight_decay": 0.1, **hyper},
            {"params": ["mlp_in.bias", "norm.weight", "norm.bias"], "step": 2, "weight_decay": 0.0, **hyper},
        ],
        "tied": {"head.weight": "emb.weight"},
        "source": {"tag": "global_step2", "zero_stage": 3, "world_size": 2, "global_step": 2, "ds_version": "0.19.8"},
    }


def test_convert_shards_optimizer_files_like_the_weights(tmp_path: Path) -> None:
    """Over max_shard_size, the moments go to optimizer-0000K-of-0000N.safetensors plus an HF-style index."""
    convert(FIXTURES / "z2_ws3_fp16", tmp_path / "out", include_optimizer=True, max_shard_size=800, progress=False)
    out = tmp_path / "out"
    index = json.loads((out / "optimizer.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"optimizer-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert json.loads((out / "optimizer.json").read_text())["files"] == files
    with zeroio.open(FIXTURES / "z2_ws3_fp16") as ckpt:
        for key, filename in index["weight_map"].items():
            name, _, moment = key.rpartition(".")
            with safe_open(out / filename, "pt") as f:
                assert torch.equal(f.get_tensor(key), ckpt.optimizer_state(name)[moment])
        assert index["metadata"]["total_size"] == sum(2 * 4 * ckpt.info(n).numel for n in _trainable(ckpt))


def test_include_optimizer_needs_safetensors_and_a_zero_source(tmp_path: Path) -> None:
    """fmt='torch' is refused before IO; a consolidated source has no optimizer state to include."""
    with pytest.raises(ValueError) as info:
        convert(FIXTURES / "z3_ws2_fp32", tmp_path / "t", fmt="torch", include_optimizer=True, progress=False)
    assert str(info.value) == (
        "include_optimizer=True writes optimizer.safetensors beside model.safetensors (or the DCP optimizer state): "
        "use fmt='safetensors' or fmt='dcp', without distributed=True."
    )
    convert(FIXTURES / "z3_ws2_fp32", tmp_path / "plain", progress=False)
    with pytest.raises(errors.UnsupportedCheckpointError) as info2:
        convert(tmp_path / "plain", tmp_path / "again", include_optimizer=True, progress=False)
    with zeroio.open(tmp_path / "plain") as consolidated:
        path = consolidated.metadata.path
    assert str(info2.value) == (
        f"'{path}' is a consolidated safetensors checkpoint without optimizer state; include_optimizer=True needs a "
        "DeepSpeed ZeRO checkpoint folder (the one engine.save_checkpoint() wrote)."
    )
    assert not (tmp_path / "again").exists() and not (tmp_path / "t").exists()


# --------------------------------------------------------------------------- DeepSpeed's universal checkpoint


# One process converts every fixture (DeepSpeed's import costs seconds; each conversion a fraction of one).
_CONVERT_ALL = """
import sys
from deepspeed.checkpoint.ds_to_universal import main, parse_arguments
for src, out, inject in (line.split("\\t") for line in sys.stdin.read().splitlines()):
    sys.argv = ["ds_to_universal", "--input_folder", src, "--output_folder", out, "--num_extract_workers", "1",
                "--num_merge_workers", "1"] + (["--inject_missing_state"] if inject == "1" else [])
    main(parse_arguments())
"""


@pytest.fixture(scope="module")
def universal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSpeed's ds_to_universal output for every fixture in UNIVERSAL: ``<root>/<name>/global_step2_universal``."""
    root = tmp_path_factory.mktemp("universal")
    # ZeRO-1/2 need --inject_missing_state: no Megatron universal_checkpoint_info in their client state.
    jobs = "\n".join(
        f"{FIXTURES / n / 'global_step2'}\t{root / n / 'global_step2_universal'}\t{int(manifest(n)['stage'] < 3)}"
        for n in UNIVERSAL
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT_ALL],
        input=jobs,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", UNIVERSAL)
def test_optimizer_state_equals_ds_to_universal(universal: Path, name: str) -> None:
    """Moments, fp32 weights, step and param groups equal DeepSpeed's universal-checkpoint conversion."""
    out = universal / name / "global_step2_universal"
    common = torch.load(out / "zero" / "optimizer_state.pt", weights_only=False)
    with zeroio.open(FIXTURES / name) as ckpt:
        for param in _trainable(ckpt):
            state = ckpt.optimizer_state(param)
            for key, want in (("fp32", ckpt[param]), *((k, state[k]) for k in MOMENTS)):
                ref = torch.load(out / "zero" / param / f"{key}.pt", weights_only=False)
                ref = ref["param"] if isinstance(ref, dict) else ref
                assert ref.numel() == want.numel() and torch.equal(ref.reshape(want.shape), want), f"{param} {key}"
            step_file = out / "zero" / param / "step.pt"
            if step_file.exists():  # ZeRO-1/2: one per parameter
                assert torch.equal(torch.load(step_file, weights_only=False), state["step"])
            else:  # ZeRO-3: rank 0's base optimizer state
                assert torch.equal(common["optimizer_state_dict"]["state"][0]["step"], state["step"])
        groups = [{k: v for k, v in g.items() if k != "params"} for g in common["param_groups"]]
        for param in _trainable(ckpt):
            state = ckpt.optimizer_state(param)
            assert {k: v for k, v in state.items() if k not in ("exp_avg", "exp_avg_sq", "step")} in groups
