"""The public surface: one namespace, sorted and complete __all__, fast import."""

from __future__ import annotations

import subprocess
import sys

import zeroio
from zeroio import errors


def test_all_is_sorted_and_complete():
    """zeroio.__all__ is sorted, and every public name it lists exists."""
    assert zeroio.__all__ == sorted(zeroio.__all__)
    for name in zeroio.__all__:
        assert hasattr(zeroio, name), name
    public = {n for n in vars(zeroio) if not n.startswith("_") and n not in ("annotations", "errors", "cli")}
    assert public <= set(zeroio.__all__)


def test_errors_all_is_sorted_and_complete():
    """zeroio.errors.__all__ is sorted and lists every exception class it defines."""
    assert errors.__all__ == sorted(errors.__all__)
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and v.__module__ == errors.__name__}
    assert defined == set(errors.__all__)


def test_import_does_not_load_heavy_optional_modules():
    """`import zeroio` pulls in neither huggingface_hub nor DeepSpeed (torch itself imports tqdm)."""
    code = "import sys, zeroio; print(sorted(m for m in ('huggingface_hub', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_version():
    """__version__ matches the installed distribution's metadata."""
    from importlib.metadata import version

    assert zeroio.__version__ == version("zeroio")
