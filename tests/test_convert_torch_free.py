"""``zeroio convert`` without torch (issue 17): bytes copied as stored, fp32/bf16/fp16 casts done with numpy.

Every fixture family (``fixtures/*/manifest.json``, the framework checkpoints, ``fixtures/layouts/*``) is converted
by the ``zeroio convert`` command as stored, to bf16 (sharded, as the golden case) and to fp16, in interpreters
whose import system refuses torch, safetensors, huggingface_hub and tqdm (``tests/torch_free_worker.py``: one
interpreter for every case). The outputs must be byte-identical to torch's: the golden hashes recorded before this
path existed (``tests/golden/outputs.json``) and a run where numpy is refused, so every cast is torch's own.
Tensor-parallel checkpoints whose tensors are merged along a dimension other than 0 still need torch, and say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
GOLDEN = json.loads((Path(__file__).resolve().parent / "golden" / "outputs.json").read_text())
HEAVY = "torch,safetensors,huggingface_hub,tqdm"


def _sources() -> dict[str, tuple[Path, list[str]]]:
    """Source id -> (path, extra convert arguments): the golden test's sources, then every layout fixture."""
    found = {p.parent.name: (p.parent, []) for p in sorted(FIXTURES.glob("*/manifest.json"))}
    frameworks = FIXTURES / "frameworks"
    found["frameworks/hf_trainer"] = (frameworks / "hf_trainer_gpt2_z3" / "checkpoint-3", [])
    for name in ("lightning_z3_fp32", "lightning_z3_bf16"):
        found[f"frameworks/{name}"] = (frameworks / name / "model.ckpt", [])
    for layout in sorted(p for p in (FIXTURES / "layouts").iterdir() if (p / "latest").is_file()):
        found[f"layouts/{layout.name}"] = (layout, ["--tp-rules", "megatron"] if "_tp_" in layout.name else [])
    return found


SOURCES = _sources()
CASTS = {"": [], "bf16": ["--dtype", "bf16", "--max-shard-size", "300"], "fp16": ["--dtype", "fp16"]}
GOLDEN_CASE = {"": "safetensors", "bf16": "safetensors-bf16-sharded"}  # the same arguments as those golden cases

NEEDS_TORCH = {
    "layouts/autotp_z1_ws2_tp2_bf16",
    "layouts/autotp_z1_ws4_dp2_tp2_fp32",
    "layouts/pipe_tp_z1_ws4_pp2tp2_fp32",
}
"""Tensor-parallel checkpoints: their column-split tensors are concatenated along dim 1, which is no byte run."""


def _cases(casts: list[str]) -> dict[str, list[str]]:
    return {
        f"{key}:{cast}": ["convert", str(path), "--quiet", *extra, *CASTS[cast]]
        for key, (path, extra) in SOURCES.items()
        for cast in casts
    }


def _run(refused: str, cases: dict[str, list[str]], out: Path, **env: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "torch_free_worker.py"), refused, str(out), json.dumps(cases)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return report


@pytest.fixture(scope="module")
def torch_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every source x (as stored, bf16, fp16), torch refused; copy_file_range on (the default)."""
    return _run(HEAVY, _cases(list(CASTS)), tmp_path_factory.mktemp("torch-free"))


@pytest.fixture(scope="module")
def torch_free_streamed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every source as stored, torch refused, copy_file_range off: bytes go through memory (pread + pwrite)."""
    out = tmp_path_factory.mktemp("torch-free-streamed")
    return _run(HEAVY, _cases([""]), out, ZEROIO_NO_COPY_FILE_RANGE="1")


@pytest.fixture(scope="module")
def numpy_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The cast cases with numpy refused: every cast is torch's, as before numpy casts existed."""
    return _run("numpy", _cases(["bf16", "fp16"]), tmp_path_factory.mktemp("numpy-free"))


def _outcome(report: dict[str, object], case: str) -> dict[str, object]:
    cases = report["cases"]
    assert isinstance(cases, dict)
    found = cases[case]
    assert isinstance(found, dict)
    return found


def test_convert_runs_without_torch_on_every_fixture(torch_free, torch_free_streamed):
    """Each case converts without asking for torch (or safetensors, huggingface_hub, tqdm), kernel copy on or
    off; only the tensor-parallel merges ask for torch, and fail loudly when it is refused."""
    needed = set()
    for report in (torch_free, torch_free_streamed):
        assert report["loaded"] == []
        for case in report["cases"]:
            outcome = _outcome(report, case)
            source = case.rsplit(":", 1)[0]
            if outcome["asked"]:
                needed.add(source)
                assert outcome["code"] != 0 and "torch refused" in outcome["stderr"], (case, outcome)
                assert {name.split(".")[0] for name in outcome["asked"]} == {"torch"}, (case, outcome)
            else:
                assert outcome["code"] == 0 and outcome["files"], (case, outcome)
    assert needed == NEEDS_TORCH
    assert len(SOURCES) - len(NEEDS_TORCH) >= 38  # every family: 22 golden sources and 16 layouts


def test_outputs_equal_the_golden_torch_outputs(torch_free, torch_free_streamed):
    """As stored and bf16: the very bytes torch's path wrote when the golden hashes were recorded."""
    compared = 0
    for source in GOLDEN:
        for cast, golden_case in GOLDEN_CASE.items():
            assert _outcome(torch_free, f"{source}:{cast}")["files"] == GOLDEN[source][golden_case], (source, cast)
            compared += 1
        assert _outcome(torch_free_streamed, f"{source}:")["files"] == GOLDEN[source]["safetensors"], source
    assert compared == 2 * 22


def test_numpy_casts_equal_torch_casts_on_every_fixture(torch_free, numpy_free):
    """bf16 and fp16 outputs of every source, cast with numpy, are byte-identical to torch's casts."""
    assert "numpy" in numpy_free["asked"]  # the reference run really had no numpy
    for case in numpy_free["cases"]:
        reference = _outcome(numpy_free, case)
        assert reference["code"] == 0 and reference["files"], (case, reference)
        if case.rsplit(":", 1)[0] not in NEEDS_TORCH:
            assert _outcome(torch_free, case)["files"] == reference["files"], case


def test_the_layout_fixtures_as_stored_agree_with_and_without_kernel_copy(torch_free, torch_free_streamed):
    """Layouts (no golden hashes): copy_file_range and pread + pwrite write the same bytes."""
    for source in SOURCES:
        if source.startswith("layouts/") and source not in NEEDS_TORCH:
            assert _outcome(torch_free, f"{source}:")["files"] == _outcome(torch_free_streamed, f"{source}:")["files"]
