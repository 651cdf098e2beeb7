"""zeroio.convert of framework checkpoints: fmt="lightning" (one .ckpt file) and HF Trainer folders transformers loads."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES, FRAMEWORKS, HF, HF_CKPT, LIGHTNING, LIGHTNING_CLIENT_KEYS, assert_state_dicts_equal

from zeroio import convert
from zeroio.cli import main
from zeroio.errors import OutputError

HF_SIDE_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
HINT = "(set ZEROIO_DEBUG=1 for the full traceback)\n"


def _tiny_lit() -> Any:
    """The fixtures' LightningModule class (layers built in configure_model), from fixtures/generate_frameworks.py."""
    spec = importlib.util.spec_from_file_location("generate_frameworks", FIXTURES / "generate_frameworks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.lightning_module_class()


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# =========================================================================== fmt="lightning"


@pytest.mark.parametrize("name", LIGHTNING)
def test_convert_lightning_writes_one_ckpt_file(tmp_path, name):
    """fmt="lightning" writes only dst: Lightning's client state plus state_dict equal to Lightning's conversion."""
    folder = FRAMEWORKS / name
    reference = torch.load(folder / "expected" / "lightning_fp32.ckpt", weights_only=True)
    dst = tmp_path / "deploy" / "model.ckpt"  # missing parent folders are created, as for folder outputs
    result = convert(folder / "model.ckpt", dst, fmt="lightning", progress=False)
    assert (result.files, result.index_path, result.copied) == ((dst,), None, ())
    assert (result.num_tensors, result.total_size) == (8, 1360)
    assert result.tied == {"head.weight": "emb.weight"}
    assert result.card_facts["format"] == "lightning" and result.card_facts["num_params"] == 340
    assert _listing(tmp_path) == ["deploy"] and _listing(dst.parent) == ["model.ckpt"]  # no temporary left
    written = torch.load(dst, weights_only=True)
    assert list(written) == [*LIGHTNING_CLIENT_KEYS, "state_dict"]
    assert (written["epoch"], written["global_step"]) == (reference["epoch"], reference["global_step"]) == (1, 3)
    assert written["hyper_parameters"] == reference["hyper_parameters"]
    assert_state_dicts_equal(written["state_dict"], reference["state_dict"])
    assert written["state_dict"]["head.weight"].data_ptr() == written["state_dict"]["emb.weight"].data_ptr()


@pytest.mark.parametrize("name", LIGHTNING)
def test_convert_lightning_loads_with_load_from_checkpoint(tmp_path, name):
    """MyModule.load_from_checkpoint(dst), with no extra argument, runs configure_model and gives the outputs of
    the module restored from Lightning's own convert_zero_checkpoint_to_fp32_state_dict file."""
    pytest.importorskip("lightning")
    folder = FRAMEWORKS / name
    tiny_lit = _tiny_lit()
    expected = torch.load(folder / "expected" / "outputs.pt", weights_only=True)
    dst = tmp_path / "model.ckpt"
    convert(folder / "model.ckpt", dst, fmt="lightning", progress=False)
    ours = tiny_lit.load_from_checkpoint(dst).eval()  # Lightning's defaults: weights_only (torch's), no map_location
    theirs = tiny_lit.load_from_checkpoint(
        folder / "expected" / "lightning_fp32.ckpt", map_location="cpu", weights_only=True
    ).eval()
    assert dict(ours.hparams) == dict(theirs.hparams) == {"vocab": 13, "dim": 8, "hidden": 12, "lr": 0.05}
    assert ours.head.weight is ours.emb.weight
    with torch.no_grad():
        out_ours, out_theirs = ours(expected["input_ids"]), theirs(expected["input_ids"])
    assert torch.equal(out_ours, out_theirs)
    # outputs.pt was computed on the GPU machine's CPU (torch 2.11): the last bits may differ here.
    torch.testing.assert_close(out_ours, expected["outputs"], rtol=1e-5, atol=1e-6)


def test_convert_lightning_casts_dtype(tmp_path):
    """dtype="bf16" reaches the .ckpt writer: every floating tensor cast with torch's rounding, tie kept."""
    folder = FRAMEWORKS / "lightning_z3_fp32"
    reference = torch.load(folder / "expected" / "lightning_fp32.ckpt", weights_only=True)["state_dict"]
    result = convert(folder / "model.ckpt", tmp_path / "bf16.ckpt", fmt="lightning", dtype="bf16", progress=False)
    assert result.total_size == 680 and result.card_facts["output_dtype"] == "bf16"
    state = torch.load(tmp_path / "bf16.ckpt", weights_only=True)["state_dict"]
    assert_state_dicts_equal(state, {k: v.to(torch.bfloat16) for k, v in reference.items()})


def test_convert_lightning_refuses_existing_file_unless_overwrite(tmp_path):
    """An existing dst file is refused (before reading the source) unless overwrite=True, which replaces it."""
    dst = tmp_path / "model.ckpt"
    dst.write_bytes(b"old")
    with pytest.raises(OutputError) as info:
        convert(tmp_path / "no-such-checkpoint", dst, fmt="lightning", progress=False)
    assert str(info.value) == (
        f"Output file '{dst}' already exists. Pass overwrite=True (--overwrite) to replace it, "
        "or choose another destination."
    )
    assert dst.read_bytes() == b"old"
    convert(FRAMEWORKS / "lightning_z3_fp32" / "model.ckpt", dst, fmt="lightning", overwrite=True, progress=False)
    assert list(torch.load(dst, weights_only=True)) == [*LIGHTNING_CLIENT_KEYS, "state_dict"]
    assert _listing(tmp_path) == ["model.ckpt"]


def test_convert_lightning_refuses_a_folder_even_with_overwrite(tmp_path):
    """A folder at dst (e.g. the DeepSpeed .ckpt folder itself) is never replaced by the single file."""
    src = tmp_path / "model.ckpt"
    shutil.copytree(FRAMEWORKS / "lightning_z3_fp32" / "model.ckpt", src)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    for overwrite in (False, True):
        with pytest.raises(OutputError) as info:
            convert(src, src, fmt="lightning", overwrite=overwrite, progress=False)
        assert str(info.value) == (
            f"Output path '{src}' is a folder; a Lightning checkpoint is one file. Pass a file path such as "
            f"'{src / 'model.ckpt'}'."
        )
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before


def test_convert_lightning_refuses_its_source_as_destination(tmp_path):
    """overwrite=True onto the source file itself is refused, as convert refuses a source inside its output."""
    src = tmp_path / "lightning.ckpt"
    shutil.copy(FRAMEWORKS / "lightning_z3_fp32" / "expected" / "lightning_fp32.ckpt", src)
    with pytest.raises(OutputError) as info:
        convert(src, src, fmt="lightning", overwrite=True, progress=False)
    assert str(info.value) == (
        f"Refusing to write '{src}': it is the source '{src}', whose files would be replaced or deleted while they "
        "are read. Write to another path."
    )
    assert src.read_bytes() == (FRAMEWORKS / "lightning_z3_fp32" / "expected" / "lightning_fp32.ckpt").read_bytes()


def test_convert_lightning_refuses_exclude_frozen(tmp_path):
    """exclude_frozen would make load_from_checkpoint's strict load fail, so it is refused before any IO."""
    with pytest.raises(ValueError) as info:
        convert(FRAMEWORKS / "lightning_z3_fp32" / "model.ckpt", tmp_path / "m.ckpt", fmt="lightning",
                exclude_frozen=True, progress=False)  # fmt: skip
    assert str(info.value) == (
        "exclude_frozen=True cannot be used with fmt='lightning': load_from_checkpoint loads strictly and needs "
        "every parameter. Drop exclude_frozen, or write fmt='safetensors'."
    )
    assert _listing(tmp_path) == []


def test_cli_convert_format_lightning(tmp_path, capsys):
    """`zeroio convert SRC DST --format lightning` writes the one file, prints one line and exits 0."""
    dst = tmp_path / "model.ckpt"
    argv = ["convert", str(FRAMEWORKS / "lightning_z3_fp32" / "model.ckpt"), str(dst), "--format", "lightning"]
    assert main(argv) == 0
    assert capsys.readouterr() == (f"Wrote 9 tensors (1 tied, 1.36 KB) in 1 file(s) to {dst}\n", "")
    assert _listing(tmp_path) == ["model.ckpt"]
    assert main([*argv, "--dtype", "bf16"]) == 1
    assert capsys.readouterr() == (
        "",
        (
            f"Output error: Output file '{dst}' already exists. Pass --overwrite to replace it, "
            f"or choose another destination.\n{HINT}"
        ),
    )
    assert main([*argv, "--dtype", "bf16", "--overwrite", "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert torch.load(dst, weights_only=True)["state_dict"]["emb.weight"].dtype == torch.bfloat16


# =========================================================================== HF Trainer checkpoint-N


def test_convert_trainer_checkpoint_copies_config_and_tokenizer(tmp_path):
    """convert(checkpoint-N) writes model.safetensors plus byte copies of config, generation config and tokenizer."""
    dst = tmp_path / "final"
    result = convert(HF_CKPT, dst, progress=False)
    assert _listing(dst) == sorted([*HF_SIDE_FILES, "model.safetensors"])
    assert result.files == (dst / "model.safetensors",)
    assert result.copied == tuple(dst / name for name in HF_SIDE_FILES)
    for name in HF_SIDE_FILES:
        assert (dst / name).read_bytes() == (HF_CKPT / name).read_bytes(), name
    # Trainer bookkeeping stays behind: it is not part of a deployable model.
    assert not {"trainer_state.json", "training_args.bin", "rng_state.pth", "latest"} & set(_listing(dst))


def test_convert_trainer_tag_folder_copies_from_checkpoint_folder(tmp_path):
    """Given global_stepN/ itself, the files are found in checkpoint-N/ beside it (torch format too)."""
    dst = tmp_path / "final"
    result = convert(HF_CKPT / "global_step3", dst, fmt="torch", progress=False)
    assert _listing(dst) == sorted([*HF_SIDE_FILES, "pytorch_model.bin"])
    assert result.copied == tuple(dst / name for name in HF_SIDE_FILES)


def test_convert_plain_deepspeed_checkpoint_copies_nothing(tmp_path):
    """A plain DeepSpeed checkpoint (root or tag folder) has no config or tokenizer: only weights are written."""
    for src, dst in [
        (FIXTURES / "z3_ws2_fp32", tmp_path / "a"),
        (FIXTURES / "z3_ws2_fp32" / "global_step2", tmp_path / "b"),
    ]:
        result = convert(src, dst, progress=False)
        assert (result.copied, _listing(dst)) == ((), ["model.safetensors"])


def test_convert_trainer_checkpoint_loads_with_from_pretrained(tmp_path):
    """AutoModelForCausalLM.from_pretrained(dst), offline and as it is, gives the logits of DeepSpeed's consolidation
    (bit for bit) and of the trained model, with lm_head tied to wte; the tokenizer loads from dst too."""
    transformers = pytest.importorskip("transformers")
    dst = tmp_path / "final"
    convert(HF_CKPT, dst, progress=False)
    expected = torch.load(HF / "expected" / "logits.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, local_files_only=True).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(HF_CKPT)).eval()
    reference.load_state_dict(torch.load(HF / "expected" / "zero_to_fp32.pt", weights_only=True), strict=True)
    with torch.no_grad():
        ours = model(input_ids=expected["input_ids"]).logits
        theirs = reference(input_ids=expected["input_ids"]).logits
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(ours, expected["logits"], rtol=1e-5, atol=1e-6)  # recorded live under ZeRO-3
    tokenizer = transformers.AutoTokenizer.from_pretrained(dst, local_files_only=True)
    original = transformers.AutoTokenizer.from_pretrained(HF_CKPT, local_files_only=True)
    assert tokenizer.get_vocab() == original.get_vocab() and len(tokenizer) == model.config.vocab_size
    assert model.generation_config.to_dict() == transformers.GenerationConfig.from_pretrained(HF_CKPT).to_dict()
