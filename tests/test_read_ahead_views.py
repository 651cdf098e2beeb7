"""Read-ahead through readers that read through others (zeroio/_formats/view.py, composite/tensor_parallel.py): a
LoRA merge (``merge_lora``) and a tensor-parallel composite read each rank file's fp32 partition in one read, as
the plain checkpoint does (before, a read per tensor and rank: the views read their inner reader's ``read_into``),
their tensors stay the references bit for bit, and a flipped byte served from a window still fails the read."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES, assert_state_dicts_equal
from safetensors.torch import load_file
from test_crc import _flip as flip
from test_read_ahead import _watch_reads

import zeroio
from zeroio.errors import CheckpointFormatError

LORA = FIXTURES / "peft" / "lora_llama_z3_fp32" / "checkpoint-3"
"""ZeRO-3, 2 ranks, frozen Llama base with r=4 LoRA on q/k/v/up/down: 20 factors back to back in each rank's one
flat group (fp32), the base weights in frozen fragments."""
TP = FIXTURES / "layouts" / "autotp_z1_ws4_dp2_tp2_fp32"
"""AutoTP, tp 2 x dp 2, ZeRO-1: each tp rank's tensors (split along dim 0, dim 1 or replicated) in its 2 ranks'
fp32 partitions, 12-13 of them in each file."""


def _merged_reference() -> dict[str, torch.Tensor]:
    """PEFT's ``merge_and_unload()`` of the live engine (fixtures/generate_peft.py)."""
    return torch.load(LORA.parent / "expected" / "merged.pt", weights_only=True)


def _tp_reference() -> dict[str, torch.Tensor]:
    """The live engine's fp32 masters, concatenated across tp ranks (fixtures/generate_autotp.py)."""
    return torch.load(TP / "expected" / "engine.pt", weights_only=True)


def _read_all(how: str, path: Path, out: Path, **options: Any) -> dict[str, torch.Tensor]:
    """Every tensor of ``path`` opened with ``options``, read by ``how`` (convert: the file it writes)."""
    if how == "state_dict":
        with zeroio.open(path, **options) as ckpt:
            return ckpt.state_dict()
    if how == "load":
        with zeroio.open(path, **options) as ckpt:
            model = _meta_model_of(ckpt)
            zeroio.load(ckpt, model)
        return dict(model.state_dict())
    zeroio.convert(path, out, dtype="fp32", progress=False, **options)
    return load_file(out / "model.safetensors")


def _meta_model_of(ckpt: zeroio.Checkpoint) -> torch.nn.Module:
    """A module holding every key of ``ckpt`` as a meta parameter (dots make submodules): what load fills."""
    model = torch.nn.Module()
    for name, info in ckpt.infos.items():
        *parents, leaf = name.split(".")
        owner = model
        for part in parents:
            if part not in owner._modules:
                owner.add_module(part, torch.nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        meta = torch.empty(info.shape, dtype=info.dtype, device="meta")
        owner.register_parameter(leaf, torch.nn.Parameter(meta, requires_grad=False))
    return model


def _optim_reads(counts: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in counts.items() if name.endswith("optim_states.pt")}


@pytest.mark.parametrize("how", ["state_dict", "load", "convert"])
def test_a_lora_merge_reads_each_rank_partition_in_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The merge reads its factors (lora_A, lora_B) through the windows of its own pass, or of the conversion:
    one read of each rank's flat group (20 before, one per factor); the merged weights are PEFT's bit for bit."""
    counts = _watch_reads(monkeypatch)
    got = _read_all(how, LORA, tmp_path / "out", merge_lora=True)
    assert _optim_reads(counts) == {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 1 for r in range(2)}
    assert_state_dicts_equal(got, _merged_reference())


@pytest.mark.parametrize("how", ["state_dict", "load", "convert", "verify"])
def test_a_tensor_parallel_composite_reads_each_rank_partition_in_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A tp composite reads each tp rank's pieces through the windows of its pass (over every rank's files) or of
    the conversion: one read of each fp32 partition (12-24 before: a read per tensor, and per row of a tensor split
    along dim 1); the tensors are the engine's bit for bit."""
    if how == "verify":
        zeroio.convert(TP, tmp_path / "out", progress=False)
        counts = _watch_reads(monkeypatch)
        assert zeroio.verify(TP, tmp_path / "out").ok
    else:
        counts = _watch_reads(monkeypatch)
        got = _read_all(how, TP, tmp_path / "out")
        assert_state_dicts_equal(got, _tp_reference())
    assert _optim_reads(counts) == {f"zero_pp_rank_{d}_mp_rank_0{t}_optim_states.pt": 1 for d in (0, 1) for t in (0, 1)}


def _flip(tmp_path: Path, source: Path, file_offset: tuple[str, int]) -> Path:
    """A copy of the checkpoint folder ``source`` with the byte at ``file_offset`` (file name, offset) flipped."""
    copy = tmp_path / "ckpt"
    shutil.copytree(source, copy)
    name, offset = file_offset
    (path,) = copy.rglob(name)
    flip(path, offset)
    return copy


def _last_byte(path: Path, name: str, index: int) -> tuple[str, int]:
    """Where the last byte of ``name``'s ``index``-th byte range lies: (file name, offset)."""
    with zeroio.open(path) as ckpt:
        ranges = ckpt.byte_ranges(ckpt.source_name(name))
    assert ranges is not None
    source, offset, nbytes = ranges[index]
    return Path(source.name).name, offset + nbytes - 1


@pytest.mark.parametrize("how", ["state_dict", "load", "convert"])
def test_a_flipped_factor_byte_served_from_a_window_fails_the_merge(tmp_path: Path, how: str) -> None:
    """The last layer's down_proj lora_B, on rank 1, is copied out of the window the first factor opened: its byte
    is checked with the window, and the merge fails with the CRC error."""
    where = _last_byte(LORA, "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight", -1)
    copy = _flip(tmp_path, LORA.parent, where) / LORA.name
    with pytest.raises(CheckpointFormatError, match="fails its CRC-32 check"):
        _read_all(how, copy, tmp_path / "out", merge_lora=True)


@pytest.mark.parametrize("how", ["state_dict", "load", "convert"])
def test_a_flipped_byte_served_from_a_window_fails_the_composite(tmp_path: Path, how: str) -> None:
    """The byte before layers.1.mlp.dense_4h_to_h.bias in its flat group is the last of tp rank 0's shard of
    dense_4h_to_h.weight (split along dim 1: a read per row before), copied out of the window an earlier tensor
    opened: the read fails with the CRC error (unchecked, that weight alone differs from the engine's)."""
    name, offset = _last_byte(TP, "layers.1.mlp.dense_4h_to_h.bias", 0)
    copy = _flip(tmp_path, TP, (name, offset - 32))  # 8 fp32 elements: the bias's first byte, less one
    with pytest.raises(CheckpointFormatError, match="fails its CRC-32 check"):
        _read_all(how, copy, tmp_path / "out")
    if how == "state_dict":
        got, want = _read_all(how, copy, tmp_path / "unchecked", verify_crc=False), _tp_reference()
        assert [k for k in want if not torch.equal(got[k], want[k])] == ["layers.1.mlp.dense_4h_to_h.weight"]


MEGATRON = FIXTURES / "megatron" / "gpt_qwen3_tp2"
"""Megatron-Core torch_dist (DCP), tp 2 x pp 2 files: the row-parallel weights (linear_proj, linear_fc2) are chunks
split along dim 1, read a row at a time without windows; 5-11 model tensor chunks a data file."""


def _model_chunks(folder: Path) -> dict[str, int]:
    """The model tensors' chunk records in each data file, as torch's own DCP reader lists them (the Adam moments,
    rng states and extra states are not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    (iteration,) = folder.glob("iter_*")
    metadata = dcp.FileSystemReader(str(iteration)).read_metadata()
    found: dict[str, int] = {}
    for index, where in metadata.storage_data.items():
        kind = metadata.state_dict_metadata[index.fqn]
        if isinstance(kind, TensorStorageMetadata) and not index.fqn.startswith("optimizer."):
            found[where.relative_path] = found.get(where.relative_path, 0) + 1
    return found


def _hf_reference(live: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Megatron's live tensors under transformers' Qwen3 names (q/k/v: the fused QKV's per-group rows; gate/up:
    fc1's halves), as tests/test_megatron_hf.py checks them."""
    groups, d, h = config["num_key_value_heads"], config["head_dim"], config["hidden_size"]
    per_group = config["num_attention_heads"] // groups
    out = {"model.embed_tokens.weight": live["embedding.word_embeddings.weight"],
           "model.norm.weight": live["decoder.final_layernorm.weight"]}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = live[f"{src}self_attention.linear_qkv.weight"].view(groups, per_group + 2, d, h)
        gate, up = live[f"{src}mlp.linear_fc1.weight"].chunk(2)
        out.update({
            f"{dst}input_layernorm.weight": live[f"{src}self_attention.linear_qkv.layer_norm_weight"],
            f"{dst}post_attention_layernorm.weight": live[f"{src}mlp.linear_fc1.layer_norm_weight"],
            f"{dst}self_attn.q_proj.weight": qkv[:, :per_group].reshape(-1, h),
            f"{dst}self_attn.k_proj.weight": qkv[:, per_group].reshape(-1, h),
            f"{dst}self_attn.v_proj.weight": qkv[:, per_group + 1].reshape(-1, h),
            f"{dst}self_attn.o_proj.weight": live[f"{src}self_attention.linear_proj.weight"],
            f"{dst}self_attn.q_norm.weight": live[f"{src}self_attention.q_layernorm.weight"],
            f"{dst}self_attn.k_norm.weight": live[f"{src}self_attention.k_layernorm.weight"],
            f"{dst}mlp.gate_proj.weight": gate, f"{dst}mlp.up_proj.weight": up,
            f"{dst}mlp.down_proj.weight": live[f"{src}mlp.linear_fc2.weight"],
        })  # fmt: skip
    return out


@pytest.mark.parametrize("names", [None, "hf"])
@pytest.mark.parametrize("how", ["state_dict", "load"])
def test_a_megatron_pass_reads_each_chunk_record_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, names: str | None
) -> None:
    """Megatron's DCP reader serves a chunk's rows (a row-parallel weight), and names="hf"'s row blocks of the
    fused QKV and fc1, from a window of the chunk's record: one read per model tensor chunk (26/58/22/53 before
    against 9/11/5/6); the tensors are Megatron's bit for bit."""
    options = {} if names is None else {"names": names}
    counts = _watch_reads(monkeypatch)
    got = _read_all(how, MEGATRON, tmp_path / "out", **options)
    assert {name: n for name, n in counts.items() if name.endswith(".distcp")} == _model_chunks(MEGATRON)
    live = torch.load(MEGATRON / "expected" / "model.pt", weights_only=True)
    if names == "hf":
        with zeroio.open(MEGATRON, names="hf") as ckpt:
            live = _hf_reference(live, ckpt.metadata.extra["hf_config"])
    assert_state_dicts_equal(got, live)
