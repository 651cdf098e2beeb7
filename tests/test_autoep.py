"""AutoEP MoE at ZeRO-3 (DeepSpeed 0.19.8 ``expert_parallel``): open, load, convert, inspect, optimizer state.

The fixtures in ``fixtures/layouts/autoep_*`` were written by DeepSpeed itself (``fixtures/generate_autoep.py``).
Their ``expected/engine.pt`` holds the live engine's fp32 masters (``safe_get_full_fp32_param`` on every rank, each
rank's expert stack placed at its global expert ids), ``expected/optimizer.pt`` its Adam moments
(``safe_get_full_optimizer_state``), ``expected/ds_to_universal.pt`` what DeepSpeed's ``ds_to_universal`` writes.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES, assert_state_dicts_equal
from safetensors.torch import load_file

import zeroio
from zeroio import errors
from zeroio.cli import main

LAYOUTS = FIXTURES / "layouts"
NAMES = ["autoep_z3_ws2_ep2_bf16", "autoep_z3_ws2_ep1_fp32", "autoep_z3_ws4_ep2_fp32"]
TAG = "global_step3"
EXPERTS = [f"model.layers.0.mlp.experts.w{i}" for i in (1, 2, 3)]
ZERO_TO_FP32_ERROR = (
    "NotImplementedError: zero_to_fp32 does not support AutoEP ZeRO-3 partition-native checkpoints. AutoEP expert "
    "parameters are partitioned over expert replica groups, so global data-parallel consolidation would produce "
    "incomplete expert tensors. Use ds_to_universal.py for expert-aware conversion.\n"
)


def _expected(name: str, what: str = "engine") -> dict:
    return torch.load(LAYOUTS / name / "expected" / f"{what}.pt", weights_only=True)


def _manifest(name: str) -> dict:
    return json.loads((LAYOUTS / name / "manifest.json").read_text())


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(LAYOUTS / name, root, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return root


@pytest.mark.parametrize("name", NAMES)
def test_open_equals_the_engine_bit_for_bit(name):
    """Every tensor, in model.state_dict() order, with experts as logical [E, ...] tensors under post-AutoEP names."""
    expected = _expected(name)
    with zeroio.open(LAYOUTS / name) as ckpt:
        assert list(ckpt) == list(expected)
        assert_state_dicts_equal(ckpt.state_dict(), expected)
        assert ckpt.info(EXPERTS[0]).shape == (4, 6, 8)
        assert ckpt.info(EXPERTS[1]).shape == (4, 8, 6)
        assert all(ckpt.info(n).kind == "trainable" for n in ckpt)


@pytest.mark.parametrize("name", NAMES)
def test_metadata_records_the_layout(name):
    cfg = _manifest(name)
    ws, ep = cfg["world_size"], cfg["ep_size"]
    with zeroio.open(LAYOUTS / name) as ckpt:
        meta = ckpt.metadata
    assert (meta.format, meta.zero_stage, meta.world_size, meta.layout) == ("zero", 3, ws, "autoep")
    assert dict(meta.parallel) == {"dp": ws, "ep": ep, "edp": ws // ep}
    assert meta.train_dtype == (torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32)
    [layer] = meta.extra["autoep_layers"]
    assert layer["expert_key_prefix"] == "model.layers.0.mlp.experts"
    assert layer["placement"] == [list(range(e * 4 // ep, (e + 1) * 4 // ep)) for e in range(ep)]


@pytest.mark.parametrize("name", NAMES)
def test_zeroio_agrees_with_ds_to_universal(name):
    """DeepSpeed's own expert-aware converter (run at fixture time) wrote the very same fp32 tensors."""
    with zeroio.open(LAYOUTS / name) as ckpt:
        assert_state_dicts_equal(ckpt.state_dict(), _expected(name, "ds_to_universal"))


@pytest.mark.parametrize("name", NAMES)
def test_zero_to_fp32_refuses_autoep(name):
    """What DeepSpeed's zero_to_fp32 does on these folders (recorded at fixture time): NotImplementedError."""
    assert (LAYOUTS / name / "expected" / "zero_to_fp32.error").read_text() == ZERO_TO_FP32_ERROR


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_state_of_experts_and_dense_params(name):
    """Adam moments come back in the parameters' logical shapes, equal to the engine's own."""
    moments = _expected(name, "optimizer")
    with zeroio.open(LAYOUTS / name) as ckpt:
        for param in ckpt:
            state = ckpt.optimizer_state(param)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], moments[key][param]), (param, key)
            assert float(state["step"]) == 3.0
        assert ckpt.optimizer_state(EXPERTS[0]).get("moe") is True  # the expert param group
        assert "moe" not in ckpt.optimizer_state("lm_head.weight")


def test_convert_writes_the_reference(tmp_path):
    name = "autoep_z3_ws4_ep2_fp32"
    result = zeroio.convert(LAYOUTS / name, tmp_path / "out", progress=False, max_shard_size=1500)
    assert len(result.files) > 1  # sharded: memory and files stay flat whatever the expert count
    written: dict[str, torch.Tensor] = {}
    for file in result.files:
        written.update(load_file(file))
    assert_state_dicts_equal(written, _expected(name))


def test_convert_bf16_keeps_the_fp32_masters_rounded_once(tmp_path):
    name = "autoep_z3_ws2_ep2_bf16"
    result = zeroio.convert(LAYOUTS / name, tmp_path / "out", dtype="bf16", progress=False)
    written = load_file(result.files[0])
    assert_state_dicts_equal(written, {k: v.to(torch.bfloat16) for k, v in _expected(name).items()})


def test_chunks_stream_an_expert_tensor_in_pieces():
    """An expert tensor streams in small chunks (memory bounded by the chunk, not the tensor)."""
    name = "autoep_z3_ws2_ep2_bf16"
    with zeroio.open(LAYOUTS / name) as ckpt:
        chunks = list(ckpt.iter_chunks(EXPERTS[0], chunk_bytes=4 * 40))
    assert len(chunks) == 5 and max(c.numel() for c in chunks) == 40  # 192 fp32 elements
    assert torch.equal(torch.cat(chunks), _expected(name)[EXPERTS[0]].reshape(-1))


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.zeros(4, 6, 8))
        self.w2 = torch.nn.Parameter(torch.zeros(4, 8, 6))
        self.w3 = torch.nn.Parameter(torch.zeros(4, 6, 8))


class _PlainMoE(torch.nn.Module):
    """A plain (no DeepSpeed) module holding all experts, the router named ``gate`` as in the HF source model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(13, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.experts = _Experts()
        self.lm_head = torch.nn.Linear(8, 13, bias=False)


_KEY_MAP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.layers.0.norm.weight": "norm.weight",
    "model.layers.0.norm.bias": "norm.bias",
    "model.layers.0.mlp.router.gate.weight": "gate.weight",
    **{name: f"experts.{name.rsplit('.', 1)[1]}" for name in EXPERTS},
    "lm_head.weight": "lm_head.weight",
}


@pytest.mark.parametrize("name", ["autoep_z3_ws2_ep2_bf16", "autoep_z3_ws4_ep2_fp32"])
def test_load_into_a_plain_module_with_key_map(name):
    model = _PlainMoE()
    report = zeroio.load(LAYOUTS / name, model, key_map=_KEY_MAP)
    assert not report.missing_keys and not report.unexpected_keys
    expected = {_KEY_MAP[k]: v for k, v in _expected(name).items()}
    assert_state_dicts_equal(model.state_dict(), expected)


def test_inspect_shows_layout_and_sources(capsys):
    assert main(["inspect", str(LAYOUTS / "autoep_z3_ws2_ep2_bf16")]) == 0
    out = capsys.readouterr().out
    assert "layout      autoep\n" in out
    assert "parallel    dp=2 ep=2 edp=1\n" in out
    expert_row = next(line for line in out.splitlines() if line.startswith(EXPERTS[0]))
    assert "(4, 6, 8)" in expert_row
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt, bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in (
        expert_row
    )
    assert main(["inspect", "--json", str(LAYOUTS / "autoep_z3_ws2_ep2_bf16")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["metadata"]["layout"] == "autoep"
    assert summary["metadata"]["parallel"] == {"dp": 2, "ep": 2, "edp": 1}


def test_reshard_refuses_autoep(tmp_path):
    with pytest.raises(errors.UnsupportedCheckpointError, match="MiCS or AutoEP"):
        zeroio.reshard(LAYOUTS / "autoep_z3_ws2_ep2_bf16", tmp_path / "out", world_size=1)


# --------------------------------------------------------------------------- crafted inconsistencies


def _edit_model_states(root: Path, edit) -> None:
    """Edit every rank's model states (plain data: they reference no DeepSpeed class) and save them back."""
    for path in sorted((root / TAG).glob("zero_pp_rank_*_model_states.pt")):
        tree = torch.load(path, weights_only=True)
        rank = int(path.name.split("_")[3])
        edit(tree["ds_autoep_layers"][0], rank)
        torch.save(tree, path)


def _drop_expert_3(layer, rank):
    layer["expert_placement"]["ranks"][1]["experts"] = [2]


def _drop_ep_rank_1(layer, rank):
    del layer["expert_placement"]["ranks"][1]


def _both_claim_ep_rank_0(layer, rank):
    layer["ep_rank"] = 0


def _affine_map_swapped(layer, rank):
    ranks = layer["affine_maps"]["params"][EXPERTS[0]]["ranks"]
    ranks[0]["pieces"], ranks[1]["pieces"] = ranks[1]["pieces"], ranks[0]["pieces"]


def _not_partition_native(layer, rank):
    layer["checkpoint_format"] = "legacy"


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (_drop_expert_3, errors.CheckpointFormatError, r"expert\(s\) \[3\] of 4 on no rank"),
        (_drop_ep_rank_1, errors.CheckpointFormatError, r"leaves EP rank\(s\) \[1\] undescribed"),
        (_both_claim_ep_rank_0, errors.CheckpointFormatError, "both claim EP rank 0"),
        (_affine_map_swapped, errors.CheckpointFormatError, "affine map of .* disagrees with the expert placement"),
        (_not_partition_native, errors.UnsupportedCheckpointError, "'zero3_partitioned' format only"),
    ],
)
def test_inconsistent_autoep_records_are_refused(tmp_path, edit, error, message):
    root = _copy(tmp_path, "autoep_z3_ws2_ep2_bf16")
    _edit_model_states(root, edit)
    with pytest.raises(error, match=message):
        zeroio.open(root)


def test_a_missing_rank_is_refused(tmp_path):
    root = _copy(tmp_path, "autoep_z3_ws4_ep2_fp32")
    (root / TAG / "zero_pp_rank_3_mp_rank_00_model_states.pt").unlink()
    (root / TAG / "zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(errors.CheckpointFormatError):
        zeroio.open(root)


# --------------------------------------------------------------------------- native MoE at ZeRO-2 still reads


@pytest.mark.parametrize("name", ["moe_z2_ws2_ep2_bf16", "moe_z2_ws4_ep2_bf16"])
def test_native_moe_zero2_experts_and_their_optimizer_state(name):
    """deepspeed.moe at ZeRO-2 with ep=2: experts under GLOBAL ids equal the engine; their moments are read from
    the expert param group with the same plan (one rank's expert moments differ from another's)."""
    expected = torch.load(FIXTURES / name / "expected" / "engine.pt", weights_only=True)
    with zeroio.open(FIXTURES / name) as ckpt:
        assert ckpt.metadata.layout == "moe"
        assert_state_dicts_equal(ckpt.state_dict(), expected)
        experts = [n for n in ckpt if ".deepspeed_experts." in n and n.endswith(".0.weight")]
        assert len(experts) == ckpt.file_tree(ckpt.metadata.path / "mp_rank_00_model_states.pt")["num_experts"][0]
        states = [ckpt.optimizer_state(n) for n in experts]
    for n, state in zip(experts, states):
        assert state["exp_avg"].shape == expected[n].shape and state["exp_avg"].abs().sum() > 0
        assert state.get("moe") is True
    assert all(not torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in itertools.pairwise(states))
