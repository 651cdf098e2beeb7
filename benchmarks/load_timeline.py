"""Where the time of a cold ``zeroio.load`` to CUDA goes: a timeline of one load, from before ``import zeroio``.

Each measurement is a fresh process (the checkpoint's files evicted from the page cache first, or every cache
dropped with ``--cache cold``). In it, torch is imported and the benchmark GPT built on ``meta``; then the clock
starts, ``zeroio`` is imported and ``zeroio.load(..., device="cuda")`` runs, with these moments recorded by
wrapping zeroio's own functions (from outside; nothing in zeroio is changed):

- ``import``: ``import zeroio`` done; ``open``: ``open_checkpoint`` start and end;
- ``context``: the CUDA context made on the pinned-ring thread; ``first_buffer``: the first pinned buffer taken;
- ``read_ahead``: the read-ahead asked for (trees that have it); ``fill``: the device filler's start and end;
- ``reads``: every positioned read of a local file (start, end, bytes): the first and last, bytes, the most in
  flight at once;
- ``disk``: the block devices' read sectors (``/proc/diskstats``) sampled every 5 ms: when the disk started
  delivering, its rate while busy, and the bytes it delivered before the filler's first read.

    python benchmarks/load_timeline.py --source /tmp/zb/st-bf16 --config /tmp/zb/ck/manifest.json --dtype bf16 \\
        --trees before=/repo after=/repo/.perf/after --rounds 2 --json timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench

# --------------------------------------------------------------------------- inside the measured process


def _disk_sectors() -> int:
    """Sectors read by the whole block devices (not partitions, loops or RAM disks) since boot."""
    total = 0
    whole = {p.name for p in Path("/sys/block").iterdir()} if Path("/sys/block").exists() else set()
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] in whole and not f[2].startswith(("loop", "ram", "zram")):
            total += int(f[5])
    return total


class _Disk(threading.Thread):
    def __init__(self, t0: float) -> None:
        super().__init__(daemon=True)
        self.t0 = t0
        self.samples: list[tuple[float, int]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append((time.perf_counter() - self.t0, _disk_sectors() * 512))
            time.sleep(0.005)


def _wrap(owner: Any, attr: str, before: Any = None, after: Any = None) -> None:
    original = getattr(owner, attr, None)
    if original is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before:
            before(*args)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                after(*args)

    setattr(owner, attr, wrapper)


def _instrument(zeroio: Any, t0: float, marks: dict[str, float], reads: list[tuple[float, float, int]]) -> None:
    import importlib

    import torch

    def mark(name: str) -> Any:
        return lambda *a: marks.setdefault(name, time.perf_counter() - t0)

    def mark_last(name: str) -> Any:
        return lambda *a: marks.__setitem__(name, time.perf_counter() - t0)

    sources = importlib.import_module("zeroio._io.sources")
    original_read_many = sources.LocalFile.read_many

    def read_many(self: Any, pieces: Any, what: str = "a tensor's data") -> None:
        start = time.perf_counter() - t0
        original_read_many(self, pieces, what)
        reads.append((start, time.perf_counter() - t0, sum(len(v) for _, v in pieces)))

    sources.LocalFile.read_many = read_many
    formats = importlib.import_module("zeroio._formats")
    _wrap(formats, "open_checkpoint", mark("open_start"), mark("open_end"))
    ring = importlib.import_module("zeroio._load.pinned_ring").PinnedRing
    original_make = ring._make

    def make(self: Any) -> None:
        marks.setdefault("context_start", time.perf_counter() - t0)
        torch.empty(1, device=self.device)
        marks.setdefault("context", time.perf_counter() - t0)
        original_make(self)

    ring._make = make
    _wrap(ring, "take", None, mark("first_buffer"))
    filler = importlib.import_module("zeroio._load.device_copy").DeviceFiller
    _wrap(filler, "read_ahead", mark("read_ahead"))
    _wrap(filler, "fill", mark("fill_start"), mark_last("fill_end"))


def _in_flight(reads: list[tuple[float, float, int]]) -> int:
    events = sorted([(s, 1) for s, _, _ in reads] + [(e, -1) for _, e, _ in reads])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from loaders_side_by_side import _model

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = _model(args.config, dtype)
    torch.cuda.init()
    marks: dict[str, float] = {}
    reads: list[tuple[float, float, int]] = []
    t0 = time.perf_counter()
    disk = _Disk(t0)
    disk.start()
    import zeroio

    marks["import"] = time.perf_counter() - t0
    _instrument(zeroio, t0, marks, reads)
    marks["load_start"] = time.perf_counter() - t0
    zeroio.load(args.source, model, device="cuda", dtype=dtype, strict=False)
    torch.cuda.synchronize()
    marks["end"] = time.perf_counter() - t0
    disk.halt.set()
    disk.join()
    return _summary(marks, reads, disk.samples, model)


def _summary(marks: dict[str, float], reads: list[Any], samples: list[tuple[float, int]], model: Any) -> dict[str, Any]:
    base = samples[0][1] if samples else 0
    delivered = [(t, b - base) for t, b in samples]
    total = delivered[-1][1] if delivered else 0
    first = next((t for t, b in delivered if b >= 1 << 20), None)
    last = next((t for t, b in delivered if b >= total - (1 << 20)), None)
    data_reads = [r for r in reads if r[2] >= 1 << 20]  # tensor chunks, not headers
    first_read = min((s for s, _, _ in data_reads), default=None)
    out: dict[str, Any] = {k: round(v, 4) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}
    out["seconds"] = marks["end"]
    out["gpu_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    out["reads"] = {
        "count": len(reads),
        "bytes": sum(r[2] for r in reads),
        "first_data_start": first_read,
        "last_end": max((e for _, e, _ in reads), default=None),
        "most_in_flight": _in_flight(data_reads),
    }
    before = next((b for t, b in reversed(delivered) if first_read is not None and t <= first_read), 0)
    out["disk"] = {
        "bytes": total,
        "first_MiB_at": first,
        "all_but_last_MiB_at": last,
        "GBps_busy": total / (last - first) / 1e9 if first is not None and last and last > first else None,
        "bytes_before_first_read": before,
    }
    # 50 ms buckets of what the disk delivered, for a plot
    buckets: list[int] = []
    for t, b in delivered:
        i = int(t / 0.05)
        while len(buckets) <= i:
            buckets.append(buckets[-1] if buckets else 0)
        buckets[i] = b
    out["disk"]["MB_per_50ms"] = [round((b - a) / 1e6, 1) for a, b in zip([0, *buckets[:-1]], buckets)]
    return out


# --------------------------------------------------------------------------- the driver


def files_of(source: Path) -> list[Path]:
    return [p for p in sorted(source.rglob("*")) if p.is_file()] if source.is_dir() else [source]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="what zeroio.load reads (folder or file)")
    parser.add_argument("--config", type=Path, required=True, help="make_checkpoint's manifest.json")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], required=True, help="the model's dtype")
    parser.add_argument("--trees", nargs="+", default=[f"here={HERE.parent}"], help="NAME=TREE[:ENV=VALUE,...]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", choices=["cold", "cold-files"], default="cold-files")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):
        trees = args.trees[i % len(args.trees) :] + args.trees[: i % len(args.trees)]
        for spec in trees:
            name, _, rest = spec.partition("=")
            tree, _, extra = rest.partition(":")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(HERE), os.environ.get("PYTHONPATH", "")]))
            env.update(dict(kv.split("=", 1) for kv in extra.split(",") if kv))
            if args.cache == "cold":
                bench.drop_caches()
            else:
                bench.evict_files(files_of(args.source))
            cmd = [sys.executable, __file__, "--child", "--source", str(args.source), "--config", str(args.config)]
            proc = subprocess.run([*cmd, "--dtype", args.dtype], env=env, capture_output=True, text=True, check=False)
            run: dict[str, Any] = {"tree": name, "env": extra, "round": i, "cache": args.cache}
            if proc.returncode:
                run["error"] = proc.stderr[-2000:]
            else:
                run.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "disk"}), flush=True)
    if args.json:
        out = {"machine": bench.machine_info(), "source": str(args.source), "dtype": args.dtype, "runs": runs}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
