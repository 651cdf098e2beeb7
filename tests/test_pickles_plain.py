"""The one walk from a parsed rank file to plain objects (zeroio._pickles.to_plain), on real DeepSpeed files."""

from __future__ import annotations

import pytest
import torch
from fixture_data import FIXTURES, FRAMEWORKS

import zeroio
from zeroio._pickles import (
    TensorRef,
    ZeroStageEnum,
    global_name,
    inert_parts,
    is_inert,
    load_pickle,
    to_plain,
    where_text,
)

OPTIM0 = FIXTURES / "z3_ws2_fp32" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _contains(value: object, kind: type) -> bool:
    if isinstance(value, kind):
        return True
    if isinstance(value, dict):
        return any(_contains(v, kind) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_contains(v, kind) for v in value)
    return False


def test_default_walk_reads_tensors_and_keeps_standins():
    """By default tensors are read to CPU with their shapes and DeepSpeed stand-ins are kept as they are."""
    tree, file = load_pickle(OPTIM0)
    try:
        plain = to_plain(tree)
    finally:
        file.close()
    assert not _contains(plain, TensorRef)
    osd = plain["optimizer_state_dict"]
    assert isinstance(osd["zero_stage"], ZeroStageEnum) and global_name(osd["zero_stage"]) == (
        "deepspeed.runtime.zero.config.ZeroStageEnum"
    )
    flat = osd["fp32_flat_groups"][0]
    ref = tree["optimizer_state_dict"]["fp32_flat_groups"][0]
    assert isinstance(flat, torch.Tensor) and tuple(flat.shape) == ref.shape
    assert torch.equal(flat, ref.materialize())
    scaler = osd["loss_scaler"]
    assert is_inert(scaler) and inert_parts(scaler).name.startswith("deepspeed.runtime.fp16.loss_scaler.")


def test_rules_see_where_each_value_sits():
    """Tensor and stand-in rules get the value's path; lists show positions as [i]."""
    tree, file = load_pickle(OPTIM0)
    file.close()
    seen: list[str] = []

    def tensor(ref: TensorRef, where: tuple[object, ...]) -> str:
        seen.append(where_text(where))
        return "tensor"

    def refuse(obj: object, where: tuple[object, ...], walk: object) -> object:
        raise LookupError(where_text(where))

    plain = to_plain(tree["optimizer_state_dict"], ("optimizer_state_dict",), tensor=tensor)
    assert "optimizer_state_dict.fp32_flat_groups[0]" in seen
    assert plain["fp32_flat_groups"] == ["tensor"] * len(plain["fp32_flat_groups"])
    with pytest.raises(LookupError, match=r"^optimizer_state_dict\.(zero_stage|loss_scaler)$"):
        to_plain(tree["optimizer_state_dict"], ("optimizer_state_dict",), tensor=tensor, standin=refuse)


def test_zero_checkpoint_keeps_the_trees_it_parsed():
    """Rank files parsed at open are served from memory: the Lightning writer and reshard reuse them."""
    src = FRAMEWORKS / "lightning_z3_fp32" / "model.ckpt"
    with zeroio.open(src) as ckpt:
        model0 = ckpt.metadata.path / ckpt.metadata.extra["model_files"][0]
        assert model0 in ckpt.parsed_files
        assert ckpt.file_tree(model0) is ckpt.file_tree(model0)
        assert "hyper_parameters" in ckpt.file_tree(model0)
