"""Legacy (non-zip) torch serialization: DeepSpeed's ``"checkpoint_serialization": false`` rank files.

Genuine fixtures (fixtures/layouts/legacy_*, written by fixtures/generate_legacy.py) read bit for bit like the
engine had them; crafted streams (tests/legacy_files.py) that lie about lengths, stop early, ask for huge counts or
name a storage twice get typed errors at once, without reading tensor bytes.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from fixture_data import ROOT
from hostile_files import Ops
from layout_checks import (
    assert_convert_equals_engine,
    assert_load_equals_engine,
    assert_open_equals_engine,
    assert_optimizer_state_equals_engine,
    case,
)
from legacy_files import floats, one_tensor, stream, two_tensors_sharing_a_key_twice

import zeroio
from zeroio._pickles import load_pickle
from zeroio.cli import main as cli_main
from zeroio.errors import CheckpointFormatError, UnsafePickleError, UnsupportedCheckpointError

LEGACY = ["legacy_z3_ws2_bf16", "legacy_z2_ws2_fp32"]
LEGACY_HEAD = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


# --------------------------------------------------------------------------- genuine DeepSpeed fixtures


@pytest.mark.parametrize("name", LEGACY)
def test_every_rank_file_is_a_legacy_stream(name: str) -> None:
    """The fixture is what it claims: every .pt starts with the legacy magic-number pickle, none is a zip."""
    files = sorted((case(name) / "global_step2").glob("*.pt"))
    assert len(files) == (4 if "z3" in name else 3)  # ZeRO-1/2: one mp_rank_00_model_states.pt
    for path in files:
        assert path.read_bytes()[: len(LEGACY_HEAD)] == LEGACY_HEAD, path


@pytest.mark.parametrize("name", LEGACY)
def test_open_equals_engine(name: str) -> None:
    assert_open_equals_engine(name)


@pytest.mark.parametrize("name", LEGACY)
def test_load_equals_engine(name: str) -> None:
    assert_load_equals_engine(name)


@pytest.mark.parametrize("name", LEGACY)
def test_convert_equals_engine(name: str, tmp_path: Path) -> None:
    assert_convert_equals_engine(name, tmp_path)


@pytest.mark.parametrize("name", LEGACY)
def test_optimizer_state_equals_engine(name: str) -> None:
    assert_optimizer_state_equals_engine(name, ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("name", LEGACY)
def test_metadata_says_legacy_and_no_crc_is_claimed(name: str) -> None:
    """serialization is 'legacy', and verify_crc stays False: a legacy stream has no CRC-32 to check."""
    with zeroio.open(case(name), verify_crc=True) as ckpt:
        assert ckpt.metadata.serialization == "legacy"
        assert ckpt.metadata.optimizer == "AdamW"
        assert ckpt.metadata.offload is None
        assert ckpt.verify_crc is False
        ckpt.verify_crc = True
        assert ckpt.verify_crc is False
        ckpt.finish_crc_checks()  # nothing to check, nothing raised


def test_zip_fixture_says_zip_and_checks_crc() -> None:
    from fixture_data import FIXTURES

    with zeroio.open(FIXTURES / "z3_ws2_bf16") as ckpt:
        assert ckpt.metadata.serialization == "zip" and ckpt.verify_crc is True
        assert ckpt.metadata.optimizer == "AdamW"


def test_inspect_says_legacy_without_crc(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["inspect", str(case("legacy_z3_ws2_bf16"))]) == 0
    out = capsys.readouterr().out
    assert "serialized  legacy (no CRC-32 in the files to check)" in out
    assert out.count("serialized") == 1 and "optimizer   AdamW" in out  # the line replaced, not the optimizer's


def test_a_corrupted_legacy_tensor_is_read_as_is(tmp_path: Path) -> None:
    """Without CRCs a flipped byte in a legacy storage cannot be detected: documented, not hidden."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(case("legacy_z2_ws2_fp32"), folder)
    path = folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last storage (tensor data, not metadata)
    path.write_bytes(bytes(data))
    with zeroio.open(folder) as ckpt:
        ckpt.get_tensor("emb.weight")
        ckpt.finish_crc_checks()


def test_deepspeed_zero_to_fp32_refuses_legacy_files() -> None:
    """DeepSpeed's zero_to_fp32 loads with mmap=True, which needs the zip format: RuntimeError."""
    script = (
        "import sys\n"
        "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as f\n"
        "try:\n    f(sys.argv[1])\nexcept RuntimeError as e:\n    print('RuntimeError:', e)\n"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", script, str(case("legacy_z3_ws2_bf16"))], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout  # fmt: skip
    assert "RuntimeError: mmap can only be used with files saved with" in out
    assert "_use_new_zipfile_serialization=True" in out


# --------------------------------------------------------------------------- torch's own legacy files


def test_genuine_torch_legacy_file_reads_like_torch_load(tmp_path: Path) -> None:
    """Views sharing storages, a transposed view, bf16, int64 and empty tensors: every value as torch.load has it."""
    base = torch.arange(24, dtype=torch.float32)
    obj = {
        "a": base[2:10], "b": base.view(4, 6).t(), "c": torch.randn(3, 5).to(torch.bfloat16),
        "d": torch.arange(7), "e": torch.empty(0), "nested": [{"x": base[::3]}],
    }  # fmt: skip
    path = tmp_path / "legacy.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    want = torch.load(path, weights_only=True)
    tree, file = load_pickle(path, legacy=True)
    try:
        assert file.serialization == "legacy"
        for key in ("a", "b", "c", "d", "e"):
            got = tree[key].materialize()
            assert got.dtype == want[key].dtype and torch.equal(got, want[key]), key
        assert torch.equal(tree["nested"][0]["x"].materialize(), want["nested"][0]["x"])
    finally:
        file.close()


def test_parsing_reads_no_tensor_bytes_and_a_read_reads_only_its_own(tmp_path: Path) -> None:
    """Opening indexes offsets only (memory far below the tensor's size); a tensor read touches its storage only."""
    path = tmp_path / "big.pt"
    torch.save({"big": torch.ones(4 << 20), "small": torch.arange(5.0)}, path, _use_new_zipfile_serialization=False)
    tracemalloc.start()
    tree, file = load_pickle(path, legacy=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    try:
        assert peak < 1 << 20  # the 16 MB tensor was not read
        assert file.read_offsets == {}
        assert torch.equal(tree["small"].materialize(), torch.arange(5.0))
        assert list(file.read_offsets) == [tree["small"].storage.key]
    finally:
        file.close()


def test_consolidated_legacy_files_are_still_refused(tmp_path: Path) -> None:
    """Only ZeRO rank files are read in the legacy format; load_pickle's default keeps refusing it."""
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedCheckpointError):
        load_pickle(path)


# --------------------------------------------------------------------------- hostile legacy streams


def _load(tmp_path: Path, data: bytes) -> object:
    path = tmp_path / "hostile.pt"
    path.write_bytes(data)
    start = time.monotonic()
    try:
        tree, file = load_pickle(path, legacy=True)
        file.close()
        return tree
    finally:
        assert time.monotonic() - start < 5


def test_honest_crafted_stream_reads(tmp_path: Path) -> None:
    """The builder itself is right: an honest stream reads back its floats."""
    path = tmp_path / "ok.pt"
    path.write_bytes(one_tensor(3))
    tree, file = load_pickle(path, legacy=True)
    assert torch.equal(tree["w"].materialize(), torch.tensor([0.0, 1.0, 2.0]))
    file.close()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (one_tensor(3, count=4), "records 4 elements in its data, the pickle declares 3"),  # lying length
        (one_tensor(3, count=2, data=floats(0, 1)), "records 2 elements in its data, the pickle declares 3"),
        (one_tensor(3, data=floats(0, 1)), "is truncated: storage '0' needs 12 bytes"),  # data cut short
        (one_tensor(3)[:-14], "is truncated"),  # cut inside the 8-byte count
        (one_tensor(2**60, count=2**60, data=b""), "is truncated: storage '0' needs"),  # huge count, no data
        (one_tensor(3, data=floats(0, 1, 2, 3)), "has 4 bytes after its last legacy storage record"),
        (one_tensor(3, keys=[]), "does not match the storages the pickle uses"),
        (one_tensor(3, keys=["0", "9"]), "does not match the storages the pickle uses"),
        (one_tensor(3, keys=["0"] * 200_000), "lists a storage twice"),
        (two_tensors_sharing_a_key_twice(), "lists a storage twice"),  # overlapping records
        (one_tensor(3, view="('0', 0, 12)"), "Unexpected persistent id"),  # view metadata torch never writes
        (stream(Ops().dict().stop(), [], [], magic=1234), "not torch's legacy magic number"),
    ],
)
def test_hostile_stream_is_refused(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(CheckpointFormatError) as exc:
        _load(tmp_path, data)
    assert message in str(exc.value) and "hostile.pt" in str(exc.value)


def test_truncated_inside_the_pickles(tmp_path: Path) -> None:
    header = len(stream(b"", [], [])) - len(pickle.dumps([], protocol=2))
    with pytest.raises(CheckpointFormatError, match="its legacy system info pickle cannot be read"):
        _load(tmp_path, one_tensor(3)[: header - 5])
    with pytest.raises(CheckpointFormatError, match="Cannot parse the pickle"):
        _load(tmp_path, one_tensor(3)[: header + 40])


def test_big_endian_stream_is_unsupported(tmp_path: Path) -> None:
    data = stream(Ops().dict().stop(), [], [], sys_info={"protocol_version": 1001, "little_endian": False})
    with pytest.raises(UnsupportedCheckpointError, match="big-endian"):
        _load(tmp_path, data)


def test_global_in_the_header_is_refused(tmp_path: Path) -> None:
    header = Ops().glob("os.system").text("true").tuple(1).reduce().stop()
    with pytest.raises(UnsafePickleError, match="os.system"):
        _load(tmp_path, stream(Ops().dict().stop(), [], [], header=header))


def test_unlisted_global_in_the_tree_is_refused(tmp_path: Path) -> None:
    tree = Ops().glob("os.system").text("true").tuple(1).reduce().stop()
    with pytest.raises(UnsafePickleError, match="os.system"):
        _load(tmp_path, stream(tree, [], []))


def test_huge_pickle_length_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A BINBYTES8 claiming 2**40 bytes in a small file: a typed error, in a subprocess (memory is the attack)."""
    tree = Ops().raw(b"\x8e" + (2**40).to_bytes(8, "little")).stop()
    path = tmp_path / "hostile.pt"
    path.write_bytes(stream(tree, [], []))
    script = (
        "import sys\nfrom zeroio._pickles import load_pickle\nfrom zeroio.errors import ZeroIOError\n"
        "try:\n    load_pickle(sys.argv[1], legacy=True)\nexcept ZeroIOError as e:\n    print(type(e).__name__)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout  # fmt: skip
    assert out.strip() in ("UnsupportedCheckpointError", "CheckpointFormatError")
