"""Converting straight from S3 vs downloading the whole checkpoint first, against a local S3 server, one run.

Starts moto's S3 server behind the counting proxy the tests use (``tests/s3_server.py``, localhost only),
uploads a checkpoint, then alternates, each in a fresh process:

- ``direct``: ``zeroio convert s3://bench/run OUT`` (ranged reads of the weights and pickles only);
- ``download``: ``s3fs`` ``get`` of the whole folder to local disk, then ``zeroio convert LOCAL OUT``.

Reports wall seconds, bytes and GET requests the server served (the proxy's accounting), each child's peak RSS,
the machine's load average after each run, and the ratios direct / download. Usage::

    python benchmarks/remote.py --repeats 3 --json benchmarks/results/remote.json          # ~38 MB checkpoint
    python benchmarks/remote.py --checkpoint /tmp/zeroio-bench/gpt-125M --repeats 3         # a bigger one
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import run as harness
from s3_server import S3Server

DOWNLOAD_THEN_CONVERT = """
import sys, s3fs, zeroio
src, local, out = sys.argv[1:4]
s3fs.S3FileSystem().get(src.removeprefix("s3://") + "/", local, recursive=True)
zeroio.convert(local, out, progress=False)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def small_checkpoint(work: Path) -> Path:
    """The ~38 MB ZeRO-3 fp32 checkpoint tests/test_remote_s3.py builds (DeepSpeed on CPU, one rank)."""
    out = work / "ckpt"
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    worker = REPO / "tests" / "remote_ckpt_worker.py"
    subprocess.run([sys.executable, str(worker), str(out)], env=env, check=True, capture_output=True, timeout=600)
    return out


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Wall seconds and the child's own peak RSS in bytes (its ``VmHWM``, sampled by run.py's sampler).

    Not ``wait4``'s ``ru_maxrss``: on Linux a child started by (v)fork + exec inherits its parent's high-water mark
    at the exec, so every child would report at least this process's RSS (moto's server lives in it)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = harness._Sampler(proc.pid)
    sampler.start()
    assert proc.stderr is not None
    err = proc.stderr.read()
    proc.wait()
    seconds = time.perf_counter() - t0
    sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed: {err[-2000:].decode(errors='replace')}")
    return seconds, sampler.peak_rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="local checkpoint root to upload (default: build ~38 MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="zeroio-remote-bench-"))
    server = S3Server()
    try:
        local = args.checkpoint or small_checkpoint(work)
        source_bytes = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        url = server.upload_tree(local, "bench", "run")
        env = dict(os.environ, **server.env(), PYTHONPATH=str(REPO))
        runs: list[dict[str, float | str | int]] = []
        for i in range(args.repeats):
            for method in ["direct", "download"] if i % 2 == 0 else ["download", "direct"]:
                out, staged = work / f"out-{method}-{i}", work / f"local-{i}"
                if method == "direct":
                    cmd = [sys.executable, "-m", "zeroio", "convert", url, str(out), "--quiet"]
                else:
                    cmd = [sys.executable, "-c", DOWNLOAD_THEN_CONVERT, url, str(staged), str(out)]
                server.accounting.reset()
                seconds, peak = _run(cmd, env)
                row = {"method": method, "seconds": seconds, "served_bytes": server.accounting.body_bytes,
                       "gets": server.accounting.gets, "peak_rss_mib": round(peak / 2**20, 1),
                       "load_average_1min": round(os.getloadavg()[0], 2)}  # fmt: skip
                runs.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(staged, ignore_errors=True)
        summary: dict[str, float | int] = {"source_bytes": source_bytes}
        for method in ("direct", "download"):
            mine = [r for r in runs if r["method"] == method]
            summary[f"{method}_median_s"] = statistics.median(float(r["seconds"]) for r in mine)
            summary[f"{method}_served_bytes"] = int(statistics.median(int(r["served_bytes"]) for r in mine))
            summary[f"{method}_gets"] = int(statistics.median(int(r["gets"]) for r in mine))
            summary[f"{method}_peak_rss_mib"] = max(float(r["peak_rss_mib"]) for r in mine)
        summary["time_ratio_direct_over_download"] = summary["direct_median_s"] / summary["download_median_s"]
        summary["bytes_ratio_direct_over_download"] = summary["direct_served_bytes"] / summary["download_served_bytes"]
        print(json.dumps(summary, indent=2))
        if args.json:
            args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2) + "\n")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
