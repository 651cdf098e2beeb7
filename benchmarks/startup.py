"""Start-up time of the ``zeroio`` command against ``python -c "import torch"``, in one run (issue 17).

Every command runs ``--repeats`` times (after one untimed warm-up that fills the page cache and writes .pyc
files), in an order rotated per repeat so a change in machine load hits all of them alike; the table reports
the median wall time and its ratio to the median of ``python -c "import torch"``. The target: ``zeroio
--version``, ``--help`` and ``inspect`` at most 0.3x. ``--before TREE`` adds the same zeroio rows for another source tree
(e.g. a ``git worktree`` of an older commit) so a change is measured against the old code in the same run.

    python benchmarks/startup.py --repeats 10
    git worktree add --detach /tmp/zeroio-before <commit>
    python benchmarks/startup.py --before /tmp/zeroio-before --json benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# (label, argv after the interpreter or script). "zeroio" rows run the console script the package installs.
ZEROIO_COMMANDS: list[tuple[str, list[str]]] = [
    ("zeroio --version", ["--version"]),
    ("zeroio --help", ["--help"]),
    ("zeroio convert --help", ["convert", "--help"]),
    ("zeroio inspect --help", ["inspect", "--help"]),
    ("python -m zeroio --version", ["-m", "zeroio", "--version"]),
    ('python -c "import zeroio"', ["-c", "import zeroio"]),
    # Reading metadata (issue 17, second part): no torch either; paths relative to the tree measured.
    ("zeroio inspect fixtures/z3_ws2_bf16", ["inspect", "fixtures/z3_ws2_bf16"]),
    ("zeroio inspect --json fixtures/z3_ws2_bf16", ["inspect", "--json", "fixtures/z3_ws2_bf16"]),
    ("zeroio inspect fixtures/layouts/pipe_z1_ws2_pp2_bf16", ["inspect", "fixtures/layouts/pipe_z1_ws2_pp2_bf16"]),
    # Writing rank files (torch needed): the whole command, start-up included, on a small fixture.
    ("zeroio reshard fixtures/z3_ws2_fp32 --world-size 3",
     ["reshard", "fixtures/z3_ws2_fp32", str(Path(tempfile.gettempdir()) / "zeroio-startup-reshard"), "--world-size",
      "3", "--overwrite", "--quiet"]),
]
BASELINE = ('python -c "import torch"', ["-c", "import torch"])
INTERPRETER = ('python -c "pass"', ["-c", "pass"])  # the floor: what any Python command costs here


def console_script() -> str:
    """The ``zeroio`` script next to this interpreter (not a pyenv/conda shim, whose own start-up would count)."""
    beside = Path(sys.executable).parent / "zeroio"
    found = str(beside) if beside.exists() else shutil.which("zeroio")
    if found is None:
        raise SystemExit("no `zeroio` script found: pip install -e . first")
    return found


def commands(tree: Path, suffix: str) -> list[tuple[str, list[str], Path]]:
    """Each zeroio row as (label, full argv, tree put first on PYTHONPATH and used as the working directory)."""
    script = console_script()
    rows = []
    for label, argv in ZEROIO_COMMANDS:
        full = [script, *argv] if label.startswith("zeroio") else [sys.executable, *argv]
        rows.append((label + suffix, full, tree))
    return rows


def run_once(argv: list[str], tree: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    subprocess.run(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per command (default: 10)")
    parser.add_argument("--before", type=Path, help="another zeroio source tree to measure in the same run")
    parser.add_argument("--json", type=Path, help="also write the raw times here")
    args = parser.parse_args()

    rows = [(label, [sys.executable, *argv], REPO) for label, argv in (BASELINE, INTERPRETER)]
    rows += commands(REPO, "")
    if args.before is not None:
        rows += commands(args.before.resolve(), " (before)")
    for _, argv, tree in rows:  # warm-up: page cache, .pyc files
        run_once(argv, tree)
    times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    for repeat in range(args.repeats):
        shift = repeat % len(rows)
        for label, argv, tree in rows[shift:] + rows[:shift]:
            times[label].append(run_once(argv, tree))

    base = statistics.median(times[BASELINE[0]])
    print(f"{args.repeats} runs each, median wall time; ratio to {BASELINE[0]}\n")
    print(f"| {'command':<62} | median (s) | min (s) | ratio |")
    print(f"|{'-' * 64}|-----------:|--------:|------:|")
    for label, values in times.items():
        median = statistics.median(values)
        print(f"| {label:<62} | {median:>10.3f} | {min(values):>7.3f} | {median / base:>5.2f} |")
    if args.json is not None:
        record: dict[str, Any] = {
            "python": sys.version.split()[0],
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "repeats": args.repeats,
            "seconds": times,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
