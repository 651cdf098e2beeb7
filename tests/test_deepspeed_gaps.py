"""Where DeepSpeed's own consolidation is wrong or fails, zeroio returns what the trained engine held.

The truth is ``expected/engine.pt`` (the live engine's tensors at save time). Where DeepSpeed's
``zero_to_fp32`` disagrees, a test asserts that it still does, both from the recorded reference and by
running the installed DeepSpeed, so the suite notices when DeepSpeed fixes it.
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
from fixture_data import FIXTURES, assert_state_dicts_equal, manifest, reference

import zeroio
from zeroio import errors
from zeroio.cli import main

FROZEN = ["frozen.bias", "frozen.weight"]
ZERO1 = ["z1_ws2_fp32", "z1_ws3_bf16"]
ZERO2 = ["z2_ws2_fp32", "z2_ws2_bf16", "z2_ws3_fp16"]
STAGE0 = ["z0_ws2_bf16", "z0_ws2_fp16_fused", "z0_ws2_fp32"]
MOE = ["moe_z2_ws2_fp32", "moe_z2_ws2_ep2_bf16", "moe_z2_ws4_ep2_bf16"]
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts"

# What DeepSpeed 0.19.8's get_fp32_state_dict_from_zero_checkpoint raises ({fixture}: the fixture folder).
DS_ERRORS = {
    "z0_ws2_bf16": "TypeError: 'NoneType' object is not iterable",
    "z0_ws2_fp16_fused": "TypeError: 'NoneType' object is not iterable",
    "z0_ws2_fp32": "TypeError: 'NoneType' object is not iterable",
    "z1_ws2_bf16_fp32acc": (
        "ValueError: {fixture}/global_step2/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt is not a zero checkpoint"
    ),
    **{
        name: "ValueError: {fixture}/global_step2/layer_0_expert_0_mp_rank_00_model_states.pt is not a model state "
        "checkpoint"
        for name in MOE
    },
}


def _engine(name: str) -> dict[str, torch.Tensor]:
    expected = reference(name, "engine")
    assert expected is not None and all(v is not None for v in expected.values())
    return expected


def _deepspeed_pickle(path: Path) -> dict:
    """What DeepSpeed itself reads from a rank file (its own classes included): the reference, not zeroio."""
    return torch.load(path, weights_only=False, map_location="cpu")


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return root


@pytest.fixture(scope="module")
def live_deepspeed(tmp_path_factory):
    """Run the installed DeepSpeed's zero_to_fp32 on the gap fixtures, in a subprocess (DeepSpeed stays out of
    the test process); returns {name: state dict or error line}."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("live_ds")
    names = ZERO1 + ZERO2 + list(DS_ERRORS)
    script = textwrap.dedent(
        """
        import sys, warnings
        from pathlib import Path
        import torch
        warnings.simplefilter("ignore")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
        for name in sys.argv[3:]:
            try:
                sd = get_fp32_state_dict_from_zero_checkpoint(str(fixtures / name))
                torch.save(dict(sd), out / f"{name}.pt")
            except Exception as exc:
                message = str(exc).replace(str(fixtures / name), "{fixture}")
                (out / f"{name}.error").write_text(f"{type(exc).__name__}: {message}")
        """
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(FIXTURES), str(out), *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results: dict[str, object] = {}
    for name in names:
        error = out / f"{name}.error"
        results[name] = error.read_text() if error.exists() else torch.load(out / f"{name}.pt", weights_only=True)
    return results


# --------------------------------------------------------------------------- ZeRO-1/2 frozen parameters


@pytest.mark.parametrize("name", ZERO1 + ZERO2)
def test_frozen_params_equal_live_engine(name):
    """ZeRO-1/2: zeroio returns every frozen parameter, equal to the engine's, in its training dtype."""
    expected = _engine(name)
    with zeroio.open(FIXTURES / name) as ckpt:
        actual = ckpt.state_dict()
        kinds = {k: ckpt.info(k).kind for k in FROZEN}
    assert_state_dicts_equal(actual, expected)
    assert kinds == {"frozen.bias": "frozen", "frozen.weight": "frozen"}
    train = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[manifest(name)["dtype"]]
    assert {actual[k].dtype for k in FROZEN} == {train}


@pytest.mark.parametrize("name", ZERO1)
def test_zero1_deepspeed_reference_drops_frozen_params(name):
    """DeepSpeed 0.19.8's zero_to_fp32 drops ZeRO-1 frozen parameters; everything else it returns is right."""
    ds = reference(name)
    expected = _engine(name)
    assert sorted(set(expected) - set(ds)) == FROZEN
    assert_state_dicts_equal(ds, {k: v for k, v in expected.items() if k not in FROZEN})


@pytest.mark.parametrize("name", ZERO1 + ZERO2)
def test_why_zero1_loses_frozen_params(name):
    """The cause (DeepSpeed issue #5439): ZeRO-1 saves no frozen_param_shapes/fragments, ZeRO-2 does; both
    keep the frozen tensors, full size, in model_states['module']."""
    tree = _deepspeed_pickle(FIXTURES / name / "global_step2" / "mp_rank_00_model_states.pt")
    if manifest(name)["stage"] == 1:
        assert tree["frozen_param_shapes"] is None and tree["frozen_param_fragments"] is None
    else:
        assert list(tree["frozen_param_shapes"]) == ["frozen.weight", "frozen.bias"]
        assert [tree["frozen_param_fragments"][k].shape for k in FROZEN] == [(7,), (7, 7)]
    assert [tree["module"][k].shape for k in FROZEN] == [(7,), (7, 7)]


def test_live_deepspeed_still_drops_zero1_frozen_params(live_deepspeed):
    """The installed DeepSpeed still drops ZeRO-1 frozen parameters and keeps ZeRO-2's (remove when fixed)."""
    for name in ZERO1:
        assert sorted(set(_engine(name)) - set(live_deepspeed[name])) == FROZEN
    for name in ZERO2:
        assert_state_dicts_equal(live_deepspeed[name], _engine(name))


# --------------------------------------------------------------------------- mixed dtypes


def test_mixed_dtypes_are_visible_in_infos():
    """Frozen params keep the training dtype (bf16), trainable ones are fp32 masters; infos say which is which."""
    with zeroio.open(FIXTURES / "z1_ws3_bf16") as ckpt:
        rows = {n: (i.kind, i.dtype) for n, i in ckpt.infos.items()}
    assert rows["frozen.weight"] == ("frozen", torch.bfloat16)
    assert rows["emb.weight"] == ("trainable", torch.float32)
    assert rows["calls"] == ("buffer", torch.int64)


@pytest.mark.parametrize("name", ["z1_ws3_bf16", "z0_ws2_bf16", "moe_z2_ws2_ep2_bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_normalises_mixed_dtypes(name, dtype):
    """state_dict(dtype=...) casts every floating tensor (fp32 masters and 16-bit frozen) like torch's .to()."""
    expected = _engine(name)
    with zeroio.open(FIXTURES / name) as ckpt:
        actual = ckpt.state_dict(dtype=dtype)
    assert_state_dicts_equal(actual, {k: v.to(dtype) if v.is_floating_point() else v for k, v in expected.items()})


def test_inspect_shows_source_and_dtype_per_tensor(capsys):
    """`zeroio inspect` shows each tensor's dtype, kind and the file it comes from."""
    assert main(["inspect", str(FIXTURES / "z1_ws3_bf16")]) == 0
    out = capsys.readouterr().out
    assert "frozen.weight   (7, 7)   bf16         98 B  frozen     mp_rank_00_model_states.pt" in out
    assert (
        "mlp_out.weight  (7, 5)   fp32        140 B  trainable  bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt" in out
    )


# --------------------------------------------------------------------------- ZeRO stage 0


@pytest.mark.parametrize("name", STAGE0)
def test_stage0_equals_live_engine(name):
    """ZeRO stage 0: zeroio returns the engine's fp32 masters (16-bit wrappers) or fp32 weights, frozen as stored."""
    expected = _engine(name)
    with zeroio.open(FIXTURES / name) as ckpt:
        actual = ckpt.state_dict()
        meta = ckpt.metadata
        kinds = {k: i.kind for k, i in ckpt.infos.items()}
    assert list(actual) == list(expected)
    assert_state_dicts_equal(actual, expected)
    assert (meta.zero_stage, meta.world_size, meta.has_fp32_master) == (0, 2, True)
    assert meta.extra["optim_files"] == []
    assert kinds["frozen.weight"] == "frozen" and kinds["emb.weight"] == "trainable"


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("z0_ws2_bf16", "FP16_UnfusedOptimizer: optimizer['fp32_groups']"),
        ("z0_ws2_fp16_fused", "FP16_Optimizer (fused): optimizer['fp32_groups_flat']"),
        ("z0_ws2_fp32", "torch optimizer (no 16-bit wrapper)"),
    ],
)
def test_stage0_records_where_masters_live(name, source):
    """metadata.extra names the model_states entry the fp32 masters came from."""
    with zeroio.open(FIXTURES / name) as ckpt:
        assert ckpt.metadata.extra["fp32_master_source"] == source


@pytest.mark.parametrize("name", ["z0_ws2_bf16", "z0_ws2_fp16_fused"])
def test_stage0_masters_are_more_precise_than_module(name):
    """The 16-bit module weights are the masters rounded; zeroio returns the unrounded masters."""
    stored = _deepspeed_pickle(FIXTURES / name / "global_step2" / "mp_rank_00_model_states.pt")["module"][
        "mlp_in.weight"
    ]
    master = _engine(name)["mlp_in.weight"]
    with zeroio.open(FIXTURES / name) as ckpt:
        assert torch.equal(ckpt["mlp_in.weight"], master)
    assert torch.equal(master.to(stored.dtype), stored) and not torch.equal(stored.float(), master)


def _rewrite_model_states(root: Path, edit) -> Path:
    """Load a genuine model_states file (it references no DeepSpeed class), edit it and save it back."""
    path = root / "global_step2" / "mp_rank_00_model_states.pt"
    tree = torch.load(path, weights_only=True)
    edit(tree)
    torch.save(tree, path)
    return path


def test_stage0_without_optimizer_state_returns_16bit_weights(tmp_path):
    """Saved without optimizer state (no fp32 copy anywhere), the bf16 weights come back as stored and
    metadata.has_fp32_master is False."""
    root = _copy(tmp_path, "z0_ws2_bf16")
    _rewrite_model_states(root, lambda tree: tree.update(optimizer=None))
    stored = torch.load(root / "global_step2" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    with zeroio.open(root) as ckpt:
        sd = ckpt.state_dict()
        assert ckpt.metadata.has_fp32_master is False
        assert ckpt.metadata.extra["fp32_master_source"] == "no optimizer state"
        assert ckpt.info("emb.weight").kind == "tensor" and ckpt.info("emb.weight").dtype == torch.bfloat16
    for key, value in stored.items():
        want = value.float() if key == "scale" else value
        assert torch.equal(sd[key], want) and sd[key].dtype == want.dtype
    assert sd["head.weight"] is sd["emb.weight"]


def test_stage0_master_that_matches_no_weight_is_not_guessed(tmp_path, caplog):
    """An fp32 master whose rounding matches no parameter of its shape is not assigned by position: those
    parameters come back in bf16 as stored, and has_fp32_master is False."""
    root = _copy(tmp_path, "z0_ws2_bf16")

    def tamper(tree):
        groups = tree["optimizer"]["fp32_groups"]
        groups[1][1] = groups[1][1] + 1.0  # norm.weight's master (group 1: mlp_in.bias, norm.weight, norm.bias)

    _rewrite_model_states(root, tamper)
    expected = _engine("z0_ws2_bf16")
    with caplog.at_level("WARNING", logger="zeroio"), zeroio.open(root) as ckpt:
        infos = ckpt.infos
        sd = ckpt.state_dict()
        assert ckpt.metadata.has_fp32_master is False
    assert {k: (infos[k].kind, infos[k].dtype) for k in ["frozen.bias", "norm.weight", "norm.bias"]} == {
        "frozen.bias": ("tensor", torch.bfloat16),
        "norm.weight": ("tensor", torch.bfloat16),
        "norm.bias": ("trainable", torch.float32),
    }
    assert torch.equal(sd["norm.weight"], expected["norm.weight"].bfloat16())
    assert torch.equal(sd["norm.bias"], expected["norm.bias"])
    assert "could not place fp32 master of shape [7]" in caplog.text


# --------------------------------------------------------------------------- BF16_Optimizer (ZeRO-1, fp32 accumulation)


def test_bf16_optimizer_zero1_equals_live_engine():
    """ZeRO-1 + bf16 + fp32 gradient accumulation (DeepSpeed's BF16_Optimizer, no zero_stage recorded) reads
    as ZeRO-1 and equals the engine."""
    expected = _engine("z1_ws2_bf16_fp32acc")
    with zeroio.open(FIXTURES / "z1_ws2_bf16_fp32acc") as ckpt:
        actual = ckpt.state_dict()
        assert ckpt.metadata.zero_stage == 1 and ckpt.metadata.train_dtype == torch.bfloat16
    assert list(actual) == list(expected)
    assert_state_dicts_equal(actual, expected)


# --------------------------------------------------------------------------- Mixture of Experts


@pytest.mark.parametrize("name", MOE)
def test_moe_equals_live_engine_with_global_expert_names(name):
    """MoE (ZeRO-2): every expert under its global id, fp32 masters from the optimizer partitions."""
    expected = _engine(name)
    with zeroio.open(FIXTURES / name) as ckpt:
        actual = ckpt.state_dict()
        infos = ckpt.infos
        expert_files = ckpt.metadata.extra["expert_files"]
    assert list(actual) == list(expected)
    assert_state_dicts_equal(actual, expected)
    assert expert_files == [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in (0, 1)]
    for e in (0, 1):
        info = infos[f"{EXPERT}.{e}.0.weight"]
        assert (info.kind, info.dtype, info.shape) == ("trainable", torch.float32, (5, 7))


def test_moe_bf16_masters_are_not_the_expert_files():
    """Under bf16 the expert files hold rounded weights; zeroio returns the fp32 masters instead."""
    name = "moe_z2_ws2_ep2_bf16"
    stored = _deepspeed_pickle(FIXTURES / name / "global_step2" / "layer_0_expert_1_mp_rank_00_model_states.pt")[
        f"{EXPERT}.1.0.weight"
    ]
    with zeroio.open(FIXTURES / name) as ckpt:
        master = ckpt[f"{EXPERT}.1.0.weight"]
        files = [p.name for p in ckpt.info(f"{EXPERT}.1.0.weight").files]
    assert stored.dtype == torch.bfloat16 and torch.equal(master.bfloat16(), stored)
    assert not torch.equal(master, stored.float())
    assert files == ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # expert 1 lives on expert-parallel rank 1


def test_moe_expert_groups_follow_expert_data_parallel_ranks():
    """World size 4, ep_size 2: expert 1's fp32 partitions are on ranks 1 and 3 (DeepSpeed's default order)."""
    with zeroio.open(FIXTURES / "moe_z2_ws4_ep2_bf16") as ckpt:
        rows = ckpt.pieces(f"{EXPERT}.1.2.weight")  # elements 35..69 of the group: both halves
    assert [r[0].name for r in rows] == [
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt",
    ]


def test_moe_missing_expert_file(tmp_path):
    """A MoE folder missing an expert file is refused, naming the file."""
    root = _copy(tmp_path, "moe_z2_ws2_fp32")
    tag = root / "global_step2"
    (tag / "layer_0_expert_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"Missing MoE expert file(s) for layer 0, expert(s) [1] in '{tag}' ('mp_rank_00_model_states.pt' records 2 "
        "experts): 'layer_0_expert_1_mp_rank_00_model_states.pt'. Copy the whole tag folder again."
    )


def test_moe_without_zero_is_refused(tmp_path):
    """MoE saved without ZeRO (expp_rank_* optimizer files, no ZeRO ones) is refused, naming the files."""
    root = _copy(tmp_path, "moe_z2_ws2_fp32")
    tag = root / "global_step2"
    for rank in (0, 1):
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").rename(
            tag / f"expp_rank_{rank}_mp_rank_00_optim_states.pt"
        )
    with pytest.raises(errors.UnsupportedCheckpointError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{tag}' is a Mixture-of-Experts checkpoint saved without ZeRO (expp_rank_0_mp_rank_00_optim_states.pt, "
        "expp_rank_1_mp_rank_00_optim_states.pt); zeroio reads MoE checkpoints of ZeRO stages 1 and 2 only. Use "
        "DeepSpeed's ds_to_universal.py for this one."
    )


def test_moe_expert_optimizer_state_next_to_zero_is_refused(tmp_path):
    """An expp_rank_* optimizer file next to ZeRO's (DeepSpeed <= 0.18 writes them empty there) that holds optimizer
    state is refused, naming it."""
    root = _copy(tmp_path, "moe_z2_ws2_fp32")
    tag = root / "global_step2"
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "expp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(errors.UnsupportedCheckpointError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{tag / 'expp_rank_0_mp_rank_00_optim_states.pt'}' holds optimizer state next to the ZeRO optimizer files; "
        "zeroio reads the MoE checkpoints of ZeRO stages 1 and 2, whose expert-parallel optimizer files are empty. "
        "Use DeepSpeed's ds_to_universal.py for this one."
    )


def test_moe_with_zero3_is_refused(tmp_path):
    """Expert files next to ZeRO-3 rank files are refused, naming them."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    tag = root / "global_step2"
    shutil.copy(FIXTURES / "moe_z2_ws2_fp32" / "global_step2" / "layer_0_expert_0_mp_rank_00_model_states.pt", tag)
    with pytest.raises(errors.UnsupportedCheckpointError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{tag}' is a Mixture-of-Experts checkpoint (layer_0_expert_0_mp_rank_00_model_states.pt) without "
        "'mp_rank_00_model_states.pt' (ZeRO-3); zeroio reads MoE checkpoints of ZeRO stages 1 and 2 only. Use "
        "DeepSpeed's ds_to_universal.py for this one."
    )


# --------------------------------------------------------------------------- pipeline / tensor parallel


def test_pipeline_parallel_is_refused(tmp_path):
    """A fake pipeline folder (a plain ZeRO-1 model-states file copied under layer_XX-model_00 names) is refused,
    naming the file that gives it away, not misread.

    Genuine pipeline and pipeline + tensor-parallel checkpoints are read (tests/test_pipeline.py,
    tests/test_pipeline_tp.py); this copy is caught because a stage's model states never hold a module."""
    root = _copy(tmp_path, "z1_ws2_fp32")
    tag = root / "global_step2"
    for layer in range(7):
        shutil.copy(tag / "mp_rank_00_model_states.pt", tag / f"layer_{layer:02d}-model_00-model_states.pt")
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{tag / 'mp_rank_00_model_states.pt'}' holds a 'module' state dict, which a pipeline stage's model states "
        "never do (its weights live in the layer files): the folder mixes files from different saves; copy the whole "
        "tag folder again."
    )


def test_tensor_parallel_is_refused(tmp_path):
    """A fake tensor-parallel folder (rank 0's files copied under mp_rank_01 names) is refused, naming the copy.

    Genuine tensor-parallel checkpoints are read (tests/test_tensor_parallel.py); this copy is caught by the name
    each file records inside itself."""
    root = _copy(tmp_path, "z2_ws2_bf16")
    tag = root / "global_step2"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    for rank in (0, 1):
        shutil.copy(
            tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            tag / f"bf16_zero_pp_rank_{rank}_mp_rank_01_optim_states.pt",
        )
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{tag / 'mp_rank_01_model_states.pt'}' was saved as 'mp_rank_00_model_states.pt' (the name recorded "
        "inside the file): the folder mixes files from different saves; copy the whole tag folder again."
    )


# --------------------------------------------------------------------------- DeepSpeed's tool fails here


@pytest.mark.parametrize("name", sorted(DS_ERRORS))
def test_deepspeed_reference_records_failure(name):
    """For these layouts DeepSpeed 0.19.8's zero_to_fp32 raised; the fixture records its exact error."""
    assert reference(name) is None
    assert manifest(name)["zero_to_fp32_fails"] is True
    assert (FIXTURES / name / "expected" / "zero_to_fp32.error").read_text() == DS_ERRORS[name] + "\n"


def test_live_deepspeed_still_fails(live_deepspeed):
    """The installed DeepSpeed still fails on stage 0, BF16_Optimizer and MoE folders (update when fixed)."""
    assert {name: live_deepspeed[name] for name in DS_ERRORS} == DS_ERRORS


# --------------------------------------------------------------------------- laziness


def _rchar() -> int:
    """Bytes this process has read through read()/pread() so far (page-cache hits included)."""
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar:")).split()[1])


def _bytes_read(action) -> int:
    """Bytes ``action()`` reads, less what reading /proc/self/io itself costs (measured just before)."""
    first = _rchar()
    overhead = _rchar() - first
    before = _rchar()
    action()
    return _rchar() - before - overhead


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
@pytest.mark.parametrize("name", ["z1_ws2_fp32", "z2_ws3_fp16"])
def test_reading_one_tensor_reads_only_its_bytes(name):
    """ZeRO-1/2: reading one parameter reads its own bytes (plus zip headers), not the flat fp32 vector it is
    part of (DeepSpeed's tool loads and concatenates every rank's whole vector)."""
    with zeroio.open(FIXTURES / name) as ckpt:
        ckpt["emb.weight"]  # warm up: first reads may import or open lazily
        flat_bytes = sum(ckpt.info(k).nbytes for k, i in ckpt.infos.items() if i.kind == "trainable" and not i.tied_to)
        pieces = ckpt.pieces("norm.bias")
        read = _bytes_read(lambda: ckpt["norm.bias"])
    own = ckpt.info("norm.bias").nbytes
    headers = len(pieces) * 30  # one 30-byte zip local header per storage touched, read once
    assert own <= read <= own + headers + 8  # 8: /proc/self/io's own length may change by a digit
    assert read * 4 < flat_bytes  # the whole vector would be several times larger


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_rchar_sees_every_read():
    """The measurement above is real: reading every tensor counts at least every trainable master's bytes."""
    with zeroio.open(FIXTURES / "z1_ws2_fp32") as ckpt:
        ckpt["emb.weight"]
        masters = sum(i.nbytes for i in ckpt.infos.values() if i.kind == "trainable" and not i.tied_to)
        read = _bytes_read(ckpt.state_dict)
    assert read >= masters


def test_fixture_manifests_record_gap_configurations():
    """The gap fixtures exist and record how they were made."""
    assert json.loads((FIXTURES / "z1_ws2_bf16_fp32acc" / "manifest.json").read_text())["grad_accum_dtype"] == "fp32"
    assert manifest("z0_ws2_fp16_fused")["fused_adam"] is True
    assert [manifest(n)["ep_size"] for n in MOE] == [1, 2, 2]


# --------------------------------------------------------------------------- convert and load inherit the fix


def _tiny_model() -> torch.nn.Module:
    """The fixtures' TinyLM, built by fixtures/generate.py (torch only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fixture_generate", FIXTURES / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._build_model()


@pytest.mark.parametrize("name", ["z1_ws3_bf16", "z0_ws2_bf16", "z1_ws2_bf16_fp32acc"])
def test_load_strict_gets_every_weight(name):
    """zeroio.load(strict=True) fills every parameter, frozen ones included, with the engine's values."""
    from zeroio import load

    model = _tiny_model()
    load(FIXTURES / name, model, strict=True)
    expected = _engine(name)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key].to(value.dtype)), key


@pytest.mark.parametrize("name", ["z1_ws3_bf16", "z0_ws2_fp16_fused", "moe_z2_ws4_ep2_bf16"])
def test_convert_writes_every_weight(name, tmp_path):
    """zeroio.convert writes every tensor the engine held (frozen, stage-0 masters, experts), bit for bit."""
    from safetensors.torch import load_file

    from zeroio import convert

    result = convert(FIXTURES / name, tmp_path / "out", progress=False)
    written: dict[str, torch.Tensor] = {}
    for file in result.files:
        written.update(load_file(file))
    expected = _engine(name)
    assert sorted(expected) == sorted([*written, "head.weight"])  # the tied alias is stored once
    assert_state_dicts_equal(written, {k: expected[k] for k in written})


def test_autoep_moe_is_refused(tmp_path):
    """A model_states file recording AutoEP layers is refused by name rather than misread."""
    root = _copy(tmp_path, "moe_z2_ws2_fp32")
    path = _rewrite_model_states(root, lambda tree: tree.update(ds_autoep_layers=[{"moe_layer_id": 0}]))
    with pytest.raises(errors.UnsupportedCheckpointError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{path}' records AutoEP MoE layers ('ds_autoep_layers'); zeroio reads deepspeed.moe.layer.MoE "
        "checkpoints only. Use DeepSpeed's ds_to_universal.py for this one."
    )


def test_deepspeed_zero1_output_fails_a_strict_load():
    """What the dropped frozen params cost a user: DeepSpeed's ZeRO-1 output does not load strictly."""
    model = _tiny_model()
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"frozen.weight\", \"frozen.bias\""):
        model.load_state_dict(reference("z1_ws2_fp32"), strict=True)
