"""Conversion under a hard memory limit: fp32 weights of at least 4x the limit still convert, bit for bit."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

CAP = 128 * 2**20
"""The hard limit (cgroup v1 ``memory.limit_in_bytes``, page cache included). A conversion that needs no cast
imports no torch (~50 MiB of anonymous memory in all, docs/benchmarks.md), so the weights-to-cap ratio is kept at
4 with half the checkpoint of the torch-importing days (256 MiB on 1.12 GB): the build is the slowest step of the
suite. DeepSpeed's zero_to_fp32 is OOM-killed under this cap (and at every size benchmarked)."""

PARAMS = "140M"
"""A GPT-like model (tied head, vocab 50304) whose fp32 weights, 555 MB (139M parameters), are >= 4 x CAP (537 MB)."""

pytestmark = pytest.mark.slow  # builds a 139M-parameter checkpoint with DeepSpeed (~35 s, ~6 GB RAM, 2 GB disk)


def _load(name: str, path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


bench = _load("zeroio_bench_run", REPO / "benchmarks" / "run.py")


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ZeRO-3 checkpoint (DeepSpeed, 2 ranks, bf16, AdamW, one step) of 139M parameters."""
    reason = bench.cgroup_available()
    if reason is not None:
        pytest.skip(f"needs a cgroup v1 memory controller, writable as root: {reason}")
    pytest.importorskip("deepspeed")
    if _mem_available() < 7 * 10**9:
        pytest.skip(f"building the checkpoint needs ~7 GB of free RAM, {_mem_available() / 1e9:.1f} GB available")
    root = tmp_path_factory.mktemp("memory-cap")
    if shutil.disk_usage(root).free < 4 * 10**9:
        pytest.skip(f"needs 4 GB of free disk in {root}")
    make = _load("zeroio_bench_make_checkpoint", REPO / "benchmarks" / "make_checkpoint.py")
    path = root / "ckpt"
    make.make_checkpoint(path, params=PARAMS, tied=True, launcher="torchrun")
    yield path
    shutil.rmtree(root, ignore_errors=True)  # gigabytes: free them as soon as the module is done


def _convert_under_cap(src: Path, dst: Path, *extra: str) -> bench.Run:
    group = bench.MemoryCgroup(CAP)
    try:
        cmd = [sys.executable, "-m", "zeroio", "convert", str(src), str(dst), "--quiet", *extra]
        return bench.measure(
            "zeroio", cmd, cache="warm", repeat=0, output=dst, cgroup=group, env=dict(os.environ, PYTHONPATH=str(REPO))
        )
    finally:
        group.remove()


def _assert_equals_deepspeed(src: Path, dst: Path) -> None:
    """Every tensor of DeepSpeed's own consolidation (its lazy API, one tensor at a time) equals the output's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors import safe_open

    (weights,) = sorted(dst.glob("*.safetensors"))
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(src), lazy_mode=True)
    with safe_open(weights, framework="pt") as f:
        stored = set(f.keys())
        aliases = {k: v for k, v in (f.metadata() or {}).items() if k != "format"}
        assert aliases == {"lm_head.weight": "wte.weight"}
        assert stored | set(aliases) == set(lazy)
        for name in list(lazy):
            expected = lazy.pop(name).contiguous()
            got = f.get_tensor(aliases.get(name, name))
            assert got.dtype == expected.dtype == torch.float32, name
            assert torch.equal(got, expected), name


@pytest.mark.parametrize(
    "extra", [pytest.param((), id="default-workers"), pytest.param(("--workers", "1"), id="workers=1")]
)
def test_convert_fits_in_a_quarter_of_the_weights(big_checkpoint: Path, tmp_path: Path, extra: tuple[str, ...]) -> None:
    """`zeroio convert` completes inside a 128 MiB cgroup on 555 MB of fp32 weights, equal to DeepSpeed's output."""
    dst = tmp_path / "out"
    try:
        _check_converted_under_cap(big_checkpoint, dst, extra)
    finally:
        shutil.rmtree(dst, ignore_errors=True)  # 0.55 GB


def _check_converted_under_cap(big_checkpoint: Path, dst: Path, extra: tuple[str, ...]) -> None:
    run = _convert_under_cap(big_checkpoint, dst, *extra)
    assert run.cgroup is not None
    assert run.ok and run.cgroup["oom_kill"] == 0, (run.error, run.cgroup)
    assert run.cgroup["max_usage_bytes"] <= CAP
    assert run.output_bytes >= 4 * CAP
    manifest = json.loads((big_checkpoint / "manifest.json").read_text())
    assert manifest["params"] * 4 >= 4 * CAP
    _assert_equals_deepspeed(big_checkpoint, dst)


def test_zero_to_fp32_is_oom_killed_under_the_same_cap(big_checkpoint: Path, tmp_path: Path) -> None:
    """DeepSpeed's zero_to_fp32.py (0.19.8) holds a whole shard in memory: SIGKILLed by the OOM killer under CAP."""
    group = bench.MemoryCgroup(CAP)
    try:
        script = bench.zero_to_fp32_script(tmp_path)
        run = bench.measure(
            "ds_bin",
            [sys.executable, str(script), str(big_checkpoint), str(tmp_path / "out")],
            cache="warm",
            repeat=0,
            output=tmp_path / "out",
            cgroup=group,
        )
    finally:
        group.remove()
    assert run.cgroup is not None
    assert not run.ok and run.cgroup["oom_kill"] >= 1, (run.error, run.cgroup)
    assert run.error is not None and run.error.startswith("exit -9 (killed by SIGKILL")
