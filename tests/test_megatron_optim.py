"""Megatron-Core checkpoints of Megatron's own optimizers (fixtures/megatron_optim/, megatron-core 0.16.1,
fixtures/generate_megatron_optim.py): bf16 with ``Float16OptimizerWithFloat16Params``, and the distributed
optimizer in Megatron-LM's default ``dp_reshardable`` format (also saved fully parallel at data parallel 3) and in
``fully_reshardable``. References from the same run: ``expected/plain.pt`` (``load_plain_tensors``),
``expected/model.pt`` (the live model), and ``expected/optimizer_common.pt`` (common.pt's optimizer entry: step and
param groups)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hostile_dcp import twin_entry
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError, UnsupportedCheckpointError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_optim"
NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/manifest.json"))
FULLY_PARALLEL = {"gpt_dp3_distopt_fps"}
"""Saved with --ckpt-fully-parallel-save: each tensor written by one data-parallel rank."""


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
        "gpt_dp3_distopt_fps",
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
        if name in FULLY_PARALLEL:  # listed in .metadata's order, the writing ranks' (docs/formats.md)
            assert sorted(ckpt) == sorted(live) and len(list(ckpt)) == len(live)
        else:
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


@pytest.mark.parametrize("name", ["gpt_dp2_distopt", "gpt_dp3_distopt_fps", "gpt_moe_ep2_distopt"])
def test_bucket_optimizer_state_is_refused_by_name(name, tmp_path, capsys):
    """dp_reshardable (Megatron-LM's default with --use-distributed-optimizer) saves flat buckets whose parameter
    offsets are not in the checkpoint: optimizer_state and --include-optimizer refuse, naming the re-save flag;
    before, convert wrote an empty optimizer.safetensors and exited 0. gpt_dp3_distopt_fps: saved fully parallel
    (.metadata in the writing ranks' order, not the buckets'), a bucket split unevenly over 3 ranks."""
    src = FIXTURES / name
    with zeroio.open(src) as ckpt:
        assert ckpt.metadata.optimizer is None
        assert any(".distributed." in k for k in ckpt.metadata.extra["other_tensors"])
        with pytest.raises(UnsupportedCheckpointError, match="--dist-ckpt-optim-fully-reshardable"):
            ckpt.optimizer_state("decoder.layers.0.mlp.linear_fc1.weight")
    assert main(["convert", str(src), str(tmp_path / "out"), "--include-optimizer", "--quiet"]) == 1
    assert "dp_reshardable" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_bucket_refusal_names_what_the_checkpoint_lacks():
    """The refusal says what is missing (which parameter each bucket range holds: Megatron derives it from the live
    model's parameter order, which is not saved; .metadata's order is not it under fully parallel save) and the
    fix; before, it said only that parameter offsets are not saved."""
    src = FIXTURES / "gpt_dp2_distopt"
    folder = src / "iter_0000003"
    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0"
    with zeroio.open(src) as ckpt, pytest.raises(UnsupportedCheckpointError) as exc:
        ckpt.optimizer_state("output_layer.weight")
    assert str(exc.value) == (
        f"'{folder}' holds Megatron's distributed-optimizer state in its dp_reshardable layout: 1 flat bucket "
        f"({bucket}.param, ...). The checkpoint does not record which parameter each range of a bucket holds, only "
        "each bucket's element counts (per_bucket_numel): Megatron lays buckets out from the live model (its "
        "trainable parameters in reverse named_parameters() order, per dtype and dense/expert group), an order not "
        "saved (.metadata lists tensors in the writing ranks' order under --ckpt-fully-parallel-save). Load it in "
        "Megatron-LM with the parallel layout it was saved with and save it again with "
        "--dist-ckpt-optim-fully-reshardable (one optimizer.state.<moment>.<key> tensor per parameter), or convert "
        "the weights alone (drop include_optimizer)."
    )
    assert exc.value.path == src and exc.value.name == "output_layer.weight"


# --------------------------------------------------------------------------- layouts zeroio has not checked

RESHARDABLE = "gpt_dp2_distopt_reshardable"
VICTIM = "optimizer.state.exp_avg.output_layer.weight"


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the fully reshardable fixture (read bit for bit before any edit) and its iteration folder."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / RESHARDABLE, src)
    return src, next(src.glob("iter_*"))


def _edit_metadata(folder: Path, edit) -> None:
    """Rewrite the fixture's own DCP metadata (written by torch) with ``edit(metadata)``."""
    import pickle

    with open(folder / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    edit(metadata)
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)


def _refused_but_weights_read(src: Path, tmp_path: Path, match: str) -> None:
    """The weights are the live model's; every parameter's optimizer state and --include-optimizer are refused."""
    live = _load(RESHARDABLE, "model.pt")
    with zeroio.open(src) as ckpt:
        assert list(ckpt) == list(live) and all(_same(ckpt[k], v) for k, v in live.items())
        assert ckpt.metadata.optimizer is None
        for key in ckpt:
            with pytest.raises(UnsupportedCheckpointError, match=match):
                ckpt.optimizer_state(key)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        zeroio.convert(src, tmp_path / "out", include_optimizer=True, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sharding", ["fully_sharded_model_space", "fsdp_dtensor", "model_space_v2"])
def test_an_unchecked_sharding_type_is_refused(sharding, tmp_path):
    """common.pt names the distributed optimizer's layout (param_state_sharding_type): one zeroio has not checked
    (Megatron's older flattened fully_sharded_model_space, Megatron-FSDP's, a future one) is refused by name, even
    where its tensors look like fully_reshardable's; before, they were read as if they were."""
    src, folder = _copy(tmp_path)
    common = torch.load(folder / "common.pt", weights_only=False)  # the fixture's own, written by megatron-core
    common["optimizer"]["param_state_sharding_type"] = sharding
    torch.save(common, folder / "common.pt")
    _refused_but_weights_read(src, tmp_path, rf"common\.pt' says the distributed optimizer was saved as '{sharding}'")


def test_moments_not_shaped_like_their_parameter_are_refused(tmp_path):
    """fully_sharded_model_space (Megatron-Core before 0.16) saved each moment as flattened ranges of a tensor
    reshaped to [fragments..., local elements]: output_layer.weight's exp_avg as [1, 1, 512], its bytes as a
    [1, 1, 512] chunk. It was returned with that shape; now no optimizer state is read, the moment named."""
    import copy
    import dataclasses
    import io

    src, folder = _copy(tmp_path)
    flat = torch.Size([1, 1, 512])

    def flatten(metadata):
        entry = metadata.state_dict_metadata[VICTIM]
        entry.size, entry.chunks[0].offsets, entry.chunks[0].sizes = flat, torch.Size([0, 0, 0]), flat
        for index, stored in list(metadata.storage_data.items()):
            if index.fqn == VICTIM:  # the same bytes as a [1, 1, 512] chunk, appended to the same data file
                data_file = folder / stored.relative_path
                data = data_file.read_bytes()
                old = torch.load(io.BytesIO(data[stored.offset : stored.offset + stored.length]), weights_only=True)
                blob = io.BytesIO()
                torch.save(old.reshape(flat).clone(), blob)
                moved = copy.deepcopy(stored)
                moved.offset, moved.length = len(data), len(blob.getvalue())
                data_file.write_bytes(data + blob.getvalue())
                del metadata.storage_data[index]
                metadata.storage_data[dataclasses.replace(index, offset=torch.Size([0, 0, 0]))] = moved

    _edit_metadata(folder, flatten)
    _refused_but_weights_read(src, tmp_path, r"'exp_avg' of 'output_layer\.weight' has shape \[1, 1, 512\]")


def test_unknown_optimizer_tensors_stay_out_of_the_weights(tmp_path):
    """A tensor under optimizer. of a family zeroio does not know (here exp_avg of output_layer.weight renamed
    optimizer.future_state...) is neither a weight nor read as state: before, it was listed and converted as a
    tensor of the model."""
    import dataclasses

    src, folder = _copy(tmp_path)
    renamed = VICTIM.replace("optimizer.state.", "optimizer.future_state.")

    def rename(metadata):
        metadata.state_dict_metadata[renamed] = metadata.state_dict_metadata.pop(VICTIM)
        for index, stored in list(metadata.storage_data.items()):
            if index.fqn == VICTIM:
                del metadata.storage_data[index]
                metadata.storage_data[dataclasses.replace(index, fqn=renamed)] = stored

    _edit_metadata(folder, rename)
    _refused_but_weights_read(src, tmp_path, rf"optimizer tensors zeroio does not know \({re.escape(renamed)}:")
    with zeroio.open(src) as ckpt:
        assert renamed in ckpt.metadata.extra["other_tensors"]


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
    src = tmp_path / "ckpt"
    victim = "chained_0.optimizer.state.exp_avg.output_layer.weight"
    twin_entry(FIXTURES / "gpt_moe_ep2_distopt_reshardable", src, victim, "chained_1." + victim[len("chained_0.") :])
    with pytest.raises(CheckpointFormatError, match=r"\.metadata': .*holds the exp_avg of 'output_layer\.weight'"):
        zeroio.open(src)
