"""zeroio.open on genuine DeepSpeed checkpoints: bit-exact consolidation, metadata, laziness, lifetimes."""

from __future__ import annotations

import os

import pytest
import torch
from fixture_data import FIXTURES, assert_state_dicts_equal, fixture_names, manifest, reference

import zeroio
from zeroio.errors import CheckpointClosedError, TensorNotFoundError

ALL = fixture_names()
WITH_DS_REFERENCE = [n for n in ALL if reference(n) is not None]


def test_fixture_matrix_is_present():
    """The committed fixtures cover ZeRO-3 at world sizes 1-4, ZeRO-1/2, and fp32/fp16/bf16."""
    stage3_sizes = {manifest(n)["world_size"] for n in fixture_names(stage=3)}
    assert {1, 2, 3, 4} <= stage3_sizes
    assert fixture_names(stage=1) and fixture_names(stage=2)
    assert {manifest(n)["dtype"] for n in ALL} >= {"fp32", "fp16", "bf16"}


@pytest.mark.parametrize("name", WITH_DS_REFERENCE)
def test_state_dict_equals_deepspeed_consolidation(name):
    """For every key DeepSpeed's zero_to_fp32 returns, zeroio returns the same dtype and bits."""
    expected = reference(name)
    with zeroio.open(FIXTURES / name) as ckpt:
        actual = ckpt.state_dict()
    assert_state_dicts_equal({k: actual[k] for k in expected}, expected)
    dropped = sorted(set(actual) - set(expected))
    if manifest(name)["stage"] == 1:
        # DeepSpeed 0.19.8's tool drops ZeRO-1 frozen parameters; zeroio keeps them (see test_deepspeed_gaps).
        assert dropped == ["frozen.bias", "frozen.weight"]
    else:
        assert dropped == []


@pytest.mark.parametrize("name", ALL)
def test_state_dict_equals_live_engine(name):
    """zeroio's consolidation equals the trained engine's own tensors, in model.state_dict() order."""
    expected = reference(name, "engine")
    with zeroio.open(FIXTURES / name) as ckpt:
        actual = ckpt.state_dict()
    assert list(actual) == list(expected)
    assert_state_dicts_equal(actual, expected)


@pytest.mark.parametrize("name", ALL)
def test_tied_weights_share_one_tensor(name):
    """DeepSpeed's shared_params map is reproduced and tied names share one tensor object."""
    with zeroio.open(FIXTURES / name) as ckpt:
        assert ckpt.tied == {"head.weight": "emb.weight"}
        sd = ckpt.state_dict()
        assert ckpt.info("head.weight").tied_to == "emb.weight"
    assert sd["head.weight"] is sd["emb.weight"]


@pytest.mark.parametrize("name", ALL)
def test_metadata_matches_manifest(name):
    """Stage, world size, training dtype, DeepSpeed version, step and tag come from metadata alone."""
    m = manifest(name)
    with zeroio.open(FIXTURES / name) as ckpt:
        meta = ckpt.metadata
    assert meta.format == "zero"
    assert meta.zero_stage == m["stage"]
    assert meta.world_size == m["world_size"]
    assert meta.train_dtype == {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[m["dtype"]]
    assert meta.ds_version == m["deepspeed"]
    assert meta.tag == m["tags"][-1]
    assert meta.global_step == int(m["tags"][-1].removeprefix("global_step"))


@pytest.mark.parametrize("name", ALL)
def test_infos_describe_every_tensor_without_reading(name):
    """info() gives shape, dtype, kind and files matching the materialised tensors."""
    with zeroio.open(FIXTURES / name) as ckpt:
        infos = ckpt.infos
        sd = ckpt.state_dict()
    for key, info in infos.items():
        assert info.shape == tuple(sd[key].shape)
        assert info.dtype == sd[key].dtype
        assert info.nbytes == sd[key].numel() * sd[key].element_size()
        assert info.files and all(f.exists() for f in info.files)
    assert infos["calls"].kind == "buffer" and infos["frozen.weight"].kind == "frozen"
    assert infos["emb.weight"].kind == "trainable"


def test_frozen_params_keep_training_dtype_and_trainable_are_fp32():
    """Mixed dtypes are visible: frozen params come back in bf16, trainable ones in fp32 master precision."""
    with zeroio.open(FIXTURES / "z3_ws2_bf16") as ckpt:
        assert ckpt.info("frozen.weight").dtype == torch.bfloat16
        assert ckpt.info("emb.weight").dtype == torch.float32
        assert ckpt.state_dict(dtype="bf16")["emb.weight"].dtype == torch.bfloat16
        assert ckpt.state_dict(dtype="bf16")["calls"].dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_casts_floating_tensors_like_torch(dtype):
    """state_dict(dtype=...) equals the reference cast with torch's own .to(dtype); integers untouched."""
    expected = reference("z3_ws3_fp32")
    with zeroio.open(FIXTURES / "z3_ws3_fp32") as ckpt:
        actual = ckpt.state_dict(dtype=dtype)
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in expected.items()}
    assert_state_dicts_equal(actual, cast)


@pytest.mark.parametrize("name", ["z3_ws3_fp32", "z2_ws3_fp16", "z1_ws3_bf16"])
@pytest.mark.parametrize("chunk_bytes", [4, 12, 1 << 20])
def test_iter_chunks_concatenate_to_the_tensor(name, chunk_bytes):
    """Streaming a tensor in chunks of any size yields exactly its flattened elements."""
    with zeroio.open(FIXTURES / name) as ckpt:
        for key in ckpt:
            chunks = list(ckpt.iter_chunks(key, chunk_bytes=chunk_bytes))
            assert all(c.numel() * c.element_size() <= max(chunk_bytes, c.element_size()) for c in chunks)
            flat = torch.cat(chunks) if chunks else torch.empty(0)
            assert torch.equal(flat, ckpt[key].reshape(-1))


def test_selects_tag_from_latest_and_explicitly():
    """Without a tag the one in `latest` is read; tag= selects another; both differ after a training step."""
    root = FIXTURES / "z3_ws2_fp32"
    assert (root / "latest").read_text().strip() == "global_step2"
    with zeroio.open(root) as latest, zeroio.open(root, tag="global_step1") as first:
        assert latest.metadata.tag == "global_step2" and first.metadata.global_step == 1
        assert not torch.equal(latest["emb.weight"], first["emb.weight"])


def test_opens_tag_folder_and_rank_file_directly():
    """A tag folder or any rank file resolves to the same checkpoint as the root."""
    root = FIXTURES / "z3_ws2_fp32"
    rank_file = root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with zeroio.open(root) as a, zeroio.open(root / "global_step2") as b, zeroio.open(rank_file) as c:
        for key in a:
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])


def test_keys_follow_model_state_dict_order():
    """keys() lists buffers, frozen, trainable params and tied aliases in model.state_dict() order."""
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as ckpt:
        assert list(ckpt) == list(reference("z3_ws2_fp32", "engine"))
        assert len(ckpt) == 11 and "scale" in ckpt and "scratch" not in ckpt  # non-persistent buffer excluded


def test_get_tensor_returns_owned_tensor_usable_after_close():
    """Tensors from get_tensor() stay valid after the checkpoint is closed."""
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as ckpt:
        weight = ckpt.get_tensor("emb.weight")
    expected = reference("z3_ws2_fp32")["emb.weight"]
    assert torch.equal(weight, expected) and weight.is_contiguous()
    before = weight.clone()
    weight.add_(1)  # writable, owned memory
    assert torch.equal(weight, before + 1)


def test_use_after_close_raises():
    """Reading after close raises CheckpointClosedError with a message that says what to do."""
    ckpt = zeroio.open(FIXTURES / "z3_ws2_fp32")
    ckpt.close()
    ckpt.close()  # idempotent
    with pytest.raises(CheckpointClosedError) as excinfo:
        ckpt["emb.weight"]
    assert str(excinfo.value) == (
        "Cannot read 'emb.weight': the checkpoint has been closed. Read tensors inside the `with zeroio.open(...)` "
        "block, or keep the tensors returned by get_tensor()."
    )
    with pytest.raises(CheckpointClosedError), ckpt:
        pass


def test_no_file_descriptors_left_open():
    """Every rank file opened for reading is closed when the `with` block ends."""
    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        pytest.skip("needs /proc")
    tag_dir = str(FIXTURES / "z3_ws4_fp32" / "global_step2")

    def open_rank_files():
        found = []
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith(tag_dir):
                found.append(target)
        return found

    with zeroio.open(FIXTURES / "z3_ws4_fp32") as ckpt:
        ckpt.state_dict()
        assert len(open_rank_files()) == 8  # each of the 8 files opened once, lazily
    assert open_rank_files() == []


def test_unknown_tensor_name_suggests_close_matches():
    """A missing key raises TensorNotFoundError (a KeyError) naming close matches."""
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as ckpt, pytest.raises(TensorNotFoundError) as excinfo:
        ckpt["emb.weights"]
    assert isinstance(excinfo.value, KeyError)
    assert str(excinfo.value) == (
        f"No tensor named 'emb.weights' in '{FIXTURES / 'z3_ws2_fp32' / 'global_step2'}' (11 tensors). "
        "Did you mean 'emb.weight'?"
    )


def test_open_reads_only_metadata():
    """Opening parses the pickles but reads no tensor data: the Adam moments are never touched."""
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as ckpt:
        files = ckpt._files  # the rank files; none has had a storage's data offset resolved yet
        assert files and all(not f.read_offsets for f in files)
        ckpt["norm.bias"]
        touched = {key for f in files for key in f.read_offsets}
    # norm.bias lives in the second fp32 flat group of each optim file: exactly one storage per rank file read.
    assert 1 <= len(touched) <= 2


def test_pieces_explain_where_bytes_live():
    """pieces() lists, per rank, the file and element range a ZeRO-3 parameter is read from (padding skipped)."""
    with zeroio.open(FIXTURES / "z3_ws4_fp32") as ckpt:
        rows = ckpt.pieces("emb.weight")  # 91 elements over 4 ranks: 23, 23, 23, 22 (+1 padding)
    assert [r[0].name for r in rows] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]
    assert [(r[1], r[2], r[3]) for r in rows] == [(0, 23, 0), (0, 23, 23), (0, 23, 46), (0, 22, 69)]
