"""``zeroio --version`` / ``--help``, ``import zeroio``, ``zeroio inspect`` and ``zeroio verify``'s metadata part
start without the heavy libraries (issue 17).

Each case runs in a fresh interpreter whose import system refuses torch, safetensors, huggingface_hub and tqdm: an
import of any of them fails the command loudly instead of only costing seconds. Timing is measured by
benchmarks/startup.py (docs/benchmarks.md, "CLI start-up"), not asserted here.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "z2_ws2_fp32"
ZERO3 = ROOT / "fixtures" / "z3_ws2_bf16"
PIPELINE = ROOT / "fixtures" / "layouts" / "pipe_z1_ws2_pp2_bf16"
TENSOR_PARALLEL = ROOT / "fixtures" / "layouts" / "autotp_z1_ws2_tp2_bf16"
PIPELINE_TP = ROOT / "fixtures" / "layouts" / "pipe_tp_z1_ws4_pp2tp2_fp32"
DCP = ROOT / "fixtures" / "dcp" / "dcp_titan_ws2"

HEAVY = ("torch", "safetensors", "huggingface_hub", "tqdm")

# Installed before anything of zeroio is imported: any import of a HEAVY package (or of its submodules) raises,
# and the names asked for are printed as JSON on the last line of stderr when the interpreter exits.
_GUARD = f"""
import atexit, json, sys
HEAVY = {HEAVY!r}
asked = []

class RefuseHeavy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            asked.append(name)
            raise ImportError(f"test_cli_startup: {{name}} imported at start-up")
        return None

sys.meta_path.insert(0, RefuseHeavy())
atexit.register(lambda: print(json.dumps({{"asked": asked,
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}}), file=sys.stderr))
"""

# What the ``zeroio`` console script does: load the entry point named in the package metadata and call it.
_RUN_CONSOLE_SCRIPT = """
from importlib.metadata import entry_points
(script,) = entry_points(group="console_scripts", name="zeroio")
sys.argv = ["zeroio", *ARGV]
raise SystemExit(script.load()())
"""


def _run_guarded(
    body: str, argv: list[str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, list[str]]]:
    code = _GUARD + (f"ARGV = {argv!r}\n" if argv is not None else "") + body
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    return proc, report


COMMANDS = [
    ["--version"],
    ["--help"],
    ["inspect", "--help"],
    ["convert", "--help"],
    ["verify", "--help"],
    ["push", "--help"],
    ["reshard", "--help"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_console_script_starts_without_heavy_imports(argv):
    """The ``zeroio`` script answers --version and every --help without importing torch, safetensors, ..."""
    proc, report = _run_guarded(_RUN_CONSOLE_SCRIPT, argv)
    assert report == {"asked": [], "loaded": []}, proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("zeroio 0.1.0" if argv == ["--version"] else "usage: zeroio")


def test_usage_error_starts_without_heavy_imports():
    """A mistyped command is refused (exit 2, argparse's message) before anything heavy is imported."""
    proc, report = _run_guarded(_RUN_CONSOLE_SCRIPT, ["convert", str(FIXTURE), "out", "--dtype", "fp8"])
    assert report == {"asked": [], "loaded": []}, proc.stderr
    assert proc.returncode == 2
    assert "argument --dtype: invalid choice: 'fp8'" in proc.stderr


def _imported_by(argv: list[str]) -> list[str]:
    """Every module ``python -X importtime -m zeroio ARGV`` imported, from the interpreter's own log."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "zeroio", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]


@pytest.mark.parametrize("argv", [["--version"], ["convert", "--help"]], ids=" ".join)
def test_python_m_zeroio_imports_no_heavy_module(argv):
    """``python -X importtime -m zeroio ...``: the interpreter's own import log names none of the heavy packages."""
    imported = _imported_by(argv)
    assert "zeroio.cli" in imported  # the log is the one expected, so an empty match below means something
    assert [m for m in imported if m.split(".")[0] in HEAVY] == []


@pytest.mark.parametrize("cast", [[], ["--dtype", "bf16"]], ids=["as stored", "bf16"])
def test_python_m_zeroio_convert_imports_no_heavy_module(cast, tmp_path):
    """``python -X importtime -m zeroio convert``: a conversion that needs no tensor arithmetic (bytes copied as
    stored, fp32 rounded to bf16 with numpy) imports none of the heavy packages (tests/test_convert_torch_free.py
    runs every fixture so)."""
    imported = _imported_by(["convert", str(ZERO3), str(tmp_path / "out"), *cast])
    assert any(m.endswith("._write.shard_files") for m in imported)  # the log covers the conversion itself
    assert [m for m in imported if m.split(".")[0] in HEAVY] == []
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_import_zeroio_and_errors_without_torch():
    """``import zeroio`` and ``zeroio.errors`` (catching zeroio's exceptions) need none of the heavy packages."""
    body = """
import zeroio
assert issubclass(zeroio.errors.CheckpointNotFoundError, zeroio.errors.ZeroIOError)
from zeroio.errors import OutputError
assert zeroio.__version__ == "0.1.0"
assert "convert" in dir(zeroio) and "Checkpoint" in dir(zeroio)
"""
    proc, report = _run_guarded(body)
    assert proc.returncode == 0, proc.stderr
    assert report == {"asked": [], "loaded": []}


def test_public_names_import_their_modules_on_first_use():
    """Reading a public name imports what it needs (torch, for ``load``) then; the object is the one its module
    defines. (``convert`` no longer needs torch to be imported: it imports it only for tensor arithmetic.)"""
    body = """
sys.meta_path.pop(0)  # the guard only watches here
import zeroio
before = "torch" in sys.modules
from zeroio import load
print(json.dumps([before, "torch" in sys.modules, load is sys.modules["zeroio._load.model"].load,
                  "load" in vars(zeroio)]))
"""
    proc, _ = _run_guarded(body)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False, True, True, True]


def test_unknown_attribute_is_an_attribute_error():
    """A misspelt name fails like any module attribute (hasattr and getattr defaults keep working)."""
    import zeroio

    with pytest.raises(AttributeError, match="module 'zeroio' has no attribute 'convret'"):
        zeroio.convret  # noqa: B018
    assert not hasattr(zeroio, "convret")
    assert getattr(zeroio, "convret", None) is None


# --------------------------------------------------------------------------- inspect and verify (metadata only)


def _run_in_this_process(argv: list[str]) -> tuple[int, str]:
    """What the command prints here, where torch may be imported: the output the torch-free run must equal."""
    from zeroio.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def metadata_commands(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[str], int, str]]:
    """Each command (by id) with its expected exit code and stdout, recorded in this (torch-importing) process."""
    import torch
    from safetensors.torch import save_file

    import zeroio

    tmp = tmp_path_factory.mktemp("startup")
    zeroio.convert(ZERO3, tmp / "converted")
    single = tmp / "converted" / "model.safetensors"
    # B shares no tensor with A by name, shape and dtype: verify finds every mismatch from metadata alone.
    other = tmp / "other.safetensors"
    save_file({"emb.weight": torch.zeros(13, 7, dtype=torch.float16), "extra.bias": torch.zeros(3)}, str(other))
    argvs = {
        "inspect zero3": ["inspect", str(ZERO3)],
        "inspect zero3 --json": ["inspect", str(ZERO3), "--json"],
        "inspect pipeline": ["inspect", str(PIPELINE)],
        "inspect pipeline --json": ["inspect", str(PIPELINE), "--json"],
        "inspect tensor parallel": ["inspect", str(TENSOR_PARALLEL)],
        "inspect pipeline+tp": ["inspect", str(PIPELINE_TP), "--tp-rules", "megatron"],
        "inspect safetensors": ["inspect", str(single)],
        "inspect dcp": ["inspect", str(DCP)],
        "inspect dcp --json": ["inspect", str(DCP), "--json"],
        "inspect safetensors --json": ["inspect", str(single), "--json"],
        "verify metadata": ["verify", str(ZERO3), str(other), "--max-report", "20"],
    }
    return {key: (argv, *_run_in_this_process(argv)) for key, argv in argvs.items()}


METADATA_IDS = [
    "inspect zero3",
    "inspect zero3 --json",
    "inspect pipeline",
    "inspect pipeline --json",
    "inspect tensor parallel",
    "inspect pipeline+tp",
    "inspect safetensors",
    "inspect safetensors --json",
    "inspect dcp",
    "inspect dcp --json",
    "verify metadata",
]


@pytest.mark.parametrize("key", METADATA_IDS)
def test_metadata_commands_run_without_heavy_imports(key, metadata_commands):
    """inspect (text, --json) of ZeRO-3, pipeline and safetensors checkpoints, and a verify decided by metadata,
    import none of the heavy packages and print exactly what they print with torch imported."""
    argv, code, expected = metadata_commands[key]
    proc, report = _run_guarded(_RUN_CONSOLE_SCRIPT, argv)
    assert report == {"asked": [], "loaded": []}, proc.stderr
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == expected
    if key == "verify metadata":  # the case really is one that compares no values
        assert code == 1 and "dtype fp32 (A) vs fp16 (B)" in expected and "extra.bias: not in A" in expected


def test_reading_a_tensor_imports_torch_on_first_use():
    """``zeroio.open`` + ``describe()`` stay torch-free; ``get_tensor`` imports torch then and returns a tensor."""
    body = f"""
sys.meta_path.pop(0)  # the guard only watches here
import zeroio
with zeroio.open({str(ZERO3)!r}) as ckpt:
    summary = ckpt.describe()
    before = "torch" in sys.modules
    info = ckpt.info("emb.weight")
    shape = list(ckpt.get_tensor("emb.weight").shape)
    print(json.dumps([before, "torch" in sys.modules, shape, str(info.dtype), summary["tensors"][2]["dtype"]]))
"""
    proc, _ = _run_guarded(body)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False, True, [13, 7], "torch.float32", "fp32"]
