"""Pipeline-parallel checkpoints (``deepspeed.pipe.PipelineModule``, ZeRO-1): open, load, convert, inspect, refusals.

The fixtures in ``fixtures/layouts/pipe_*`` were written by DeepSpeed 0.19.8 (``fixtures/generate_pipeline.py``);
``expected/engine.pt`` holds the live engines' fp32 masters, frozen parameters and buffers under the
``PipelineModule.state_dict()`` names, taken from the replica that wrote each layer file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES, assert_state_dicts_equal
from safetensors.torch import load_file
from torch import nn

import zeroio
from zeroio import errors
from zeroio.cli import main

LAYOUTS = FIXTURES / "layouts"
NAMES = ["pipe_z1_ws2_pp2_bf16", "pipe_z1_ws4_pp2dp2_fp32_frozen", "pipe_z0_ws4_pp2dp2_bf16"]
FROZEN_FIXTURE = "pipe_z1_ws4_pp2dp2_fp32_frozen"
TAG = "global_step2"
KEYS = [
    "tied_modules.embed.weight", "1.weight", "1.bias", "3.weight", "3.bias", "4.weight", "4.bias", "5.scale",
    "5.running",
]  # fmt: skip
DS_ERROR = "AttributeError: 'NoneType' object has no attribute 'items'"


def _manifest(name: str) -> dict:
    return json.loads((LAYOUTS / name / "manifest.json").read_text())


def _engine(name: str) -> dict[str, torch.Tensor]:
    return torch.load(LAYOUTS / name / "expected" / "engine.pt", weights_only=True)


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(LAYOUTS / name, root, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return root


class _PipelineEquivalent(nn.Module):
    """The fixtures' PipelineModule rebuilt from plain torch layers under the same state_dict names."""

    def __init__(self) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict({"embed": nn.Embedding(11, 8)})
        self.add_module("1", nn.Linear(8, 17))
        self.add_module("3", nn.Linear(17, 8))
        self.add_module("4", nn.LayerNorm(8))
        scale = nn.Module()
        scale.scale = nn.Parameter(torch.zeros(8))
        scale.register_buffer("running", torch.zeros(8))
        self.add_module("5", scale)


class _PlainNet(nn.Module):
    """The same network as a user would write it without pipeline parallelism (head tied to the embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc1 = nn.Linear(8, 17)
        self.fc2 = nn.Linear(17, 8)
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.zeros(8))
        self.register_buffer("running", torch.zeros(8))


PLAIN_KEYS = {
    "tied_modules.embed.weight": "emb.weight", "1.weight": "fc1.weight", "1.bias": "fc1.bias",
    "3.weight": "fc2.weight", "3.bias": "fc2.bias", "4.weight": "norm.weight", "4.bias": "norm.bias",
    "5.scale": "scale", "5.running": "running",
}  # fmt: skip


# --------------------------------------------------------------------------- the fixtures


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_what_deepspeed_writes(name):
    """One file per layer with a state_dict (not the relu function 2, not the tied head 6); mp_rank = stage."""
    m = _manifest(name)
    tag_dir = LAYOUTS / name / TAG
    prefix = "bf16_" if m["dtype"] == "bf16" else ""
    expected = [f"layer_{i:02d}-model_states.pt" for i in (0, 1, 3, 4, 5)]
    expected += [f"mp_rank_{s:02d}_model_states.pt" for s in range(2)]
    expected += [f"{prefix}zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in range(m["dp"]) for s in range(2)]
    assert sorted(p.name for p in tag_dir.iterdir()) == sorted(expected)
    for rel, digest in m["files"].items():
        assert hashlib.sha256((LAYOUTS / name / rel).read_bytes()).hexdigest() == digest, rel
    assert sum((LAYOUTS / name / f).stat().st_size for f in m["files"]) < 150_000


def test_buffers_come_from_the_replica_that_wrote_the_layer_file():
    """The two replicas' running buffers differ; the reference (and zeroio) hold the one in layer_05's file.

    With parallel_write.pipeline_stage, DeepSpeed spreads each stage's layers over its dp ranks
    (partition_uniform): stage 0's layers 2-3 are written by dp rank 1, stage 1's layers 4-5 by dp rank 0.
    """
    writers = json.loads((LAYOUTS / FROZEN_FIXTURE / "expected" / "layer_writers.json").read_text())
    assert writers["5.running"] == {"replicas_differ": True, "stage": 1, "writer_dp": 0}
    assert writers["3.weight"] == {"replicas_differ": False, "stage": 0, "writer_dp": 1}
    with zeroio.open(LAYOUTS / FROZEN_FIXTURE) as ckpt:
        assert torch.equal(ckpt["5.running"], _engine(FROZEN_FIXTURE)["5.running"])


def test_zero0_stage_files_record_no_parameter_shapes():
    """ZeRO-0 bf16 pipelines train with BF16_Optimizer: optimizer files like ZeRO-1's, but the stage model states
    record no param_shapes, so names come from each rank's param_slice_mappings and shapes from the layer files."""
    with zeroio.open(LAYOUTS / "pipe_z0_ws4_pp2dp2_bf16") as ckpt:
        assert ckpt.metadata.zero_stage == 0 and dict(ckpt.metadata.parallel) == {"dp": 2, "pp": 2}
        assert {p.name for p in ckpt.info("1.weight").files} <= {
            "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
        }  # fmt: skip
        # Stage 1's 112 elements (its fp32 copy of the tied weight first) split 56/56: 5.scale is in dp rank 1's half.
        assert [p.name for p in ckpt.info("5.scale").files] == ["bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"]


# --------------------------------------------------------------------------- open / load / convert


@pytest.mark.parametrize("name", NAMES)
def test_open_equals_the_engine_bit_for_bit(name):
    """fp32 masters (the tied weight from stage 0's optimizer), frozen params and buffers from their layer files."""
    with zeroio.open(LAYOUTS / name) as ckpt:
        assert list(ckpt) == KEYS
        assert_state_dicts_equal(ckpt.state_dict(), _engine(name))
        tied = ckpt.info("tied_modules.embed.weight")
        assert tied.kind == "trainable"
        assert tied.files[0].name.endswith("mp_rank_00_optim_states.pt")
        assert [p.name for p in ckpt.info("5.running").files] == ["layer_05-model_states.pt"]
        assert ckpt.info("5.running").kind == "buffer"
        frozen = name == FROZEN_FIXTURE
        assert ckpt.info("3.weight").kind == ("frozen" if frozen else "trainable")
        if frozen:
            assert [p.name for p in ckpt.info("3.weight").files] == ["layer_03-model_states.pt"]


@pytest.mark.parametrize("name", NAMES)
def test_metadata_says_pipeline(name):
    m = _manifest(name)
    with zeroio.open(LAYOUTS / name) as ckpt:
        meta = ckpt.metadata
        assert (meta.layout, dict(meta.parallel)) == ("pipeline", {"dp": m["dp"], "pp": 2})
        assert meta.zero_stage == m["stage"]
        assert meta.train_dtype == (torch.bfloat16 if m["dtype"] == "bf16" else torch.float32)
        assert meta.tag == TAG and meta.global_step == 2


@pytest.mark.parametrize("name", NAMES)
def test_load_into_the_pipeline_equivalent_module(name):
    model = _PipelineEquivalent()
    zeroio.load(LAYOUTS / name, model)
    assert_state_dicts_equal(model.state_dict(), _engine(name))


def test_load_into_a_plain_module_with_key_map():
    model = _PlainNet()
    zeroio.load(LAYOUTS / FROZEN_FIXTURE, model, key_map=PLAIN_KEYS)
    expected = {PLAIN_KEYS[k]: v for k, v in _engine(FROZEN_FIXTURE).items()}
    assert_state_dicts_equal(model.state_dict(), expected)


@pytest.mark.parametrize("name", NAMES)
def test_convert_to_safetensors_equals_the_engine(name, tmp_path):
    zeroio.convert(LAYOUTS / name, tmp_path / "out", progress=False)
    assert_state_dicts_equal(load_file(tmp_path / "out" / "model.safetensors"), _engine(name))


def test_inspect_shows_the_layout_and_sources(capsys):
    assert main(["inspect", str(LAYOUTS / FROZEN_FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "layout      pipeline" in out
    assert "parallel    dp=2 pp=2" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line and line.split()[0] in KEYS}
    assert rows["3.weight"].split()[-1] == "layer_03-model_states.pt"
    assert "frozen" in rows["3.weight"]
    assert rows["5.running"].split()[-1] == "layer_05-model_states.pt"
    assert rows["5.scale"].split()[-1] == "zero_pp_rank_1_mp_rank_01_optim_states.pt"  # dp rank 1's partition


# --------------------------------------------------------------------------- DeepSpeed's own tool


@pytest.mark.parametrize("name", NAMES)
def test_zero_to_fp32_fails_with_attribute_error(name):
    """DeepSpeed 0.19.8's zero_to_fp32 reads ``module`` of mp_rank_00, which a pipeline stage saves as None."""
    assert _manifest(name)["zero_to_fp32_fails"] is True
    assert not (LAYOUTS / name / "expected" / "zero_to_fp32.pt").exists()
    assert (LAYOUTS / name / "expected" / "zero_to_fp32.error").read_text() == DS_ERROR + "\n"


# --------------------------------------------------------------------------- refusals, each naming the file


def test_missing_layer_file_is_named(tmp_path):
    root = _copy(tmp_path, FROZEN_FIXTURE)
    (root / TAG / "layer_05-model_states.pt").unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match=r"layer_05-model_states\.pt.*5\."):
        zeroio.open(root)


def test_missing_tied_layer_file_is_refused(tmp_path):
    root = _copy(tmp_path, NAMES[0])
    (root / TAG / "layer_00-model_states.pt").unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match=r"tied_modules\.embed\.weight"):
        zeroio.open(root)


def test_missing_stage_model_states_is_named(tmp_path):
    root = _copy(tmp_path, FROZEN_FIXTURE)
    (root / TAG / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match=r"mp_rank_01_model_states\.pt"):
        zeroio.open(root)


def test_missing_optimizer_rank_is_named(tmp_path):
    root = _copy(tmp_path, FROZEN_FIXTURE)
    (root / TAG / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match=r"zero_pp_rank_1_mp_rank_01_optim_states\.pt"):
        zeroio.open(root)


def test_layer_file_from_another_save_is_named(tmp_path):
    """layer_04 of the bf16 run has the same names and shapes; its weights are not this run's masters."""
    root = _copy(tmp_path, FROZEN_FIXTURE)
    shutil.copy(LAYOUTS / NAMES[0] / TAG / "layer_04-model_states.pt", root / TAG / "layer_04-model_states.pt")
    with pytest.raises(errors.CheckpointFormatError, match=r"layer_04-model_states\.pt.*another save"):
        zeroio.open(root)


def test_layer_file_under_another_name_is_named(tmp_path):
    root = _copy(tmp_path, FROZEN_FIXTURE)
    shutil.copy(root / TAG / "layer_04-model_states.pt", root / TAG / "layer_01-model_states.pt")
    with pytest.raises(errors.CheckpointFormatError, match=r"layer_01-model_states\.pt.*saved as 'layer_04"):
        zeroio.open(root)


def test_optimizer_file_from_another_save_is_named(tmp_path):
    """Stage 1's optimizer file of the bf16 run under this run's name: the name inside the archive differs."""
    root = _copy(tmp_path, FROZEN_FIXTURE)
    target = root / TAG / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    shutil.copy(LAYOUTS / NAMES[0] / TAG / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", target)
    with pytest.raises(errors.CheckpointFormatError, match=r"zero_pp_rank_0_mp_rank_01_optim_states\.pt"):
        zeroio.open(root)


def test_mixed_optimizer_prefixes_are_named(tmp_path):
    root = _copy(tmp_path, FROZEN_FIXTURE)
    tag_dir = root / TAG
    (tag_dir / "zero_pp_rank_1_mp_rank_01_optim_states.pt").rename(
        tag_dir / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"
    )
    with pytest.raises(errors.CheckpointFormatError, match=r"bf16_zero_pp_rank_1_mp_rank_01_optim_states\.pt"):
        zeroio.open(root)


def test_stage_model_states_hold_names_only(tmp_path):
    """Another run's stage 1 model states with the same parameter names change nothing: every value comes from
    the optimizer and layer files, which are checked against each other."""
    root = _copy(tmp_path, FROZEN_FIXTURE)
    shutil.copy(LAYOUTS / NAMES[0] / TAG / "mp_rank_01_model_states.pt", root / TAG / "mp_rank_01_model_states.pt")
    with zeroio.open(root) as ckpt:
        assert_state_dicts_equal(ckpt.state_dict(), _engine(FROZEN_FIXTURE))


def test_tensor_parallel_layer_files_are_refused(tmp_path):
    root = _copy(tmp_path, NAMES[0])
    (root / TAG / "layer_01-model_states.pt").rename(root / TAG / "layer_01-model_01-model_states.pt")
    with pytest.raises(errors.UnsupportedCheckpointError, match=r"tensor parallelism"):
        zeroio.open(root)


def test_pipeline_without_optimizer_files_is_refused(tmp_path):
    """fp32/fp16 ZeRO-0 pipelines write no '*_optim_states.pt' (the masters are not in the layer files at fp16)."""
    root = _copy(tmp_path, FROZEN_FIXTURE)
    for path in (root / TAG).glob("*_optim_states.pt"):
        path.unlink()
    with pytest.raises(errors.UnsupportedCheckpointError, match=r"without ZeRO optimizer files"):
        zeroio.open(root)
