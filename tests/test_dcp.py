"""PyTorch Distributed Checkpoint (DCP) sources: FSDP2, FSDP1, torchtitan and accelerate folders read lazily.

Every fixture in fixtures/dcp/ was written by ``torch.distributed.checkpoint.save`` from a live FSDP run
(fixtures/generate_dcp.py); each result is compared bit for bit with that run's full state dicts
(``expected/model.pt``, ``expected/optim.pt``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main
from zeroio.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    TensorNotFoundError,
    UnsupportedCheckpointError,
)

ROOT = Path(__file__).resolve().parent.parent
DCP = ROOT / "fixtures" / "dcp"
NAMES = sorted(p.parent.name for p in DCP.glob("*/manifest.json") if not json.loads(p.read_text()).get("refused"))
EMPTY_SHARD = "dcp_fsdp_tp_ws6_empty_shard"  # torch wrote wrong chunk metadata: refused (see its test)
LAYOUTS = {
    "dcp_fsdp2_ws2_fp32": "dcp",
    "dcp_titan_ws2": "torchtitan",
    "dcp_accelerate_ws2": "accelerate",
    "dcp_fsdp2_ws2_bf16": "dcp",
    "dcp_fsdp2_ws4_uneven": "dcp",
    "dcp_fsdp1_ws2": "dcp",
    "dcp_tp_ws2": "dcp",
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _reference(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    folder = DCP / name / "expected"
    return torch.load(folder / "model.pt", weights_only=True), torch.load(folder / "optim.pt", weights_only=True)


def test_every_layout_has_a_fixture():
    assert NAMES == sorted(LAYOUTS)


@pytest.mark.parametrize("name", NAMES)
def test_open_equals_the_live_run(name):
    """Every model tensor and every parameter's optimizer state equal the live run's full state, bit for bit."""
    model, optim = _reference(name)
    with zeroio.open(DCP / name) as ckpt:
        assert ckpt.metadata.format == "dcp" and ckpt.metadata.layout == LAYOUTS[name]
        assert list(ckpt) == [k for k in ckpt.infos] and set(ckpt) == set(model)
        for key, want in model.items():
            assert _same(ckpt[key], want), key
        assert {n for n, i in ckpt.infos.items() if i.kind == "trainable"} == set(optim["state"])
        groups = {p: g for g in optim["param_groups"] for p in g["params"]}
        for param, state in optim["state"].items():
            got = ckpt.optimizer_state(param)
            for key, want in state.items():
                assert _same(got[key], want), (param, key)
            hyper = {k: v for k, v in groups[param].items() if k != "params"}
            assert {k: got[k] for k in hyper} == hyper
        with pytest.raises(TensorNotFoundError, match="No optimizer state for 'frozen.weight'"):
            ckpt.optimizer_state("frozen.weight")
        ckpt.finish_crc_checks()


def test_fsdp_over_tensor_parallel_empty_shard_is_refused_naming_torchs_metadata(tmp_path, capsys):
    """FSDP2 over tensor parallel (dp 3 x tp 2) with a TP shard of 4 rows: torch 2.13 records rank 4's empty
    _StridedShard at row 6 and rank 5's row there as empty. torch's own dcp.load fails; zeroio refuses by name (the
    file, the tensor, the cause, the fix), reads the tensors whose chunks are right, and convert leaves no output."""
    folder = DCP / EMPTY_SHARD
    assert (
        "mismatch sizes torch.Size([1, 5]) vs torch.Size([0, 5])"
        in (folder / "expected" / "torch_load.error").read_text()
    )
    model = torch.load(folder / "expected" / "model.pt", weights_only=True)
    with zeroio.open(folder) as ckpt:
        for key in ("emb.weight", "mlp_in.weight", "norm.weight"):
            assert _same(ckpt[key], model[key]), key
        with pytest.raises(CheckpointFormatError) as excinfo:
            ckpt["mlp_out.weight"]
    message = str(excinfo.value)
    assert excinfo.value.path == folder / "__4_0.distcp" and "\n" not in message
    assert "of 'model.mlp_out.weight' of shape (1, 5) at offsets (6, 0): torch recorded a wrong place" in message
    assert "StateDictOptions(full_state_dict=True)" in message and "different saves" not in message
    assert main(["convert", str(folder), str(tmp_path / "out"), "--quiet"]) == 1
    assert "torch recorded a wrong place for an empty shard" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_chunks_are_read_lazily_and_in_pieces():
    """Streaming reads any element range: chunked reads reassemble rows that span two ranks' chunks."""
    with zeroio.open(DCP / "dcp_fsdp2_ws4_uneven") as ckpt:
        whole = ckpt["emb.weight"].reshape(-1)
        pieces = torch.cat(list(ckpt.iter_chunks("emb.weight", chunk_bytes=4 * 9)))
        assert torch.equal(pieces, whole)
        assert ckpt.byte_ranges("emb.weight") is not None  # row shards: plain byte runs, copied without torch
    with zeroio.open(DCP / "dcp_tp_ws2") as ckpt:  # column shards: each chunk is one run per row
        whole = ckpt["mlp_in.weight"].reshape(-1)
        for size in (4, 12, 20):  # reads starting and ending inside a chunk's runs
            pieces = torch.cat(list(ckpt.iter_chunks("mlp_in.weight", chunk_bytes=size)))
            assert torch.equal(pieces, whole), size
        assert ckpt.byte_ranges("mlp_in.weight") is None


def test_torchtitan_metadata_and_steps(tmp_path):
    """torchtitan: the checkpoint folder opens its newest step-N (or the tag named); train_state is metadata."""
    with zeroio.open(DCP / "dcp_titan_ws2") as ckpt:
        meta = ckpt.metadata
        assert (meta.tag, meta.global_step, meta.optimizer) == ("step-2", 2, "Adam")
        assert meta.extra["values"]["train_state.ntokens_seen"] == 16
    with zeroio.open(DCP / "dcp_titan_ws2" / "step-2") as ckpt:
        assert ckpt.metadata.tag == "step-2"
    with pytest.raises(CheckpointNotFoundError, match="no DCP folder 'step-9'"):
        zeroio.open(DCP / "dcp_titan_ws2", tag="step-9")


@pytest.mark.parametrize("name", ["dcp_fsdp2_ws2_fp32", "dcp_fsdp2_ws2_bf16", "dcp_fsdp2_ws4_uneven", "dcp_tp_ws2"])
def test_convert_and_verify(name, tmp_path):
    """convert writes safetensors bit-identical to the live run's tensors; verify agrees; --include-optimizer
    writes each moment as optimizer_state gives it."""
    model, optim = _reference(name)
    assert main(["convert", str(DCP / name), str(tmp_path / "out"), "--quiet", "--include-optimizer"]) == 0
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert set(written) == set(model)
    for key, want in model.items():
        assert _same(written[key], want.contiguous()), key
    moments = load_file(tmp_path / "out" / "optimizer.safetensors")
    for param, state in optim["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same(moments[f"{param}.{key}"], state[key]), (param, key)
    summary = json.loads((tmp_path / "out" / "optimizer.json").read_text())
    assert {g["step"] for g in summary["param_groups"]} == {2}
    assert zeroio.verify(DCP / name, tmp_path / "out").ok


def test_load_into_a_model():
    """zeroio.load fills the fixtures' TinyLM with the live run's values."""
    from layout_checks import tiny_model

    model, _ = _reference("dcp_accelerate_ws2")
    net = tiny_model()
    zeroio.load(DCP / "dcp_accelerate_ws2", net)
    for key, value in net.state_dict().items():
        assert torch.equal(value, model[key]), key


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_convert_imports_no_torch(tmp_path):
    """Converting a DCP folder as stored copies the chunks' bytes without torch, to the very bytes torch writes."""
    name = "dcp_fsdp2_ws4_uneven"
    worker = Path(__file__).with_name("torch_free_worker.py")
    cases = {"stored": ["convert", str(DCP / name), "--quiet"]}
    proc = subprocess.run(
        [sys.executable, str(worker), "torch,safetensors,huggingface_hub,tqdm", str(tmp_path / "tf"), json.dumps(cases)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["asked"] == [] and report["cases"]["stored"]["code"] == 0, report
    zeroio.convert(DCP / name, tmp_path / "local", progress=False)
    assert report["cases"]["stored"]["files"] == _hashes(tmp_path / "local")


def test_from_an_s3_url_equals_local(tmp_path, monkeypatch):
    """open, convert and optimizer_state from s3:// (moto on localhost) equal the local folder's."""
    pytest.importorskip("s3fs")
    from s3_server import S3Server

    server = S3Server()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        url = server.upload_tree(DCP / "dcp_accelerate_ws2", "dcp", "accelerate")
        before = server.accounting.gets
        with zeroio.open(DCP / "dcp_accelerate_ws2") as local, zeroio.open(url) as remote:
            # open: each folder's .metadata, then its pickled values, neighbours in one request per data file
            assert server.accounting.gets - before <= 6, server.accounting.gets - before
            assert list(remote) == list(local) and remote.metadata.layout == "accelerate"
            for key in local:
                assert _same(remote[key], local[key]), key
            assert _same(
                remote.optimizer_state("emb.weight")["exp_avg"], local.optimizer_state("emb.weight")["exp_avg"]
            )
        zeroio.convert(DCP / "dcp_accelerate_ws2", tmp_path / "local", progress=False)
        zeroio.convert(url, tmp_path / "remote", progress=False)
        assert _hashes(tmp_path / "remote") == _hashes(tmp_path / "local")
        # DCP to DCP (accelerate -> torchtitan), URL to URL: staged locally, uploaded when complete.
        (tmp_path / "empty").mkdir()
        server.upload_tree(tmp_path / "empty", "out", "")
        zeroio.convert(url, "s3://out/step-2", fmt="dcp", include_optimizer=True, progress=False)
        with zeroio.open(DCP / "dcp_accelerate_ws2") as local, zeroio.open("s3://out/step-2") as out:
            assert out.metadata.layout == "torchtitan" and list(out) == list(local)
            for key in local:
                assert _same(out[key], local[key]), key
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert _same(out.optimizer_state("norm.bias")[key], local.optimizer_state("norm.bias")[key])
    finally:
        server.stop()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the case under test
def test_a_state_dict_saved_without_prefix_or_process_group(tmp_path):
    """dcp.save of a bare state dict from one process (no process group): keys as saved, layout 'dcp'."""
    import torch.distributed.checkpoint as dcp

    state = {"a.weight": torch.arange(6.0).view(2, 3), "b": torch.tensor([7], dtype=torch.int32), "note": "x"}
    dcp.save(state, checkpoint_id=str(tmp_path / "bare"))
    with zeroio.open(tmp_path / "bare") as ckpt:
        assert ckpt.metadata.layout == "dcp" and list(ckpt) == ["a.weight", "b"]
        assert _same(ckpt["a.weight"], state["a.weight"]) and _same(ckpt["b"], state["b"])
        assert ckpt.metadata.extra["values"] == {"note": "x"}


def test_hf_trainer_checkpoint_folder_gives_its_step(tmp_path):
    """The HF Trainer under FSDP writes accelerate's folders into checkpoint-N/ with trainer_state.json."""
    import shutil

    folder = tmp_path / "checkpoint-2"
    shutil.copytree(DCP / "dcp_accelerate_ws2", folder, ignore=shutil.ignore_patterns("expected"))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2, "epoch": 1.0}))
    with zeroio.open(folder) as ckpt:
        assert ckpt.metadata.layout == "accelerate" and ckpt.metadata.global_step == 2
    (folder / "trainer_state.json").write_text("[not an object")
    with zeroio.open(folder) as ckpt:
        assert ckpt.metadata.global_step is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_safetensors_serialization_is_refused_by_name(tmp_path):
    """DCP's SerializationFormat.SAFETENSORS (torch >= 2.8) writes safetensors data files: refused by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    writer = FileSystemWriter(str(tmp_path / "st"), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"model": {"w": torch.arange(6.0).view(2, 3)}}, storage_writer=writer)
    with zeroio.open(tmp_path / "st") as ckpt, pytest.raises(UnsupportedCheckpointError, match="SAFETENSORS"):
        ckpt["w"]
