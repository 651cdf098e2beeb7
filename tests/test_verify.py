"""zeroio verify: every tensor compared bit for bit across checkpoint kinds; every difference reported."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from fixture_data import FIXTURES, reference
from safetensors.torch import save_file

import zeroio
from zeroio import Mismatch, VerifyReport, convert, verify

SRC = FIXTURES / "z3_ws2_fp32"


def test_identical_checkpoints(tmp_path):
    """A checkpoint verifies against itself; the summary is one line."""
    report = verify(SRC, SRC)
    assert report.ok and report.mismatches == () and report.num_tensors == 11
    assert report.summary() == f"OK: all 11 tensors of '{SRC}' and '{SRC}' are identical."


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="one-file"),
        pytest.param({"max_shard_size": 1}, id="sharded"),
        pytest.param({"fmt": "torch", "max_shard_size": 300}, id="torch"),
    ],
)
@pytest.mark.parametrize("name", ["z3_ws3_bf16", "z2_ws3_fp16", "z1_ws2_fp32"])
def test_converted_output_verifies_against_its_source(tmp_path, name, kwargs):
    """A converted folder (safetensors, sharded, torch) equals its DeepSpeed source, tied alias included."""
    convert(FIXTURES / name, tmp_path / "out", progress=False, **kwargs)
    report = verify(FIXTURES / name, tmp_path / "out")
    assert report.ok, report.summary()
    assert report.num_tensors == 11


def test_deepspeed_consolidation_file_verifies(tmp_path):
    """DeepSpeed's own zero_to_fp32 output (a torch file) verifies against the checkpoint it came from."""
    report = verify(FIXTURES / "z3_ws4_fp32", FIXTURES / "z3_ws4_fp32" / "expected" / "zero_to_fp32.pt")
    assert report.ok, report.summary()


def test_deepspeed_dropping_zero1_frozen_params_is_reported(tmp_path):
    """Against DeepSpeed's ZeRO-1 consolidation, the frozen parameters it drops are reported missing."""
    b = FIXTURES / "z1_ws3_bf16" / "expected" / "zero_to_fp32.pt"
    report = verify(FIXTURES / "z1_ws3_bf16", b)
    assert not report.ok
    assert report.mismatches == (
        Mismatch("frozen.weight", "missing", "missing in B"),
        Mismatch("frozen.bias", "missing", "missing in B"),
    )
    assert report.summary() == (
        f"MISMATCH: 2 of 11 tensors differ between '{FIXTURES / 'z1_ws3_bf16'}' (A) and '{b}' (B):\n"
        "  frozen.weight: missing in B\n"
        "  frozen.bias: missing in B"
    )


def _flip(path, name: str, flat_index: int) -> None:
    """Flip the lowest bit of one element of ``name`` in a safetensors file, in place."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    entry = json.loads(data[8 : 8 + length])[name]
    itemsize = {"F32": 4, "BF16": 2, "F16": 2}[entry["dtype"]]
    data[8 + length + entry["data_offsets"][0] + flat_index * itemsize] ^= 1
    path.write_bytes(bytes(data))


def test_single_flipped_element_is_found(tmp_path):
    """One element with one flipped bit is reported with its index and both values."""
    convert(SRC, tmp_path / "out", progress=False)
    _flip(tmp_path / "out" / "model.safetensors", "mlp_in.weight", 2 * 7 + 3)
    report = verify(SRC, tmp_path / "out")
    a = reference("z3_ws2_fp32")["mlp_in.weight"][2, 3]
    b = (a.reshape(1).view(torch.int32) ^ 1).view(torch.float32)[0]
    assert report.mismatches == (
        Mismatch(
            "mlp_in.weight",
            "values",
            f"1 of 35 elements differ; first at [2, 3]: {a.item()!r} (A) vs {b.item()!r} (B)",
            num_different=1,
            first_index=(2, 3),
        ),
    )
    assert report.summary() == (
        f"MISMATCH: 1 of 11 tensors differ between '{SRC}' (A) and '{tmp_path / 'out'}' (B):\n"
        f"  mlp_in.weight: 1 of 35 elements differ; first at [2, 3]: {a.item()!r} (A) vs {b.item()!r} (B)"
    )


def test_flipped_source_of_a_tie_is_found_once(tmp_path):
    """A difference in a tied source is reported once, under the source's name."""
    convert(SRC, tmp_path / "out", progress=False)
    _flip(tmp_path / "out" / "model.safetensors", "emb.weight", 90)
    report = verify(SRC, tmp_path / "out")
    assert [(m.name, m.kind, m.num_different, m.first_index) for m in report.mismatches] == [
        ("emb.weight", "values", 1, (12, 6))
    ]


def test_untied_copy_of_an_alias_is_compared_by_value(tmp_path):
    """If B stores a tied alias as its own tensor, its values are compared (equal: ok; different: reported)."""
    state = reference("z3_ws2_fp32", "engine")
    untied = {k: v.clone() for k, v in state.items()}
    save_file(untied, tmp_path / "same.safetensors")
    assert verify(SRC, tmp_path / "same.safetensors").ok
    untied["head.weight"][0, 0] += 1
    save_file(untied, tmp_path / "diff.safetensors")
    report = verify(SRC, tmp_path / "diff.safetensors")
    assert [(m.name, m.kind, m.first_index) for m in report.mismatches] == [("head.weight", "values", (0, 0))]


def test_declared_dtype_cast(tmp_path):
    """A bf16 conversion equals its fp32 source after casting A to bf16, and differs in dtype without it."""
    convert(SRC, tmp_path / "bf16", dtype="bf16", progress=False)
    report = verify(SRC, tmp_path / "bf16", dtype="bf16")
    assert report.ok
    assert report.summary() == (
        f"OK: all 11 tensors of '{SRC}' and '{tmp_path / 'bf16'}' are equal after casting A to bf16."
    )
    strict = verify(SRC, tmp_path / "bf16", max_report=2)
    assert [(m.name, m.kind) for m in strict.mismatches] == [
        ("scale", "dtype"),
        ("emb.weight", "dtype"),
        ("frozen.weight", "dtype"),
        ("frozen.bias", "dtype"),
        ("mlp_in.weight", "dtype"),
        ("mlp_in.bias", "dtype"),
        ("mlp_out.weight", "dtype"),
        ("norm.weight", "dtype"),
        ("norm.bias", "dtype"),
    ]
    assert strict.summary() == (
        f"MISMATCH: 9 of 11 tensors differ between '{SRC}' (A) and '{tmp_path / 'bf16'}' (B):\n"
        "  scale: dtype fp32 (A) vs bf16 (B)\n"
        "  emb.weight: dtype fp32 (A) vs bf16 (B)\n"
        "  ... and 7 more"
    )


def test_cast_to_another_dtype_than_b_is_a_dtype_mismatch(tmp_path):
    """Declaring fp16 against a bf16 copy reports the dtype after the cast."""
    convert(SRC, tmp_path / "bf16", dtype="bf16", progress=False)
    report = verify(SRC, tmp_path / "bf16", dtype="fp16", max_report=1)
    assert report.mismatches[0] == Mismatch("scale", "dtype", "dtype fp16 (A after the cast) vs bf16 (B)")


def test_missing_and_extra_keys(tmp_path):
    """Keys only in A are missing, keys only in B are extra; both are mismatches."""
    convert(SRC, tmp_path / "nofrozen", exclude_frozen=True, progress=False)
    forward = verify(SRC, tmp_path / "nofrozen")
    assert [(m.name, m.kind, m.detail) for m in forward.mismatches] == [
        ("frozen.weight", "missing", "missing in B"),
        ("frozen.bias", "missing", "missing in B"),
    ]
    backward = verify(tmp_path / "nofrozen", SRC)
    assert [(m.name, m.kind, m.detail) for m in backward.mismatches] == [
        ("frozen.weight", "extra", "not in A (extra in B)"),
        ("frozen.bias", "extra", "not in A (extra in B)"),
    ]
    assert backward.num_tensors == 11


def test_shape_mismatch(tmp_path):
    """A tensor of another shape is reported with both shapes."""
    state = dict(reference("z3_ws2_fp32", "engine"))
    state["mlp_in.weight"] = state["mlp_in.weight"].t().contiguous()
    state["norm.bias"] = state["norm.bias"][:3].clone()
    state["head.weight"] = state["head.weight"].clone()
    save_file(state, tmp_path / "b.safetensors")
    report = verify(SRC, tmp_path / "b.safetensors")
    assert [(m.name, m.detail) for m in report.mismatches] == [
        ("mlp_in.weight", "shape (5, 7) (A) vs (7, 5) (B)"),
        ("norm.bias", "shape (7,) (A) vs (3,) (B)"),
    ]


def test_other_tag_differs_everywhere_and_summary_truncates(tmp_path):
    """Two training steps apart, every trained tensor differs; the summary lists max_report and counts the rest."""
    report = verify(SRC, SRC, tag="global_step1", max_report=2)
    names = [m.name for m in report.mismatches]
    assert names == [
        "calls",
        "emb.weight",
        "mlp_in.weight",
        "mlp_in.bias",
        "mlp_out.weight",
        "norm.weight",
        "norm.bias",
    ]
    lines = report.summary().splitlines()
    assert lines[0] == f"MISMATCH: 7 of 11 tensors differ between '{SRC}' (A) and '{SRC}' (B):"
    assert lines[1] == "  calls: 1 of 1 elements differ; first at []: 1 (A) vs 2 (B)"
    assert lines[2].startswith("  emb.weight: 91 of 91 elements differ; first at [0, 0]: ")
    assert lines[3:] == ["  ... and 5 more"]


def test_bitwise_semantics(tmp_path):
    """NaNs with the same bits match; 0.0 and -0.0 differ (equality is bit for bit)."""
    save_file({"x": torch.tensor([float("nan"), 0.0, 1.0])}, tmp_path / "a.safetensors")
    save_file({"x": torch.tensor([float("nan"), -0.0, 1.0])}, tmp_path / "b.safetensors")
    assert verify(tmp_path / "a.safetensors", tmp_path / "a.safetensors").ok
    report = verify(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert report.mismatches == (
        Mismatch("x", "values", "1 of 3 elements differ; first at [1]: 0.0 (A) vs -0.0 (B)", 1, (1,)),
    )


def test_chunks_of_different_lengths_are_realigned(tmp_path):
    """Chunk streams cut differently on each side are re-cut into equal pieces covering every element."""
    n = 5_000_003  # over verify's 16 MiB chunks in fp32, under them in bf16: A arrives in 2 chunks, B in 1
    x = torch.arange(n, dtype=torch.float32)
    y = x.bfloat16()
    y[4_194_304] = -1.0  # the first element of A's second chunk
    y[n - 1] = -2.0  # the last element: nothing past the shorter stream's first chunk is skipped
    save_file({"x": x}, tmp_path / "a.safetensors")
    save_file({"x": y}, tmp_path / "b.safetensors")
    with zeroio.open(tmp_path / "a.safetensors") as a, zeroio.open(tmp_path / "b.safetensors") as b:
        cuts_a = [t.numel() for t in a.iter_chunks("x", dtype="bf16", chunk_bytes=16 * 1024 * 1024)]
        cuts_b = [t.numel() for t in b.iter_chunks("x", chunk_bytes=16 * 1024 * 1024)]
    assert cuts_a == [4_194_304, 805_699] and cuts_b == [n]  # the streams really are cut differently
    report = verify(tmp_path / "a.safetensors", tmp_path / "b.safetensors", dtype="bf16")
    assert report.mismatches == (
        Mismatch(
            "x", "values", f"2 of {n} elements differ; first at [4194304]: 4194304.0 (A) vs -1.0 (B)", 2, (4194304,)
        ),
    )


def test_report_is_a_frozen_value():
    """VerifyReport is immutable and `ok` follows from its mismatches."""
    report = VerifyReport(a=SRC, b=SRC, num_tensors=1, mismatches=())
    assert report.ok
    with pytest.raises(AttributeError):
        report.num_tensors = 2


def test_bad_max_report():
    """max_report must be a non-negative int."""
    with pytest.raises(ValueError) as excinfo:
        verify(SRC, SRC, max_report=-1)
    assert str(excinfo.value) == "max_report must be a non-negative int, got -1."


def test_missing_checkpoint_raises_its_error(tmp_path):
    """A path that does not exist raises CheckpointNotFoundError, as zeroio.open does."""
    with pytest.raises(zeroio.errors.CheckpointNotFoundError):
        verify(SRC, tmp_path / "missing")
