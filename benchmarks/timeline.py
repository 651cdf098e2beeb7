"""Each process's timeline in runs of ``benchmarks/distributed.py``: when it was created, when its ``main()`` began
and returned, and every zeroio debug-log record between (the worker keeps them with their times), in seconds from
the run's start (the launcher's command).

    python benchmarks/timeline.py benchmarks/results/distributed-2core-125M-one-reader.json [--run 3] [--summary]

``--summary`` prints, per variant, the medians of the wall time and of each process's ``convert`` call, and for
the one-reader runs the spans the reader's and the others' records mark (writes, waiting for the others, the
group joined).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _start(run: dict[str, Any]) -> float:
    """Epoch seconds of the run's start: the first worker's creation minus the launcher's time before it."""
    first = min(r["created_at"] for r in run["ranks"])
    return first - run.get("phases", {}).get("launch_s", 0.0)


def show(run: dict[str, Any], index: int) -> str:
    t0 = _start(run)
    label = f"torchrun x{run['processes']}" if run["distributed"] else "plain"
    lines = [f"run {index} ({label}, tree {run.get('tree', '')}): wall {run['wall_s']:.2f} s"]
    for r in run["ranks"]:
        lines.append(
            f"  process {r['rank']}: created {r['created_at'] - t0:6.3f}  main() {r['main_start_at'] - t0:6.3f} -> "
            f"{r['main_end_at'] - t0:6.3f}  convert {r['convert_s']:.2f} s"
        )
        lines += [f"    {at - t0:7.3f}  {thread[:16]:16}  {message}" for at, thread, message in r.get("events", [])]
    return "\n".join(lines)


def _at(rank: dict[str, Any], prefix: str) -> float | None:
    return next((at for at, _, message in rank.get("events", []) if message.startswith(prefix)), None)


def spans(run: dict[str, Any]) -> dict[str, float]:
    """What the one-reader records mark, in seconds: the reader's writes (first record to its outcome), its wait
    for the others (outcome to main()'s end), and, on the others, the group joined after main() began."""
    out: dict[str, float] = {}
    reader = run["ranks"][0]
    told = _at(reader, "output in place") or _at(reader, "failed; telling")
    if told is not None:
        out["reader_converting_s"] = told - reader["main_start_at"]
        out["reader_waiting_s"] = reader["main_end_at"] - told
    joins = [_at(r, "joined the process group") for r in run["ranks"][1:]]
    if joins and all(j is not None for j in joins):
        out["others_joined_s"] = max(j - r["main_start_at"] for j, r in zip(joins, run["ranks"][1:]))  # type: ignore[operator]
    return out


def _key(run: dict[str, Any]) -> tuple[str, str, int, bool]:
    return run.get("source", ""), run.get("tree", ""), run["processes"], run["distributed"]


def summary(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| source | tree | variant | runs | wall | convert per process | reader converting / waiting | others joined |",
        "|---|---|---|---:|---:|---|---|---:|",
    ]
    for source, tree, processes, distributed in sorted({_key(r) for r in runs}):
        mine = [r for r in runs if _key(r) == (source, tree, processes, distributed)]
        wall = statistics.median(r["wall_s"] for r in mine)
        per = [statistics.median(r["ranks"][i]["convert_s"] for r in mine) for i in range(processes)]
        marks = [spans(r) for r in mine]

        def med(key: str, marks: list[dict[str, float]] = marks) -> str:
            values = [m[key] for m in marks if key in m]
            return f"{statistics.median(values):.2f}" if values else ""

        label = f"torchrun x{processes}" if distributed else "plain"
        lines.append(
            f"| {source} | {tree} | {label} | {len(mine)} | {wall:.2f} | {', '.join(f'{c:.2f}' for c in per)} "
            f"| {med('reader_converting_s')} / {med('reader_waiting_s')} | {med('others_joined_s')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, nargs="+", help="benchmarks/distributed.py --json outputs")
    parser.add_argument("--run", type=int, action="append", help="print only these runs (0-based, over all files)")
    parser.add_argument("--summary", action="store_true", help="the medians table only")
    args = parser.parse_args()
    runs = []
    for path in args.json:
        data = json.loads(path.read_text())
        info = data["info"]
        source = f"{info.get('checkpoint', '')} ({info.get('cache', '')})"
        runs += [{**run, "tree": run.get("tree", info.get("tree", "")), "source": source} for run in data["runs"]]
    if args.summary:
        print(summary(runs))
        return 0
    for i, run in enumerate(runs):
        if args.run is None or i in args.run:
            print(show(run, i))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
