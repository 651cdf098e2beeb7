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
    public = {
        n for n in vars(zeroio) if not n.startswith("_") and n not in ("annotations", "errors", "cli", "zero_to_fp32")
    }
    assert public <= set(zeroio.__all__)


def test_errors_all_is_sorted_and_complete():
    """zeroio.errors.__all__ is sorted and lists every exception class it defines."""
    assert errors.__all__ == sorted(errors.__all__)
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and v.__module__ == errors.__name__}
    assert defined == set(errors.__all__)


def test_zero_to_fp32_is_the_one_public_module_besides():
    """zeroio.zero_to_fp32 (the drop-in for deepspeed.utils.zero_to_fp32) has a sorted __all__ of what it defines,
    and every DeepSpeed 0.19.8 function it replaces (and ds_to_universal's main) keeps its parameters and defaults."""
    import inspect

    from deepspeed.utils import zero_to_fp32 as deepspeed_module

    from zeroio import zero_to_fp32

    assert zero_to_fp32.__all__ == sorted(zero_to_fp32.__all__)
    defined = {
        n
        for n, v in vars(zero_to_fp32).items()
        if not n.startswith("_") and getattr(v, "__module__", "") == zero_to_fp32.__name__
    }
    assert defined == set(zero_to_fp32.__all__)
    from deepspeed.checkpoint import ds_to_universal

    theirs_by_name = {name: getattr(deepspeed_module, name, None) for name in zero_to_fp32.__all__}
    theirs_by_name |= {"ds_to_universal": ds_to_universal.main, "LazyTensor": None}  # a class of zeroio's own
    for name, function in theirs_by_name.items():
        if function is None:
            continue
        ours, theirs = inspect.signature(getattr(zero_to_fp32, name)), inspect.signature(function)
        assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == [
            (p.name, p.default, p.kind) for p in theirs.parameters.values()
        ], name


def test_import_does_not_load_heavy_optional_modules():
    """`import zeroio` pulls in neither huggingface_hub nor DeepSpeed (torch itself imports tqdm)."""
    code = "import sys, zeroio; print(sorted(m for m in ('huggingface_hub', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_version():
    """__version__ matches the installed distribution's metadata."""
    from importlib.metadata import version

    assert zeroio.__version__ == version("zeroio")


def test_type_checking_view_matches_run_time():
    """The names zeroio/__init__.py imports for type checkers are __all__, each bound to the object its module defines.

    ``import zeroio`` imports them on first use; this keeps that table and the ``TYPE_CHECKING`` imports (what mypy and
    IDEs see) from drifting apart.
    """
    import ast
    import importlib
    from pathlib import Path

    tree = ast.parse(Path(zeroio.__file__).read_text(encoding="utf-8"))
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, (ast.Name, ast.Attribute)) and ast.unparse(test).split(".")[-1] == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.level == 1, ast.unparse(stmt)
                typed.update({alias.name: f"zeroio.{stmt.module}" for alias in stmt.names})
    assert sorted(typed) == sorted(set(zeroio.__all__) - {"__version__"})
    for name, module in typed.items():
        assert getattr(zeroio, name) is getattr(importlib.import_module(module), name), name


def test_dir_lists_every_public_name_before_use():
    """dir(zeroio) shows the whole public API at once, though the names are imported on first use."""
    code = "import zeroio; print(' '.join(n for n in dir(zeroio) if not n.startswith('_')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert set(zeroio.__all__) - {"__version__"} <= set(out)
    assert set(out) <= set(zeroio.__all__) | {"annotations", "errors"}
