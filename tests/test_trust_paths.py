"""Paths built from checkpoint content stay inside the checkpoint (issue 23, item 1): universal parameter names,
NVMe optimizer keys and swap-file links, index shard names. Each hostile input is a genuine fixture, edited."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES
from hostile_folders import nvme_swap_link_out, universal_name_escape
from safetensors.torch import load_file, save_file

import zeroio
from zeroio import errors

UNIVERSAL = FIXTURES / "universal" / "universal_z3_ws2_fp32"
UTAG = "global_step2_universal"
NVME = FIXTURES / "layouts" / "nvme_z3_ws2_bf16"
FIX = "The checkpoint is corrupted or hostile; zeroio reads only files inside the checkpoint folder."


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return dst


def _rename_universal_param(root: Path, old: str, new: str) -> Path:
    """Rename a trainable parameter in every rank's ``param_shapes`` (plain data: torch.load/torch.save)."""
    for path in sorted((root / UTAG).glob("*_model_states.pt")):
        tree = torch.load(path, weights_only=True)
        for group in tree["param_shapes"]:
            if old in group:
                group[new] = group.pop(old)
        torch.save(tree, path)
    return root / UTAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"


def _victim(tmp_path: Path) -> Path:
    """Another folder's ``zero/norm.bias/fp32.pt``: the fixture's own file, so the read would succeed."""
    folder = tmp_path / "victim" / "zero" / "norm.bias"
    folder.mkdir(parents=True)
    shutil.copy(UNIVERSAL / UTAG / "zero" / "norm.bias" / "fp32.pt", folder / "fp32.pt")
    return folder / "fp32.pt"


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_universal_parameter_name_cannot_leave_the_checkpoint(tmp_path: Path, form: str) -> None:
    """A param_shapes name '../../../victim/zero/norm.bias' (or an absolute path) is refused at open, naming it."""
    root = _copy(UNIVERSAL, tmp_path / "ckpt")
    victim = _victim(tmp_path)
    name = "../../../victim/zero/norm.bias" if form == "relative" else str(victim.parent)
    recorded = _rename_universal_param(root, "norm.bias", name)
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.convert(root, tmp_path / "out", progress=False)
    assert str(excinfo.value) == (
        f"'{recorded}' names a parameter {name!r}, which is not a plain file name inside '{root / UTAG / 'zero'}'. "
        + FIX
    )
    assert excinfo.value.path == recorded and excinfo.value.name == name
    assert not (tmp_path / "out").exists()


def test_universal_parameter_folder_linking_out_is_refused(tmp_path: Path) -> None:
    """A zero/<param> folder that is a link to another checkpoint's folder is refused (converting copied it)."""
    root = _copy(UNIVERSAL, tmp_path / "ckpt")
    victim = _victim(tmp_path)
    folder = root / UTAG / "zero" / "norm.bias"
    shutil.rmtree(folder)
    folder.symlink_to(victim.parent)
    with pytest.raises(errors.CheckpointFormatError, match="is a link leading outside") as excinfo:
        zeroio.open(root)
    assert excinfo.value.name == "fp32.pt"


def test_universal_link_inside_the_checkpoint_still_reads(tmp_path: Path) -> None:
    """A link that stays inside the checkpoint (here: zero/norm.bias/fp32.pt to a copy beside it) is followed."""
    root = _copy(UNIVERSAL, tmp_path / "ckpt")
    fp32 = root / UTAG / "zero" / "norm.bias" / "fp32.pt"
    fp32.rename(root / UTAG / "zero" / "norm.bias" / "fp32.real")
    fp32.symlink_to("fp32.real")
    with zeroio.open(root) as ckpt, zeroio.open(UNIVERSAL) as reference:
        assert torch.equal(ckpt["norm.bias"], reference["norm.bias"])


@pytest.fixture(scope="module")
def nvme_optim_rank0() -> dict:
    """Rank 0's optimizer file of the NVMe fixture, unpickled by torch (it holds DeepSpeed classes)."""
    path = NVME / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    return torch.load(path, weights_only=False)


def test_nvme_optimizer_key_cannot_leave_the_checkpoint(tmp_path: Path, nvme_optim_rank0: dict) -> None:
    """An optimizer state key '../../../../victim/exp_avg' would name a swap file outside: refused at open."""
    root = _copy(NVME, tmp_path / "ckpt")
    key = "../../../../victim/exp_avg"
    tree = {**nvme_optim_rank0}
    osd = tree["optimizer_state_dict"] = {**tree["optimizer_state_dict"]}
    inner = osd["optimizer_state_dict"] = {**osd["optimizer_state_dict"]}
    inner["state"] = {**inner["state"], 0: {k if k != "exp_avg" else key: v for k, v in inner["state"][0].items()}}
    (tmp_path / "victim").mkdir()
    shutil.copy(
        root / "global_step2" / "offloaded_tensors" / "rank00" / "exp_avg-0_5.tensor.swp",
        tmp_path / "victim" / "exp_avg-0_5.tensor.swp",
    )
    path = root / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(tree, path)
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(root)
    assert str(excinfo.value) == (
        f"'{path}' names a swap file '{key}-0_5.tensor.swp', which is not a plain file name inside "
        f"'{root / 'global_step2'}'. " + FIX
    )


def test_nvme_swap_file_linking_out_is_refused(tmp_path: Path) -> None:
    """A swap file that is a link to a secret outside the checkpoint: convert refuses instead of copying it."""
    root, _ = nvme_swap_link_out(tmp_path)
    swap = root / "global_step2" / "offloaded_tensors" / "rank00" / "0_5.tensor.swp"
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.convert(root, tmp_path / "out", progress=False)
    assert str(excinfo.value) == (
        f"'{swap}' (the swap file '0_5.tensor.swp' of "
        f"'{root / 'global_step2' / 'bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt'}') is a link leading outside "
        f"'{root / 'global_step2'}'. " + FIX
    )
    assert not (tmp_path / "out").exists()


def _sharded(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3)}
    folder.mkdir(parents=True)
    save_file({"a": tensors["a"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": tensors["b"]}, folder / "model-00002-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": 36}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_index_shard_linking_out_is_refused(tmp_path: Path) -> None:
    """An index shard that is a link to another model's file outside the folder is refused."""
    folder = tmp_path / "model"
    _sharded(folder)
    other = tmp_path / "other.safetensors"
    save_file({"b": torch.full((3,), 7.0)}, other)
    shard = folder / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(other)
    with pytest.raises(errors.CheckpointFormatError, match="is a link leading outside") as excinfo:
        zeroio.open(folder)
    assert excinfo.value.path == folder / "model.safetensors.index.json"


@pytest.mark.parametrize("shard", ["", "/etc/passwd", "sub//x.safetensors", "..\\x.safetensors"])
def test_index_shard_names_must_be_plain(tmp_path: Path, shard: str) -> None:
    """Empty, absolute, doubled-slash and backslash-parent shard names are refused, naming the index."""
    folder = tmp_path / "model"
    _sharded(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["b"] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(errors.CheckpointFormatError, match="is not a plain file name inside"):
        zeroio.open(folder)


def test_hugging_face_cache_snapshot_still_reads(tmp_path: Path) -> None:
    """A Hub cache snapshot (files linking to ../../blobs/<sha>) is read as before."""
    source = tmp_path / "src"
    tensors = _sharded(source)
    cache = tmp_path / "models--org--name"
    (cache / "blobs").mkdir(parents=True)
    snapshot = cache / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(source.iterdir())):
        blob = cache / "blobs" / f"sha{i}"
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    with zeroio.open(snapshot) as ckpt:
        for name, tensor in tensors.items():
            assert torch.equal(ckpt[name], tensor)
    assert load_file(source / "model-00001-of-00002.safetensors")["a"].equal(tensors["a"])


@pytest.mark.parametrize(
    "repo, sub, reads",
    [
        ("models--org--name", "subfolder/model", True),  # hf_hub_download(..., subfolder=...) keeps the tree
        ("not-a-hub-cache", "", False),  # a folder named snapshots elsewhere does not open its ../../blobs
    ],
)
def test_hub_cache_blobs_rule(tmp_path: Path, repo: str, sub: str, reads: bool) -> None:
    """Links may leave a checkpoint only for the blobs/ of the Hugging Face cache repository whose snapshot holds
    it, at any depth of the snapshot (one rule for indexes and DCP folders: zeroio/_io/confine.py)."""
    source = tmp_path / "src"
    tensors = _sharded(source)
    cache = tmp_path / repo
    (cache / "blobs").mkdir(parents=True)
    folder = cache / "snapshots" / "abc123" / sub
    folder.mkdir(parents=True)
    for i, path in enumerate(sorted(source.iterdir())):
        blob = cache / "blobs" / f"sha{i}"
        shutil.copy(path, blob)
        (folder / path.name).symlink_to(os.path.relpath(blob, folder))
    if not reads:
        with pytest.raises(errors.CheckpointFormatError, match="outside"):
            zeroio.open(folder)
        return
    with zeroio.open(folder) as ckpt:
        for name, tensor in tensors.items():
            assert torch.equal(ckpt[name], tensor)


def test_url_roots_refuse_the_same_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An s3:// universal checkpoint naming '../../../victim/...' is refused by name, before any request for it
    (an https:// server would resolve the '..' and serve the other folder)."""
    pytest.importorskip("s3fs")
    from s3_server import S3Server

    universal_name_escape(tmp_path)
    server = S3Server()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        server.upload_tree(tmp_path, "attack", "run")
        url = "s3://attack/run/ckpt"
        with pytest.raises(errors.CheckpointFormatError) as excinfo:
            zeroio.open(url)
        assert excinfo.value.name == "../../../victim/zero/norm.bias"
        assert "is not a plain file name inside" in str(excinfo.value)
    finally:
        server.stop()
