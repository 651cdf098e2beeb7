"""``zeroio --version`` / ``--help`` and ``import zeroio`` start without the heavy libraries (issue 17).

Each case runs in a fresh interpreter whose import system refuses torch, safetensors, huggingface_hub and tqdm: an
import of any of them fails the command loudly instead of only costing seconds. Timing is measured by
benchmarks/startup.py (docs/benchmarks.md, "CLI start-up"), not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "z2_ws2_fp32"

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


@pytest.mark.parametrize("argv", [["--version"], ["convert", "--help"]], ids=" ".join)
def test_python_m_zeroio_imports_no_heavy_module(argv):
    """``python -X importtime -m zeroio ...``: the interpreter's own import log names none of the heavy packages."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "zeroio", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "zeroio.cli" in imported  # the log is the one expected, so an empty match below means something
    assert [m for m in imported if m.split(".")[0] in HEAVY] == []


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
    """Reading a public name imports what it needs (torch) then; the object is the one its module defines."""
    body = """
sys.meta_path.pop(0)  # the guard only watches here
import zeroio
before = "torch" in sys.modules
from zeroio import convert
print(json.dumps([before, "torch" in sys.modules, convert is sys.modules["zeroio._convert"].convert,
                  "convert" in vars(zeroio)]))
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
