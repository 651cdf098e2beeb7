"""Framework-written ZeRO-3 checkpoints (HF Trainer, Lightning DeepSpeedStrategy) and the single-file Lightning writer."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES, FRAMEWORKS, HF, HF_CKPT, LIGHTNING, LIGHTNING_CLIENT_KEYS, assert_state_dicts_equal

import zeroio
from zeroio import convert
from zeroio.errors import OutputError, UnsafePickleError, UnsupportedCheckpointError


def _generator_module() -> Any:
    """fixtures/generate_frameworks.py, which defines the fixtures' LightningModule and inputs."""
    spec = importlib.util.spec_from_file_location("generate_frameworks", FIXTURES / "generate_frameworks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "manifest.json").read_text())


def _assert_same_tree(actual: Any, expected: Any, where: str = "") -> None:
    """Equal nested client state: same types, keys and values; tensors equal bit for bit."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            _assert_same_tree(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same_tree(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


# =========================================================================== fixtures are what they claim


def test_framework_fixtures_are_small_and_match_their_manifests():
    """Every framework fixture folder is under 1 MB and its files hash to the manifest's sha256."""
    import hashlib

    for folder in sorted(p for p in FRAMEWORKS.iterdir() if p.is_dir()):
        files = [p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json"]
        assert sum(p.stat().st_size for p in files) < 1_000_000, folder.name
        recorded = _manifest(folder)["files"]
        assert sorted(recorded) == sorted(str(p.relative_to(folder)) for p in files), folder.name
        for rel, digest in recorded.items():
            assert hashlib.sha256((folder / rel).read_bytes()).hexdigest() == digest, f"{folder.name}/{rel}"


def test_hf_fixture_keeps_the_trainer_layout():
    """The HF fixture is the Trainer's own checkpoint-N folder: ZeRO tag folder, latest, configs, tokenizer."""
    names = sorted(p.name for p in HF_CKPT.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "global_step3",
        "latest",
        "rng_state.pth",
        "tokenizer.json",
        "tokenizer_config.json",
        "trainer_state.json",
        "training_args.bin",
    ]
    assert (HF_CKPT / "latest").read_text().strip() == "global_step3"
    assert json.loads((HF_CKPT / "trainer_state.json").read_text())["global_step"] == 3
    assert sorted(p.name for p in (HF_CKPT / "global_step3").iterdir()) == [
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")
    ]


# =========================================================================== HF Trainer


def test_hf_checkpoint_folder_opens_through_latest():
    """zeroio.open(checkpoint-N) follows `latest` to global_stepN; the tag folder opens to the same tensors."""
    with zeroio.open(HF_CKPT) as ckpt:
        meta = ckpt.metadata
        assert (meta.format, meta.tag, meta.zero_stage, meta.world_size, meta.global_step) == (
            "zero", "global_step3", 3, 2, 3
        )  # fmt: skip
        assert meta.path == HF_CKPT / "global_step3"
        assert meta.train_dtype == torch.float32
        via_latest = ckpt.state_dict()
    with zeroio.open(HF_CKPT / "global_step3") as ckpt:
        assert_state_dicts_equal(ckpt.state_dict(), via_latest)


def test_hf_state_dict_equals_deepspeed_consolidation():
    """zeroio's state dict of the Trainer checkpoint equals DeepSpeed's zero_to_fp32 bit for bit, in its key order."""
    reference = torch.load(HF / "expected" / "zero_to_fp32.pt", weights_only=True)
    with zeroio.open(HF_CKPT) as ckpt:
        actual = ckpt.state_dict()
        assert ckpt.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert list(actual) == list(reference)
    assert_state_dicts_equal(actual, reference)
    assert actual["lm_head.weight"] is actual["transformer.wte.weight"]
    assert reference["lm_head.weight"].data_ptr() == reference["transformer.wte.weight"].data_ptr()


def test_hf_keys_use_transformers_naming():
    """The Trainer checkpoint's keys are the model's own state-dict names (no `module.` wrapper prefix)."""
    with zeroio.open(HF_CKPT) as ckpt:
        keys = list(ckpt)
    assert keys[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert keys[-1] == "lm_head.weight"
    assert not any(k.startswith(("module.", "_forward_module.", "model.")) for k in keys)
    assert len(keys) == 2 + 2 * 12 + 2 + 1  # wte, wpe; 12 tensors per GPT-2 block; ln_f; lm_head


def test_hf_transformers_reproduces_trained_logits():
    """GPT2 from the checkpoint's config.json, loaded with zeroio's state dict, gives the trained logits, ties intact."""
    transformers = pytest.importorskip("transformers")
    expected = torch.load(HF / "expected" / "logits.pt", weights_only=True)
    config = transformers.AutoConfig.from_pretrained(HF_CKPT)

    def logits(state_dict: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        result = model.load_state_dict(state_dict, strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        with torch.no_grad():
            return model(input_ids=expected["input_ids"]).logits, model

    with zeroio.open(HF_CKPT) as ckpt:
        ours, model = logits(ckpt.state_dict())
    theirs, _ = logits(torch.load(HF / "expected" / "zero_to_fp32.pt", weights_only=True))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert torch.equal(ours, theirs)  # same weights, same machine: same bits
    # Recorded on the machine that trained it (live ZeRO-3 forward); other CPUs may differ in the last bits.
    assert torch.equal(expected["logits"], expected["consolidated_logits"])
    torch.testing.assert_close(ours, expected["logits"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="needs the deepspeed launcher (pip install -e '.[test]')")
def test_fresh_hf_trainer_checkpoint_matches_deepspeed(tmp_path):
    """A Trainer checkpoint written now by the installed transformers/DeepSpeed opens like DeepSpeed consolidates it."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    proc = subprocess.run(
        [sys.executable, str(FIXTURES / "generate_frameworks.py"), "--out", str(tmp_path), "hf"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "hf_trainer_gpt2_z3"
    reference = torch.load(out / "expected" / "zero_to_fp32.pt", weights_only=True)
    with zeroio.open(out / "checkpoint-3") as ckpt:
        actual = ckpt.state_dict()
    assert_state_dicts_equal(actual, reference)
    assert actual["lm_head.weight"] is actual["transformer.wte.weight"]


# =========================================================================== Lightning DeepSpeedStrategy


@pytest.mark.parametrize("name", LIGHTNING)
def test_lightning_folder_equals_lightning_conversion(name):
    """zeroio.open(<x>.ckpt folder) equals Lightning's convert_zero_checkpoint_to_fp32_state_dict bit for bit."""
    folder = FRAMEWORKS / name
    reference = torch.load(folder / "expected" / "lightning_fp32.ckpt", weights_only=True)["state_dict"]
    with zeroio.open(folder / "model.ckpt") as ckpt:
        meta = ckpt.metadata
        assert (meta.tag, meta.zero_stage, meta.world_size, meta.global_step) == ("checkpoint", 3, 1, 3)
        actual = ckpt.state_dict()
        assert ckpt.tied == {"head.weight": "emb.weight"}
    assert_state_dicts_equal(actual, reference)
    assert actual["head.weight"] is actual["emb.weight"]


@pytest.mark.parametrize("name", LIGHTNING)
def test_lightning_folder_equals_live_engine(name):
    """zeroio's tensors equal the engine's own fp32 masters and buffers recorded on the GPU at the end of training."""
    folder = FRAMEWORKS / name
    engine = torch.load(folder / "expected" / "engine.pt", weights_only=True)
    with zeroio.open(folder / "model.ckpt") as ckpt:
        assert_state_dicts_equal(ckpt.state_dict(), engine)


@pytest.mark.parametrize("name", LIGHTNING)
def test_lightning_keys_carry_no_forward_module_prefix(name):
    """Lightning 2.6 hands DeepSpeed the LightningModule itself: keys are the module's names, no `_forward_module.`."""
    folder = FRAMEWORKS / name
    with zeroio.open(folder / "model.ckpt") as ckpt:
        keys = list(ckpt)
    assert keys == _manifest(folder)["engine_state_dict_keys"]
    assert keys == [
        "emb.weight", "scale.scale", "mlp_in.weight", "mlp_in.bias", "mlp_out.weight", "mlp_out.bias",
        "norm.weight", "norm.bias", "head.weight",
    ]  # fmt: skip


def test_lightning_bf16_checkpoint_trained_in_bf16():
    """bf16-mixed writes bf16_-prefixed optimizer files; zeroio reports bf16 training and returns fp32 masters."""
    with zeroio.open(FRAMEWORKS / "lightning_z3_bf16" / "model.ckpt") as ckpt:
        assert ckpt.metadata.train_dtype == torch.bfloat16
        assert ckpt.metadata.extra["optim_files"] == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
        assert {info.dtype for info in ckpt.infos.values()} == {torch.float32}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks reading GPU-written files on a CPU-only machine")
@pytest.mark.parametrize("name", LIGHTNING)
def test_lightning_gpu_pickles_read_without_cuda(name):
    """The GPU-written optimizer files hold cuda:0 storages that plain torch.load refuses here; zeroio reads them."""
    pytest.importorskip("deepspeed")  # the optimizer file's pickle names DeepSpeed's ZeroStageEnum
    tag = FRAMEWORKS / name / "model.ckpt" / "checkpoint"
    (optim,) = tag.glob("*optim_states.pt")
    with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
        torch.load(optim, weights_only=False)
    with zeroio.open(tag) as ckpt:
        assert ckpt.get_tensor("emb.weight").device.type == "cpu"


# =========================================================================== single-file Lightning writer


@pytest.mark.parametrize("name", LIGHTNING)
def test_write_lightning_ckpt_structure(tmp_path, name):
    """The .ckpt holds Lightning's client state as saved plus state_dict equal to Lightning's own conversion."""
    folder = FRAMEWORKS / name
    reference = torch.load(folder / "expected" / "lightning_fp32.ckpt", weights_only=True)
    result = convert(folder / "model.ckpt", tmp_path / "model.ckpt", fmt="lightning", progress=False)
    assert result.files == (tmp_path / "model.ckpt",) and result.index_path is None
    assert result.tied == {"head.weight": "emb.weight"}
    assert (result.num_tensors, result.total_size) == (8, 1360)
    written = torch.load(tmp_path / "model.ckpt", weights_only=True)
    assert list(written) == [*LIGHTNING_CLIENT_KEYS, "state_dict"]
    for key in LIGHTNING_CLIENT_KEYS:
        _assert_same_tree(written[key], reference[key], key)
    assert written["epoch"] == 1 and written["global_step"] == 3
    assert written["pytorch-lightning_version"] == "2.6.6"
    assert written["hyper_parameters"] == {"vocab": 13, "dim": 8, "hidden": 12, "lr": 0.05}
    assert_state_dicts_equal(written["state_dict"], reference["state_dict"])
    assert written["state_dict"]["head.weight"].data_ptr() == written["state_dict"]["emb.weight"].data_ptr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]  # no temporary file left behind


@pytest.mark.parametrize("name", LIGHTNING)
def test_write_lightning_ckpt_load_from_checkpoint(tmp_path, name):
    """load_from_checkpoint on zeroio's file gives the outputs of the module restored from Lightning's conversion."""
    pytest.importorskip("lightning")
    folder = FRAMEWORKS / name
    gen = _generator_module()
    tiny_lit = gen.lightning_module_class()
    expected = torch.load(folder / "expected" / "outputs.pt", weights_only=True)
    convert(folder / "model.ckpt", tmp_path / "model.ckpt", fmt="lightning", progress=False)
    ours = tiny_lit.load_from_checkpoint(tmp_path / "model.ckpt", map_location="cpu", weights_only=True).eval()
    theirs = tiny_lit.load_from_checkpoint(
        folder / "expected" / "lightning_fp32.ckpt", map_location="cpu", weights_only=True
    ).eval()
    assert dict(ours.hparams) == dict(theirs.hparams) == {"vocab": 13, "dim": 8, "hidden": 12, "lr": 0.05}
    assert ours.head.weight is ours.emb.weight  # configure_model ran and the tie survived loading
    with torch.no_grad():
        out_ours, out_theirs = ours(expected["input_ids"]), theirs(expected["input_ids"])
    assert torch.equal(out_ours, out_theirs)
    # expected/outputs.pt was computed on the GPU machine's CPU (torch 2.11): last bits may differ here.
    torch.testing.assert_close(out_ours, expected["outputs"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", LIGHTNING)
def test_zeroio_load_into_lightning_module_runs_configure_model(name):
    """zeroio.load of the ZeRO folder into a fresh module calls configure_model and gives Lightning's outputs."""
    pytest.importorskip("lightning")
    from zeroio import load

    folder = FRAMEWORKS / name
    tiny_lit = _generator_module().lightning_module_class()
    model = tiny_lit()
    report = load(folder / "model.ckpt", model)
    assert report.hooks_called == ("configure_model",)
    assert report.tied == {"head.weight": "emb.weight"} and model.head.weight is model.emb.weight
    theirs = tiny_lit.load_from_checkpoint(
        folder / "expected" / "lightning_fp32.ckpt", map_location="cpu", weights_only=True
    ).eval()
    ids = torch.load(folder / "expected" / "outputs.pt", weights_only=True)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), theirs(ids))


def test_zeroio_load_into_transformers_model():
    """zeroio.load of checkpoint-N into AutoModelForCausalLM.from_config keeps the tie and gives the trained logits."""
    transformers = pytest.importorskip("transformers")
    from zeroio import load

    expected = torch.load(HF / "expected" / "logits.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(HF_CKPT)).eval()
    report = load(HF_CKPT, model)
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=expected["input_ids"]).logits, expected["logits"], rtol=1e-5, atol=1e-6
        )


def test_write_lightning_ckpt_casts_dtype(tmp_path):
    """dtype="bf16" casts every floating tensor and keeps the tie."""
    folder = FRAMEWORKS / "lightning_z3_fp32"
    reference = torch.load(folder / "expected" / "lightning_fp32.ckpt", weights_only=True)["state_dict"]
    result = convert(folder / "model.ckpt", tmp_path / "bf16.ckpt", fmt="lightning", dtype="bf16", progress=False)
    assert result.total_size == 1360 // 2
    state = torch.load(tmp_path / "bf16.ckpt", weights_only=True)["state_dict"]
    assert_state_dicts_equal(state, {k: v.to(torch.bfloat16) for k, v in reference.items()})
    assert state["head.weight"].data_ptr() == state["emb.weight"].data_ptr()


def test_write_lightning_ckpt_refuses_existing_file(tmp_path):
    """An existing destination is refused unless overwrite=True, which replaces it."""
    dst = tmp_path / "model.ckpt"
    dst.write_bytes(b"old")
    src = FRAMEWORKS / "lightning_z3_fp32" / "model.ckpt"
    with pytest.raises(OutputError) as info:
        convert(src, dst, fmt="lightning", progress=False)
    assert str(info.value) == (
        f"Output file '{dst}' already exists. Pass overwrite=True (--overwrite) to replace it, "
        "or choose another destination."
    )
    assert dst.read_bytes() == b"old"
    convert(src, dst, fmt="lightning", overwrite=True, progress=False)
    assert "state_dict" in torch.load(dst, weights_only=True)


def test_write_lightning_ckpt_refuses_folder_and_creates_missing_parent(tmp_path):
    """A folder destination is refused (a Lightning checkpoint is one file); missing parent folders are created."""
    src = FRAMEWORKS / "lightning_z3_fp32" / "model.ckpt"
    with pytest.raises(OutputError) as info:
        convert(src, tmp_path, fmt="lightning", progress=False)
    assert str(info.value) == (
        f"Output path '{tmp_path}' is a folder; a Lightning checkpoint is one file. Pass a file path such as "
        f"'{tmp_path / 'model.ckpt'}'."
    )
    assert list(tmp_path.iterdir()) == []
    missing = tmp_path / "nope" / "model.ckpt"
    convert(src, missing, fmt="lightning", progress=False)
    assert sorted(p.name for p in missing.parent.iterdir()) == ["model.ckpt"]


def test_write_lightning_ckpt_from_raw_deepspeed_checkpoint(tmp_path):
    """A plain DeepSpeed checkpoint (no Lightning client state) gives a .ckpt holding state_dict and the version
    key Lightning's load_from_checkpoint needs (issue 15: without it Lightning raised KeyError)."""
    reference = torch.load(FIXTURES / "z3_ws2_fp32" / "expected" / "zero_to_fp32.pt", weights_only=True)
    convert(FIXTURES / "z3_ws2_fp32", tmp_path / "raw.ckpt", fmt="lightning", progress=False)
    written = torch.load(tmp_path / "raw.ckpt", weights_only=True)
    assert list(written) == ["pytorch-lightning_version", "state_dict"]
    assert_state_dicts_equal(written["state_dict"], reference)


def test_write_lightning_ckpt_rewrites_a_lightning_ckpt_file(tmp_path):
    """A single-file Lightning .ckpt as source keeps its client state (DeepSpeed's bookkeeping keys dropped)."""
    source = FRAMEWORKS / "lightning_z3_fp32" / "expected" / "lightning_fp32.ckpt"
    reference = torch.load(source, weights_only=True)
    convert(source, tmp_path / "again.ckpt", fmt="lightning", progress=False)
    written = torch.load(tmp_path / "again.ckpt", weights_only=True)
    client_state_keys = ("epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks",
                         "lr_schedulers", "hparams_name", "hyper_parameters")  # fmt: skip
    assert list(written) == [*client_state_keys, "state_dict"]
    for key in client_state_keys:
        _assert_same_tree(written[key], reference[key], key)
    assert_state_dicts_equal(written["state_dict"], reference["state_dict"])


# --------------------------------------------------------------------------- client state edge cases
# These copy a real Lightning fixture and re-save its rank-0 model_states with more client state, exactly as
# engine.save_checkpoint(client_state=...) would have written it (DeepSpeed does state.update(client_state)).


class _UserConfig:
    """A user's own class in client state (not plain data)."""

    def __init__(self) -> None:
        self.depth = 3


def _copy_with_client_state(tmp_path: Path, extra: dict[str, Any], *, prefix: str = "") -> Path:
    src = FRAMEWORKS / "lightning_z3_fp32" / "model.ckpt"
    dst = tmp_path / "model.ckpt"
    shutil.copytree(src, dst)
    states = dst / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    tree = torch.load(states, weights_only=True)
    tree.update(extra)
    if prefix:  # Lightning < 2.1 wrapped the module: every name gained `_forward_module.`
        tree["module"] = type(tree["module"])((prefix + k, v) for k, v in tree["module"].items())
        tree["buffer_names"] = [prefix + n for n in tree["buffer_names"]]
        tree["param_shapes"] = [type(g)((prefix + k, v) for k, v in g.items()) for g in tree["param_shapes"]]
        tree["shared_params"] = {prefix + k: prefix + v for k, v in tree["shared_params"].items()}
    torch.save(tree, states)
    return dst


def test_write_lightning_ckpt_rebuilds_plain_data_client_state(tmp_path):
    """Namespaces, paths and dates in client state come back as the real objects, tensors as CPU tensors."""
    extra = {
        "args": argparse.Namespace(lr=0.1, data=pathlib.PurePosixPath("/data/train"), tags=["a", "b"]),
        "run_dir": pathlib.PosixPath("/runs/7"),
        "started": datetime.datetime(2026, 12, 2, 14, 30, 5),
        "elapsed": datetime.timedelta(minutes=3, seconds=2),
        "best": torch.tensor([0.25, 0.5]),
    }
    src = _copy_with_client_state(tmp_path, extra)
    trusted = ["argparse.Namespace", "pathlib.PurePosixPath"]  # PosixPath and datetime are on the allowlist
    zeroio.convert(src, tmp_path / "out.ckpt", fmt="lightning", trusted_globals=trusted)
    written = torch.load(tmp_path / "out.ckpt", weights_only=False)  # paths and dates need the full unpickler
    client_state_keys = [key for key in written if key != "state_dict"]
    assert client_state_keys == [*LIGHTNING_CLIENT_KEYS, "args", "run_dir", "started", "elapsed", "best"]
    assert written["args"] == extra["args"]
    assert written["run_dir"] == extra["run_dir"] and type(written["run_dir"]) is pathlib.PosixPath
    assert written["started"] == extra["started"] and written["elapsed"] == extra["elapsed"]
    assert torch.equal(written["best"], extra["best"])


def test_write_lightning_ckpt_refuses_unrebuildable_client_state(tmp_path):
    """A user class in client state is refused by zeroio.open, and, if trusted, by the writer with a clear fix."""
    src = _copy_with_client_state(tmp_path, {"cfg": _UserConfig()})
    qualified = f"{_UserConfig.__module__}._UserConfig"
    states = src / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with pytest.raises(UnsafePickleError):
        zeroio.open(src)
    with pytest.raises(UnsupportedCheckpointError) as info:
        zeroio.convert(src, tmp_path / "out.ckpt", fmt="lightning", trusted_globals=[qualified])
    assert str(info.value) == (
        f"Cannot write the client state 'cfg' of '{states}' into a Lightning checkpoint: it holds a "
        f"'{qualified}' object, which zeroio read as inert data and cannot rebuild. Remove it from what "
        "on_save_checkpoint() stores, or write fmt='safetensors' (weights only)."
    )
    assert not (tmp_path / "out.ckpt").exists()


def test_write_lightning_ckpt_strips_forward_module_prefix(tmp_path):
    """Keys saved by Lightning < 2.1 (`_forward_module.` prefix) are written under the module's own names."""
    src = _copy_with_client_state(tmp_path, {}, prefix="_forward_module.")
    reference = torch.load(FRAMEWORKS / "lightning_z3_fp32" / "expected" / "lightning_fp32.ckpt", weights_only=True)[
        "state_dict"
    ]
    with zeroio.open(src) as ckpt:
        assert next(iter(ckpt)) == "_forward_module.emb.weight"
    result = convert(src, tmp_path / "out.ckpt", fmt="lightning", progress=False)
    assert result.tied == {"head.weight": "emb.weight"}
    assert_state_dicts_equal(torch.load(tmp_path / "out.ckpt", weights_only=True)["state_dict"], reference)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
