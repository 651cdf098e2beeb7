"""The README's Python examples run as written."""

from __future__ import annotations

import os
import re

import pytest
from fixture_data import ROOT

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_blocks_run(index, monkeypatch):
    """Each ```python block of README.md executes from the repository root without error."""
    monkeypatch.chdir(ROOT)
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})  # noqa: S102 - runs the README's examples
    assert os.getcwd() == str(ROOT)


def test_readme_first_screen_commands_match_ci():
    """The README's test command is exactly what .ci/run runs."""
    ci = (ROOT / ".ci" / "run").read_text()
    command = (
        "pip install torch==2.13.0 && pip install -e '.[test]' && ruff check zeroio tests && "
        "ruff format --check zeroio tests && mypy && python -m pytest -q -p no:cacheprovider"
    )
    assert command in README.split("## What it does")[0]
    assert command in ci.splitlines()
