"""CPU time (user+sys, of the converting process) with and without CRC checks, warm cache, alternating.

Example (docs/benchmarks.md, "CRC-32 checks"):

    python benchmarks/crc_cpu.py --checkpoint /tmp/zeroio-bench/gpt-470M --json crc-cpu.json
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="DeepSpeed checkpoint root to convert")
    parser.add_argument("--out", type=Path, help="output folder, replaced at every run (default: a temporary one)")
    parser.add_argument("--code", type=Path, help="zeroio tree to time (PYTHONPATH; default: the installed zeroio)")
    parser.add_argument("--pairs", type=int, default=4, help="alternating (crc, nocrc) pairs")
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args(argv)
    src = str(args.checkpoint)
    out = str(args.out or Path(tempfile.mkdtemp(prefix="crc-cpu-")) / "out")
    env = dict(os.environ, **({"PYTHONPATH": str(args.code)} if args.code else {}))
    res: dict[str, list[tuple[float, float, float]]] = {}
    subprocess.run(f"cat {src}/*/* > /dev/null", shell=True, check=True)
    for rep in range(args.pairs):
        for name in ["crc", "nocrc"] if rep % 2 == 0 else ["nocrc", "crc"]:
            shutil.rmtree(out, ignore_errors=True)
            flags = [] if name == "crc" else ["--no-verify-crc"]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "zeroio", "convert", src, out, "--quiet", *flags], env=env, check=True)
            wall = time.perf_counter() - t
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            user = after.ru_utime - before.ru_utime
            res.setdefault(name, []).append((round(wall, 2), round(cpu, 2), round(user, 2)))
            print(rep, name, f"wall {wall:.2f} cpu {cpu:.2f} user {user:.2f} load {os.getloadavg()[0]:.1f}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(
            k,
            "median wall",
            statistics.median(x[0] for x in v),
            "cpu",
            statistics.median(x[1] for x in v),
            "user",
            statistics.median(x[2] for x in v),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
