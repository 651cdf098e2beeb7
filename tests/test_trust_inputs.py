"""Inputs zeroio must refuse rather than trust: rank files mixed from different saves, a `latest` file that leads
outside the checkpoint, safetensors headers whose tensors share bytes.

Every mixed folder is built from genuine fixture files, copied, duplicated, swapped or taken from another tag.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zeroio
from zeroio import errors

MIXED = "the folder mixes files from different saves; copy the whole tag folder again."


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root)
    return root


def _z3(rank: int, kind: str, prefix: str = "") -> str:
    return f"{prefix if kind == 'optim' else ''}zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _refuse(root: Path, **open_args) -> errors.CheckpointFormatError:
    with pytest.raises(errors.CheckpointFormatError) as excinfo, zeroio.open(root, **open_args) as ckpt:
        ckpt.state_dict()
    exc = excinfo.value
    assert "\n" not in str(exc) and str(exc).endswith(".")
    return exc


def _resave_without_name(path: Path) -> None:
    """Write ``path`` again through a buffer, as checkpoint engines that write file objects do: the archive then
    records no file name (its root folder is torch's default ``archive``), so only the other checks can tell."""
    obj = torch.load(path, weights_only=False, map_location="cpu")
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    path.write_bytes(buffer.getvalue())


# --------------------------------------------------------------------------- ZeRO-3


def test_zero3_rank_from_another_step(tmp_path):
    """Rank 1's files from global_step1 next to rank 0's from global_step2: global_steps disagree."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    for kind in ("model", "optim"):
        shutil.copy(root / "global_step1" / _z3(1, kind), root / "global_step2" / _z3(1, kind))
    exc = _refuse(root)
    assert exc.path == root / "global_step2" / _z3(1, "model") and exc.rank == 1
    assert "global_steps 1" in str(exc) and MIXED in str(exc)


def test_zero3_optim_file_from_another_step(tmp_path):
    """Only rank 1's optimizer file from global_step1: the Adam step counters disagree."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    shutil.copy(root / "global_step1" / _z3(1, "optim"), root / "global_step2" / _z3(1, "optim"))
    exc = _refuse(root)
    assert exc.path == root / "global_step2" / _z3(1, "optim") and exc.rank == 1
    assert "step" in str(exc) and MIXED in str(exc)


def test_zero3_flat_groups_of_another_dtype(tmp_path):
    """Rank 1's fp32 partitions re-saved as bf16 (same element counts): each piece is read at rank 0's element
    size, so this converted with exit 0 and wrong values (bytes past the record's end) before it was refused."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    path = root / "global_step2" / _z3(1, "optim")
    tree = torch.load(path, weights_only=False, map_location="cpu")
    osd = tree["optimizer_state_dict"]
    osd["fp32_flat_groups"] = [t.to(torch.bfloat16) for t in osd["fp32_flat_groups"]]
    torch.save(tree, path)
    exc = _refuse(root)
    assert exc.path == path and exc.rank == 1
    assert "flat group 0 is stored as torch.bfloat16, rank 0's as torch.float32" in str(exc) and MIXED in str(exc)


def test_zero3_frozen_fragment_of_another_dtype(tmp_path):
    """Rank 1's frozen fragments re-saved as fp16 (same element counts): read at rank 0's element size before."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    path = root / "global_step2" / _z3(1, "model")
    tree = torch.load(path, weights_only=False, map_location="cpu")
    tree["frozen_param_fragments"] = {k: v.half() for k, v in tree["frozen_param_fragments"].items()}
    torch.save(tree, path)
    exc = _refuse(root)
    assert exc.path == path and exc.rank == 1 and exc.name == "frozen.weight"
    assert "stored as torch.float16, rank 0's fragment as torch.float32" in str(exc) and MIXED in str(exc)


@pytest.mark.parametrize("kinds", [("model", "optim"), ("optim",), ("model",)])
def test_zero3_rank0_duplicated_as_rank1(tmp_path, kinds):
    """Rank 0's files copied over rank 1's: the archive records the name each file was saved under."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    tag = root / "global_step2"
    for kind in kinds:
        shutil.copy(tag / _z3(0, kind), tag / _z3(1, kind))
    exc = _refuse(root)
    assert exc.path == tag / _z3(1, kinds[0]) and exc.rank == 1
    assert f"saved as '{_z3(0, kinds[0])}'" in str(exc) and MIXED in str(exc)


@pytest.mark.parametrize("kinds", [("model", "optim"), ("optim",)])
@pytest.mark.parametrize("fixture", ["z3_ws2_fp32", "z3_ws4_fp32", "z3_ws3_bf16"])
def test_zero3_ranks_swapped(tmp_path, fixture, kinds):
    """Ranks 0 and 1 swapped (model and optimizer files together, or only the optimizer files)."""
    root = _copy(tmp_path, fixture)
    tag = root / "global_step2"
    prefix = "bf16_" if "bf16" in fixture else ""
    for kind in kinds:
        _swap(tag / _z3(0, kind, prefix), tag / _z3(1, kind, prefix))
    exc = _refuse(root)
    assert exc.path == tag / _z3(0, kinds[0], prefix) and exc.rank == 0
    assert f"saved as '{_z3(1, kinds[0], prefix)}'" in str(exc) and MIXED in str(exc)


def test_zero3_unnamed_archives_duplicate_model_states_of_rank0(tmp_path):
    """Without names in the archives, rank 0's model states duplicated as rank 1 still show: only rank 0's
    model states record the tied parameters (shared_params)."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    tag = root / "global_step2"
    for rank in (0, 1):
        _resave_without_name(tag / _z3(rank, "model"))
    shutil.copy(tag / _z3(0, "model"), tag / _z3(1, "model"))
    exc = _refuse(root)
    assert exc.path == tag / _z3(1, "model") and exc.rank == 1
    assert "shared_params" in str(exc) and MIXED in str(exc)


def test_zero3_unnamed_archives_duplicate_optim_file(tmp_path):
    """Without names in the archives, two optimizer files holding byte-identical partitions are one file twice."""
    root = _copy(tmp_path, "z3_ws3_fp32")
    tag = root / "global_step2"
    for rank in range(3):
        _resave_without_name(tag / _z3(rank, "optim"))
    shutil.copy(tag / _z3(1, "optim"), tag / _z3(2, "optim"))
    exc = _refuse(root)
    assert exc.path == tag / _z3(2, "optim") and exc.rank == 2
    assert "same optimizer partitions" in str(exc) and MIXED in str(exc)


# --------------------------------------------------------------------------- ZeRO-1/2

_ZERO12 = ["z2_ws2_fp32", "z1_ws3_bf16", "z2_ws3_fp16", "z1_ws2_bf16_fp32acc"]


def _prefix(fixture: str) -> str:
    return "bf16_" if "bf16" in fixture else ""


@pytest.mark.parametrize("fixture", _ZERO12)
def test_zero12_optim_file_duplicated(tmp_path, fixture):
    root = _copy(tmp_path, fixture)
    tag = root / "global_step2"
    p = _prefix(fixture)
    shutil.copy(tag / _z3(0, "optim", p), tag / _z3(1, "optim", p))
    exc = _refuse(root)
    assert exc.path == tag / _z3(1, "optim", p) and exc.rank == 1 and MIXED in str(exc)


@pytest.mark.parametrize("fixture", _ZERO12)
def test_zero12_optim_files_swapped(tmp_path, fixture):
    root = _copy(tmp_path, fixture)
    tag = root / "global_step2"
    p = _prefix(fixture)
    _swap(tag / _z3(0, "optim", p), tag / _z3(1, "optim", p))
    exc = _refuse(root)
    assert exc.path == tag / _z3(0, "optim", p) and exc.rank == 0 and MIXED in str(exc)


@pytest.mark.parametrize("fixture", _ZERO12)
def test_zero12_unnamed_archives_swapped(tmp_path, fixture):
    """Without names in the archives, each ZeRO-1/2 rank's param_slice_mappings still say which slice it holds."""
    root = _copy(tmp_path, fixture)
    tag = root / "global_step2"
    p = _prefix(fixture)
    for path in tag.glob("*optim_states.pt"):
        _resave_without_name(path)
    _swap(tag / _z3(0, "optim", p), tag / _z3(1, "optim", p))
    exc = _refuse(root)
    assert exc.path == tag / _z3(0, "optim", p) and exc.rank == 0
    assert "param_slice_mappings" in str(exc) and MIXED in str(exc)


def test_zero12_optim_file_from_another_step(tmp_path):
    """Rank 1's optimizer file one step behind.

    No ZeRO-1/2 fixture has two tags, so rank 1's genuine file is written again with its Adam step counters set
    back to 1 (what DeepSpeed wrote at global_step1); everything else in it is as DeepSpeed saved it.
    """
    root = _copy(tmp_path, "z2_ws2_fp32")
    path = root / "global_step2" / _z3(1, "optim")
    obj = torch.load(path, weights_only=False, map_location="cpu")
    for state in obj["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
        state["step"] = torch.tensor(1.0)
    torch.save(obj, path)
    exc = _refuse(root)
    assert exc.path == path and exc.rank == 1 and "step" in str(exc) and MIXED in str(exc)


def test_mixed_optimizer_file_prefixes(tmp_path):
    """A bf16 run's optimizer file next to an fp32 run's: the bf16_ prefix differs."""
    root = _copy(tmp_path, "z2_ws2_fp32")
    tag = root / "global_step2"
    (tag / _z3(1, "optim")).unlink()
    shutil.copy(FIXTURES / "z2_ws2_bf16" / "global_step2" / _z3(1, "optim", "bf16_"), tag / _z3(1, "optim", "bf16_"))
    exc = _refuse(root)
    assert exc.path == tag / _z3(1, "optim", "bf16_") and exc.rank == 1 and MIXED in str(exc)


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.iterdir() if (p / "latest").is_file()))
def test_genuine_fixtures_still_open(fixture):
    with zeroio.open(FIXTURES / fixture) as ckpt:
        assert len(ckpt.keys()) > 0


def test_both_genuine_tags_open():
    for tag in ("global_step1", "global_step2"):
        with zeroio.open(FIXTURES / "z3_ws2_fp32", tag=tag) as ckpt:
            assert ckpt.metadata.global_step == int(tag[-1])


@settings(max_examples=25, deadline=10000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    choice=st.lists(
        st.tuples(st.sampled_from(["global_step1", "global_step2"]), st.integers(0, 1)), min_size=4, max_size=4
    )
)
def test_any_mix_of_two_saves_is_refused(tmp_path_factory, choice):
    """Each of the 4 rank files of z3_ws2_fp32/global_step2 replaced by any rank's file of either tag: any mix
    raises a ZeroIOError, except the one the files cannot tell (docs/format.md): every model-states file from one
    save and every optimizer file from another, each under its own rank."""
    root = tmp_path_factory.mktemp("mix") / "z3_ws2_fp32"
    shutil.copytree(FIXTURES / "z3_ws2_fp32", root)
    slots = [(0, "model"), (1, "model"), (0, "optim"), (1, "optim")]
    src = FIXTURES / "z3_ws2_fp32"
    for (rank, kind), (tag, src_rank) in zip(slots, choice):
        shutil.copy(src / tag / _z3(src_rank, kind), root / "global_step2" / _z3(rank, kind))
    own_ranks = all(src_rank == rank for (rank, _), (_, src_rank) in zip(slots, choice))
    one_tag_per_kind = choice[0][0] == choice[1][0] and choice[2][0] == choice[3][0]
    if own_ranks and one_tag_per_kind:
        with zeroio.open(root) as ckpt:
            ckpt.state_dict()
    else:
        with pytest.raises(errors.ZeroIOError), zeroio.open(root) as ckpt:
            ckpt.state_dict()


def test_model_states_of_one_save_with_optimizer_files_of_another_are_not_told_apart(tmp_path):
    """The documented limit: nothing ties a ZeRO-3 model-states file to an optimizer file of the same save (the
    Adam step need not equal global_steps, e.g. after loading weights without optimizer state)."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    for rank in (0, 1):
        shutil.copy(root / "global_step1" / _z3(rank, "model"), root / "global_step2" / _z3(rank, "model"))
    with zeroio.open(root) as ckpt:
        assert ckpt.metadata.global_step == 1


# --------------------------------------------------------------------------- `latest` and tag=


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_latest_cannot_leave_the_checkpoint_root(tmp_path, where):
    """`latest` naming an absolute path or ../ would silently open another run: refused, naming the file."""
    root = _copy(tmp_path, "z3_ws2_fp32")
    other = _copy(tmp_path / "other", "z3_ws3_fp32")
    target = other / "global_step2"
    (root / "latest").write_text(str(target) if where == "absolute" else "../other/z3_ws3_fp32/global_step2")
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(root)
    assert excinfo.value.path == root / "latest"
    assert "pass tag=" in str(excinfo.value) and "outside" in str(excinfo.value)
    with zeroio.open(root, tag="global_step1") as ckpt:  # tag= still chooses any folder inside the root
        assert ckpt.metadata.global_step == 1


@pytest.mark.parametrize("tag", ["../other/z3_ws3_fp32/global_step2", "ABSOLUTE"])
def test_tag_cannot_leave_the_checkpoint_root(tmp_path, tag):
    root = _copy(tmp_path, "z3_ws2_fp32")
    other = _copy(tmp_path / "other", "z3_ws3_fp32")
    if tag == "ABSOLUTE":
        tag = str(other / "global_step2")
    with pytest.raises(errors.CheckpointNotFoundError) as excinfo:
        zeroio.open(root, tag=tag)
    assert "outside" in str(excinfo.value)


def test_nested_tag_inside_the_root_opens(tmp_path):
    """tag= may name a folder below the root (DeepSpeed's save_checkpoint(tag=...) joins it as a path)."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z3_ws2_fp32" / "global_step2", root / "runs" / "global_step2")
    with zeroio.open(root, tag="runs/global_step2") as ckpt:
        assert ckpt.metadata.global_step == 2


# --------------------------------------------------------------------------- safetensors


def _converted(tmp_path: Path) -> Path:
    out = tmp_path / "st"
    zeroio.convert(FIXTURES / "z3_ws2_fp32", out)
    return out / "model.safetensors"


def _rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def _tensors(header: dict) -> list[tuple[str, dict]]:
    return sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])


def test_safetensors_overlapping_tensors_are_refused(tmp_path):
    """Two tensors of one shape and dtype pointed at the same bytes: safetensors refuses it, so does zeroio."""
    path = _converted(tmp_path)
    chosen = {}

    def overlap(header):
        by_shape = {}
        for name, spec in _tensors(header):
            key = (spec["dtype"], tuple(spec["shape"]))
            if key in by_shape:
                spec["data_offsets"] = list(header[by_shape[key]]["data_offsets"])
                chosen["name"] = name
                return
            by_shape[key] = name
        raise AssertionError("no two tensors of one shape")

    _rewrite_header(path, overlap)
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(path)
    assert excinfo.value.path == path and chosen["name"] in str(excinfo.value)
    assert "overlap" in str(excinfo.value) or "contiguous" in str(excinfo.value)


def test_safetensors_gap_and_uncovered_tail_are_refused(tmp_path):
    """Data offsets must run back to back from 0 and end exactly at the end of the file."""
    path = _converted(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data + b"\0" * 16)  # trailing bytes no tensor covers
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(path)
    assert "16 bytes" in str(excinfo.value) and excinfo.value.path == path

    path.write_bytes(data)

    def shift_first(header):  # first tensor starts at 8 instead of 0: a gap at the start, the rest shifted
        for _, spec in _tensors(header):
            spec["data_offsets"] = [o + 8 for o in spec["data_offsets"]]

    _rewrite_header(path, shift_first)
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(path)
    assert excinfo.value.path == path and "starts at byte 8" in str(excinfo.value)


def test_safetensors_header_limit_is_the_formats(tmp_path: Path):
    """The reader refuses a header over safetensors' own limit (100,000,000 bytes, as the writer uses), and only
    over it: the claim alone decides, nothing that large is read."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(path)
    assert excinfo.value.path == path and "over the format's limit of 100000000" in str(excinfo.value)
    path.write_bytes(struct.pack("<Q", 100_000_000) + b"{}")
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(path)
    assert "over the format's limit" not in str(excinfo.value)


def test_safetensors_header_over_the_limit_is_refused(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}" + b" " * 64)
    with pytest.raises(errors.CheckpointFormatError) as excinfo:
        zeroio.open(path)
    assert "100000000" in str(excinfo.value)
