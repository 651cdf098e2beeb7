"""CPU time (user+sys, of the converting process) with and without CRC checks, warm cache, alternating."""

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = "/tmp/zeroio-bench/gpt-470M"
OUT = "/tmp/crc-bench/out2"
CODE = "/tmp/crc-bench/src"
res = {}
subprocess.run(f"cat {SRC}/*/* > /dev/null", shell=True, check=True)
for rep in range(4):
    for name in ["crc", "nocrc"] if rep % 2 == 0 else ["nocrc", "crc"]:
        shutil.rmtree(OUT, ignore_errors=True)
        flags = [] if name == "crc" else ["--no-verify-crc"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "zeroio", "convert", SRC, OUT, "--quiet", *flags],
            env=dict(os.environ, PYTHONPATH=CODE),
            check=True,
        )
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        user = after.ru_utime - before.ru_utime
        res.setdefault(name, []).append((round(wall, 2), round(cpu, 2), round(user, 2)))
        print(rep, name, f"wall {wall:.2f} cpu {cpu:.2f} user {user:.2f} load {os.getloadavg()[0]:.1f}", flush=True)
shutil.rmtree(OUT, ignore_errors=True)
Path("/tmp/crc-bench/results2.json").write_text(json.dumps(res, indent=1))
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
