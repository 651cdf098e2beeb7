"""Progress in logs: off a terminal the command prints a line every 10 % or 10 s (percent, bytes, rate, time left),
keeps the bar on a terminal, prints none with --quiet, and --progress / ZEROIO_PROGRESS force a mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixture_data import FIXTURES

from zeroio.cli import main
from zeroio.cli._progress import ProgressLines, choose_mode

SRC = FIXTURES / "z3_ws2_fp32"
LINE = re.compile(r"^zeroio convert: \d{1,3}% \d+ B of 980 B, [\d.]+ [KMG]?B/s, (\d+ s left|done in \d+ s)$")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_every_ten_percent_or_ten_seconds(capsys):
    """A line at each 10 % step or after 10 s without one, none in between, one at 100 %, with rate and time left."""
    clock = Clock()
    lines = ProgressLines("zeroio convert", clock=clock)
    total = 4_000_000_000
    lines(0, total)  # the start: no line
    for seconds, done in ((1, 100_000_000), (2, 400_000_000), (3, 410_000_000), (14, 420_000_000), (20, total)):
        clock.now = 100.0 + seconds
        lines(done, total)
    lines(total, total)  # a repeated 100 %: no second line
    assert capsys.readouterr().err.splitlines() == [
        "zeroio convert: 10% 400.00 MB of 4.00 GB, 200.00 MB/s, 18 s left",
        "zeroio convert: 10% 420.00 MB of 4.00 GB, 30.00 MB/s, 1 min 59 s left",
        "zeroio convert: 100% 4.00 GB of 4.00 GB, 200.00 MB/s, done in 20 s",
    ]


def test_auto_lines_wait_three_seconds(capsys):
    """With --progress auto off a terminal, a conversion done within 3 s prints no line: its summary says it all."""
    clock = Clock()
    lines = ProgressLines("x", first_after=3.0, clock=clock)
    lines(0, 100)
    clock.now += 1
    lines(50, 100)
    clock.now += 3
    lines(60, 100)
    assert capsys.readouterr().err == "x: 60% 60 B of 100 B, 15 B/s, 3 s left\n"


@pytest.mark.parametrize(
    "flag, env, quiet, mode",
    [
        (None, None, False, "auto"),
        ("lines", None, False, "lines"),
        (None, "lines", False, "lines"),
        ("none", "lines", False, "none"),  # the flag wins over the variable
        (None, "BAR", False, "bar"),
        ("bar", None, True, "none"),  # --quiet wins
    ],
)
def test_mode_from_flag_environment_and_quiet(monkeypatch, flag, env, quiet, mode):
    """--quiet, then --progress, then ZEROIO_PROGRESS, then auto."""
    monkeypatch.delenv("ZEROIO_PROGRESS", raising=False)
    if env is not None:
        monkeypatch.setenv("ZEROIO_PROGRESS", env)
    assert choose_mode(flag, quiet) == mode


def test_cli_progress_lines_in_a_log(tmp_path, capsys, monkeypatch):
    """`--progress lines` (and ZEROIO_PROGRESS=lines) print lines to stderr, the last at 100 %; --quiet none."""
    monkeypatch.delenv("ZEROIO_PROGRESS", raising=False)
    assert main(["convert", str(SRC), str(tmp_path / "a"), "--progress", "lines", "--max-shard-size", "300"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) >= 2 and all(LINE.match(line) for line in err), err
    assert err[-1].startswith("zeroio convert: 100% 980 B of 980 B")
    monkeypatch.setenv("ZEROIO_PROGRESS", "lines")
    assert main(["convert", str(SRC), str(tmp_path / "b")]) == 0
    assert LINE.match(capsys.readouterr().err.splitlines()[-1])
    assert main(["convert", str(SRC), str(tmp_path / "c"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("ZEROIO_PROGRESS", "sometimes")
    assert main(["convert", str(SRC), str(tmp_path / "d")]) == 2
    assert "ZEROIO_PROGRESS='sometimes' is not a progress mode: use one of auto, bar, lines, none." in (
        capsys.readouterr().err
    )


def test_forced_bar_into_a_file(tmp_path):
    """`--progress bar` draws tqdm's bar even when stderr is a file (a bar off a terminal is otherwise hidden)."""
    env = {k: v for k, v in os.environ.items() if k != "ZEROIO_PROGRESS"}
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "zeroio", "convert", str(SRC), str(tmp_path / "out"), "--progress", "bar"],
        capture_output=True, text=True, env=env, cwd=root, check=True,
    )  # fmt: skip
    assert re.search(r"zeroio convert: 100%\S* *\|.*\| 980/980", proc.stderr), proc.stderr
