"""`zeroio convert` and `zeroio verify` on the command line: exact output and exit codes."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest
from fixture_data import FIXTURES, ROOT
from safetensors import safe_open

from zeroio.cli import main

SRC = FIXTURES / "z3_ws2_fp32"
HINT = "(set ZEROIO_DEBUG=1 for the full traceback)\n"


def test_convert_prints_one_summary_line(tmp_path, capsys):
    """`zeroio convert SRC DST` writes model.safetensors and prints what it wrote; no bar off a terminal."""
    dst = tmp_path / "out"
    assert main(["convert", str(SRC), str(dst)]) == 0
    assert capsys.readouterr() == (f"Wrote 11 tensors (1 tied, 980 B) in 1 file(s) to {dst}\n", "")
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]


def test_convert_quiet_prints_nothing(tmp_path, capsys):
    """--quiet silences both the progress bar and the summary."""
    assert main(["convert", str(SRC), str(tmp_path / "out"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")


def test_convert_flags(tmp_path, capsys):
    """--format, --dtype, --max-shard-size, --tag, --exclude-frozen and --workers reach the converter."""
    dst = tmp_path / "out"
    argv = ["convert", str(SRC), str(dst), "--format", "torch", "--dtype", "bf16", "--max-shard-size", "0.3KB",
            "--tag", "global_step1", "--exclude-frozen", "--workers", "2"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out == f"Wrote 9 tensors (1 tied, 382 B) in 2 file(s) to {dst}\n"
    assert sorted(p.name for p in dst.iterdir()) == [
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    index = json.loads((dst / "pytorch_model.bin.index.json").read_text())
    assert index["metadata"] == {"total_size": 382}
    assert "frozen.weight" not in index["weight_map"]


def test_convert_sharded_safetensors(tmp_path, capsys):
    """A small --max-shard-size gives HF-named shards plus the index."""
    dst = tmp_path / "out"
    assert main(["convert", str(SRC), str(dst), "--max-shard-size", "300"]) == 0
    assert capsys.readouterr().out == f"Wrote 11 tensors (1 tied, 980 B) in 4 file(s) to {dst}\n"
    assert sorted(p.name for p in dst.iterdir()) == [
        "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
        "model-00004-of-00004.safetensors",
        "model.safetensors.index.json",
    ]
    with safe_open(dst / "model-00004-of-00004.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_convert_refuses_existing_destination(tmp_path, capsys):
    """An existing destination is an output error: one line, exit 1; --overwrite replaces it."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"an earlier output")  # an empty folder is a fine destination
    assert main(["convert", str(SRC), str(dst)]) == 1
    assert capsys.readouterr() == (
        "",
        (
            f"Output error: Output folder '{dst}' already exists. Pass --overwrite to replace it, "
            f"or choose another destination.\n{HINT}"
        ),
    )
    assert main(["convert", str(SRC), str(dst), "--overwrite", "--quiet"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]


def test_convert_missing_source(tmp_path, capsys):
    """A missing source is a zeroio error: one line, exit 1, nothing created."""
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 1
    assert capsys.readouterr() == ("", f"Error: Checkpoint path '{tmp_path / 'nope'}' does not exist.\n{HINT}")
    assert list(tmp_path.iterdir()) == []


def test_convert_bad_shard_size_is_a_usage_error(tmp_path, capsys):
    """An unparseable --max-shard-size exits 2 with argparse's usage message."""
    with pytest.raises(SystemExit) as excinfo:
        main(["convert", str(SRC), str(tmp_path / "out"), "--max-shard-size", "5XB"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "zeroio convert: error: argument --max-shard-size: cannot read '5XB' as a size: use a number with a unit, "
        "e.g. 5GB, 500MB (decimal), 2GiB (binary), 200B, or a byte count"
    )


def _big_sparse_safetensors(path, numel: int) -> None:
    """A valid safetensors file with one fp32 tensor of ``numel`` zeros, sparse on disk (cheap to make)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [numel], "data_offsets": [0, numel * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + numel * 4)


def test_ctrl_c_exits_130_and_leaves_nothing(tmp_path, ctrl_c_raises):
    """SIGINT during `zeroio convert` removes the partial output, says so on stderr, and exits 130."""
    src = tmp_path / "big.safetensors"
    _big_sparse_safetensors(src, 96 * 1024 * 1024)  # 384 MB to write: long enough to interrupt
    dst = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeroio", "convert", str(src), str(dst), "--quiet", "--workers", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(".zeroio-tmp-" in p.name for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "conversion ended before it was interrupted"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert out == ""
    assert err == (
        f"Output error: Cannot write '{dst}': interrupted (KeyboardInterrupt). Removed the partial output. "
        "Run the conversion again.\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


# --------------------------------------------------------------------------- verify


def test_verify_equal_exits_0(tmp_path, capsys):
    """`zeroio verify` prints one OK line and exits 0 when every tensor matches."""
    assert main(["convert", str(SRC), str(tmp_path / "out"), "--quiet", "--max-shard-size", "300"]) == 0
    assert main(["verify", str(SRC), str(tmp_path / "out")]) == 0
    assert capsys.readouterr() == (f"OK: all 11 tensors of '{SRC}' and '{tmp_path / 'out'}' are identical.\n", "")


def test_verify_single_flipped_element_exits_1(tmp_path, capsys):
    """One flipped bit in one element: exit 1 and the mismatch printed."""
    out = tmp_path / "out"
    assert main(["convert", str(SRC), str(out), "--quiet"]) == 0
    data = bytearray((out / "model.safetensors").read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin = json.loads(data[8 : 8 + length])["norm.bias"]["data_offsets"][0]
    data[8 + length + begin + 4 * 6 + 3] ^= 0x80  # the sign bit of norm.bias[6]
    (out / "model.safetensors").write_bytes(bytes(data))
    assert main(["verify", str(SRC), str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()
    assert lines[0] == f"MISMATCH: 1 of 11 tensors differ between '{SRC}' (A) and '{out}' (B):"
    a, b = lines[1].rsplit(": ", 1)[1].replace(" (A)", "").replace(" (B)", "").split(" vs ")
    assert lines[1] == f"  norm.bias: 1 of 7 elements differ; first at [6]: {a} (A) vs {b} (B)"
    assert float(a) == -float(b) != 0
    assert len(lines) == 2


def test_verify_dtype_and_max_report(tmp_path, capsys):
    """--dtype casts A before comparing; --tag picks A's tag; --max-report limits the listing."""
    assert main(["convert", str(SRC), str(tmp_path / "bf16"), "--dtype", "bf16", "--quiet"]) == 0
    assert main(["verify", str(SRC), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert capsys.readouterr().out == (
        f"OK: all 11 tensors of '{SRC}' and '{tmp_path / 'bf16'}' are equal after casting A to bf16.\n"
    )
    assert main(["verify", str(SRC), str(SRC), "--tag", "global_step1", "--max-report", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"MISMATCH: 7 of 11 tensors differ between '{SRC}' (A) and '{SRC}' (B):",
        "  calls: 1 of 1 elements differ; first at []: 1 (A) vs 2 (B)",
        "  ... and 6 more",
    ]


def test_verify_missing_checkpoint_exits_1(tmp_path, capsys):
    """A missing B is a zeroio error: one line on stderr, exit 1."""
    assert main(["verify", str(SRC), str(tmp_path / "nope")]) == 1
    assert capsys.readouterr() == ("", f"Error: Checkpoint path '{tmp_path / 'nope'}' does not exist.\n{HINT}")
