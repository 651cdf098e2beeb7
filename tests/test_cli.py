"""The command line: exact output and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fixture_data import FIXTURES, ROOT

from zeroio.cli import main


def test_inspect_table(capsys):
    """`zeroio inspect` prints metadata, one row per tensor with its source, and totals."""
    assert main(["inspect", str(FIXTURES / "z3_ws2_bf16")]) == 0
    out = capsys.readouterr().out
    tag_dir = FIXTURES / "z3_ws2_bf16" / "global_step2"
    assert out.splitlines()[:9] == [
        f"checkpoint  {tag_dir}",
        "format      zero",
        "tag         global_step2",
        "zero stage  3",
        "world size  2",
        "train dtype bf16",
        "deepspeed   0.19.8",
        "global step 2",
        "fp32 master yes",
    ]
    assert "frozen.weight   (7, 7)   bf16         98 B  frozen     zero_pp_rank_0_mp_rank_00_model_states.pt, " in out
    assert "head.weight     (13, 7)  fp32        364 B  trainable  tied to emb.weight" in out
    assert out.splitlines()[-1] == "11 tensors (1 tied), 244 elements, 868 B"


def test_inspect_json(capsys):
    """`zeroio inspect --json` prints machine-readable metadata and tensors."""
    assert main(["inspect", "--json", str(FIXTURES / "z2_ws3_fp16")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["metadata"]["zero_stage"] == 2 and data["metadata"]["world_size"] == 3
    assert data["metadata"]["train_dtype"] == "fp16"
    assert data["tied"] == {"head.weight": "emb.weight"}
    rows = {r["name"]: r for r in data["tensors"]}
    assert rows["frozen.weight"]["dtype"] == "fp16" and rows["frozen.weight"]["kind"] == "frozen"
    assert rows["emb.weight"]["dtype"] == "fp32" and rows["emb.weight"]["kind"] == "trainable"


def test_error_is_one_line_and_exit_1(capsys, tmp_path):
    """A zeroio error prints one line plus the debug hint on stderr and exits 1."""
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"Error: Checkpoint path '{tmp_path / 'missing'}' does not exist.\n"
        "(set ZEROIO_DEBUG=1 for the full traceback)\n"
    )


def test_usage_error_exits_2():
    """Bad flags exit 2 (argparse's usage error)."""
    with pytest.raises(SystemExit) as excinfo:
        main(["inspect"])
    assert excinfo.value.code == 2


def test_python_dash_m_and_console_script():
    """`python -m zeroio` runs the same CLI as the `zeroio` console script."""
    proc = subprocess.run(
        [sys.executable, "-m", "zeroio", "--version"], check=False, capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.startswith("zeroio ")


def test_push_refuses_pr_with_revision(capsys):
    """`zeroio push --create-pr --revision X` is a usage error (exit 2) before any network call."""
    with pytest.raises(SystemExit) as excinfo:
        main(["push", str(FIXTURES / "z3_ws2_fp32"), "me/model", "--create-pr", "--revision", "dev"])
    assert excinfo.value.code == 2
    assert "--create-pr opens a pull request against the main branch" in capsys.readouterr().err


def test_invalid_flag_combination_is_a_usage_error(capsys, tmp_path):
    """A flag combination the library rejects prints one line and exits 2, without a traceback."""
    code = main(
        [
            "convert",
            str(FIXTURES / "z3_ws2_fp32"),
            str(tmp_path / "m.ckpt"),
            "--format",
            "lightning",
            "--exclude-frozen",
            "--quiet",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("Invalid arguments: ") and len(err) == 2


def test_convert_include_optimizer_flag(tmp_path):
    """`zeroio convert --include-optimizer` writes the consolidated moments beside the weights."""
    dst = tmp_path / "out"
    assert main(["convert", str(FIXTURES / "z3_ws2_fp32"), str(dst), "--include-optimizer", "--quiet"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors", "optimizer.json", "optimizer.safetensors"]
