"""zeroio.open on consolidated files: safetensors files and folders, torch state dicts, Lightning .ckpt."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from fixture_data import FIXTURES, fixture_names, reference
from safetensors.torch import save_file

import zeroio
from zeroio.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafePickleError,
    UnsupportedCheckpointError,
)

WITH_DS_REFERENCE = [n for n in fixture_names() if reference(n) is not None]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(13, 7, generator=g),
        "half": torch.randn(3, 5, generator=g).half(),
        "brain": torch.randn(4, generator=g).bfloat16(),
        "steps": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
    }


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, want in expected.items():
        assert actual[key].dtype == want.dtype, key
        assert actual[key].shape == want.shape, key
        assert torch.equal(actual[key], want), key


# --------------------------------------------------------------------------- safetensors


def test_safetensors_file_roundtrip(tmp_path):
    """A safetensors file reads back bit for bit: every dtype, empty and 0-d tensors, metadata kept."""
    tensors = _tensors()
    path = tmp_path / "weights.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "note": "hello"})
    with zeroio.open(path) as ckpt:
        assert ckpt.metadata.format == "safetensors"
        assert ckpt.metadata.path == path
        assert ckpt.metadata.extra["safetensors_metadata"] == {"format": "pt", "note": "hello"}
        assert ckpt.tied == {}
        infos = ckpt.infos
        sd = ckpt.state_dict()
    _assert_same(sd, tensors)
    for name, tensor in tensors.items():
        assert infos[name].shape == tuple(tensor.shape)
        assert infos[name].dtype == tensor.dtype
        assert infos[name].kind == "tensor"
        assert infos[name].files == (path,)


def test_safetensors_keys_in_storage_order(tmp_path):
    """Keys come in the order their bytes lie in the file, so iterating reads the file front to back."""
    path = tmp_path / "m.safetensors"
    save_file(_tensors(), path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    by_offset = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    with zeroio.open(path) as ckpt:
        assert list(ckpt) == by_offset


def test_safetensors_reads_only_requested_bytes(tmp_path, monkeypatch):
    """get_tensor reads exactly the tensor's byte range; nothing else of the file."""
    tensors = {"a": torch.randn(1000), "b": torch.randn(10, 10), "c": torch.randn(500)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + length])["b"]["data_offsets"]
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def recording(fd, buffers, offset):
        got = real(fd, buffers, offset)
        reads.append((offset, got))
        return got

    with zeroio.open(path) as ckpt:
        monkeypatch.setattr(os, "preadv", recording)
        b = ckpt.get_tensor("b")
        monkeypatch.setattr(os, "preadv", real)
    assert torch.equal(b, tensors["b"])
    assert reads == [(8 + length + begin, end - begin)]


def test_safetensors_chunks_and_casting(tmp_path):
    """iter_chunks streams bounded pieces and dtype= casts floating tensors only."""
    tensors = {"w": torch.randn(1000), "i": torch.arange(10)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    with zeroio.open(path) as ckpt:
        chunks = list(ckpt.iter_chunks("w", chunk_bytes=400))
        assert [c.numel() for c in chunks] == [100] * 10
        assert torch.equal(torch.cat(chunks), tensors["w"])
        assert torch.equal(ckpt.get_tensor("w", dtype="bf16"), tensors["w"].bfloat16())
        assert ckpt.get_tensor("i", dtype="bf16").dtype == torch.int64


def test_safetensors_folder_and_single_file_name(tmp_path):
    """A folder holding model.safetensors opens as that file."""
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with zeroio.open(tmp_path) as ckpt:
        assert ckpt.metadata.format == "safetensors"
        _assert_same(ckpt.state_dict(), tensors)


def _write_sharded(folder, tensors, shards, extra_metadata=None):
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": 0, **(extra_metadata or {})}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_safetensors_folder(tmp_path):
    """A sharded folder opens through its index: every name from its weight_map shard, bit for bit."""
    tensors = _tensors()
    names = list(tensors)
    _write_sharded(tmp_path, tensors, [names[:3], names[3:]])
    with zeroio.open(tmp_path) as ckpt:
        assert ckpt.metadata.format == "safetensors"
        assert ckpt.metadata.path == tmp_path
        assert ckpt.metadata.extra["index"] == "model.safetensors.index.json"
        assert ckpt.info("steps").files == (tmp_path / "model-00002-of-00002.safetensors",)
        _assert_same(ckpt.state_dict(), tensors)
    with zeroio.open(tmp_path / "model.safetensors.index.json") as ckpt:
        _assert_same(ckpt.state_dict(), tensors)


def test_sharded_safetensors_missing_shard(tmp_path):
    """A shard named by the index but absent raises CheckpointNotFoundError naming it."""
    tensors = _tensors()
    names = list(tensors)
    _write_sharded(tmp_path, tensors, [names[:3], names[3:]])
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError) as exc:
        zeroio.open(tmp_path)
    assert str(exc.value) == (
        f"Shard 'model-00002-of-00002.safetensors' listed in '{tmp_path / 'model.safetensors.index.json'}' does not "
        "exist. Copy every shard next to the index."
    )


def test_sharded_safetensors_index_disagrees(tmp_path):
    """An index that maps a name to a shard lacking it raises CheckpointFormatError."""
    tensors = _tensors()
    names = list(tensors)
    _write_sharded(tmp_path, tensors, [names[:3], names[3:]])
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["emb.weight"] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError) as exc:
        zeroio.open(tmp_path)
    assert str(exc.value) == (
        f"'{index_path}' maps 'emb.weight' to 'model-00002-of-00002.safetensors', which holds no such tensor. "
        "The index and its shards come from different saves; write them again together."
    )


def test_index_without_weight_map(tmp_path):
    """An index file without a weight_map is a format error with the expected layout."""
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointFormatError) as exc:
        zeroio.open(tmp_path)
    assert str(exc.value) == (
        f"The index '{tmp_path / 'model.safetensors.index.json'}' has no 'weight_map' of tensor names to shard files. "
        'Write it as Hugging Face does: {"metadata": {...}, "weight_map": {name: file}}.'
    )


def test_ties_recorded_by_huggingface_hub(tmp_path):
    """huggingface_hub.save_torch_state_dict stores a tie once and records alias: source; .tied exposes it."""
    from huggingface_hub import save_torch_state_dict

    emb = torch.randn(13, 7)
    sd = {"emb.weight": emb, "head.weight": emb, "bias": torch.randn(7)}
    save_torch_state_dict(sd, tmp_path)
    with zeroio.open(tmp_path) as ckpt:
        assert ckpt.tied == {"head.weight": "emb.weight"}
        assert ckpt.info("head.weight").tied_to == "emb.weight"
        out = ckpt.state_dict()
    assert out["head.weight"] is out["emb.weight"]
    assert torch.equal(out["emb.weight"], emb)


def test_ties_recorded_in_sharded_index(tmp_path):
    """In a sharded folder the tie record sits in the index's metadata (huggingface_hub's layout)."""
    from huggingface_hub import save_torch_state_dict

    emb = torch.randn(13, 7)
    sd = {"emb.weight": emb, "mid": torch.randn(100), "head.weight": emb}
    save_torch_state_dict(sd, tmp_path, max_shard_size=400)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    with zeroio.open(tmp_path) as ckpt:
        assert ckpt.tied == {"head.weight": "emb.weight"}
        out = ckpt.state_dict()
    assert out["head.weight"] is out["emb.weight"]
    assert torch.equal(out["mid"], sd["mid"])


@pytest.mark.parametrize("max_shard_size", ["5GB", 300], ids=["single", "sharded"])
def test_converter_output_reads_back(tmp_path, max_shard_size):
    """zeroio.convert's safetensors output reads back equal to the ZeRO checkpoint, ties included."""
    from zeroio import convert

    out = tmp_path / "out"
    convert(FIXTURES / "z3_ws2_fp32", out, max_shard_size=max_shard_size, progress=False)
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as src, zeroio.open(out) as ckpt:
        assert ckpt.metadata.format == "safetensors"
        assert ckpt.tied == src.tied == {"head.weight": "emb.weight"}
        expected, actual = src.state_dict(), ckpt.state_dict()
    _assert_same(actual, expected)
    assert actual["head.weight"] is actual["emb.weight"]


def test_metadata_value_that_is_not_a_tie(tmp_path):
    """Metadata entries whose value names no stored tensor are plain metadata, not ties."""
    save_file({"a": torch.ones(2)}, tmp_path / "m.safetensors", metadata={"format": "pt", "author": "me"})
    with zeroio.open(tmp_path / "m.safetensors") as ckpt:
        assert ckpt.tied == {}
        assert list(ckpt) == ["a"]


TRUNCATED = "The copy or download was cut short: copy the file again from its source."
RESAVE = "Re-save it with safetensors.torch.save_file."


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda raw: raw[:5], "is truncated: it holds 5 bytes, fewer than the 8-byte header length. " + TRUNCATED),
        (
            lambda raw: struct.pack("<Q", 10**6) + raw[8:],
            "is truncated: its header claims 1000000 bytes, the file holds {size}. " + TRUNCATED,
        ),
        (
            lambda raw: raw[:8] + b"x" + raw[9:],
            "is not a valid safetensors file: its header is not JSON (Expecting value: line 1 column 1 (char 0)). "
            + RESAVE,
        ),
        (
            lambda raw: raw[:-4],
            "is truncated: 'a' ends at byte 16 of the data section, the file holds 12 bytes of data. " + TRUNCATED,
        ),
    ],
    ids=["short", "length", "json", "truncated"],
)
def test_corrupt_safetensors(tmp_path, mutate, why):
    """Corrupted headers are CheckpointFormatErrors that say what is wrong; a cut-short file is told to copy again."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4)}, path)
    raw = mutate(path.read_bytes())
    path.write_bytes(raw)
    with pytest.raises(CheckpointFormatError) as exc:
        zeroio.open(path)
    assert str(exc.value) == f"'{path}' {why.format(size=len(raw))}"


def test_unknown_safetensors_dtype(tmp_path):
    """A dtype zeroio cannot map to torch raises UnsupportedCheckpointError naming it."""
    header = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(UnsupportedCheckpointError) as exc:
        zeroio.open(path)
    assert str(exc.value).startswith(f"'{path}': tensor 'x' has dtype 'F4', which zeroio cannot read with torch ")


def test_closed_safetensors_checkpoint_releases_file(tmp_path):
    """After close, reads raise and no file descriptor stays open."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4)}, path)
    before = set(os.listdir("/proc/self/fd"))
    with zeroio.open(path) as ckpt:
        ckpt.get_tensor("a")
    assert set(os.listdir("/proc/self/fd")) <= before
    with pytest.raises(zeroio.errors.CheckpointClosedError):
        ckpt.get_tensor("a")


# --------------------------------------------------------------------------- torch files


def test_torch_bin_roundtrip_with_ties_and_views(tmp_path):
    """A torch.save'd state dict reads back bit for bit; shared storages become ties, views read right."""
    lin = torch.nn.Linear(6, 4)
    base = torch.randn(5, 6)
    sd = {
        "w": lin.weight.detach(),
        "w_alias": lin.weight.detach(),
        "b": lin.bias.detach(),
        "transposed": base.t(),
        "row": base[2],
        **_tensors(),
    }
    path = tmp_path / "pytorch_model.bin"
    torch.save(sd, path)
    with zeroio.open(path) as ckpt:
        assert ckpt.metadata.format == "torch"
        assert ckpt.tied == {"w_alias": "w"}
        out = ckpt.state_dict()
    _assert_same(out, sd)
    assert out["w_alias"] is out["w"]
    assert "row" not in ckpt.tied  # a view of another storage region is no tie


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth"])
def test_torch_suffixes(tmp_path, suffix):
    """.bin, .pt and .pth state dicts all open as torch checkpoints."""
    sd = _tensors()
    torch.save(sd, tmp_path / f"weights{suffix}")
    with zeroio.open(tmp_path / f"weights{suffix}") as ckpt:
        _assert_same(ckpt.state_dict(), sd)


def test_lightning_style_ckpt(tmp_path):
    """A Lightning .ckpt (state dict under "state_dict" plus client state) opens with its step recorded."""
    sd = {"model.w": torch.randn(3, 3), "model.b": torch.randn(3)}
    torch.save(
        {"state_dict": sd, "epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.6.6", "loops": {}},
        tmp_path / "last.ckpt",
    )
    with zeroio.open(tmp_path / "last.ckpt") as ckpt:
        meta = ckpt.metadata
        _assert_same(ckpt.state_dict(), sd)
    assert meta.format == "torch"
    assert meta.global_step == 120
    assert meta.extra["state_dict_key"] == "state_dict"
    assert meta.extra["lightning_version"] == "2.6.6"
    assert meta.extra["client_state_keys"] == ["epoch", "global_step", "loops", "pytorch-lightning_version"]


def test_sharded_torch_folder(tmp_path):
    """A pytorch_model.bin.index.json folder opens through its weight_map."""
    sd = _tensors()
    names = list(sd)
    weight_map = {}
    for i, part in enumerate([names[:4], names[4:]]):
        fname = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({n: sd[n] for n in part}, tmp_path / fname)
        weight_map.update({n: fname for n in part})
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with zeroio.open(tmp_path) as ckpt:
        assert ckpt.metadata.format == "torch"
        assert ckpt.metadata.extra["index"] == "pytorch_model.bin.index.json"
        _assert_same(ckpt.state_dict(), sd)


def test_safetensors_preferred_over_torch_in_a_folder(tmp_path):
    """With both model.safetensors and pytorch_model.bin present, safetensors is read (as transformers does)."""
    save_file({"a": torch.ones(2)}, tmp_path / "model.safetensors")
    torch.save({"a": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with zeroio.open(tmp_path) as ckpt:
        assert ckpt.metadata.format == "safetensors"
        assert torch.equal(ckpt["a"], torch.ones(2))


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_torch_file_with_code_is_refused(tmp_path, capsys):
    """A pickle asking for a global outside the allowlist raises UnsafePickleError; nothing runs."""
    path = tmp_path / "evil.bin"
    torch.save({"w": torch.ones(2), "x": _Payload()}, path)
    with pytest.raises(UnsafePickleError) as exc:
        zeroio.open(path)
    assert capsys.readouterr().out == ""
    # torch.save writes protocol 2, which spells builtins by their Python 2 names ('__builtin__.print'); the
    # unpickler maps them as pickle does (81be94f), so the refusal names the global as Python 3 does
    assert str(exc.value) == (
        f"Refusing to unpickle global 'builtins.print' from '{path}': it is not on zeroio's allowlist. "
        "If you trust this file, pass trusted_globals=['builtins.print'] "
        "(it is rebuilt as inert data, never called)."
    )
    # the name the message gives works, and so does the spelling in the file (what this message said before)
    for trusted in ("builtins.print", "__builtin__.print"):
        with zeroio.open(path, trusted_globals=[trusted]) as ckpt:
            assert torch.equal(ckpt["w"], torch.ones(2))
        assert capsys.readouterr().out == ""


def test_torch_file_without_tensors(tmp_path):
    """A torch file holding no state dict is a format error listing its top-level keys."""
    path = tmp_path / "x.pt"
    torch.save({"epoch": 1, "note": "hi"}, path)
    with pytest.raises(CheckpointFormatError) as exc:
        zeroio.open(path)
    assert str(exc.value) == (
        f"'{path}' holds no tensors at its top level nor under 'state_dict', 'model_state_dict', 'module', 'model' "
        "(top-level keys: epoch, note). Save model.state_dict() with torch.save."
    )


def test_torch_file_that_is_a_list(tmp_path):
    """A torch file whose top level is not a dict is a format error."""
    path = tmp_path / "x.pt"
    torch.save([torch.ones(2)], path)
    with pytest.raises(CheckpointFormatError) as exc:
        zeroio.open(path)
    assert str(exc.value) == (f"'{path}' holds a list, not a state dict. Save model.state_dict() with torch.save.")


def test_non_tensor_entries_are_skipped(tmp_path):
    """Non-tensor values inside a state dict (a module's _extra_state) are skipped and recorded."""
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2), "layer._extra_state": {"k": 1}}, path)
    with zeroio.open(path) as ckpt:
        assert list(ckpt) == ["w"]
        assert ckpt.metadata.extra["skipped_keys"] == ["layer._extra_state"]


def test_legacy_torch_serialization_is_unsupported(tmp_path):
    """Pre-1.6 (non-zip) torch files are refused with a re-save hint."""
    path = tmp_path / "old.bin"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedCheckpointError) as exc:
        zeroio.open(path)
    assert str(exc.value) == (
        f"'{path}' uses torch's legacy (pre-1.6) serialization, which zeroio does not read. "
        "Re-save it with torch.save (zip format)."
    )


def test_folder_without_known_files():
    """A folder with none of the Hugging Face names and no DeepSpeed files says what it looked for."""
    folder = FIXTURES / "z3_ws2_fp32" / "expected"  # holds only zero_to_fp32.pt and engine.pt
    with pytest.raises(CheckpointNotFoundError) as exc:
        zeroio.open(folder)
    assert str(exc.value) == (
        f"'{folder}' is not a DeepSpeed checkpoint: it has no '*_model_states.pt' files, no 'latest' file and no "
        "tag folders. Point zeroio at the folder passed to engine.save_checkpoint()."
    )


@pytest.mark.parametrize("name", WITH_DS_REFERENCE)
def test_deepspeed_consolidation_file_reads_back(name):
    """DeepSpeed's own zero_to_fp32 output (a torch file) reads equal to torch.load, its tie detected."""
    path = FIXTURES / name / "expected" / "zero_to_fp32.pt"
    expected = torch.load(path, weights_only=True)
    with zeroio.open(path) as ckpt:
        assert ckpt.tied == {"head.weight": "emb.weight"}
        actual = ckpt.state_dict()
    assert list(actual) == list(expected)
    _assert_same(actual, expected)
    assert actual["head.weight"] is actual["emb.weight"]


def test_consolidated_files_have_no_optimizer_state(tmp_path):
    """optimizer_state() on a consolidated file raises UnsupportedCheckpointError, not AttributeError."""
    import safetensors.torch

    from zeroio.errors import UnsupportedCheckpointError

    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, path)
    with zeroio.open(path) as ckpt, pytest.raises(UnsupportedCheckpointError) as excinfo:
        ckpt.optimizer_state("w")
    assert str(excinfo.value) == (
        f"'{path}' is a consolidated safetensors checkpoint: it holds no optimizer state. Read optimizer state from "
        "the DeepSpeed checkpoint it was converted from."
    )
