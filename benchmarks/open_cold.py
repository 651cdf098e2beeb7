"""Cold cost of opening a checkpoint, apart from reading its tensors: importing zeroio, then ``zeroio.open`` with
the rank files parsed one by one or on threads (``zeroio._formats.zero.reader.PARSE_LOCAL_CONCURRENTLY``).

Each run is a fresh process after the page cache is dropped (root), variants alternating::

    python benchmarks/open_cold.py --checkpoint /tmp/ck --repeats 3 --json results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import run as bench

CHILD = """
import sys, time, json
import torch
t0 = time.perf_counter()
import zeroio
import zeroio._formats.zero.reader as zero
t1 = time.perf_counter()
zero.PARSE_LOCAL_CONCURRENTLY = sys.argv[2] == "threads"
with zeroio.open(sys.argv[1]) as ckpt:
    t2 = time.perf_counter()
    n = len(ckpt.infos)
print(json.dumps({"import_seconds": t1 - t0, "open_seconds": t2 - t1, "tensors": n}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cold = bench.can_drop_caches()
    runs: list[dict[str, Any]] = []
    variants = ["serial", "threads"]
    for repeat in range(args.repeats):
        for variant in variants[repeat % 2 :] + variants[: repeat % 2]:
            if cold:
                bench.drop_caches()
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.checkpoint), variant], capture_output=True,
                                 text=True, check=True, cwd=REPO)  # fmt: skip
            runs.append({"variant": variant, **json.loads(out.stdout.strip().splitlines()[-1])})
            print(json.dumps(runs[-1]), flush=True)
    summary = {
        v: {k: statistics.median(r[k] for r in runs if r["variant"] == v) for k in ("import_seconds", "open_seconds")}
        for v in variants
    }
    print(json.dumps(summary))
    if args.json:
        result = {"machine": bench.machine_info(), "cache": "cold" if cold else "warm", "runs": runs, "median": summary}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
