"""CRC cost: convert gpt-470M with/without --no-verify-crc, kernel copy or streaming, warm/cold, alternating."""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = "/tmp/zeroio-bench/gpt-470M"
OUT = "/tmp/crc-bench/out"
CODE = "/tmp/crc-bench/src"
variants = {
    "crc_kernel": ([], {}),
    "nocrc_kernel": (["--no-verify-crc"], {}),
    "crc_stream": ([], {"ZEROIO_NO_COPY_FILE_RANGE": "1"}),
    "nocrc_stream": (["--no-verify-crc"], {"ZEROIO_NO_COPY_FILE_RANGE": "1"}),
}
results = {}
for rep in range(3):
    for cache in ("warm", "cold"):
        names = list(variants)
        names = names[rep % 4 :] + names[: rep % 4]  # rotate order
        for name in names:
            flags, env = variants[name]
            shutil.rmtree(OUT, ignore_errors=True)
            if cache == "cold":
                subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
            else:  # warm: read the source once
                subprocess.run(f"cat {SRC}/*/* > /dev/null", shell=True, check=True)
            e = dict(os.environ, PYTHONPATH=CODE, **env)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "zeroio", "convert", SRC, OUT, "--quiet", *flags], env=e, check=True)
            dt = time.perf_counter() - t
            load = os.getloadavg()[0]
            results.setdefault(f"{cache}/{name}", []).append(round(dt, 2))
            print(rep, cache, name, f"{dt:.2f}s load {load:.1f}", flush=True)
shutil.rmtree(OUT, ignore_errors=True)
summary = {k: {"runs": v, "median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in results.items()}
Path("/tmp/crc-bench/results.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
