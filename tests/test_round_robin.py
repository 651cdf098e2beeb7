"""ZeRO-1/2 with ``round_robin_gradients`` (fixtures/layouts/round_robin_z2_ws2_fp32, generate_legacy.py).

DeepSpeed flattens each param group in round-robin order (parameter i dealt to rank ``i % world size``: what
``param_shapes`` lists and the flat partitions hold) but, without alignment padding, builds its hp mappings in the
original order, so its ``param_slice_mappings`` and ``safe_get_full_fp32_param`` describe another layout
(``expected/hp_mapping.pt``). zeroio reads the flat order: the engine's flat partitions and live parameters
(``expected/engine.pt``), as DeepSpeed's own zero_to_fp32 does, and still checks each rank's recorded slice.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from fixture_data import assert_state_dicts_equal
from layout_checks import (
    assert_convert_equals_engine,
    assert_load_equals_engine,
    assert_open_equals_engine,
    assert_optimizer_state_equals_engine,
    case,
    expected,
)

import zeroio
from zeroio import errors
from zeroio._formats.partition import round_robin_original

NAME = "round_robin_z2_ws2_fp32"
PIPE = "pipe_z1_ws4_pp2dp2_fp32_rr"  # ZeRO-1 pipeline (2 stages x 2 dp ranks): each stage's groups round-robin
BF16_ACC = "round_robin_bf16acc_z1_ws2"  # BF16_Optimizer ignores round_robin_gradients: groups keep their order


def test_open_load_convert_equal_engine(tmp_path: Path) -> None:
    assert_open_equals_engine(NAME)
    assert_load_equals_engine(NAME)
    assert_convert_equals_engine(NAME, tmp_path)


def test_equals_deepspeed_consolidation_not_its_hp_mapping() -> None:
    """zero_to_fp32 (param_shapes order) agrees; DeepSpeed's safe_get_full_fp32_param differs (a wrong layout)."""
    with zeroio.open(case(NAME)) as ckpt:
        got = ckpt.state_dict()
    consolidated = expected(NAME, "zero_to_fp32")
    for key, value in consolidated.items():
        assert torch.equal(got[key], value), key
    hp_mapping = expected(NAME, "hp_mapping")
    assert sorted(hp_mapping) == sorted(got)
    assert any(not torch.equal(got[key], value) for key, value in hp_mapping.items())


def test_optimizer_state_equals_flat_partitions() -> None:
    assert_optimizer_state_equals_engine(NAME, ("exp_avg", "exp_avg_sq"))


def test_swapped_rank_files_are_refused(tmp_path: Path) -> None:
    """The slice check follows DeepSpeed's record: optimizer files of two ranks swapped are still refused, by their
    param_slice_mappings alone (the files re-saved through a buffer record no name of their own)."""
    root = tmp_path / NAME
    shutil.copytree(case(NAME), root)
    tag = root / "global_step2"
    a, b = (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    for path in (a, b):
        buffer = io.BytesIO()
        torch.save(torch.load(path, weights_only=False, map_location="cpu"), buffer)
        path.write_bytes(buffer.getvalue())
    with zeroio.open(root) as ckpt:  # re-saved in place: still the same checkpoint
        assert_state_dicts_equal(ckpt.state_dict(), expected(NAME))
    a.rename(tag / "swap")
    b.rename(a)
    (tag / "swap").rename(b)
    refused = "param_slice_mappings.*mixes files from different saves"
    with pytest.raises(errors.CheckpointFormatError, match=refused), zeroio.open(root) as ckpt:
        ckpt.state_dict()


@pytest.mark.parametrize(("count", "ranks"), [(1, 2), (3, 2), (5, 2), (3, 3), (7, 3), (10, 4), (2, 5)])
def test_order_is_deepspeeds(count: int, ranks: int) -> None:
    """round_robin_original equals DeepSpeed 0.19.8's own _round_robin_reorder."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    tensors = [torch.tensor([i]) for i in range(count)]
    reordered, _ = DeepSpeedZeroOptimizer._round_robin_reorder(None, tensors, ranks)
    assert [int(t) for t in reordered] == round_robin_original(count, ranks)


def test_pipeline_stages_read_the_flat_order() -> None:
    """A ZeRO-1 pipeline with round_robin_gradients: every tensor equals the live fp32 parameters (expected/engine.pt)
    and the layer files DeepSpeed wrote from them; refused before as mixing two saves."""
    want = expected(PIPE)
    with zeroio.open(case(PIPE)) as ckpt:
        assert ckpt.metadata.layout == "pipeline"
        got = ckpt.state_dict()
    assert_state_dicts_equal(got, want)
    layer = torch.load(case(PIPE) / "global_step2" / "layer_01-model_states.pt", weights_only=True)
    assert torch.equal(got["1.weight"], layer["weight"]) and torch.equal(got["1.bias"], layer["bias"])


def test_bf16_optimizer_ignores_the_setting() -> None:
    """ZeRO-1 + bf16 + fp32 gradient accumulation (DeepSpeed's BF16_Optimizer) with round_robin_gradients set: its
    groups keep their order, so DeepSpeed's own accessors are right and zeroio equals them (weights and moments)."""
    assert_open_equals_engine(BF16_ACC)
    assert_load_equals_engine(BF16_ACC)
    assert_optimizer_state_equals_engine(BF16_ACC, ("exp_avg", "exp_avg_sq"))
