"""ZeRO++ (hpZ, qwZ/qgZ) and MiCS: the ZeRO-3 variants that partition or communicate over sub-groups of ranks.

Fixtures (fixtures/layouts/, written by fixtures/generate_zeropp.py with DeepSpeed 0.19.8 on CPU):

* ``hpz_z3_ws4_part2_fp32``: genuine hpZ (``zero_hpz_partition_size=2``, 4 ranks). The rank files are plain
  ZeRO-3 files partitioned over all 4 ranks; zeroio and DeepSpeed's zero_to_fp32 both read them right.
* ``qwz_qgz_z3_ws4_part2_fp32``: DeepSpeed refuses qwZ/qgZ on CPU; the fixture records its words.
* ``mics_z3_ws4_shard2_fp32``: DeepSpeed 0.19.8 rejects MiCS; the fixture is a reconstruction (one trained shard
  group of 2, re-saved as 4 rank files with the MiCS ds_config, see the generator). zeroio reads the first shard
  group and checks the replicas; DeepSpeed's zero_to_fp32 refuses it (partition_count 2, 4 files).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from layout_checks import (
    LAYOUTS,
    assert_convert_equals_engine,
    assert_load_equals_engine,
    assert_open_equals_engine,
    case,
    expected,
    manifest,
)

import zeroio
from zeroio._pickles import load_pickle
from zeroio.errors import CheckpointFormatError, UnsupportedCheckpointError

HPZ = "hpz_z3_ws4_part2_fp32"
QUANTIZED = "qwz_qgz_z3_ws4_part2_fp32"
MICS = "mics_z3_ws4_shard2_fp32"
READABLE = [HPZ, MICS]


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(case(name), root, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return root


# --------------------------------------------------------------------------- what the files are


def test_hpz_files_are_plain_zero3_over_the_whole_world() -> None:
    """hpZ's secondary partition is never saved: 4 rank files, each partitioned for partition_count=4."""
    files = sorted((case(HPZ) / "global_step2").glob("*_optim_states.pt"))
    assert len(files) == 4
    for path in files:
        tree, _ = load_pickle(path)
        assert tree["optimizer_state_dict"]["partition_count"] == 4
    model, _ = load_pickle(case(HPZ) / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert model["ds_config"]["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 2}
    assert model["dp_world_size"] == 4


def test_mics_files_hold_two_replicas_of_two_partitions() -> None:
    """MiCS: 4 rank files whose partition_count is the shard size (2); rank r replicates shard rank r % 2."""
    tag = case(MICS) / "global_step2"
    trees = [load_pickle(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")[0] for r in range(4)]
    assert [t["optimizer_state_dict"]["partition_count"] for t in trees] == [2, 2, 2, 2]
    shapes = [[tuple(g.shape) for g in t["optimizer_state_dict"]["fp32_flat_groups"]] for t in trees]
    assert shapes[0] == shapes[2] and shapes[1] == shapes[3]
    model, _ = load_pickle(tag / "zero_pp_rank_3_mp_rank_00_model_states.pt")
    assert model["ds_config"]["zero_optimization"]["mics_shard_size"] == 2
    assert model["dp_world_size"] == 4
    assert manifest(MICS)["reconstructed"] is True


def test_deepspeed_refuses_mics_and_quantized_zeropp_on_cpu() -> None:
    """DeepSpeed 0.19.8 rejects the MiCS keys outright, and qwZ/qgZ on the CPU accelerator."""
    mics = (case(MICS) / "expected" / "deepspeed.error").read_text()
    assert mics.startswith("DeepSpeedConfigError: MiCS ZeRO-3 sharding has been removed; "
                           "'zero_optimization.mics_shard_size' is no longer supported.")  # fmt: skip
    quantized = (case(QUANTIZED) / "expected" / "deepspeed.error").read_text()
    assert quantized == "ValueError: This op had not been implemented on CPU backend.\n"
    assert manifest(QUANTIZED)["deepspeed_refuses"] is True
    assert not list(case(QUANTIZED).glob("global_step*"))


# --------------------------------------------------------------------------- zeroio reads both, bit for bit


@pytest.mark.parametrize("name", READABLE)
def test_open_equals_engine(name: str) -> None:
    assert_open_equals_engine(name)


@pytest.mark.parametrize("name", READABLE)
def test_load_equals_engine(name: str) -> None:
    assert_load_equals_engine(name)


@pytest.mark.parametrize("name", READABLE)
def test_convert_equals_engine(name: str, tmp_path: Path) -> None:
    assert_convert_equals_engine(name, tmp_path)


def test_metadata_names_the_layouts() -> None:
    with zeroio.open(case(HPZ)) as ckpt:
        meta = ckpt.metadata
        assert (meta.layout, meta.world_size, dict(meta.parallel)) == ("zero++", 4, {"dp": 4, "hpz": 2})
        assert meta.extra["zeropp_quantized"] == []
    with zeroio.open(case(MICS)) as ckpt:
        meta = ckpt.metadata
        assert (meta.layout, meta.world_size) == ("mics", 2)
        assert dict(meta.parallel) == {"dp": 4, "mics_shard": 2, "mics_replicas": 2}
        assert meta.extra["optim_files"] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
        assert len(meta.extra["mics_replica_files"]) == 4


def test_mics_single_shard_group_reads_alone(tmp_path: Path) -> None:
    """The first shard group's files alone are the whole model: zeroio reads them as MiCS with 1 replica."""
    root = _copy(tmp_path, MICS)
    for path in (root / "global_step2").glob("zero_pp_rank_[23]_*"):
        path.unlink()
    with zeroio.open(root) as ckpt:
        got = ckpt.state_dict()
        assert dict(ckpt.metadata.parallel) == {"dp": 2, "mics_shard": 2, "mics_replicas": 1}
    want = expected(MICS)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


# --------------------------------------------------------------------------- damaged MiCS folders


def test_mics_partial_group_is_refused_by_name(tmp_path: Path) -> None:
    root = _copy(tmp_path, MICS)
    for path in (root / "global_step2").glob("zero_pp_rank_3_*"):
        path.unlink()
    with pytest.raises(UnsupportedCheckpointError, match=r"MiCS \(mics_shard_size=2\).*3 optimizer"):
        zeroio.open(root)


def test_mics_replica_copied_from_another_rank_is_refused(tmp_path: Path) -> None:
    """Rank 0's optimizer file copied over rank 2's: the name inside the archive gives it away."""
    root = _copy(tmp_path, MICS)
    tag = root / "global_step2"
    shutil.copyfile(
        tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    )
    with pytest.raises(CheckpointFormatError, match="zero_pp_rank_2_mp_rank_00_optim_states.pt"):
        zeroio.open(root)


def test_mics_replica_of_other_sizes_is_refused(tmp_path: Path) -> None:
    """A rank-2 optimizer file partitioned for another world size (the hpZ fixture's, 4 ranks) is no replica."""
    root = _copy(tmp_path, MICS)
    tag = root / "global_step2"
    hpz_tag = case(HPZ) / "global_step2"  # a genuine rank-2 file partitioned for 4 ranks, not 2
    shutil.copyfile(
        hpz_tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    )
    with pytest.raises(CheckpointFormatError, match="not a MiCS replica"):
        zeroio.open(root)


# --------------------------------------------------------------------------- DeepSpeed's own consolidation


def test_zero_to_fp32_reference_is_right_on_hpz() -> None:
    ds = expected(HPZ, "zero_to_fp32")
    want = expected(HPZ)
    assert sorted(ds) == sorted(want)
    assert all(torch.equal(ds[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def live_zero_to_fp32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The installed DeepSpeed's zero_to_fp32 on both readable fixtures, in a subprocess."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("live_ds")
    script = textwrap.dedent(
        """
        import sys, warnings
        from pathlib import Path
        import torch
        warnings.simplefilter("ignore")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        root, out = Path(sys.argv[1]), Path(sys.argv[2])
        for name in sys.argv[3:]:
            try:
                torch.save(dict(get_fp32_state_dict_from_zero_checkpoint(str(root / name))), out / f"{name}.pt")
            except Exception as exc:
                message = str(exc).replace(str(root / name), "{fixture}")
                (out / f"{name}.error").write_text(f"{type(exc).__name__}: {message}")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(LAYOUTS), str(out), *READABLE],
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results: dict[str, object] = {}
    for name in READABLE:
        error = out / f"{name}.error"
        results[name] = error.read_text() if error.exists() else torch.load(out / f"{name}.pt", weights_only=True)
    return results


def test_live_zero_to_fp32_refuses_mics(live_zero_to_fp32: dict[str, object]) -> None:
    """zero_to_fp32 takes partition_count (2) as the world size and refuses the 4 files: not wrong, but unread."""
    message = (
        "ValueError: Expected 2 of '*_optim_states.pt' under '{fixture}/global_step2' but found 4 files. "
        "Possibly due to an overwrite of an old checkpoint, or a checkpoint didn't get saved by one or more processes."
    )
    assert live_zero_to_fp32[MICS] == message
    assert (case(MICS) / "expected" / "zero_to_fp32.error").read_text() == message + "\n"


def test_live_zero_to_fp32_reads_hpz(live_zero_to_fp32: dict[str, object]) -> None:
    got = live_zero_to_fp32[HPZ]
    want = expected(HPZ)
    assert isinstance(got, dict) and sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
