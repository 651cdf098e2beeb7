"""The benchmark harness (benchmarks/run.py) runs end to end on a tiny real checkpoint, so it cannot rot."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "z3_ws2_fp32"


def _load_run_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("zeroio_bench_run", REPO / "benchmarks" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_fp32_ranges_are_deepspeeds_master_weights() -> None:
    """The disk-limit baseline reads exactly the bytes of DeepSpeed's fp32 master-weight partitions."""
    pytest.importorskip("deepspeed")  # the optimizer pickles reference DeepSpeed classes
    bench = _load_run_module()
    tag = FIXTURE / (FIXTURE / "latest").read_text().strip()
    ranges = bench.fp32_ranges(FIXTURE)
    expected = []
    for path in sorted(tag.glob("*optim_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        expected += [(path, g) for g in state["optimizer_state_dict"]["fp32_flat_groups"]]
    assert [r[0] for r in ranges] == [p for p, _ in expected]
    for (path, start, count), (_, group) in zip(ranges, expected):
        with open(path, "rb") as fh:
            fh.seek(start)
            data = bytearray(fh.read(count))
        assert torch.equal(torch.frombuffer(data, dtype=torch.float32), group.reshape(-1))


def test_parse_bytes_table() -> None:
    """--memory-cap sizes accept binary and decimal units."""
    bench = _load_run_module()
    assert [bench.parse_bytes(t) for t in ("256MiB", "1GB", "64M", "1048576", "1.5GiB")] == [
        256 * 2**20,
        10**9,
        64 * 10**6,
        2**20,
        3 * 2**29,
    ]


def test_harness_end_to_end(tmp_path: Path) -> None:
    """run.py times zeroio, zero_to_fp32 (.bin, safetensors) and the disk limits on a checkpoint; writes JSON, table, PNG."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "run.py"),
        "--checkpoint",
        str(FIXTURE),
        "--repeats",
        "1",
        "--cache",
        "warm",
        "--inspect-repeats",
        "1",
        "--methods",
        "zeroio",
        "ds_bin",
        "ds_safe",
        "limit",
        "limit_kernel",
        "--work",
        str(tmp_path / "work"),
        "--json",
        str(out / "results.json"),
        "--markdown",
        str(out / "table.md"),
        "--plot",
        str(out / "plot.png"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "results.json").read_text())
    (summary,) = result["checkpoints"]
    rows = summary["results"]["warm"]
    assert summary["tied"] is True and summary["fp32_bytes"] > 0
    for method in ("zeroio", "ds_bin", "limit", "limit_kernel"):
        assert rows[method]["ok"] is True, rows[method]
        assert rows[method]["seconds"]["n"] == 1
    # zeroio writes one safetensors file; the dd baseline copies exactly the fp32 master bytes.
    assert rows["limit"]["output_bytes"] == rows["limit_kernel"]["output_bytes"] == summary["fp32_bytes"]
    assert rows["zeroio"]["output_bytes"] > 0 and rows["zeroio"]["peak_anon_bytes"]["median"] > 0
    # DeepSpeed's --safe_serialization cannot write tied weights: recorded as a failure, not a crash.
    assert rows["ds_safe"]["ok"] is False
    assert "share memory" in rows["ds_safe"]["error"] or "shared" in rows["ds_safe"]["error"], rows["ds_safe"]
    assert set(summary["ratios"]["warm"]["zeroio"]) >= {
        "time_vs_ds_bin",
        "anon_vs_ds_bin",
        "throughput_vs_limit",
        "throughput_vs_kernel_copy",
    }
    assert result["open_inspect"]["warm"]["open_describe"]["n"] == 1
    assert (out / "table.md").read_text().startswith("| model | cache | method |")
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Outputs are cleaned up after every run.
    assert not any((tmp_path / "work" / "out").iterdir())
