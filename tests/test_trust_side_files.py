"""Side files copied beside converted weights (issue 15): the config's dtype follows a cast, links never leak."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES

from zeroio import convert

TRAINER = FIXTURES / "frameworks" / "hf_trainer_gpt2_z3" / "checkpoint-3"


def _trainer_copy(tmp_path: Path, config_text: str | None = None) -> Path:
    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(TRAINER, ckpt, symlinks=True)
    if config_text is not None:
        (ckpt / "config.json").write_text(config_text)
    return ckpt


# --------------------------------------------------------------------------- item 14: config dtype after a cast


@pytest.mark.parametrize(("dtype", "name"), [("bf16", "bfloat16"), ("fp16", "float16")])
def test_cast_writes_the_weights_dtype_into_config(tmp_path: Path, dtype: str, name: str) -> None:
    """transformers 5.x configs say "dtype": the cast output says the new dtype; every other byte is the same."""
    result = convert(TRAINER, tmp_path / "out", dtype=dtype, progress=False)
    original = (TRAINER / "config.json").read_text()
    written = (tmp_path / "out" / "config.json").read_text()
    assert json.loads(written)["dtype"] == name
    assert written == original.replace('"dtype": "float32"', f'"dtype": "{name}"')
    assert tmp_path / "out" / "config.json" in result.copied

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert {p.dtype for p in model.parameters()} == {getattr(torch, name)}


def test_cast_updates_legacy_torch_dtype_and_nested_configs(tmp_path: Path) -> None:
    """Older configs say "torch_dtype"; composite configs repeat it per sub-config: all follow the cast."""
    config = (
        '{\n  "model_type": "toy",\n  "torch_dtype": "float32",\n'
        '  "text_config": {"dtype": "float32", "hidden_size": 16},\n  "note": "dtype stays"\n}\n'
    )
    ckpt = _trainer_copy(tmp_path, config)
    convert(ckpt, tmp_path / "out", dtype="bf16", progress=False)
    written = (tmp_path / "out" / "config.json").read_text()
    assert written == config.replace('"float32"', '"bfloat16"')


def test_no_cast_copies_config_byte_for_byte(tmp_path: Path) -> None:
    convert(TRAINER, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "config.json").read_bytes() == (TRAINER / "config.json").read_bytes()


def test_config_without_dtype_is_copied_unchanged_on_a_cast(tmp_path: Path) -> None:
    ckpt = _trainer_copy(tmp_path, '{"model_type": "toy"}')
    convert(ckpt, tmp_path / "out", dtype="bf16", progress=False)
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "toy"}'


# --------------------------------------------------------------------------- item 7: links leaving the checkpoint


def test_side_file_links_outside_the_checkpoint_are_not_copied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tokenizer.json linking to a secret outside checkpoint-N/ is skipped with a warning; links inside work."""
    secret = tmp_path / "secret"
    secret.write_text("hf_SECRET")
    ckpt = _trainer_copy(tmp_path)
    (ckpt / "tokenizer.json").unlink()
    os.symlink(secret, ckpt / "tokenizer.json")
    (ckpt / "config.json").rename(ckpt / "config.real.json")
    os.symlink("config.real.json", ckpt / "config.json")  # relative link inside the checkpoint: followed

    with caplog.at_level(logging.WARNING, logger="zeroio"):
        result = convert(ckpt, tmp_path / "out", progress=False)

    out = tmp_path / "out"
    assert not (out / "tokenizer.json").exists()
    assert out / "tokenizer.json" not in result.copied
    assert (out / "config.json").read_bytes() == (TRAINER / "config.json").read_bytes()
    assert not (out / "config.json").is_symlink()
    assert any("tokenizer.json" in r.getMessage() and "outside" in r.getMessage() for r in caplog.records)
    assert all(b"hf_SECRET" not in p.read_bytes() for p in out.iterdir())


def test_side_file_link_to_etc_from_a_tag_folder(tmp_path: Path) -> None:
    """Converting checkpoint-N/global_stepN looks in checkpoint-N/: a link there to /etc/passwd is not copied."""
    ckpt = _trainer_copy(tmp_path)
    (ckpt / "config.json").unlink()
    os.symlink("/etc/passwd", ckpt / "config.json")
    result = convert(ckpt / "global_step3", tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "config.json").exists()
    assert [p.name for p in result.copied] == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
