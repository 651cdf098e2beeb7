"""Before/after ratio of two zeroio source trees on one checkpoint, in one run (issue 13's performance check).

Each repeat runs, in an order rotated per repeat, ``convert`` (``python -m zeroio convert SRC DST --quiet``,
safetensors, fsynced) and ``load`` (``zeroio.load`` into the GPT the checkpoint was built from, created on
the ``meta`` device) with each tree first on ``PYTHONPATH``; cold runs drop the page cache first (root).
Wall time and the child's peak RSS are recorded; the ratio is after / before (lower is better).

    git worktree add --detach /tmp/zeroio-before <commit>
    python benchmarks/before_after.py --before /tmp/zeroio-before --after . \\
        --checkpoint /tmp/zeroio-bench/gpt-470M --repeats 3 --json benchmarks/results/before-after-470M.json
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
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

_LOAD = """
import json, sys, time
import torch
sys.path.insert(0, {bench!r})
from make_checkpoint import GPTConfig, build_model
import zeroio
cfg = GPTConfig(**json.loads({cfg!r}))
with torch.device("meta"):
    model = build_model(cfg)
t0 = time.perf_counter()
zeroio.load({src!r}, model{load_args})
print(json.dumps({{"load_s": time.perf_counter() - t0}}))
"""


def drop_caches() -> bool:
    """Drop the page cache (needs root); False when not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def run_child(cmd: list[str], tree: Path) -> tuple[float, int, str]:
    """Wall seconds, the child's own peak RSS (KiB, from ``wait4``) and its stdout, with ``tree`` on the path."""
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with {tree}:\n{err[-2000:]}")
    return wall, usage.ru_maxrss, out


def model_config(checkpoint: Path) -> dict[str, Any]:
    """The GPTConfig the benchmark checkpoint was built with (make_checkpoint's manifest)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    return dict(manifest["config"])


def one(method: str, tree: Path, checkpoint: Path, work: Path, cold: bool, no_crc: bool = False) -> dict[str, Any]:
    dst = work / "out"
    if dst.exists():
        shutil.rmtree(dst)
    if cold and not drop_caches():
        raise SystemExit("cold runs need root (drop_caches)")
    if method == "convert":
        cmd = [sys.executable, "-m", "zeroio", "convert", str(checkpoint), str(dst), "--quiet"]
        cmd += ["--no-verify-crc"] if no_crc else []
        wall, rss, _ = run_child(cmd, tree)
        shutil.rmtree(dst, ignore_errors=True)
        return {"wall_s": wall, "peak_rss_mib": round(rss / 1024, 1)}
    load_args = ", verify_crc=False" if no_crc else ""
    code = _LOAD.format(
        bench=str(HERE), cfg=json.dumps(model_config(checkpoint)), src=str(checkpoint), load_args=load_args
    )
    wall, rss, out = run_child([sys.executable, "-c", code], tree)
    return {"wall_s": wall, "peak_rss_mib": round(rss / 1024, 1), **json.loads(out.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree of the baseline (has zeroio/)")
    parser.add_argument("--after", type=Path, required=True, help="source tree to compare (has zeroio/)")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--methods", nargs="+", default=["convert", "load"], choices=["convert", "load"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/zeroio-before-after"))
    parser.add_argument(
        "--after-no-crc", action="store_true", help="also run the after tree with CRC-32 checks off (a third column)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before, "after": args.after}
    if args.after_no_crc:
        trees["after-no-crc"] = args.after
    runs: list[dict[str, Any]] = []
    for cache in args.cache:
        for method in args.methods:
            if cache == "warm":  # warm the cache and both trees' imports once
                for tree in trees.values():
                    one(method, tree, args.checkpoint, args.work, cold=False)  # (crc setting irrelevant here)
            for r in range(args.repeats):
                items = list(trees.items())
                order = items[r % len(items) :] + items[: r % len(items)]  # rotate who goes first
                for label, tree in order:
                    no_crc = label == "after-no-crc"
                    result = one(method, tree, args.checkpoint, args.work, cold=cache == "cold", no_crc=no_crc)
                    runs.append({"cache": cache, "method": method, "tree": label, "repeat": r, **result})
                    print(json.dumps(runs[-1]), flush=True)
    summary: dict[str, Any] = {}
    for cache in args.cache:
        for method in args.methods:
            med = {
                label: statistics.median(
                    x["wall_s"] for x in runs if (x["cache"], x["method"], x["tree"]) == (cache, method, label)
                )
                for label in trees
            }
            ratios = {f"ratio_{k}": round(v / med["before"], 3) for k, v in med.items() if k != "before"}
            summary[f"{method}-{cache}"] = {**{f"{k}_s": round(v, 3) for k, v in med.items()}, **ratios}
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "node": platform.node()},
        "checkpoint": str(args.checkpoint),
        "before": str(args.before),
        "after": str(args.after),
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
