"""`zeroio.load` to a CUDA device vs the disk's cold-read limit of the same bytes vs DeepSpeed's loader, one run.

Each measurement runs in a fresh process (cold runs after dropping the page cache), alternating methods:

- ``read-limit``: ``pread`` of exactly the fp32 master-weight records ``zeroio.load`` reads, 64 MiB at a time, one
  thread: the bytes-read bound a loader cannot beat.
- ``zeroio``: a meta-device model built from the checkpoint's config, ``zeroio.load(..., device="cuda",
  dtype="bf16")`` until ``torch.cuda.synchronize()``.
- ``zeroio-nocrc``: the same with ``verify_crc=False`` (what the CRC-32 checks cost).
- ``deepspeed``: ``get_fp32_state_dict_from_zero_checkpoint`` + ``load_state_dict`` + ``.to("cuda", bf16)``.

Reports seconds (the load call alone and the whole process), host peak RSS and GPU peak allocated memory, and the
ratio read-limit / zeroio (issue 17 asks for >= 0.9). Usage::

    python benchmarks/make_checkpoint.py --params 1.3B --world-size 8 --out /tmp/ckpt-1.3B
    python benchmarks/gpu_load.py --checkpoint /tmp/ckpt-1.3B --repeats 3 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench

CHUNK = 64 * 2**20


def read_limit(checkpoint: Path) -> dict[str, float]:
    """Read the fp32 records zeroio.load reads, sequentially, into one reused buffer."""
    ranges = bench.fp32_ranges(checkpoint)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for path, offset, nbytes in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [view[: min(CHUNK, nbytes - done)]], offset + done)
                if n <= 0:
                    raise OSError(f"short read in {path}")
                done += n
        finally:
            os.close(fd)
        total += nbytes
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": total}


def _meta_model(checkpoint: Path):  # type: ignore[no-untyped-def]
    import make_checkpoint as make
    import torch

    cfg = make.GPTConfig(**json.loads((checkpoint / "manifest.json").read_text())["config"])
    with torch.device("meta"):
        return make.build_model(cfg)


def child(method: str, checkpoint: Path) -> dict[str, float]:
    """One measurement, in this (fresh) process."""
    t_start = time.perf_counter()
    if method == "read-limit":
        out = read_limit(checkpoint)
        out["process_seconds"] = time.perf_counter() - t_start
        return out
    import torch

    model = _meta_model(checkpoint)
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if method.startswith("zeroio"):
        import zeroio

        crc = method != "zeroio-nocrc"
        zeroio.load(checkpoint, model, device="cuda", dtype="bf16", progress=False, verify_crc=crc)
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
        model.load_state_dict(state, strict=False, assign=True)
        del state
        model.to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "process_seconds": time.perf_counter() - t_start,
        "host_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gpu_peak_mib": torch.cuda.max_memory_allocated() / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["read-limit", "zeroio", "deepspeed"])
    parser.add_argument("--cache", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.checkpoint)))
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    runs: list[dict] = []
    if "cold" in args.cache and not bench.can_drop_caches():
        print("cannot drop the page cache here (needs root): measuring warm only", file=sys.stderr)
        args.cache = ["warm"]
    for cache in args.cache:
        for i in range(args.repeats):
            for method in args.methods:
                if cache == "cold":
                    bench.drop_caches()
                elif i == 0:
                    child("read-limit", args.checkpoint)  # warm the cache with the bytes themselves
                proc = subprocess.run(
                    [sys.executable, __file__, "--checkpoint", str(args.checkpoint), "--child", method],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{method} failed (exit {proc.returncode})")
                result = {"method": method, "cache": cache, **json.loads(proc.stdout.strip().splitlines()[-1])}
                runs.append(result)
                print(json.dumps(result), flush=True)
    summary: dict[str, dict[str, float]] = {}
    for cache in args.cache:
        for method in args.methods:
            times = [r["seconds"] for r in runs if r["method"] == method and r["cache"] == cache]
            summary[f"{method}/{cache}"] = {"median_s": statistics.median(times), "min_s": min(times)}
        if "zeroio" in args.methods and "read-limit" in args.methods:
            limit = summary[f"read-limit/{cache}"]["median_s"]
            summary[f"ratio/{cache}"] = {"read_limit_over_zeroio": limit / summary[f"zeroio/{cache}"]["median_s"]}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
