"""DCP saved through torch's HuggingFaceStorageWriter (fixtures/dcp_hf/, torchtitan's layout): open, convert and load
equal the live run's full state bit for bit, reading only the byte ranges asked for; overlapping, gapped or missing
pieces are refused with typed errors, never returned scrambled."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError, CheckpointNotFoundError

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "dcp_hf" / "dcp_hf_ws2"
STEP = FIXTURE / "step-2"


def _reference() -> dict[str, torch.Tensor]:
    return torch.load(FIXTURE / "expected" / "model.pt", weights_only=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar")


@pytest.mark.parametrize("where", ["root", "step", "file"])
def test_open_equals_the_live_run(where):
    """From the torchtitan root, its step-2 folder or one shard file: every tensor equals the full state dict
    (uneven rows 7 + 6 and 3 + 2 reassembled; shapes derived from the offsets)."""
    path = {"root": FIXTURE, "step": STEP, "file": STEP / "shard-00002-model-00001-of-00002.safetensors"}[where]
    model = _reference()
    with zeroio.open(path) as ckpt:
        assert (ckpt.metadata.format, ckpt.metadata.layout, ckpt.metadata.tag) == ("dcp", "hf-storage", "step-2")
        assert set(ckpt) == set(model)
        for key, want in model.items():
            assert _same(ckpt[key], want), key


def test_reads_only_the_ranges_asked_for():
    """Opening reads headers only; a tensor's read costs its own bytes (two row pieces of emb.weight: 7 + 6 rows)."""
    with zeroio.open(STEP) as ckpt:
        ranges = ckpt.byte_ranges("emb.weight")
        assert ranges is not None and [n for _, _, n in ranges] == [7 * 7 * 4, 6 * 7 * 4]
        before = _rchar()
        overhead = _rchar() - before  # reading /proc/self/io counts too
        before = _rchar()
        ckpt["emb.weight"]
        assert _rchar() - before - overhead == 13 * 7 * 4


def test_convert_and_load(tmp_path):
    """convert writes the live run's tensors bit for bit (verify agrees); load fills the fixtures' TinyLM."""
    from layout_checks import tiny_model

    model = _reference()
    assert main(["convert", str(FIXTURE), str(tmp_path / "out"), "--quiet"]) == 0
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert set(written) == set(model)
    for key, want in model.items():
        assert _same(written[key], want), key
    assert zeroio.verify(FIXTURE, tmp_path / "out").ok
    net = tiny_model()
    zeroio.load(FIXTURE, net)
    for key, value in net.state_dict().items():
        assert _same(value, model[key]), key


def _set_info(path: Path, text: str) -> None:
    """Rewrite one shard file's DCP_SHARDING_INFO (a crafted file; the data kept)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["__metadata__"]["DCP_SHARDING_INFO"] = text
    data = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(data)) + data + raw[8 + length :])


def _set_offsets(path: Path, name: str, offsets: object) -> None:
    """Rewrite one shard file's saved offsets of ``name``."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    info = json.loads(json.loads(raw[8 : 8 + length])["__metadata__"]["DCP_SHARDING_INFO"])
    info[name]["saved_offsets"] = offsets
    _set_info(path, json.dumps(info))


RANK2 = "shard-00002-model-00001-of-00002.safetensors"


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        pytest.param([6, 0], r"chunks of 'emb.weight' at \(0, 0\) and \(6, 0\) overlap", id="overlap"),
        pytest.param([8, 0], r"the chunks of 'emb.weight' hold 91 elements, its shape \(14, 7\) has 98", id="gap"),
        pytest.param([10**12, 0], r"hold 91 elements", id="huge"),
        pytest.param([7], r"'emb.weight' of shape \(6, 7\) has saved offsets \[7\]", id="rank"),
    ],
)
def test_bad_offsets_are_refused(tmp_path, offsets, message):
    """Overlapping, gapped, absurd or malformed offsets raise CheckpointFormatError naming the tensor."""
    folder = shutil.copytree(STEP, tmp_path / "step-2")
    _set_offsets(folder / RANK2, "emb.weight", offsets)
    with pytest.raises(CheckpointFormatError, match=message):
        zeroio.open(folder)


def test_missing_files_and_steps(tmp_path):
    """A lost rank's files, or sharding info that is not JSON, raise typed errors; an unknown tag names the steps."""
    folder = shutil.copytree(STEP, tmp_path / "a" / "step-2")
    for path in folder.glob("shard-00001-*"):
        path.unlink()
    with pytest.raises(CheckpointFormatError, match=r"holds no files of shard\(s\) \[1\]"):
        zeroio.open(folder)
    folder = shutil.copytree(STEP, tmp_path / "b" / "step-2")
    _set_info(folder / RANK2, "{not json")
    with pytest.raises(CheckpointFormatError, match="DCP_SHARDING_INFO is not JSON"):
        zeroio.open(folder)
    with pytest.raises(CheckpointNotFoundError, match="no step folder 'step-9'"):
        zeroio.open(FIXTURE, tag="step-9")


def test_sharded_folder_of_a_step(tmp_path):
    """torchtitan with consolidation puts the shards in step-N/sharded/: a step folder holding only that opens it."""
    shutil.copytree(STEP, tmp_path / "step-3" / "sharded")
    with zeroio.open(tmp_path / "step-3") as ckpt:
        assert ckpt.metadata.tag == "step-3" and ckpt.metadata.path == tmp_path / "step-3" / "sharded"
        assert _same(ckpt["head.weight"], _reference()["head.weight"])


def test_from_an_s3_url_equals_local(monkeypatch):
    """From s3:// (moto on localhost): the same tensors as the local folder."""
    pytest.importorskip("s3fs")
    from s3_server import S3Server

    server = S3Server()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        url = server.upload_tree(STEP, "titan", "step-2")
        with zeroio.open(STEP) as local, zeroio.open(url) as remote:
            assert list(remote) == list(local)
            for key in local:
                assert _same(remote[key], local[key]), key
    finally:
        server.stop()
