"""What a new user meets in the first hour (issue 23, item 11): counts that agree, messages that name the fix."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest
from fixture_data import FIXTURES, HF, ROOT

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointNotFoundError, HubError, RemoteStorageError

SRC = FIXTURES / "z3_ws2_fp32"


def test_convert_counts_tensors_as_inspect_and_verify_do(tmp_path, capsys):
    """convert, inspect and verify count the same names: 11 tensors, 1 of them tied."""
    dst = tmp_path / "out"
    assert main(["convert", str(SRC), str(dst), "--quiet"]) == 0
    assert main(["inspect", str(SRC)]) == 0
    inspected = capsys.readouterr().out.splitlines()[-1]
    assert main(["convert", str(SRC), str(tmp_path / "again")]) == 0
    converted = capsys.readouterr().out
    assert main(["verify", str(SRC), str(dst)]) == 0
    verified = capsys.readouterr().out
    assert inspected.startswith("11 tensors (1 tied),")
    assert converted.startswith("Wrote 11 tensors (1 tied, ")
    assert verified.startswith("OK: all 11 tensors")


def test_numpy_is_a_runtime_dependency():
    """torch warns 'Failed to initialize NumPy' on casts without numpy: a base install brings it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "numpy" for dep in project["dependencies"])


def test_unknown_url_scheme_names_the_supported_ones():
    """A typo'd scheme is called unknown, not a package to install (fsspec is installed)."""
    with pytest.raises(RemoteStorageError) as exc:
        zeroio.open("s4://bucket/ckpt")
    assert str(exc.value) == (
        "Unknown URL scheme 's4://' in 's4://bucket/ckpt'. zeroio reads s3://, gs://, hf://, https:// and http:// "
        "URLs (and any other scheme fsspec knows), or a local path."
    )


def test_invalid_repo_id_says_what_is_wrong(tmp_path):
    """An invalid Hub repo id is named as such (no request is sent), not 'run the same push again'."""
    folder = tmp_path / "model"
    zeroio.convert(SRC, folder, progress=False)
    with pytest.raises(HubError) as exc:
        zeroio.push_to_hub(folder, "my org/bad..id", endpoint="http://127.0.0.1:9", token="hf_x", progress=False)
    assert str(exc.value) == (
        "'my org/bad..id' is not a valid Hub repo id: use 'namespace/name' (or 'name' in your own namespace) of "
        "letters, digits, '-', '_' and '.', not starting or ending with '-' or '.', without '--' or '..', at most "
        "96 characters."
    )


def test_s3_without_network_fails_fast():
    """No S3 endpoint to connect to: a typed error in seconds (it took 40-63 s: 60 s connect timeouts, retries)."""
    with socket.socket() as sock:  # a port nothing listens on: every connection is refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"}
    start = time.monotonic()
    with pytest.raises(RemoteStorageError, match="Check the endpoint and the network"):
        zeroio.open("s3://bucket/ckpt", storage_options=options)
    assert time.monotonic() - start < 20


def test_a_port_holding_403_is_no_refused_access():
    """A closed endpoint whose port holds the digits 403 (127.0.0.1:40403, as a random port once was): the failure
    says check the endpoint and the network, not set credentials (the URL's digits were taken for an HTTP 403)."""
    for port in [*range(40300, 40400), *range(14030, 14040)]:
        with socket.socket() as sock:  # nothing listens once it is closed: every connection is refused at once
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        break
    else:
        pytest.skip("no free port holding 403")
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"}
    with pytest.raises(RemoteStorageError, match="Check the endpoint and the network"):
        zeroio.open("s3://bucket/ckpt", storage_options=options)


def test_abbreviated_flags_are_refused(tmp_path, capsys):
    """`--exclude` is not silently taken for --exclude-frozen."""
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(SRC), str(tmp_path / "out"), "--exclude"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith("zeroio: error: unrecognized arguments: --exclude\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flag", "fix"),
    [
        ("--max_shard_size=2GB", "use --max-shard-size"),
        ("--exclude_frozen_parameters", "use --exclude-frozen"),
        ("--safe_serialization", "drop it: zeroio writes safetensors by default (--format torch for .bin files)"),
        ("-t", "use --tag"),
        ("--num_extract_workers", "use --workers (IO threads)"),
    ],
)
def test_deepspeed_script_flags_name_zeroio_flags(tmp_path, capsys, flag, fix):
    """zero_to_fp32.py / ds_to_universal.py flags get the zeroio flag to use, not a bare 'unrecognized arguments'."""
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(SRC), str(tmp_path / "out"), flag, "global_step2"])
    assert exc.value.code == 2
    name = flag.split("=")[0]
    assert capsys.readouterr().err.endswith(
        f"zeroio: error: {name} is a flag of DeepSpeed's zero_to_fp32.py/ds_to_universal.py: {fix} "
        "(docs/migrating.md)\n"
    )


def test_trainer_output_dir_suggests_its_checkpoint_folders():
    """An HF Trainer output_dir (checkpoint-N/ folders inside) points to those folders."""
    with pytest.raises(CheckpointNotFoundError) as exc:
        zeroio.open(HF)
    assert str(exc.value) == (
        f"'{HF}' is not a DeepSpeed checkpoint but a Hugging Face Trainer output_dir holding checkpoint-3. Pass one "
        f"of those folders, e.g. '{HF / 'checkpoint-3'}'."
    )


def test_ctrl_c_while_starting_is_one_line():
    """A Ctrl-C that lands while the CLI is still importing exits 130 with one line, no traceback."""
    # The interrupt is raised where SIGINT would land: when Python imports the CLI's command table.
    script = textwrap.dedent(
        """
        import sys

        class CtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == "zeroio.cli._app":
                    raise KeyboardInterrupt
                return None

        sys.meta_path.insert(0, CtrlC())
        sys.argv = ["zeroio", "inspect", sys.argv[1]]
        import runpy
        runpy.run_module("zeroio", run_name="__main__")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(SRC)], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "Interrupted.\n", "")


@pytest.mark.parametrize("script", ["crc_cost.py", "crc_cpu.py"])
def test_crc_benchmarks_take_their_paths_as_arguments(script):
    """benchmarks/crc_*.py answer --help and name no machine's paths (they were hard-coded to /tmp/...)."""
    path = ROOT / "benchmarks" / script
    proc = subprocess.run(
        [sys.executable, str(path), "--help"], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "--checkpoint CHECKPOINT" in proc.stdout
    assert "/tmp/" not in path.read_text().split('"""', 2)[2]  # examples in the docstring may name a folder
