"""verl FSDP checkpoints (fixtures/verl/, written by verl 0.9.1's own FSDPCheckpointManager): open, optimizer
state, convert and load equal the live run's full state bit for bit; FSDP1's optimizer, missing ranks and crafted
files are refused with typed errors."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroio
import zeroio.errors
from zeroio.cli import main
from zeroio.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafePickleError,
    UnsupportedCheckpointError,
    WorldSizeMismatchError,
)

VERL = Path(__file__).resolve().parent.parent / "fixtures" / "verl"
FSDP2 = ["verl_fsdp2_ws2_fp32", "verl_fsdp2_ws2_bf16", "verl_fsdp2_ws2_critic"]


def _reference(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    expected = VERL / name / "expected"
    return (
        torch.load(expected / "model.pt", weights_only=True),
        torch.load(expected / "optim.pt", weights_only=True),
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                                      b.contiguous().view(-1).view(torch.uint8))  # fmt: skip


def _copy(name: str, dst: Path) -> Path:
    shutil.copytree(VERL / name, dst, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return dst


@pytest.mark.parametrize("name", FSDP2)
def test_open_equals_the_live_run(name):
    """Every tensor equals get_model_state_dict(full_state_dict=True) of the run that saved it, in its dtype."""
    model, _ = _reference(name)
    with zeroio.open(VERL / name) as ckpt:
        assert ckpt.metadata.format == "verl"
        assert ckpt.metadata.world_size == 2
        assert ckpt.metadata.layout == "fsdp2"
        assert set(ckpt) == set(model)
        for key, want in model.items():
            assert _same(ckpt[key], want), key
    dtype = torch.bfloat16 if "bf16" in name else torch.float32
    assert {t.dtype for t in model.values()} == {dtype}


def test_tied_embeddings_and_empty_shards():
    """A tied lm_head is an alias of the embedding; the critic's 1-row score head (rank 1's shard is empty) reads
    whole; uneven dims (37 and 27 rows over 2 ranks) follow torch.chunk."""
    with zeroio.open(VERL / "verl_fsdp2_ws2_bf16") as ckpt:
        assert ckpt.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    model, _ = _reference("verl_fsdp2_ws2_critic")
    with zeroio.open(VERL / "verl_fsdp2_ws2_critic") as ckpt:
        assert ckpt.info("score.weight").shape == (1, 16)
        assert _same(ckpt["score.weight"], model["score.weight"])
        assert ckpt.info("model.embed_tokens.weight").shape == (37, 16)
        assert ckpt.info("model.layers.0.mlp.gate_proj.weight").shape == (27, 16)


@pytest.mark.parametrize("name", FSDP2)
def test_optimizer_state_equals_the_live_run(name):
    """optimizer_state maps verl's parameter indices to names: moments and step equal get_optimizer_state_dict's."""
    _, optim = _reference(name)
    with zeroio.open(VERL / name) as ckpt:
        assert ckpt.metadata.optimizer == "Adam"
        for param, state in optim["state"].items():
            got = ckpt.optimizer_state(param)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert _same(got[key], state[key]), (param, key)
            assert got["lr"] == 0.05 and got["weight_decay"] == 0.01


@pytest.mark.parametrize("name", ["verl_fsdp2_ws2_fp32", "verl_fsdp2_ws2_bf16"])
def test_convert_keeps_dtype_config_and_moments(name, tmp_path):
    """convert writes the live run's tensors in their own dtype (fp32 stays fp32, unlike verl's bf16 merger),
    copies huggingface/config.json, and --include-optimizer writes each moment; verify agrees."""
    model, optim = _reference(name)
    out = tmp_path / "out"
    assert main(["convert", str(VERL / name), str(out), "--quiet", "--include-optimizer"]) == 0
    written = load_file(out / "model.safetensors")
    tied = {"lm_head.weight"} if "bf16" in name else set()
    assert set(written) == set(model) - tied
    for key in written:
        assert _same(written[key], model[key]), key
    assert (out / "config.json").read_bytes() == (VERL / name / "huggingface" / "config.json").read_bytes()
    moments = load_file(out / "optimizer.safetensors")
    for param, state in optim["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same(moments[f"{param}.{key}"], state[key]), (param, key)
    assert zeroio.verify(VERL / name, out).ok


@pytest.mark.parametrize("name", ["verl_fsdp2_ws2_fp32", "verl_fsdp2_ws2_bf16"])
def test_load_into_the_hf_model(name):
    """zeroio.load fills the transformers model built from huggingface/config.json with the live run's values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model, _ = _reference(name)
    config = AutoConfig.from_pretrained(VERL / name / "huggingface")
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config, dtype=next(iter(model.values())).dtype)
    report = zeroio.load(VERL / name, net)
    assert not report.missing_keys and not report.unexpected_keys
    for key, value in net.state_dict().items():
        assert _same(value, model[key]), key


def test_step_folders_and_root(tmp_path):
    """A verl root (latest_checkpointed_iteration.txt, global_step_N/actor) opens its latest step, or ``tag``;
    a global_step_N folder opens its actor."""
    root = tmp_path / "ckpts"
    _copy("verl_fsdp2_ws2_fp32", root / "global_step_2" / "actor")
    _copy("verl_fsdp2_ws2_bf16", root / "global_step_4" / "actor")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    with zeroio.open(root) as ckpt:
        assert (ckpt.metadata.tag, ckpt.metadata.global_step) == ("global_step_2", 2)
        assert ckpt.metadata.train_dtype == torch.float32
    with zeroio.open(root, tag="global_step_4") as ckpt:
        assert ckpt.metadata.train_dtype == torch.bfloat16
    with zeroio.open(root / "global_step_4") as ckpt:
        assert ckpt.metadata.path == root / "global_step_4" / "actor"
    with pytest.raises(CheckpointNotFoundError, match="no step folder 'global_step_9'"):
        zeroio.open(root, tag="global_step_9")
    megatron = tmp_path / "megatron"  # verl's Megatron backend: same root and step names, no FSDP rank files
    (megatron / "global_step_2" / "actor" / "dist_ckpt").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("2")
    with pytest.raises(zeroio.errors.ZeroIOError) as info:
        zeroio.open(megatron)
    assert "verl" not in str(info.value)


def test_optimizer_of_other_param_groups_is_refused_weights_read(tmp_path):
    """An optimizer built with its own param groups (layer-wise learning rates, not in model order) numbers its
    parameters group after group, which the files do not record: optimizer_state and include_optimizer are refused
    naming the groups, the weights still equal the live run's (3 ranks). Before, index i was taken for the i-th
    parameter and layer 0's moments and lr were returned for layer 1 (equal shapes) without an error."""
    name = "verl_fsdp2_ws3_param_groups"
    model, optim = _reference(name)
    assert {g["lr"] for g in optim["param_groups"]} == {0.05, 0.01}
    with zeroio.open(VERL / name) as ckpt:
        assert ckpt.metadata.world_size == 3 and ckpt.metadata.optimizer is None
        for key, want in model.items():
            assert _same(ckpt[key], want), key
        with pytest.raises(UnsupportedCheckpointError, match=r"holds 2 param groups.*weights only"):
            ckpt.optimizer_state("model.layers.1.self_attn.q_proj.weight")
    with pytest.raises(UnsupportedCheckpointError, match="2 param groups"):
        zeroio.convert(VERL / name, tmp_path / "out", include_optimizer=True, progress=False)
    assert not (tmp_path / "out").exists()
    zeroio.convert(VERL / name, tmp_path / "weights", progress=False)
    written = load_file(tmp_path / "weights" / "model.safetensors")
    assert all(_same(written[k], v) for k, v in model.items())


def test_convert_from_the_root_copies_the_chosen_steps_config(tmp_path):
    """From the root (or with tag=), the output gets config.json from the huggingface/ folder of the step read,
    so transformers loads it; before, only an actor/ or global_step_N/ source had it copied."""
    root = tmp_path / "ckpts"
    _copy("verl_fsdp2_ws2_fp32", root / "global_step_2" / "actor")
    _copy("verl_fsdp2_ws2_bf16", root / "global_step_4" / "actor")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    for tag, name in ((None, "verl_fsdp2_ws2_fp32"), ("global_step_4", "verl_fsdp2_ws2_bf16")):
        out = tmp_path / f"out-{tag}"
        zeroio.convert(root, out, tag=tag, progress=False)
        assert (out / "config.json").read_bytes() == (VERL / name / "huggingface" / "config.json").read_bytes()


def test_fsdp1_weights_read_and_its_optimizer_refused_by_name(tmp_path):
    """verl's FSDP1 (strategy fsdp, with its device mesh) saves DTensors too: weights equal FSDP1's own
    FULL_STATE_DICT bit for bit; its flattened-parameter optimizer state gets a typed error naming it."""
    path = VERL / "verl_fsdp1_ws2"
    model = torch.load(path / "expected" / "model.pt", weights_only=True)
    with zeroio.open(path) as ckpt:
        assert (ckpt.metadata.layout, ckpt.metadata.optimizer) == ("fsdp1", None)
        assert set(ckpt) == set(model)
        for key, want in model.items():
            assert _same(ckpt[key], want), key
        with pytest.raises(UnsupportedCheckpointError) as info:
            ckpt.optimizer_state("lm_head.weight")
    assert str(info.value) == (
        f"No optimizer state for 'lm_head.weight' in '{path}': verl's FSDP1 optimizer files hold FSDP's "
        "flattened-parameter state, which zeroio does not map to parameters; zeroio reads an FSDP1 checkpoint's "
        "weights only. Resume with verl, or train with strategy fsdp2."
    )
    folder = _copy("verl_fsdp1_ws2", tmp_path / "sharded_tensor")  # FSDP1 without a mesh: ShardedTensor values
    _rewrite_pickle(
        folder / "model_world_size_2_rank_0.pt",
        b"ctorch.distributed.tensor\nDTensor\n",
        b"ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n",
    )
    with pytest.raises(UnsupportedCheckpointError, match="FSDP1 checkpoint whose shards are ShardedTensors"):
        zeroio.open(folder)
    (folder / "fsdp_config.json").write_text('{"FSDP_version": 3, "world_size": 2}')
    with pytest.raises(UnsupportedCheckpointError, match="says FSDP_version 3 in its fsdp_config.json"):
        zeroio.open(folder)


def test_missing_and_mixed_ranks(tmp_path):
    """A missing rank file, or rank files of another world size beside them, raise WorldSizeMismatchError."""
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "a")
    (folder / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(WorldSizeMismatchError, match=r"lacks model_world_size_2_rank_R.pt for rank\(s\) \[1\]"):
        zeroio.open(folder)
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "b")
    shutil.copy(folder / "model_world_size_2_rank_0.pt", folder / "model_world_size_4_rank_0.pt")
    with pytest.raises(WorldSizeMismatchError, match=r"world sizes \[2, 4\]"):
        zeroio.open(folder)
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "c")
    (folder / "optim_world_size_2_rank_0.pt").unlink()
    with pytest.raises(WorldSizeMismatchError, match=r"lacks optim_world_size_2_rank_R.pt for rank\(s\) \[0\]"):
        zeroio.open(folder)


def test_files_of_other_saves_are_refused(tmp_path):
    """Swapped rank files (pieces that are not torch.chunk's), a rank from a bf16 save, or an optimizer of another
    model raise CheckpointFormatError naming the file, never a scrambled tensor."""
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "swap")
    a, b = folder / "model_world_size_2_rank_0.pt", folder / "model_world_size_2_rank_1.pt"
    a.rename(tmp_path / "r0")
    b.rename(a)
    (tmp_path / "r0").rename(b)
    with pytest.raises(CheckpointFormatError, match=r"holds a float32 piece of shape \(18, 16\) on rank 0"):
        zeroio.open(folder)
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "mixed")
    shutil.copy(VERL / "verl_fsdp2_ws2_bf16" / "model_world_size_2_rank_1.pt", folder)
    with pytest.raises(CheckpointFormatError, match="different names|on rank 1 but a float32"):
        zeroio.open(folder)
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "optim")
    for rank in (0, 1):
        shutil.copy(VERL / "verl_fsdp2_ws2_critic" / f"optim_world_size_2_rank_{rank}.pt", folder)
    with pytest.raises(
        CheckpointFormatError, match="param group index .27. does not name one of the model.s 27 parameters once"
    ):
        zeroio.open(folder)


def _rewrite_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Replace bytes in a rank file's pickle (a crafted file: the rest of the archive kept)."""
    with zipfile.ZipFile(path) as zin:
        records = [(info, zin.read(info)) for info in zin.infolist()]
    with zipfile.ZipFile(path, "w") as zout:
        for info, data in records:
            if info.filename.endswith("data.pkl"):
                assert old in data
                data = data.replace(old, new)
            zout.writestr(info, data)


def test_crafted_pickles_are_refused(tmp_path):
    """A rank file naming a code-running global raises UnsafePickleError; a placement zeroio does not read
    (_StridedShard) and a broken fsdp_config.json raise typed errors; nothing runs."""
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "payload")
    _rewrite_pickle(folder / "model_world_size_2_rank_1.pt", b"ccollections\nOrderedDict\n", b"cos\nsystem\n")
    with pytest.raises(UnsafePickleError, match="global 'os.system'"):
        zeroio.open(folder)
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "strided")
    _rewrite_pickle(folder / "model_world_size_2_rank_0.pt", b"placement_types\nShard\n", b"placement_types\n_StridedShard\n")  # fmt: skip
    with pytest.raises(UnsupportedCheckpointError, match="has placement _StridedShard"):
        zeroio.open(folder)
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "config")
    (folder / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": "2"}')
    with pytest.raises(CheckpointFormatError, match="does not hold positive integers FSDP_version and world_size"):
        zeroio.open(folder)


def test_manifest_names_the_versions():
    """Each fixture's manifest records the torch, verl and transformers versions that wrote it."""
    for name in [*FSDP2, "verl_fsdp1_ws2"]:
        manifest = json.loads((VERL / name / "manifest.json").read_text())
        assert (manifest["torch"], manifest["verl"]) == ("2.13.0", "0.9.1")
        assert manifest["world_size"] == 2


def test_from_an_s3_url_equals_local(monkeypatch):
    """open and optimizer_state from s3:// (moto on localhost) equal the local folder's."""
    pytest.importorskip("s3fs")
    from s3_server import S3Server

    server = S3Server()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        url = server.upload_tree(VERL / "verl_fsdp2_ws2_bf16", "verl", "global_step_2/actor")
        with zeroio.open(VERL / "verl_fsdp2_ws2_bf16") as local, zeroio.open(url) as remote:
            assert list(remote) == list(local) and remote.tied == local.tied
            for key in local:
                assert _same(remote[key], local[key]), key
            assert remote.metadata.global_step == 2
            want = local.optimizer_state("model.norm.weight")["exp_avg_sq"]
            assert _same(remote.optimizer_state("model.norm.weight")["exp_avg_sq"], want)
    finally:
        server.stop()


def test_huggingface_folder_linked_elsewhere_is_not_copied(tmp_path):
    """A huggingface/ that links outside the checkpoint folder contributes no side files (they could be anything)."""
    folder = _copy("verl_fsdp2_ws2_fp32", tmp_path / "actor")
    outside = tmp_path / "outside"
    shutil.move(folder / "huggingface", outside)
    (folder / "huggingface").symlink_to(outside, target_is_directory=True)
    assert main(["convert", str(folder), str(tmp_path / "out"), "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
