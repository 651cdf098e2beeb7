"""Issue 32, "the first hour, round 2": what a new user met going through the docs in order, each message true."""

from __future__ import annotations

import pytest
import torch
from fixture_data import FIXTURES

import zeroio
from zeroio import errors
from zeroio.cli import main

SRC = FIXTURES / "z3_ws2_fp32"


def test_overwrite_names_earlier_outputs_as_zeroios(tmp_path, capsys):
    """`--overwrite` on a folder holding earlier conversions in subfolders says so, instead of calling them files
    zeroio did not write; other files are still named as such."""
    out = tmp_path / "out"
    for name in ("model", "final"):
        zeroio.convert(SRC, out / name, progress=False)
    assert main(["convert", str(SRC), str(out), "--overwrite", "--quiet"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        f"Output error: Refusing to overwrite '{out}': it holds earlier zeroio outputs in folders of their own "
        f"(final/, model/), and overwrite replaces one output, not a folder of outputs. Give this output a folder of "
        f"its own (e.g. '{out / 'new'}'), or move them away."
    )
    (out / "notes.txt").write_text("mine")
    with pytest.raises(errors.OutputError, match=r"holds files zeroio did not write \(notes.txt\) and earlier zeroio "):
        zeroio.convert(SRC, out, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["final", "model", "notes.txt"]


def test_dcp_summary_counts_each_name_once(tmp_path, capsys):
    """`--format dcp` says 11 tensors (1 tied), as every other format does, not 12."""
    assert main(["convert", str(SRC), str(tmp_path / "step-2"), "--format", "dcp", "--progress", "none"]) == 0
    assert capsys.readouterr().out.startswith("Wrote 11 tensors (1 tied, ")


def test_tag_on_a_tag_folder(tmp_path, capsys):
    """`--tag` on a tag folder: its own name reads it; another names the root to pass and the tags there."""
    assert main(["inspect", str(SRC / "global_step1"), "--tag", "global_step1"]) == 0
    assert "global_step1" in capsys.readouterr().out
    assert main(["inspect", str(SRC / "global_step2"), "--tag", "global_step1"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        f"Error: '{SRC / 'global_step2'}' is itself a tag folder ('global_step2'), so it holds no tag 'global_step1'. "
        f"Pass the checkpoint root '{SRC}' with --tag global_step1 (available there: global_step1, global_step2), "
        "or drop the tag to read this folder."
    )


def test_loading_an_entirely_different_model_says_nothing_matches():
    """No key in common: the message says nothing matches and what the checkpoint holds, not "load the 0 matching"."""
    with pytest.raises(errors.StateDictMismatchError) as info:
        zeroio.load(SRC, torch.nn.Sequential(torch.nn.Linear(3, 3)))
    message = str(info.value)
    assert "0 matching" not in message
    assert message.splitlines()[-1].strip() == (
        f"Checkpoint: '{SRC / 'global_step2'}'. No parameter was modified: no key of the checkpoint matches the model "
        "(it holds 11 tensors, listed above as unexpected; the model expects 2). Check that this is the checkpoint of "
        "this model, or pass key_map= to rename keys."
    )


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("z3_ws2_fp3", "z3_ws2_fp32"),
        ("z3_ws2_fp32/global_stepp2", "z3_ws2_fp32/global_step2"),
        ("z3-ws2-fp32/global_step", "z3_ws2_fp32/global_step2"),
    ],
)
def test_a_wrong_path_suggests_the_nearest_existing_one(typed, meant):
    """A mistyped local path: the error names the closest existing path, level by level."""
    with pytest.raises(errors.CheckpointNotFoundError) as info:
        zeroio.open(FIXTURES / typed)
    assert str(info.value) == f"Checkpoint path '{FIXTURES / typed}' does not exist. Did you mean '{FIXTURES / meant}'?"


def test_a_path_with_nothing_near_suggests_nothing(tmp_path):
    with pytest.raises(errors.CheckpointNotFoundError) as info:
        zeroio.open(tmp_path / "nothing" / "here")
    assert str(info.value) == f"Checkpoint path '{tmp_path / 'nothing' / 'here'}' does not exist."


def test_remote_extras_are_pinned_together():
    """`pip install -e '.[test]'` must not backtrack through aiobotocore: the test extra pins s3fs, aiobotocore,
    botocore, boto3, fsspec, moto and gcsfs to versions that agree (the ones installed), and the s3 extra bounds
    s3fs and aiobotocore to the same compatible releases."""
    from importlib.metadata import version

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = FIXTURES.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {req.split("==")[0].split("[")[0]: req.split("==")[1] for req in extras["test"] if "==" in req}
    for name in ("fsspec", "s3fs", "aiobotocore", "botocore", "boto3", "moto", "gcsfs"):
        assert pins[name] == version(name), name
    assert extras["s3"] == ["fsspec~=2026.9.0", "s3fs~=2026.9.0", "aiobotocore~=3.10.0"]
