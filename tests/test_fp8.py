"""Block-scaled FP8 checkpoints (DeepSeek-V3 layout): every verb reads them dequantized exactly as DeepSeek's
``fp8_cast_bf16.py`` does, ``quantized="raw"`` reads them as stored, and every other quantized layout is refused.

Fixture: ``fixtures/fp8/`` (``fixtures/generate_fp8.py``): a tiny Llama quantized by transformers' own
``Fp8Quantize``, with references dequantized by DeepSeek's ``weight_dequant`` algorithm (bf16, and the fp32
products before the bf16 store).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES
from hub_server import DEFAULT_TOKEN, DEFAULT_USER
from safetensors.torch import load_file, save_file

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError, UnsupportedCheckpointError

pytest_plugins = ["hub_fixtures"]

FP8 = FIXTURES / "fp8" / "model"
REFERENCE = load_file(str(FIXTURES / "fp8" / "expected" / "reference_bf16.safetensors"))
REFERENCE_FP32 = load_file(str(FIXTURES / "fp8" / "expected" / "reference_fp32.safetensors"))
QUANTIZED = sorted(REFERENCE_FP32)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so NaNs and signed zeros compare exactly."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), name


def _stored() -> dict[str, torch.Tensor]:
    """Every tensor of the fixture's shards, as safetensors itself reads them."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(FP8.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def _fp32_reference() -> dict[str, torch.Tensor]:
    """``dtype=fp32``: the unrounded products for quantized weights, the bf16 tensors cast for the others."""
    return {n: REFERENCE_FP32[n] if n in REFERENCE_FP32 else t.float() for n, t in REFERENCE.items()}


def _copy_fixture(tmp_path: Path) -> Path:
    dst = tmp_path / "fp8"
    shutil.copytree(FP8, dst)
    return dst


# --------------------------------------------------------------------------- reading dequantized


def test_open_presents_the_dequantized_weights_bit_exact():
    with zeroio.open(FP8) as ckpt:
        assert sorted(ckpt) == sorted(REFERENCE)  # no *_scale_inv key
        _assert_equal(dict(ckpt.items()), REFERENCE)
        _assert_equal(ckpt.state_dict(dtype="fp32"), _fp32_reference())
        info = ckpt.info(QUANTIZED[0])
        assert info.dtype == torch.bfloat16 and info.stored_dtype == torch.float8_e4m3fn
        assert ckpt.metadata.train_dtype == torch.bfloat16
        for chunk_bytes in (4 * 37, 4 * 137, 4 * 300, 4 * 5000):  # chunks starting and ending inside rows and blocks
            for name in QUANTIZED:
                flat = torch.cat(list(ckpt.iter_chunks(name, dtype="fp32", chunk_bytes=chunk_bytes)))
                assert torch.equal(_bits(flat), _bits(REFERENCE_FP32[name])), (name, chunk_bytes)


def test_inspect_shows_logical_tensors(capsys):
    assert main(["inspect", str(FP8), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    assert sorted(rows) == sorted(REFERENCE)
    assert rows[QUANTIZED[0]]["dtype"] == "bf16" and rows[QUANTIZED[0]]["stored_dtype"] == "float8_e4m3fn"
    assert main(["inspect", str(FP8)]) == 0
    assert "dequantized with its *_scale_inv" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("fmt", "out", "extra"),
    [
        ("safetensors", "out", {"max_shard_size": "100KB"}),
        ("torch", "out", {}),
        ("lightning", "out.ckpt", {}),
        ("dcp", "out", {"dcp_layout": "accelerate"}),
    ],
)
def test_convert_writes_the_reference(tmp_path, fmt, out, extra):
    result = zeroio.convert(FP8, tmp_path / out, fmt=fmt, progress=False, **extra)
    assert result.num_tensors == len(REFERENCE)
    with zeroio.open(tmp_path / out) as ckpt:
        _assert_equal(ckpt.state_dict(), REFERENCE)
    if fmt in ("safetensors", "torch"):
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    if fmt == "safetensors":
        index = json.loads((tmp_path / out / "model.safetensors.index.json").read_text())
        assert not any(n.endswith("_scale_inv") for n in index["weight_map"])


def test_convert_to_fp32_keeps_the_unrounded_products(tmp_path):
    zeroio.convert(FP8, tmp_path / "out", dtype="fp32", progress=False)
    _assert_equal(load_file(str(tmp_path / "out" / "model.safetensors")), _fp32_reference())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"


def test_verify_compares_dequantized(capsys):
    ref = str(FIXTURES / "fp8" / "expected" / "reference_bf16.safetensors")
    assert zeroio.verify(FP8, ref).ok
    assert not zeroio.verify(FP8, ref, quantized="raw").ok  # float8 vs bf16, and the scales
    assert main(["verify", str(FP8), ref]) == 0
    assert main(["verify", str(FP8), ref, "--keep-quantized"]) == 1
    capsys.readouterr()


def _llama(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((FP8 / "config.json").read_text())
    config.pop("quantization_config")
    return LlamaForCausalLM(LlamaConfig(**config)).to(dtype)


def test_load_fills_a_model_with_the_reference():
    model = _llama(torch.bfloat16)
    report = zeroio.load(FP8, model)
    assert not report.missing_keys and not report.unexpected_keys
    _assert_equal(dict(model.state_dict()), REFERENCE)
    model = _llama(torch.float32)
    zeroio.load(FP8, model)
    _assert_equal(dict(model.state_dict()), _fp32_reference())


def test_hf_url_converts(hub_server, hub_api, xet_disabled, monkeypatch, tmp_path):
    repo = f"{DEFAULT_USER}/fp8-tiny"
    hub_api.create_repo(repo)
    hub_api.upload_folder(repo_id=repo, folder_path=FP8)
    monkeypatch.setenv("HF_TOKEN", DEFAULT_TOKEN)
    zeroio.convert(f"hf://{repo}", tmp_path / "out", progress=False)
    _assert_equal(load_file(str(tmp_path / "out" / "model.safetensors")), REFERENCE)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


# --------------------------------------------------------------------------- reading raw


def test_raw_reads_every_tensor_as_stored(tmp_path, capsys):
    with zeroio.open(FP8, quantized="raw") as ckpt:
        _assert_equal(dict(ckpt.items()), _stored())
        # a cast asked for leaves quantized values alone: they mean nothing without their scales
        assert ckpt.get_tensor(QUANTIZED[0], dtype="bf16").dtype == torch.float8_e4m3fn
    assert main(["convert", str(FP8), str(tmp_path / "raw"), "--keep-quantized", "--quiet"]) == 0
    assert "quantization_config" in json.loads((tmp_path / "raw" / "config.json").read_text())
    with zeroio.open(tmp_path / "raw", quantized="raw") as ckpt:
        _assert_equal(dict(ckpt.items()), _stored())
    with zeroio.open(tmp_path / "raw") as ckpt:  # its config still declares FP8: read dequantized again
        _assert_equal(dict(ckpt.items()), REFERENCE)
    zeroio.convert(FP8, tmp_path / "raw32", dtype="fp32", quantized="raw", progress=False)
    with zeroio.open(tmp_path / "raw32", quantized="raw") as ckpt:  # fp32 asked: float8 and scales kept as stored
        stored = _stored()
        for name, tensor in ckpt.items():
            want = stored[name] if stored[name].dtype in (torch.float8_e4m3fn, torch.float32) else stored[name].float()
            assert torch.equal(_bits(tensor), _bits(want)), name
    with pytest.raises(ValueError, match="quantized must be"):
        zeroio.open(FP8, quantized="dequantise")  # type: ignore[arg-type]
    capsys.readouterr()


# --------------------------------------------------------------------------- refusals


def _edit_config(folder: Path, **quantization: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("quantization", "words"),
    [
        ({"quant_method": "gptq"}, "quant_method 'gptq'"),
        ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
        ({"weight_block_size": None}, "per-tensor or per-channel"),
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ],
)
def test_other_quantization_configs_are_refused(tmp_path, capsys, quantization, words):
    src = _copy_fixture(tmp_path)
    _edit_config(src, **quantization)
    with pytest.raises(UnsupportedCheckpointError, match=words) as caught:
        zeroio.open(src)
    assert "quantized='raw'" in str(caught.value) and "\n" not in str(caught.value)
    assert main(["convert", str(src), str(tmp_path / "out"), "--quiet"]) != 0
    assert not (tmp_path / "out").exists()
    assert "--keep-quantized" in capsys.readouterr().err
    with zeroio.open(src, quantized="raw") as ckpt:
        assert len(ckpt) == len(_stored())


def test_block_size_that_does_not_match_the_scales_is_refused(tmp_path):
    src = _copy_fixture(tmp_path)
    _edit_config(src, weight_block_size=[64, 128])
    with pytest.raises(CheckpointFormatError, match=r"in 64x128 blocks needs"):
        zeroio.open(src)


def _one_file(tmp_path: Path, tensors: dict[str, torch.Tensor], config: bool = True) -> Path:
    folder = tmp_path / "crafted"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    if config:
        shutil.copy(FP8 / "config.json", folder / "config.json")
    return folder


WEIGHT = torch.zeros(136, 264, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("tensors", "error", "words"),
    [
        ({"w.weight": WEIGHT, "w.weight_scale_inv": torch.ones(2, 2)}, CheckpointFormatError, r"needs \(2, 3\)"),
        ({"w.weight": WEIGHT, "w.weight_scale_inv": torch.ones(6)}, CheckpointFormatError, r"needs \(2, 3\)"),
        ({"w.weight_scale_inv": torch.ones(2, 3)}, CheckpointFormatError, "'w.weight' is missing"),
        (
            {"w.weight": WEIGHT, "w.weight_scale_inv": torch.ones(2, 3, dtype=torch.bfloat16)},
            CheckpointFormatError,
            "is bfloat16, not float32",
        ),
        (
            {"w.weight": WEIGHT.float(), "w.weight_scale_inv": torch.ones(2, 3)},
            CheckpointFormatError,
            "not a 2-D float8_e4m3fn weight",
        ),
        ({"w.weight": WEIGHT}, UnsupportedCheckpointError, "without a 'w.weight_scale_inv'"),
        ({"w.weight": WEIGHT, "w.weight_scale": torch.ones(1)}, UnsupportedCheckpointError, "per-tensor or per-chan"),
        ({"w.weight": WEIGHT, "w.input_scale": torch.ones(1)}, UnsupportedCheckpointError, "per-tensor or per-chan"),
        (
            {"e.gate_up_proj_blocks": torch.zeros(4, 8, 16, dtype=torch.uint8), "e.gate_up_proj_scales": torch.zeros(4, 8, dtype=torch.uint8)},
            UnsupportedCheckpointError,
            "MXFP4",
        ),
    ],
    ids=["scale-shape", "scale-1d", "scale-without-weight", "scale-dtype", "weight-not-fp8", "fp8-without-scale",
         "per-tensor-scale", "static-input-scale", "mxfp4"],
)  # fmt: skip
@pytest.mark.parametrize("config", [True, False], ids=["config", "no-config"])
def test_layouts_zeroio_cannot_dequantize_are_refused(tmp_path, tensors, error, words, config):
    folder = _one_file(tmp_path, tensors, config)
    with pytest.raises(error, match=words) as caught:
        zeroio.open(folder)
    assert "\n" not in str(caught.value)
    with zeroio.open(folder, quantized="raw") as ckpt:  # as stored, always possible
        assert sorted(ckpt) == sorted(tensors)


def test_truncated_scale_is_a_typed_error(tmp_path):
    src = _copy_fixture(tmp_path)
    shard = src / "model-00002-of-00002.safetensors"  # its last tensors include scales
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        zeroio.open(src)


def test_tied_alias_of_a_quantized_weight_reads_dequantized(tmp_path):
    """safetensors stores a tied group once and records ``alias: source`` in its metadata (huggingface_hub)."""
    name = "model.layers.0.self_attn.q_proj.weight"
    stored = _stored()
    folder = tmp_path / "tied"
    folder.mkdir()
    tensors = {name: stored[name], name + "_scale_inv": stored[name + "_scale_inv"]}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", "alias.weight": name})
    with zeroio.open(folder) as ckpt:
        assert ckpt.tied == {"alias.weight": name}
        _assert_equal(ckpt.state_dict(), {name: REFERENCE[name], "alias.weight": REFERENCE[name]})
