"""Is it the read pattern or the reader? One cold read of the same files by fastsafetensors' C++ threads, Python
threads (``read_limit.py``) and one Python thread driving Linux AIO (``aio_read.py``), in one run.

fastsafetensors (``nogds=True``) reads 16 threads x 512 KiB ``O_DIRECT`` (its 16 MiB bounce buffer cut into two
slots a thread) into pinned memory and on to the GPU; it is timed here from the loader's creation to its last copy,
after torch, its module and the CUDA context are loaded. ``fst@T,K,D``: T threads, bounce buffer of K KiB
(T x 2 slots: K / 2T KiB reads), ``D`` 1 for ``O_DIRECT``, 0 buffered (``FASTSAFETENSORS_ODIRECT``). Every
measurement reads cold files (evicted first)::

    python benchmarks/read_engines.py --files /tmp/zr/hf-bf16/model-0000*.safetensors --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

METHODS = [
    "fst@16,16384,1", "fst@16,16384,0", "fst@16,524288,1", "fst@16,524288,0",
    "threads@d16x512", "threads@b16x32768", "aio@16x512", "aio@32x512", "aio@8x4096",
]  # fmt: skip


def fastsafetensors_child(files: list[str], spec: str) -> dict[str, Any]:
    import torch
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    threads, kib, _ = (int(x) for x in spec.split(","))
    torch.empty(1, device="cuda")  # the CUDA context, outside the clock
    t0 = time.perf_counter()
    loader = SafeTensorsFileLoader(SingleGroup(), "cuda:0", bbuf_size_kb=kib, max_threads=threads, nogds=True)
    loader.add_filenames({0: files})
    buffer = loader.copy_files_to_device()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    nbytes = sum(Path(f).stat().st_size for f in files)
    buffer.close()
    loader.close()
    return {"seconds": seconds, "bytes": nbytes}


def measure(method: str, files: list[str]) -> dict[str, Any]:
    import aio_read
    import read_limit

    ranges = [(Path(f), 0, Path(f).stat().st_size) for f in files]
    kind, spec = method.split("@")
    if kind == "threads":
        threads, kib = (int(x) for x in spec[1:].split("x"))
        return read_limit.read_parallel(ranges, threads, kib << 10, direct=spec[0] == "d")
    if kind == "aio":
        depth, kib = (int(x) for x in spec.split("x"))
        return aio_read.read_aio(ranges, depth, kib << 10)
    env = dict(os.environ, FASTSAFETENSORS_ODIRECT=spec.rsplit(",", 1)[1])
    proc = subprocess.run(
        [sys.executable, __file__, "--child", spec, "--files", *files], env=env, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    if proc.returncode:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", nargs="+", required=True)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: start no run after it")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(fastsafetensors_child(args.files, args.child)))
        return 0
    import run as bench

    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for method in args.methods[i % len(args.methods) :] + args.methods[: i % len(args.methods)]:
            if args.deadline and time.time() > args.deadline:
                break
            bench.evict_files([Path(f) for f in args.files])
            run = {"method": method, "round": i, **measure(method, args.files)}
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "error"}), run.get("error", "")[-300:], flush=True)
            summary = {}
            for m in args.methods:
                times = [r["seconds"] for r in runs if r["method"] == m and "seconds" in r]
                if times:
                    summary[m] = {"median_s": statistics.median(times), "runs_s": times}
            if args.json:
                args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
