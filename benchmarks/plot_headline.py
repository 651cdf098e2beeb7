"""Draw docs/benchmarks.png: today's headline conversions side by side (time and memory per checkpoint).

Each panel group is one results file of ``benchmarks/run.py`` (one checkpoint, one machine), so bars are only
compared within a group, never across machines. Usage::

    python benchmarks/plot_headline.py benchmarks/results/convert-h200-1.3B-torchfree.json \
        benchmarks/results/convert-2core-355M-torchfree.json --out docs/benchmarks.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

METHODS = {
    "zeroio": "zeroio convert",
    "ds_bin": "DeepSpeed zero_to_fp32.py",
    "limit_kernel": "disk copy limit (same bytes)",
}
COLORS = {"zeroio": "tab:blue", "ds_bin": "tab:orange", "limit_kernel": "0.55"}


def _group(path: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    data = json.loads(path.read_text())
    ckpt = data["checkpoints"][0]
    machine = data["machine"]
    label = (
        f"{ckpt['params'] / 1e9:.2f}B params, {ckpt['fp32_bytes'] / 1e9:.1f} GB fp32\n"
        f"{machine.get('cpus')} CPUs ({path.stem})"
    )
    return label, ckpt["results"]["cold"]


def plot(files: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [_group(f) for f in files]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / len(METHODS)
    for i, (method, name) in enumerate(METHODS.items()):
        for ax, key, scale, skip in ((ax_time, "seconds", 1, False), (ax_mem, "peak_anon_bytes", 2**20, True)):
            if skip and method.startswith("limit"):
                continue
            xs, ys, lo, hi = [], [], [], []
            for g, (_, results) in enumerate(groups):
                row = results.get(method)
                if not row or not row.get("ok"):
                    continue
                st = row[key]
                xs.append(g + (i - 1) * width)
                ys.append(st["median"] / scale)
                lo.append((st["median"] - st["min"]) / scale)
                hi.append((st["max"] - st["median"]) / scale)
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=name, color=COLORS[method])
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.1f}" if key == "seconds" else f"{y:.0f}", (x, y), ha="center", va="bottom",
                            fontsize=8, xytext=(0, 2), textcoords="offset points")  # fmt: skip
    for ax, title in (
        (ax_time, "cold cache: time to durable completion (s, median of runs, bars min/max)"),
        (ax_mem, "peak anonymous memory (MiB, log scale)"),
    ):
        ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ax_mem.set_yscale("log")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "results", type=Path, nargs="+", help="results files of benchmarks/run.py (one checkpoint each)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.png"), help="the PNG to write")
    args = parser.parse_args()
    plot(args.results, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
