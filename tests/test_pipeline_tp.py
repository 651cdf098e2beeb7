"""Pipeline + tensor parallel (3D, Megatron-DeepSpeed / GPT-NeoX): tp shards of every pipeline layer merged by rules.

The fixture ``fixtures/layouts/pipe_tp_z1_ws4_pp2tp2_fp32`` was written by DeepSpeed 0.19.8
(``fixtures/generate_pipeline_tp.py``): a ``PipelineModule`` over ``PipeModelDataParallelTopology(num_pp=2,
num_mp=2, num_dp=1)`` whose layers shard their own weights like Megatron's vocab-parallel embedding and
column/row-parallel linears. ``expected/engine.pt`` holds the live engines' fp32 masters concatenated over the tp
ranks along the dims the layers split them. ``PipelineModule`` records no partition, so ``tp_rules`` decide.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES
from safetensors.torch import load_file
from torch import nn

import zeroio
from zeroio import errors
from zeroio.cli import main

NAME = "pipe_tp_z1_ws4_pp2tp2_fp32"
CASE = FIXTURES / "layouts" / NAME
TAG = "global_step2"
BUFFERS = {"5.attention.dense.calls"}
SPLIT = {
    "0.word_embeddings.weight": "dim 0", "1.mlp.dense_h_to_4h.weight": "dim 0", "1.mlp.dense_h_to_4h.bias": "dim 0",
    "2.mlp.dense_4h_to_h.weight": "dim 1", "2.mlp.dense_4h_to_h.bias": "replicated",
    "3.input_layernorm.weight": "replicated", "3.input_layernorm.bias": "replicated",
    "4.attention.query_key_value.weight": "dim 0", "4.attention.query_key_value.bias": "dim 0",
    "5.attention.dense.weight": "dim 1", "5.attention.dense.bias": "replicated", "5.attention.dense.calls": "replicated",
}  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> dict[str, torch.Tensor]:
    return torch.load(CASE / "expected" / "engine.pt", weights_only=True)


def _assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, ordered: bool = True) -> None:
    assert list(got) == list(want) if ordered else sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / NAME
    shutil.copytree(CASE, root, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return root


def test_the_fixture_is_what_megatron_deepspeed_writes():
    """One layer file per (layer, tp rank); mp_rank_XX numbers (stage, tp rank) pipe-major; one optimizer file each."""
    names = sorted(p.name for p in (CASE / TAG).iterdir())
    assert [n for n in names if n.startswith("layer_")] == [
        f"layer_{layer:02d}-model_{tp:02d}-model_states.pt" for layer in range(6) for tp in range(2)
    ]
    assert [n for n in names if n.startswith("mp_rank_")] == [f"mp_rank_{r:02d}_model_states.pt" for r in range(4)]
    assert [n for n in names if n.startswith("zero_")] == [
        f"zero_pp_rank_0_mp_rank_{r:02d}_optim_states.pt" for r in range(4)
    ]
    manifest = json.loads((CASE / "manifest.json").read_text())
    assert (manifest["pp"], manifest["tp"], manifest["dp"], manifest["tp_rules"]) == (2, 2, 1, "megatron")


# --------------------------------------------------------------------------- open / load / convert / CLI


def test_open_with_the_megatron_preset_equals_the_engine(engine):
    with zeroio.open(CASE, tp_rules="megatron") as ckpt:
        _assert_bits(ckpt.state_dict(), engine)
        assert ckpt.metadata.layout == "pipeline"
        assert dict(ckpt.metadata.parallel) == {"dp": 1, "pp": 2, "tp": 2}
        assert {name: ckpt.partition(name) for name in ckpt} == SPLIT
        assert len(ckpt.metadata.extra["layer_files"]) == 12


def test_chunked_reads_of_a_row_parallel_weight_stay_exact(engine):
    """A dim-1 merge interleaves the tp ranks row by row: every chunk boundary must land right."""
    name = "5.attention.dense.weight"
    with zeroio.open(CASE, tp_rules="megatron") as ckpt:
        pieces = list(ckpt.iter_chunks(name, chunk_bytes=20))  # 5 floats: shard rows are 6 wide
    assert len(pieces) > 1 and all(p.numel() * p.element_size() <= 20 for p in pieces)
    assert torch.equal(torch.cat(pieces).view(torch.uint8), engine[name].reshape(-1).view(torch.uint8))


def test_load_equals_the_engine(engine):
    model = nn.Module()
    for key, value in engine.items():
        *path, leaf = key.split(".")
        module = model
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        if key in BUFFERS:
            module.register_buffer(leaf, torch.zeros_like(value))
        else:
            module.register_parameter(leaf, nn.Parameter(torch.zeros_like(value)))
    report = zeroio.load(CASE, model, tp_rules="megatron")
    assert not report.missing_keys and not report.unexpected_keys
    _assert_bits(model.state_dict(), engine)


def test_convert_equals_the_engine(engine, tmp_path):
    result = zeroio.convert(CASE, tmp_path / "out", tp_rules="megatron", progress=False)
    _assert_bits(load_file(str(result.files[0])), engine, ordered=False)


def test_cli_convert_and_inspect_with_a_preset(engine, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(CASE), str(out), "--quiet", "--tp-rules", "megatron"]) == 0
    _assert_bits(load_file(str(out / "model.safetensors")), engine, ordered=False)
    capsys.readouterr()
    assert main(["inspect", str(CASE), "--tp-rules", "megatron"]) == 0
    text = capsys.readouterr().out
    assert "layout      pipeline" in text and "parallel    dp=1 pp=2 tp=2" in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in SPLIT}
    assert rows["5.attention.dense.weight"].endswith(
        "mp_rank_02_optim_states.pt, zero_pp_rank_0_mp_rank_03_optim_states.pt"
    )
    assert rows["5.attention.dense.calls"].endswith("layer_05-model_00-model_states.pt")


def test_user_rules_alone_rebuild_it(engine):
    rules = {r"\.(word_embeddings|dense_h_to_4h|query_key_value)\.": 0, r"\.(dense_4h_to_h|dense)\.weight$": 1}
    rules |= {r"(norm\.|\.bias$)": "replicated"}
    rules[r"\.(dense_h_to_4h|query_key_value)\.bias$"] = 0
    with pytest.raises(errors.UnsupportedCheckpointError, match="patterns disagree"):
        zeroio.open(CASE, tp_rules=rules)  # the column biases match both 0 and 'replicated'
    rules = {r"\.(word_embeddings|dense_h_to_4h|query_key_value)\.": 0, r"\.(dense_4h_to_h|dense)\.weight$": 1}
    rules |= {r"(norm\.|\.(dense_4h_to_h|dense)\.bias$)": "replicated"}
    with zeroio.open(CASE, tp_rules=rules) as ckpt:
        _assert_bits(ckpt.state_dict(), engine)


# --------------------------------------------------------------------------- refusals


def test_without_rules_every_split_tensor_is_refused_by_name():
    with pytest.raises(errors.UnsupportedCheckpointError, match=r"pipeline \+ tensor parallel \(pp=2, tp=2") as err:
        zeroio.open(CASE)
    assert sorted(err.value.found) == sorted(set(SPLIT) - BUFFERS)  # buffers are never split
    assert "tp_rules" in str(err.value)


def test_a_preset_for_other_names_leaves_them_refused():
    with pytest.raises(errors.UnsupportedCheckpointError) as err:
        zeroio.open(CASE, tp_rules="neox")
    assert "0.word_embeddings.weight" in err.value.found  # NeoX calls it embed_in
    assert "1.mlp.dense_h_to_4h.weight" not in err.value.found


def test_wrong_rules_are_refused_not_merged():
    """'replicated' for a split tensor: its shards differ; a dim a bias does not have: the shapes do not fit."""
    with pytest.raises(errors.UnsupportedCheckpointError) as err:
        zeroio.open(CASE, tp_rules={".": "replicated"})
    assert "2.mlp.dense_4h_to_h.weight" in err.value.found and "3.input_layernorm.weight" not in err.value.found
    with pytest.raises(errors.UnsupportedCheckpointError, match="does not fit the shard shapes"):
        zeroio.open(CASE, tp_rules={r"\.bias$": 1, r"\.weight$": 0})


def test_swapped_tp_shards_are_refused(tmp_path):
    """A layer file of the other tp rank is not the master of this one: refused, never merged in the wrong order."""
    root = _copy(tmp_path)
    first, second = root / TAG / "layer_01-model_00-model_states.pt", root / TAG / "layer_01-model_01-model_states.pt"
    first.rename(tmp_path / "swap")
    second.rename(first)
    (tmp_path / "swap").rename(second)
    with pytest.raises(errors.CheckpointFormatError, match="layer_01-model_0"):
        zeroio.open(root, tp_rules="megatron")


@pytest.mark.parametrize(
    "missing",
    ["layer_03-model_01-model_states.pt", "mp_rank_03_model_states.pt", "zero_pp_rank_0_mp_rank_02_optim_states.pt"],
)
def test_a_missing_file_is_named(tmp_path, missing):
    root = _copy(tmp_path)
    (root / TAG / missing).unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match=missing):
        zeroio.open(root, tp_rules="megatron")


def test_optimizer_state_is_refused():
    with zeroio.open(CASE, tp_rules="megatron") as ckpt, pytest.raises(errors.UnsupportedCheckpointError):
        ckpt.optimizer_state("1.mlp.dense_h_to_4h.weight")


def test_deepspeed_zero_to_fp32_fails_on_it():
    """DeepSpeed 0.19.8's zero_to_fp32 reads ``module`` of mp_rank_00, which a pipeline stage saves as None."""
    manifest = json.loads((CASE / "manifest.json").read_text())
    assert manifest["zero_to_fp32_fails"] is True
    assert not (CASE / "expected" / "zero_to_fp32.pt").exists()
    error = (CASE / "expected" / "zero_to_fp32.error").read_text()
    assert error == "AttributeError: 'NoneType' object has no attribute 'items'\n"


def test_deepspeed_ds_to_universal_refuses_it_or_merges_it_wrong(engine):
    """ds_to_universal (run at fixture time) asserts on the missing ``universal_checkpoint_info``; with
    ``--inject_missing_state`` it concatenates every tensor on dim 0: the column-parallel ones come out right, the
    row-parallel weights and the replicated tensors doubled into wrong shapes, and the buffer is dropped."""
    manifest = json.loads((CASE / "manifest.json").read_text())
    assert manifest["ds_to_universal_refuses"] is True
    error = (CASE / "expected" / "ds_to_universal.error").read_text()
    assert error.startswith("AssertionError: Required universal_checkpoint_info state is missing")
    theirs = torch.load(CASE / "expected" / "ds_to_universal.pt", weights_only=True)
    assert sorted(theirs) == sorted(set(engine) - BUFFERS)
    right = {name for name, value in theirs.items() if torch.equal(value, engine[name])}
    assert right == {name for name, rule in SPLIT.items() if rule == "dim 0"}
    assert theirs["5.attention.dense.weight"].shape == (16, 6)  # [8, 12] in the engine
    assert theirs["3.input_layernorm.weight"].shape == (16,)  # a replicated [8], doubled
