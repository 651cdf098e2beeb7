"""The command line as a Unix tool: quiet when its reader leaves, errors in the user's own flags, forgiving units."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from fixture_data import FIXTURES, ROOT
from safetensors.torch import load_file

from zeroio import convert
from zeroio.cli import main

SRC = FIXTURES / "z3_ws2_fp32"
HINT = "(set ZEROIO_DEBUG=1 for the full traceback)"


# --------------------------------------------------------------------------- zeroio inspect ... | head


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["table", "json"])
def test_closed_pipe_exits_quietly(extra):
    """`zeroio inspect ... | head`: the reader is gone before the first write; no traceback, SIGPIPE's exit code."""
    with subprocess.Popen(
        [sys.executable, "-m", "zeroio", "inspect", str(SRC), *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        proc.stdout.close()  # like `head` exiting: every write of the CLI now fails with EPIPE
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
    assert err == ""
    assert proc.returncode == 141  # 128 + SIGPIPE, what a shell reports for a tool killed by SIGPIPE


# --------------------------------------------------------------------------- errors name the flags typed


@pytest.mark.parametrize(
    "flags, message",
    [
        pytest.param(
            ["--format", "lightning", "--include-optimizer"],
            "--include-optimizer writes optimizer.safetensors beside model.safetensors (or the DCP optimizer state): "
            "use --format safetensors or --format dcp, without --distributed.",
            id="include-optimizer",
        ),
        pytest.param(
            ["--format", "lightning", "--exclude-frozen"],
            "--exclude-frozen cannot be used with --format lightning: load_from_checkpoint loads strictly and needs "
            "every parameter. Drop --exclude-frozen, or write --format safetensors.",
            id="exclude-frozen",
        ),
    ],
)
def test_usage_errors_name_the_flags(tmp_path, capsys, flags, message):
    """A rejected flag combination is reported in flags, not Python arguments, with the ZEROIO_DEBUG hint."""
    assert main(["convert", str(SRC), str(tmp_path / "model.ckpt"), *flags]) == 2
    assert capsys.readouterr() == ("", f"Invalid arguments: {message}\n{HINT}\n")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- sizes and dtypes as users type them


def _listing(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(
    "text, size",
    [("200B", 200), ("1KiB", 1024), ("0.5KiB", 512), ("2GiB", 2 * 1024**3), ("1k", 1000), ("1GB", 10**9)],
)
def test_max_shard_size_accepts_binary_and_byte_units(tmp_path, text, size):
    """--max-shard-size takes B, KiB..TiB (binary) as well as KB..TB (decimal): the same shards as that byte count."""
    assert main(["convert", str(SRC), str(tmp_path / "cli"), "--max-shard-size", text, "--quiet"]) == 0
    convert(SRC, tmp_path / "api", max_shard_size=size, progress=False)
    assert _listing(tmp_path / "cli") == _listing(tmp_path / "api")
    for name in _listing(tmp_path / "api"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "api" / name).read_bytes()


@pytest.mark.parametrize("typed, short", [("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")])
def test_dtype_accepts_torch_names(tmp_path, typed, short):
    """--dtype bfloat16 means --dtype bf16 (torch's names, as in training configs)."""
    assert main(["convert", str(SRC), str(tmp_path / "typed"), "--dtype", typed, "--quiet"]) == 0
    assert main(["convert", str(SRC), str(tmp_path / "short"), "--dtype", short, "--quiet"]) == 0
    typed_tensors = load_file(tmp_path / "typed" / "model.safetensors")
    assert (
        typed_tensors["emb.weight"].dtype
        == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[short]
    )
    assert (tmp_path / "typed" / "model.safetensors").read_bytes() == (
        tmp_path / "short" / "model.safetensors"
    ).read_bytes()


def test_unknown_dtype_is_a_usage_error(tmp_path, capsys):
    """An unknown --dtype exits 2 listing what is accepted."""
    with pytest.raises(SystemExit) as excinfo:
        main(["convert", str(SRC), str(tmp_path / "out"), "--dtype", "int8"])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zeroio convert: error: argument --dtype: invalid choice: 'int8' (choose from fp32, fp16, bf16, or "
        "float32, float16, bfloat16)"
    )


# --------------------------------------------------------------------------- destinations named like files


@pytest.mark.parametrize(
    "fmt, name, folder",
    [("safetensors", "model.safetensors", "model"), ("torch", "pytorch_model.bin", "pytorch_model")],
)
def test_file_named_destination_is_refused(tmp_path, capsys, fmt, name, folder):
    """`convert SRC model.safetensors` would make a folder named like a file: refused, nothing written."""
    dst = tmp_path / name
    with pytest.raises(SystemExit) as excinfo:
        main(["convert", str(SRC), str(dst), "--format", fmt])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"zeroio: error: DST '{dst}' is named like a file, but --format {fmt} writes a folder of files (e.g. "
        f"'{dst}/model.safetensors'): pass a folder name such as '{tmp_path / folder}'"
    )
    assert list(tmp_path.iterdir()) == []


def test_ckpt_destination_suggests_lightning(tmp_path, capsys):
    """A `.ckpt` destination with a folder format points at --format lightning, which writes that one file."""
    dst = tmp_path / "model.ckpt"
    with pytest.raises(SystemExit):
        main(["convert", str(SRC), str(dst)])
    assert capsys.readouterr().err.splitlines()[-1].endswith(" (or --format lightning for one .ckpt file)")
    assert main(["convert", str(SRC), str(dst), "--format", "lightning", "--quiet"]) == 0
    assert dst.is_file()


def test_existing_folder_with_a_file_like_name_is_still_a_folder(tmp_path):
    """An existing folder named `x.bin` is a folder the user chose: --overwrite replaces it as usual."""
    dst = tmp_path / "weights.bin"
    dst.mkdir()
    assert main(["convert", str(SRC), str(dst), "--overwrite", "--quiet"]) == 0
    assert _listing(dst) == ["model.safetensors"]


# --------------------------------------------------------------------------- remote URLs


@pytest.mark.parametrize(
    "argv",
    [
        ["push", "gs://bucket/x", "me/model"],
        ["reshard", "gs://bucket/x", "out", "--world-size", "2"],
    ],
    ids=["push", "reshard"],
)
def test_remote_source_is_read_as_a_url(tmp_path, monkeypatch, capsys, argv):
    """push and reshard read URL sources (tests/test_remote_s3.py reads them): a URL is named as typed (not folded
    into 'gs:/bucket/x'), here with its backend missing, in one line, and nothing is written locally."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    url = next(a for a in argv if "://" in a)
    assert main(argv) == 1
    assert capsys.readouterr() == (
        "",
        f"Error: Reading '{url}' needs the 'gcsfs' package, which is not installed: pip install gcsfs (zeroio's [gcs] extra)\n{HINT}\n",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["convert", "reshard"])
def test_remote_destination_without_credentials(tmp_path, monkeypatch, capsys, command):
    """convert and reshard to a URL check the destination before reading: refused credentials are one line naming
    the URL and the variables to set; no local folder named 's3:' appears."""
    pytest.importorskip("s3fs")
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    extra = ["--world-size", "2"] if command == "reshard" else []
    assert main([command, str(SRC), "s3://bucket/out", *extra]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("Error: Access to 's3://bucket/out' was refused") and "AWS_ACCESS_KEY_ID" in err
    assert list(tmp_path.iterdir()) == []
