"""Megatron-Core checkpoints of Megatron's own optimizers (fixtures/megatron_optim/, megatron-core 0.16.1,
fixtures/generate_megatron_optim.py): bf16 with ``Float16OptimizerWithFloat16Params``, and the distributed
optimizer in Megatron-LM's default ``dp_reshardable`` format and in ``fully_reshardable``. References from the same
run: ``expected/plain.pt`` (``load_plain_tensors``), ``expected/model.pt`` (the live model), and
``expected/optimizer_common.pt`` (common.pt's optimizer entry: step and param groups)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError, UnsupportedCheckpointError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_optim"
NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/manifest.json"))


def _load(name: str, what: str) -> dict:
    return torch.load(FIXTURES / name / "expected" / what, weights_only=False)


def _plain(name: str) -> dict[str, torch.Tensor]:
    """load_plain_tensors' tensors, ChainedOptimizer's ``chained_<i>.`` prefix dropped (keys are unique without)."""
    found = {re.sub(r"^chained_\d+\.", "", k): v for k, v in _load(name, "plain.pt").items()}
    assert len(found) == len(_load(name, "plain.pt"))
    return found


def _step(name: str) -> torch.Tensor:
    """The step in common.pt: Float16Optimizer's common_step, else the (equal) steps of every param group of every
    chained optimizer."""
    common = _load(name, "optimizer_common.pt")
    parts = list(common.values()) if all(isinstance(k, int) for k in common) else [common]
    if "state" in parts[0]["optimizer"]:
        return parts[0]["optimizer"]["state"]["common_step"]
    (step,) = {g["step"] for part in parts for g in part["optimizer"]["param_groups"]}
    return torch.tensor(step)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _stacked(name: str) -> tuple[str, int | None]:
    head, sep, rest = name.partition(".layers.")
    if not sep:
        return name, None
    index, _, rest = rest.partition(".")
    return f"{head}.layers.{rest}", int(index)


def test_fixtures_present():
    assert NAMES == [
        "gpt_dp2_distopt",
        "gpt_dp2_distopt_reshardable",
        "gpt_moe_ep2_distopt",
        "gpt_moe_ep2_distopt_reshardable",
        "gpt_tp2_bf16",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_the_live_models_and_nothing_else(name, tmp_path):
    """The distributed optimizer's flat buckets (``optimizer.distributed.*``) are optimizer state, not weights:
    before, dp_reshardable's were listed and written into model.safetensors as tensors of the model."""
    live = _load(name, "model.pt")
    with zeroio.open(FIXTURES / name) as ckpt:
        assert list(ckpt) == list(live)
        assert all(_same(ckpt[k], v) for k, v in live.items())
    zeroio.convert(FIXTURES / name, tmp_path / "st", progress=False)
    written = load_file(tmp_path / "st" / "model.safetensors")
    assert set(written) == set(live) and all(_same(written[k], v) for k, v in live.items())


@pytest.mark.parametrize(
    ("name", "master"),
    [
        ("gpt_tp2_bf16", "fp32_param"),
        ("gpt_dp2_distopt_reshardable", "param"),
        ("gpt_moe_ep2_distopt_reshardable", "param"),
    ],
)
def test_optimizer_state_with_step_and_hyper_parameters(name, master):
    """Float16OptimizerWithFloat16Params keeps step and param groups under common.pt's ``optimizer.optimizer``; the
    distributed optimizer's two param groups (weight decay on / off) each carry the step; MoE's ChainedOptimizer
    prefixes its keys ``chained_<i>.`` and saves one common entry per optimizer. Before, the first two lost the step
    and learning rate, and the chained moments were read as weights."""
    plain, step = _plain(name), _step(name)
    with zeroio.open(FIXTURES / name) as ckpt:
        assert ckpt.metadata.has_fp32_master and ckpt.metadata.optimizer == "Adam"
        for key in ckpt:
            state = ckpt.optimizer_state(key)
            stacked, layer = _stacked(key)
            for moment in ("exp_avg", "exp_avg_sq", master):
                want = plain[f"optimizer.state.{moment}.{stacked}"]
                assert _same(state[moment], want if layer is None else want[layer]), (key, moment)
            got = state["step"] if isinstance(state["step"], torch.Tensor) else torch.tensor(state["step"])
            assert _same(got, step), key
            assert state["lr"] == 0.01 and list(state["betas"]) == [0.9, 0.999]


@pytest.mark.parametrize("name", ["gpt_dp2_distopt", "gpt_moe_ep2_distopt"])
def test_bucket_optimizer_state_is_refused_by_name(name, tmp_path, capsys):
    """dp_reshardable (Megatron-LM's default with --use-distributed-optimizer) saves flat buckets whose parameter
    offsets are not in the checkpoint: optimizer_state and --include-optimizer refuse, naming the re-save flag;
    before, convert wrote an empty optimizer.safetensors and exited 0."""
    src = FIXTURES / name
    with zeroio.open(src) as ckpt:
        assert ckpt.metadata.optimizer is None
        assert any(".distributed." in k for k in ckpt.metadata.extra["other_tensors"])
        with pytest.raises(UnsupportedCheckpointError, match="--dist-ckpt-optim-fully-reshardable"):
            ckpt.optimizer_state("decoder.layers.0.mlp.linear_fc1.weight")
    assert main(["convert", str(src), str(tmp_path / "out"), "--include-optimizer", "--quiet"]) == 1
    assert "dp_reshardable" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_include_optimizer_without_optimizer_state_is_refused(tmp_path):
    """A Megatron checkpoint saved without optimizer state: --include-optimizer wrote an empty optimizer file."""
    src = FIXTURES.parent / "megatron" / "gpt_tp2_tied"
    with pytest.raises(UnsupportedCheckpointError, match="no parameters with optimizer state"):
        zeroio.convert(src, tmp_path / "out", include_optimizer=True, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_moment_held_by_two_chained_optimizers_is_refused(tmp_path):
    """MoE chains Megatron's dense and expert optimizers (``chained_<i>.`` keys, the prefix dropped when read): a
    crafted checkpoint whose second optimizer also holds the first one's ``exp_avg`` of ``output_layer.weight``
    (its own copy of the bytes) was read silently, one of the two winning; now refused naming the metadata file."""
    import copy
    import dataclasses
    import pickle
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "gpt_moe_ep2_distopt_reshardable", src)
    metadata_file = next(src.glob("iter_*/.metadata"))
    with open(metadata_file, "rb") as fh:
        metadata = pickle.load(fh)  # the fixture's own DCP metadata, written by torch
    victim = "chained_0.optimizer.state.exp_avg.output_layer.weight"
    twin = "chained_1." + victim[len("chained_0.") :]
    metadata.state_dict_metadata[twin] = copy.deepcopy(metadata.state_dict_metadata[victim])
    for index, stored in list(metadata.storage_data.items()):
        if index.fqn == victim:  # the twin's chunk: a copy of the victim's bytes at the end of the same file
            data_file = metadata_file.parent / stored.relative_path
            data = data_file.read_bytes()
            moved = copy.deepcopy(stored)
            moved.offset = len(data)
            data_file.write_bytes(data + data[stored.offset : stored.offset + stored.length])
            metadata.storage_data[dataclasses.replace(index, fqn=twin)] = moved
    with open(metadata_file, "wb") as fh:
        pickle.dump(metadata, fh)
    with pytest.raises(CheckpointFormatError, match=r"\.metadata': .*holds the exp_avg of 'output_layer\.weight'"):
        zeroio.open(src)
