"""Tensor-parallel (DeepSpeed AutoTP) checkpoints: merged bit for bit from their tp ranks, never guessed.

Fixtures (``fixtures/layouts/``, written by ``fixtures/generate_autotp.py``): ``autotp_z1_ws2_tp2_bf16``
(LLaMA names, tp 2, bf16, frozen split and replicated params, buffers) and ``autotp_z1_ws4_dp2_tp2_fp32``
(Megatron names, dp 2 x tp 2). ``expected/engine.pt``: the live engine's fp32 masters (``safe_get_full_fp32_param``
per tp rank), frozen params and buffers, concatenated across tp ranks along the partitions the generator set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zeroio
from zeroio.cli import main
from zeroio.errors import UnsupportedCheckpointError

LAYOUTS = Path(__file__).resolve().parent.parent / "fixtures" / "layouts"
TP2_BF16 = "autotp_z1_ws2_tp2_bf16"
DP2_TP2_FP32 = "autotp_z1_ws4_dp2_tp2_fp32"
FIXTURES = [TP2_BF16, DP2_TP2_FP32]


def _reference(name: str) -> dict[str, torch.Tensor]:
    return torch.load(LAYOUTS / name / "expected" / "engine.pt", weights_only=True)


def _assert_bits(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, ordered: bool = True) -> None:
    assert list(got) == list(expected) if ordered else sorted(got) == sorted(expected)
    for key, want in expected.items():
        value = got[key]
        assert value.dtype == want.dtype and value.shape == want.shape, key
        assert torch.equal(value.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request: pytest.FixtureRequest) -> tuple[str, dict[str, torch.Tensor]]:
    return request.param, _reference(request.param)


# --------------------------------------------------------------------------- open / load / convert


def test_open_equals_engine_bit_for_bit(fixture):
    name, expected = fixture
    with zeroio.open(LAYOUTS / name) as ckpt:
        _assert_bits(ckpt.state_dict(), expected)
        meta = ckpt.metadata
        assert meta.layout == "tensor-parallel"
        assert dict(meta.parallel) == {"dp": 2 if name == DP2_TP2_FP32 else 1, "tp": 2}
        assert meta.zero_stage == 1


def test_chunked_reads_stay_within_the_chunk(fixture):
    """A merged tensor streams in chunks smaller than one shard row: the runs of both ranks interleave."""
    name, expected = fixture
    with zeroio.open(LAYOUTS / name) as ckpt:
        for key, want in expected.items():
            chunks = list(ckpt.iter_chunks(key, chunk_bytes=12))
            assert all(c.numel() * c.element_size() <= 12 for c in chunks)
            got = torch.cat(chunks).view(want.shape) if chunks else torch.empty(0)
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key


def test_frozen_params_keep_the_training_dtype_and_split():
    with zeroio.open(LAYOUTS / TP2_BF16) as ckpt:
        k_proj = ckpt.info("model.layers.1.self_attn.k_proj.weight")  # frozen, column-parallel
        assert (k_proj.kind, k_proj.dtype, k_proj.shape) == ("frozen", torch.bfloat16, (8, 8))
        assert [f.name for f in k_proj.files] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        assert ckpt.info("model.norm.weight").dtype == torch.bfloat16  # frozen, replicated
        assert ckpt.partition("model.layers.0.self_attn.o_proj.weight") == "dim 1"
        assert ckpt.partition("model.layers.0.self_attn.v_proj.bias") == "dim 0"  # column-parallel bias
        assert ckpt.partition("model.layers.0.self_attn.o_proj.bias") == "replicated"
        assert ckpt.metadata.extra["tp_rule_source"]["model.layers.0.self_attn.q_proj.weight"] == "recorded"


def _module_for(expected: dict[str, torch.Tensor], buffers: set[str]) -> nn.Module:
    """A module whose state dict has exactly the reference's names, shapes and dtypes (zero-filled)."""
    root = nn.Module()
    for key, value in expected.items():
        *path, leaf = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        blank = torch.zeros_like(value)
        if key in buffers:
            module.register_buffer(leaf, blank)
        else:
            module.register_parameter(leaf, nn.Parameter(blank, requires_grad=blank.is_floating_point()))
    return root


def test_load_equals_engine_bit_for_bit(fixture):
    name, expected = fixture
    model = _module_for(expected, {"scale", "calls"})
    rules = "megatron" if name == DP2_TP2_FP32 else None  # rules agreeing with the recorded partitions are accepted
    report = zeroio.load(LAYOUTS / name, model, tp_rules=rules)
    assert not report.missing_keys and not report.unexpected_keys
    _assert_bits(model.state_dict(), expected)


def test_convert_equals_engine_bit_for_bit(fixture, tmp_path):
    name, expected = fixture
    result = zeroio.convert(LAYOUTS / name, tmp_path / "out", progress=False)
    _assert_bits(load_file(str(result.files[0])), expected, ordered=False)


def test_cli_convert_with_a_preset(tmp_path):
    expected = _reference(DP2_TP2_FP32)
    assert (
        main(["convert", str(LAYOUTS / DP2_TP2_FP32), str(tmp_path / "out"), "--quiet", "--tp-rules", "megatron"]) == 0
    )
    _assert_bits(load_file(str(tmp_path / "out" / "model.safetensors")), expected, ordered=False)


# --------------------------------------------------------------------------- inspect


def test_inspect_shows_the_layout_and_where_tensors_come_from(capsys):
    assert main(["inspect", str(LAYOUTS / DP2_TP2_FP32)]) == 0
    out = capsys.readouterr().out
    assert "layout      tensor-parallel\n" in out
    assert "parallel    dp=2 tp=2\n" in out
    row = next(line for line in out.splitlines() if line.startswith("layers.0.self_attention.dense.weight "))
    assert "(8, 24)" in row  # the row-parallel weight, merged on dim 1 from two (8, 12) shards
    assert row.endswith("zero_pp_rank_0_mp_rank_00_optim_states.pt, zero_pp_rank_0_mp_rank_01_optim_states.pt")
    assert main(["inspect", "--json", str(LAYOUTS / TP2_BF16)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["metadata"]["layout"] == "tensor-parallel"
    assert summary["metadata"]["parallel"] == {"dp": 1, "tp": 2}
    files = {r["name"]: r["files"] for r in summary["tensors"]}
    assert files["model.layers.0.self_attn.v_proj.bias"] == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ]
    assert files["lm_head.weight"] == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]  # replicated: rank 0's


# --------------------------------------------------------------------------- rules: presets, refusals


def test_megatron_preset_alone_rebuilds_the_megatron_named_checkpoint():
    """The recorded partitions set aside, the preset's name rules give the same tensors bit for bit."""
    with zeroio.open(LAYOUTS / DP2_TP2_FP32, tp_rules="megatron", ignore_recorded_tp=True) as ckpt:
        assert set(ckpt.metadata.extra["tp_rule_source"].values()) == {"tp_rules"}
        _assert_bits(ckpt.state_dict(), _reference(DP2_TP2_FP32))


def test_without_recorded_partitions_or_rules_every_parameter_is_refused_by_name():
    with pytest.raises(UnsupportedCheckpointError) as err:
        zeroio.open(LAYOUTS / DP2_TP2_FP32, ignore_recorded_tp=True)
    assert err.value.found == list(_reference(DP2_TP2_FP32))
    assert "tp_rules" in str(err.value) and "mp_rank_00_model_states.pt" in str(err.value)


def test_a_preset_for_other_names_leaves_the_unmatched_ones_refused():
    """NeoX names its attention 'attention.*', not 'self_attention.*': those (and final_layernorm) are refused."""
    with pytest.raises(UnsupportedCheckpointError) as err:
        zeroio.open(LAYOUTS / DP2_TP2_FP32, tp_rules="neox", ignore_recorded_tp=True)
    assert err.value.found == [
        f"layers.{i}.self_attention.{p}"
        for i in (0, 1)
        for p in ("query_key_value.weight", "query_key_value.bias", "dense.weight", "dense.bias")
    ] + ["final_layernorm.weight", "final_layernorm.bias"]


def test_rules_contradicting_the_recorded_partition_are_refused():
    with pytest.raises(UnsupportedCheckpointError, match="recorded as dim 1, tp_rules say dim 0") as err:
        zeroio.open(LAYOUTS / DP2_TP2_FP32, tp_rules={r"dense\.weight$": 0})
    assert err.value.found == ["layers.0.self_attention.dense.weight", "layers.1.self_attention.dense.weight"]


def test_wrong_rules_are_refused_not_merged():
    """'replicated' for split tensors: the shards differ, so the claim is refused; disagreeing patterns too."""
    with pytest.raises(UnsupportedCheckpointError) as err:
        zeroio.open(LAYOUTS / TP2_BF16, tp_rules={".*": "replicated"}, ignore_recorded_tp=True)
    assert "model.layers.0.self_attn.o_proj.weight" in err.value.found  # same shard shapes, different values
    assert "lm_head.weight" not in err.value.found
    with pytest.raises(UnsupportedCheckpointError, match="patterns disagree"):
        zeroio.open(LAYOUTS / TP2_BF16, tp_rules={".*": "replicated", "proj": 0}, ignore_recorded_tp=True)


@pytest.mark.parametrize(
    "rules",
    ["bogus", {"x": -1}, {"x": "rows"}, {"(": 0}, '{"x": 1.5}', "{not json"],
)
def test_malformed_rules_are_argument_errors(rules):
    with pytest.raises(ValueError, match="tp_rules"):
        zeroio.open(LAYOUTS / TP2_BF16, tp_rules=rules)


def test_a_missing_tp_rank_is_refused(tmp_path):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(LAYOUTS / TP2_BF16, root)
    for path in (root / "global_step2").glob("*mp_rank_01*"):
        path.rename(path.with_name(path.name.replace("mp_rank_01", "mp_rank_02")))
    with pytest.raises(zeroio.errors.CheckpointNotFoundError, match="model-parallel rank"):
        zeroio.open(root)


# --------------------------------------------------------------------------- DeepSpeed's own consolidation


def test_deepspeed_zero_to_fp32_refuses_tensor_parallel_checkpoints(tmp_path):
    """DeepSpeed 0.19.8's get_fp32_state_dict_from_zero_checkpoint counts every tp rank's optimizer files as
    data-parallel ranks and raises ValueError."""
    pytest.importorskip("deepspeed")
    script = textwrap.dedent(
        """
        import sys, warnings
        warnings.simplefilter("ignore")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        for path in sys.argv[1:]:
            try:
                get_fp32_state_dict_from_zero_checkpoint(path)
                print("OK")
            except Exception as exc:
                print(f"{type(exc).__name__}: {str(exc).replace(path, '{fixture}')}")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *(str(LAYOUTS / n) for n in FIXTURES)],
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("OK", "ValueError", "Error"))]
    message = (
        "ValueError: Expected {} of '*_optim_states.pt' under '{{fixture}}/global_step2' but found {} files. Possibly "
        "due to an overwrite of an old checkpoint, or a checkpoint didn't get saved by one or more processes."
    )
    assert lines == [message.format(1, 2), message.format(2, 4)], proc.stderr[-2000:]
    for name, line in zip(FIXTURES, lines, strict=True):
        assert (LAYOUTS / name / "expected" / "zero_to_fp32.error").read_text().strip() == line
