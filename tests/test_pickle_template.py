"""Pickle templates (zeroio/_pickles/pickle_template.py): a tree saved through a template after the first is written
from the first one's pickle, byte for byte what torch.save writes for it; a tree whose tensors differ is pickled."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zeroio._pickles import PickleTemplate, RankFileBuilder, ds_object

SHARED = collections.OrderedDict((f"layer.{i}.weight", torch.empty((0,), dtype=torch.bfloat16)) for i in range(3))
"""Empty placeholders shared by every tree, as a reshard's module placeholders are."""


def _tree(builder: RankFileBuilder, values: torch.Tensor) -> dict[str, Any]:
    def chunks() -> Iterator[torch.Tensor]:
        yield values

    flat = builder.tensor(("optimizer", "flat", 0), tuple(values.shape), values.dtype, chunks)
    return {
        "module": SHARED,
        "own": torch.empty((0, 4)),
        "optimizer": {
            "flat": [flat],
            "step": 3,
            "scaler": ds_object("deepspeed.runtime.fp16.loss_scaler.LossScaler", {"cur_scale": 1.0}),
        },
    }


def _save(path: Path, values: torch.Tensor, template: PickleTemplate | None) -> None:
    builder = RankFileBuilder()
    builder.save(_tree(builder, values), path, lambda n: None, template)


def test_later_trees_replay_the_pickle_and_equal_torch_save(tmp_path: Path) -> None:
    template = PickleTemplate()
    values = [torch.arange(6, dtype=torch.float32) + 10 * rank for rank in range(3)]
    for rank, v in enumerate(values):
        _save(tmp_path / f"t{rank}.pt", v, template)
        _save(tmp_path / f"f{rank}.pt", v, None)
    assert template.replayed == 2
    for rank, v in enumerate(values):
        assert (tmp_path / f"t{rank}.pt").read_bytes() == (tmp_path / f"f{rank}.pt").read_bytes()
        loaded = torch.load(tmp_path / f"t{rank}.pt", weights_only=False)
        assert torch.equal(loaded["optimizer"]["flat"][0], v)
        assert list(loaded["module"]) == list(SHARED) and loaded["own"].shape == (0, 4)


def test_a_tree_whose_tensors_differ_is_pickled_afresh(tmp_path: Path) -> None:
    template = PickleTemplate()
    _save(tmp_path / "first.pt", torch.zeros(6), template)
    longer = torch.arange(7, dtype=torch.float32)  # another shape: the recorded pickle says (6,)
    _save(tmp_path / "t.pt", longer, template)
    _save(tmp_path / "f.pt", longer, None)
    assert template.replayed == 0
    assert (tmp_path / "t.pt").read_bytes() == (tmp_path / "f.pt").read_bytes()
    assert torch.equal(torch.load(tmp_path / "t.pt", weights_only=False)["optimizer"]["flat"][0], longer)


def test_tensors_sharing_storage_otherwise_than_recorded_are_pickled_afresh(tmp_path: Path) -> None:
    """The recorded pickle names storages by key: two tensors on one storage in the first tree, on two in a later
    one, would need other keys, so the later tree is pickled (and equals torch.save's file)."""

    def tree(shared: bool) -> dict[str, Any]:
        a = torch.arange(4.0)
        return {"a": a, "b": a.view(2, 2) if shared else torch.arange(4.0).view(2, 2)}

    template = PickleTemplate()
    for name, shared in (("first", True), ("later", False)):
        builder = RankFileBuilder()
        builder.save(tree(shared), tmp_path / f"{name}.pt", lambda n: None, template)
        RankFileBuilder().save(tree(shared), tmp_path / f"{name}-afresh.pt", lambda n: None)
        assert (tmp_path / f"{name}.pt").read_bytes() == (tmp_path / f"{name}-afresh.pt").read_bytes()
    assert template.replayed == 0
    loaded = torch.load(tmp_path / "later.pt", weights_only=True)
    assert loaded["a"].untyped_storage().data_ptr() != loaded["b"].untyped_storage().data_ptr()
