"""CRC cost: convert a checkpoint with/without --no-verify-crc, kernel copy or streaming, warm/cold, alternating.

Example (docs/benchmarks.md, "CRC-32 checks"):

    python benchmarks/make_checkpoint.py --params 470M --out /tmp/zeroio-bench/gpt-470M
    python benchmarks/crc_cost.py --checkpoint /tmp/zeroio-bench/gpt-470M --json crc-wall.json

Cold runs drop the page cache (``echo 3 > /proc/sys/vm/drop_caches``: root only).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "crc_kernel": ([], {}),
    "nocrc_kernel": (["--no-verify-crc"], {}),
    "crc_stream": ([], {"ZEROIO_NO_COPY_FILE_RANGE": "1"}),
    "nocrc_stream": (["--no-verify-crc"], {"ZEROIO_NO_COPY_FILE_RANGE": "1"}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="DeepSpeed checkpoint root to convert")
    parser.add_argument("--out", type=Path, help="output folder, replaced at every run (default: a temporary one)")
    parser.add_argument("--code", type=Path, help="zeroio tree to time (PYTHONPATH; default: the installed zeroio)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", nargs="+", default=["warm", "cold"], choices=["warm", "cold"])
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args(argv)
    src = str(args.checkpoint)
    out = str(args.out or Path(tempfile.mkdtemp(prefix="crc-bench-")) / "out")
    env_base = dict(os.environ, **({"PYTHONPATH": str(args.code)} if args.code else {}))
    results: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for cache in args.cache:
            names = list(VARIANTS)
            names = names[rep % 4 :] + names[: rep % 4]  # rotate order
            for name in names:
                flags, env = VARIANTS[name]
                shutil.rmtree(out, ignore_errors=True)
                if cache == "cold":
                    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
                else:  # warm: read the source once
                    subprocess.run(f"cat {src}/*/* > /dev/null", shell=True, check=True)
                t = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "zeroio", "convert", src, out, "--quiet", *flags],
                    env=dict(env_base, **env),
                    check=True,
                )
                dt = time.perf_counter() - t
                results.setdefault(f"{cache}/{name}", []).append(round(dt, 2))
                print(rep, cache, name, f"{dt:.2f}s load {os.getloadavg()[0]:.1f}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    summary = {k: {"runs": v, "median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in results.items()}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
