"""Checkpoints written by older DeepSpeed releases (fixtures/versions/, fixtures/generate_versions.py) read bit for bit.

Each fixture was trained and saved by the release its manifest names, on torch 2.13's CPU build; its
``expected/engine.pt`` holds that engine's own tensors at save time and ``expected/optimizer.pt`` DeepSpeed's
``safe_get_full_optimizer_state``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES
from hostile_files import Ops, archive
from safetensors.torch import load_file

import zeroio
from zeroio._pickles import load_pickle
from zeroio.errors import UnsafePickleError

VERSIONS = FIXTURES / "versions"
NAMES = sorted(p.parent.name for p in VERSIONS.glob("*/manifest.json"))


def _manifest(name: str) -> dict[str, Any]:
    return json.loads((VERSIONS / name / "manifest.json").read_text())


def _expected(name: str, kind: str) -> dict[str, Any]:
    return torch.load(VERSIONS / name / "expected" / f"{kind}.pt", weights_only=True)


def _assert_engine_bits(ckpt: zeroio.Checkpoint, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor equals the engine's, dtype for dtype; floating buffers come back as fp32 (docs/format.md), so a
    16-bit live buffer must be what the file stores and equal the fp32 one once upcast."""
    assert list(got) == list(want)
    for key, value in want.items():
        if ckpt.info(key).kind == "buffer" and value.is_floating_point() and value.dtype != torch.float32:
            assert ckpt.info(key).stored_dtype == value.dtype, key
            value = value.float()
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("name", NAMES)
def test_open_equals_the_engine(name: str) -> None:
    """zeroio.open serves the release's engine tensors bit for bit, in model.state_dict() order."""
    manifest = _manifest(name)
    with zeroio.open(VERSIONS / name) as ckpt:
        assert ckpt.metadata.ds_version == manifest["deepspeed"]
        _assert_engine_bits(ckpt, {key: ckpt[key] for key in ckpt}, _expected(name, "engine"))
        for param, states in _expected(name, "optimizer").items():
            got = ckpt.optimizer_state(param)
            for key, value in states.items():
                assert torch.equal(got[key].float(), value), f"{param} {key}"


@pytest.mark.parametrize("name", NAMES)
def test_convert_equals_the_engine(name: str, tmp_path: Path) -> None:
    """zeroio.convert writes the engine's tensors (the tied head left out, as Hugging Face does)."""
    zeroio.convert(VERSIONS / name, tmp_path / "out", progress=False)
    got: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        got.update(load_file(shard))
    want = _expected(name, "engine")
    assert "emb.weight" in got and set(got) <= set(want)
    with zeroio.open(VERSIONS / name) as ckpt:
        _assert_engine_bits(ckpt, got, {key: want[key] for key in got})


def test_python2_names_of_protocol_2_pickles(tmp_path: Path) -> None:
    """torch.save writes protocol 2, where a set is '__builtin__.set': read as a set. The mapping only renames:
    '__builtin__.eval' is still refused, under its Python 3 name."""
    path = tmp_path / "set.pt"
    ops = Ops().dict().text("names").glob("__builtin__.set").mark().text("a").raw(b"l").tuple(1).reduce().setitem()
    path.write_bytes(archive(ops.stop()))
    tree, _ = load_pickle(path)
    assert tree == {"names": {"a"}}
    path.write_bytes(archive(Ops().glob("__builtin__.eval").text("1").tuple(1).reduce().stop()))
    with pytest.raises(UnsafePickleError, match="'builtins.eval'"):
        load_pickle(path)
