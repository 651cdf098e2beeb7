"""LoRA fine-tunes out of DeepSpeed checkpoints: PEFT adapter folders and merged base weights (issue 33).

Fixtures: fixtures/peft/ (fixtures/generate_peft.py): DeepSpeed ZeRO-2/3 runs of PEFT models, with PEFT's own
references computed from the live engine at save time (``get_peft_model_state_dict``, ``merge_and_unload``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError, CheckpointNotFoundError, OutputError, UnsupportedCheckpointError

peft = pytest.importorskip("peft")

# transformers 5.24 warns from inside peft 0.21.2's PeftModel (its own deprecated alias): not zeroio's concern.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    # PEFT's note when it saves a targeted embedding layer's base weight with the adapter (what the files hold).
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`:UserWarning"),
]

PEFT_FIXTURES = FIXTURES / "peft"
SINGLE = [
    "lora_llama_z3_fp32",
    "lora_llama_z3_bf16",
    "lora_llama_z2_bf16",
    "lora_llama_z2_fp16",
    "lora_gpt2_z3_fp32",
    "lora_llama_fsdp2_dcp",
    "lora_qwen2_z3_bias_embed",
]
ALL = [*SINGLE, "lora_llama_z2_two_adapters", "lora_gpt2_z2_tokens", "lora_qwen3moe_z2_experts"]


def _generator() -> Any:
    """fixtures/generate_peft.py: the fixtures' base models and LoRA configs."""
    spec = importlib.util.spec_from_file_location("generate_peft", FIXTURES / "generate_peft.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def _ckpt(name: str) -> Path:
    return PEFT_FIXTURES / name / "checkpoint-3"


def _expected(name: str, what: str) -> Any:
    return torch.load(PEFT_FIXTURES / name / "expected" / f"{what}.pt", weights_only=True)


def _base(name: str) -> torch.nn.Module:
    torch.manual_seed(0)  # random base weights: every test below overwrites the ones it checks
    return GEN.base_model(GEN.CASES[name]["model"])


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key], tensor), key


@pytest.fixture(scope="module")
def adapters_out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``convert(fmt="peft")`` of every fixture, once."""
    root = tmp_path_factory.mktemp("peft")
    return {name: _adapter_folder(name, root / name) for name in ALL}


def _adapter_folder(name: str, dst: Path) -> Path:
    result = zeroio.convert(_ckpt(name), dst, fmt="peft", progress=False)
    adapters = list(_expected(name, "adapter"))
    assert result.files == tuple(dst / ("" if a == "default" else a) / "adapter_model.safetensors" for a in adapters)
    return dst


# --------------------------------------------------------------------------- adapters out


@pytest.mark.parametrize("name", ALL)
def test_adapter_file_is_peft_state_dict(name: str, adapters_out: dict[str, Path]) -> None:
    """adapter_model.safetensors holds exactly get_peft_model_state_dict's keys and the engine's tensors."""
    for adapter, expected in _expected(name, "adapter").items():
        folder = adapters_out[name] / ("" if adapter == "default" else adapter)
        _assert_equal(load_file(folder / "adapter_model.safetensors"), expected)
        # adapter_config.json: the run's own file, byte for byte.
        source = _ckpt(name) / ("" if adapter == "default" else adapter) / "adapter_config.json"
        assert (folder / "adapter_config.json").read_bytes() == source.read_bytes()


@pytest.mark.parametrize("name", ALL)
def test_peft_loads_adapter(name: str, adapters_out: dict[str, Path]) -> None:
    """PeftModel.from_pretrained / load_adapter: no missing or unexpected adapter keys, weights bit-identical."""
    from peft import PeftModel, get_peft_model_state_dict

    expected = _expected(name, "adapter")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(missing|unexpected).*")  # PEFT warns on a key mismatch
        model = PeftModel.from_pretrained(_base(name), adapters_out[name])
        for adapter in list(expected)[1:]:
            result = model.load_adapter(adapters_out[name] / adapter, adapter_name=adapter)
            assert not [k for k in result.missing_keys if f".{adapter}" in k] and not result.unexpected_keys
    for adapter, tensors in expected.items():
        _assert_equal(get_peft_model_state_dict(model, adapter_name=adapter), tensors)


def test_adapter_file_biases_and_embeddings_follow_the_config(tmp_path: Path) -> None:
    """What PEFT saves besides the LoRA tensors depends on the config: bias="all" every bias, bias="lora_only"
    the LoRA layers' biases, a targeted embed_tokens (listed, or matched by a pattern) its base weight (the fixture
    trains with "all" and LoRA on embed_tokens). The same checkpoint with each config gives
    get_peft_model_state_dict's keys for that config, computed by PEFT here from the engine's tensors."""
    from peft import get_peft_model_state_dict

    name = "lora_qwen2_z3_bias_embed"
    engine = _expected(name, "engine")
    adapter = load_file(_adapter_folder(name, tmp_path / "all") / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.k_proj.bias" in adapter  # not a LoRA layer's: still saved
    assert "base_model.model.model.embed_tokens.base_layer.weight" in adapter
    config = json.loads((_ckpt(name) / "adapter_config.json").read_text())
    regex = r".*\.(q_proj|v_proj|down_proj|embed_tokens)"  # the same layers as a pattern (PEFT's other branch)
    for bias, targets in (("lora_only", config["target_modules"]), ("none", regex)):
        changed = {**config, "bias": bias, "target_modules": targets}
        out = tmp_path / bias
        zeroio.convert(_ckpt(name), out, fmt="peft", adapter_config=changed, progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT's notes on the config (embedding layers saved, ...)
            model = peft.get_peft_model(_base(name), peft.LoraConfig(**{
                k: v for k, v in changed.items() if k not in ("peft_type", "peft_version", "auto_mapping")
            }))  # fmt: skip
            expected = get_peft_model_state_dict(model, state_dict=engine)
        _assert_equal(load_file(out / "adapter_model.safetensors"), expected)


def test_adapter_config_missing_is_refused(tmp_path: Path) -> None:
    """No adapter_config.json beside the checkpoint: a typed error naming the adapter and --adapter-config;
    with adapter_config= the same adapter is written."""
    src = tmp_path / "checkpoint-3"
    shutil.copytree(_ckpt("lora_llama_z3_fp32"), src)
    (src / "adapter_config.json").unlink()
    with pytest.raises(
        CheckpointNotFoundError, match=r"adapter_config.json for LoRA adapter 'default'.*adapter_config="
    ):
        zeroio.convert(src, tmp_path / "out", fmt="peft", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointNotFoundError, match="adapter_config.json"):
        zeroio.convert(src, tmp_path / "merged", merge_lora=True, progress=False)
    given = _ckpt("lora_llama_z3_fp32") / "adapter_config.json"
    zeroio.convert(src, tmp_path / "out", fmt="peft", adapter_config=given, progress=False)
    _assert_equal(
        load_file(tmp_path / "out" / "adapter_model.safetensors"), _expected("lora_llama_z3_fp32", "adapter")["default"]
    )
    assert (tmp_path / "out" / "adapter_config.json").read_bytes() == given.read_bytes()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[" * 100_000 + "]" * 100_000, "is not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"r": 4}', "no numeric lora_alpha"),
    ],
    ids=["deep", "list", "no-alpha"],
)
def test_bad_adapter_config_is_a_typed_error(tmp_path: Path, text: str, error: str) -> None:
    """A hostile or wrong adapter_config.json: CheckpointFormatError naming the file, nothing written."""
    src = tmp_path / "checkpoint-3"
    shutil.copytree(_ckpt("lora_llama_z3_fp32"), src)
    (src / "adapter_config.json").write_text(text)
    with pytest.raises(CheckpointFormatError, match=error):
        if error == "no numeric lora_alpha":
            zeroio.convert(src, tmp_path / "out", merge_lora=True, progress=False)
        else:
            zeroio.convert(src, tmp_path / "out", fmt="peft", progress=False)
    assert not (tmp_path / "out").exists()


def test_not_a_peft_checkpoint() -> None:
    with pytest.raises(UnsupportedCheckpointError, match="holds no LoRA adapter"):
        zeroio.convert(FIXTURES / "z3_ws2_fp32", "/nonexistent/never", fmt="peft", progress=False)


def test_adapter_output_overwrite(tmp_path: Path) -> None:
    """An existing folder is refused; overwrite replaces a folder of fmt="peft" outputs (named-adapter folders
    included) but never one holding other files."""
    name = "lora_llama_z2_two_adapters"
    out = tmp_path / "out"
    zeroio.convert(_ckpt(name), out, fmt="peft", progress=False)
    with pytest.raises(OutputError, match="already exists"):
        zeroio.convert(_ckpt(name), out, fmt="peft", progress=False)
    zeroio.convert(_ckpt(name), out, fmt="peft", dtype="bf16", overwrite=True, progress=False)
    assert (
        load_file(out / "extra" / "adapter_model.safetensors")[
            "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
        ].dtype
        == torch.bfloat16
    )
    (out / "extra" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"extra/"):
        zeroio.convert(_ckpt(name), out, fmt="peft", overwrite=True, progress=False)
    assert (out / "extra" / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- merged weights out


@pytest.mark.parametrize("name", SINGLE)
def test_merge_equals_peft_merge_and_unload(name: str, tmp_path: Path) -> None:
    """merge_lora in fp32 equals PEFT's merge_and_unload() bit for bit (tolerance 0: zeroio computes
    transpose(B @ A, fan_in_fan_out) * scale, then W + delta, PEFT's own ops in its order, in fp32); chunked reads
    (64-byte chunks, several per row) give the same bits."""
    expected = _expected(name, "merged")
    if GEN.CASES[name]["model"] == "gpt2":
        expected.pop("lm_head.weight")  # tied to transformer.wte.weight: stored once, recorded as a tie
    for chunk_bytes in (64 * 1024 * 1024, 64):
        out = tmp_path / f"merged-{chunk_bytes}"
        zeroio.convert(_ckpt(name), out, merge_lora=True, dtype="fp32", chunk_bytes=chunk_bytes, progress=False)
        _assert_equal(load_file(out / "model.safetensors"), expected)


@pytest.mark.parametrize("name", ["lora_llama_z3_bf16", "lora_gpt2_z3_fp32"])
def test_merge_default_dtype_and_formats(name: str, tmp_path: Path) -> None:
    """Without dtype, merged weights are the fp32 merge and the other tensors keep their stored dtype (bf16 base
    weights of a bf16 run); dtype="bf16" casts the fp32 merge once. torch and DCP outputs hold the same tensors;
    config.json is copied so transformers loads the folder."""
    expected = _expected(name, "merged")
    with zeroio.open(_ckpt(name), merge_lora=True) as merged:
        dtypes = {k: info.dtype for k, info in merged.infos.items()}
        merged_names = [k for k, info in merged.infos.items() if info.kind == "trainable" and k.endswith("weight")]
    assert merged_names and all(dtypes[k] == torch.float32 for k in merged_names)
    train_dtype = torch.bfloat16 if GEN.CASES[name]["dtype"] == "bf16" else torch.float32
    assert dtypes["transformer.wte.weight" if "gpt2" in name else "model.embed_tokens.weight"] == train_dtype
    want = {k: v.to(dtypes[k]) for k, v in expected.items()}
    zeroio.convert(_ckpt(name), tmp_path / "bf16", merge_lora=True, dtype="bf16", progress=False)
    _assert_equal(load_file(tmp_path / "bf16" / "model.safetensors"), {
        k: v.to(torch.bfloat16) for k, v in expected.items() if k in load_file(tmp_path / "bf16" / "model.safetensors")
    })  # fmt: skip
    zeroio.convert(_ckpt(name), tmp_path / "torch", merge_lora=True, fmt="torch", progress=False)
    got = torch.load(tmp_path / "torch" / "pytorch_model.bin", weights_only=True)
    _assert_equal(got, want)
    assert (tmp_path / "torch" / "config.json").is_file()
    # accelerate's layout ({"model": state dict}): read back, torchtitan's top-level keys beginning with "model."
    # are taken for that wrapper by the DCP reader (a naming ambiguity of DCP folders, not of the merge).
    zeroio.convert(_ckpt(name), tmp_path / "dcp", merge_lora=True, fmt="dcp", dcp_layout="accelerate", progress=False)
    with zeroio.open(tmp_path / "dcp") as dcp:
        _assert_equal({k: dcp[k] for k in dcp}, want)


@pytest.mark.parametrize(
    "name", ["lora_llama_z3_fp32", "lora_gpt2_z3_fp32", "lora_llama_z2_bf16", "lora_llama_fsdp2_dcp"]
)
def test_load_merge_lora_into_base_model(name: str) -> None:
    """zeroio.load(ckpt, base, merge_lora=True) fills a plain fp32 base model with PEFT's fp32 merged weights (a
    bf16 run's frozen weights are bf16 values, exactly representable)."""
    model = _base(name).float()
    report = zeroio.load(_ckpt(name), model, merge_lora=True)
    assert not report.missing_keys and not report.unexpected_keys
    _assert_equal({k: v for k, v in model.state_dict().items()}, _expected(name, "merged"))


def test_merge_refuses_several_adapters_and_dora(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"2 LoRA adapters \(default, extra\)"):
        zeroio.convert(_ckpt("lora_llama_z2_two_adapters"), tmp_path / "a", merge_lora=True, progress=False)
    config = json.loads((_ckpt("lora_llama_z3_fp32") / "adapter_config.json").read_text())
    for key in ("use_dora", "use_qalora", "lora_bias"):
        with pytest.raises(UnsupportedCheckpointError, match=key):
            zeroio.convert(
                _ckpt("lora_llama_z3_fp32"), tmp_path / "b", merge_lora=True, adapter_config={**config, key: True},
                progress=False,
            )  # fmt: skip
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="merge_lora"):
        zeroio.convert(_ckpt("lora_llama_z3_fp32"), tmp_path / "c", merge_lora=True, fmt="peft", progress=False)


def test_merge_refuses_variants_peft_does_not_merge_as_lora(tmp_path: Path) -> None:
    """aLoRA and Arrow (PEFT itself refuses to merge them) and KaSA (another delta): refused by name."""
    config = json.loads((_ckpt("lora_llama_z3_fp32") / "adapter_config.json").read_text())
    variants = {"alora_invocation_tokens": [5, 6], "arrow_config": {"top_k": 2}, "kasa_config": {"k": 1}}
    for key, value in variants.items():
        with pytest.raises(UnsupportedCheckpointError, match=key):
            zeroio.convert(
                _ckpt("lora_llama_z3_fp32"), tmp_path / "m", merge_lora=True, adapter_config={**config, key: value},
                progress=False,
            )  # fmt: skip
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("lora_gpt2_z2_tokens", r"trained token rows \(trainable_token_indices\) at '.*transformer\.wte'"),
        ("lora_qwen3moe_z2_experts", r"'lora_A' factors but no '.*mlp\.experts\..*base_layer\.weight'"),
    ],
)
def test_merge_refuses_what_is_not_w_plus_ba(name: str, what: str, tmp_path: Path) -> None:
    """Trained token rows (trainable_token_indices) and LoRA on parameters other than a layer's weight
    (target_parameters on fused MoE experts) are refused by name: before, the rows and the expert factors were
    silently left out and the unmerged base written under PEFT's inner names."""
    with pytest.raises(UnsupportedCheckpointError, match=what):
        zeroio.convert(_ckpt(name), tmp_path / "m", merge_lora=True, progress=False)
    with pytest.raises(UnsupportedCheckpointError, match=what):
        zeroio.open(_ckpt(name), merge_lora=True)
    assert not (tmp_path / "m").exists()


def test_merge_refuses_a_config_that_does_not_fit(tmp_path: Path) -> None:
    """GPT-2's Conv1D weights are [in, out]: a config without fan_in_fan_out cannot fit the non-square c_attn
    (32 x 96); the merge is refused before anything is written, naming the module."""
    config = json.loads((_ckpt("lora_gpt2_z3_fp32") / "adapter_config.json").read_text())
    with pytest.raises(CheckpointFormatError, match=r"c_attn.*fan_in_fan_out=False"):
        zeroio.convert(
            _ckpt("lora_gpt2_z3_fp32"), tmp_path / "m", merge_lora=True,
            adapter_config={**config, "fan_in_fan_out": False}, progress=False,
        )  # fmt: skip
    assert not (tmp_path / "m").exists()


def test_rslora_scale_is_alpha_over_sqrt_r() -> None:
    """The GPT-2 fixture trains with use_rslora: PEFT's merge (the reference) used lora_alpha / sqrt(r); the
    plain lora_alpha / r scale would not match it."""
    config = json.loads((_ckpt("lora_gpt2_z3_fp32") / "adapter_config.json").read_text())
    assert config["use_rslora"] is True and config["fan_in_fan_out"] is True
    expected = _expected("lora_gpt2_z3_fp32", "merged")
    with zeroio.open(_ckpt("lora_gpt2_z3_fp32"), merge_lora=True) as merged:
        assert torch.equal(merged["transformer.h.0.attn.c_attn.weight"], expected["transformer.h.0.attn.c_attn.weight"])
    plain = {**config, "use_rslora": False}
    with zeroio.open(_ckpt("lora_gpt2_z3_fp32"), merge_lora=True, adapter_config=plain) as merged:
        assert not torch.equal(
            merged["transformer.h.0.attn.c_attn.weight"], expected["transformer.h.0.attn.c_attn.weight"]
        )


# --------------------------------------------------------------------------- command line


def test_cli_format_peft_and_merge_lora(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "lora_llama_z3_bf16"
    assert main(["convert", str(_ckpt(name)), str(tmp_path / "adapter"), "--format", "peft", "--quiet"]) == 0
    _assert_equal(load_file(tmp_path / "adapter" / "adapter_model.safetensors"), _expected(name, "adapter")["default"])
    assert main(["convert", str(_ckpt(name)), str(tmp_path / "m"), "--merge-lora", "--dtype", "fp32", "--quiet"]) == 0
    _assert_equal(load_file(tmp_path / "m" / "model.safetensors"), _expected(name, "merged"))
    src = tmp_path / "checkpoint-3"
    shutil.copytree(_ckpt(name), src)
    (src / "adapter_config.json").unlink()
    assert main(["convert", str(src), str(tmp_path / "x"), "--format", "peft", "--quiet"]) == 1
    assert "--adapter-config PATH" in capsys.readouterr().err


# --------------------------------------------------------------------------- sources at URLs


def test_adapter_and_merge_from_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An s3:// checkpoint-N/: adapter_config.json is found beside the checkpoint at the URL, as locally."""
    pytest.importorskip("s3fs")
    import logging

    from s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        name = "lora_llama_z3_bf16"
        url = server.upload_tree(_ckpt(name), "runs", "lora/checkpoint-3")
        zeroio.convert(url, tmp_path / "adapter", fmt="peft", progress=False)
        _assert_equal(
            load_file(tmp_path / "adapter" / "adapter_model.safetensors"), _expected(name, "adapter")["default"]
        )
        zeroio.convert(url, tmp_path / "merged", merge_lora=True, dtype="fp32", progress=False)
        _assert_equal(load_file(tmp_path / "merged" / "model.safetensors"), _expected(name, "merged"))
    finally:
        server.stop()
