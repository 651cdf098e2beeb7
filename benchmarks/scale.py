"""Scale in ranks and tensors: open, inspect, plan and convert of a ZeRO-3 layout of R ranks x T tensors, against
DeepSpeed's lazy mode on the same layout. Each measurement is a fresh process (wall seconds, peak RSS).

The layout is built cheaply: a real DeepSpeed ZeRO-3 checkpoint of a narrow, deep GPT (``--layers`` blocks of
width 64: 12 tensors each, so 170 layers give 2,045 tensors; vocabulary 512, context 64: ~9M parameters) made on 2
CPU ranks by benchmarks/make_checkpoint.py, then ``zeroio.reshard`` to each rank count (DeepSpeed's own record
layout, written by zeroio's writer, as ``engine.load_checkpoint`` reads it).

    python benchmarks/scale.py --work /tmp/zeroio-scale --ranks 64 256 1024 --json benchmarks/results/scale.json

Methods (each in its own process, after one warm-up read of the files):

- ``open``: ``zeroio.open(ckpt)`` and its ``infos`` (every tensor's name, shape, dtype): the metadata parse.
- ``inspect``: ``python -m zeroio inspect CKPT`` (the CLI: parse + describe + print).
- ``plan``: ``zeroio.open`` + ``list(ckpt.iter_chunks(name))`` of no tensor: as ``open``, plus each tensor's read plan
  (``ckpt.byte_ranges`` of every tensor).
- ``convert``: ``python -m zeroio convert CKPT OUT --quiet`` (safetensors, fsynced).
- ``ds_lazy``: ``get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)`` (DeepSpeed 0.19.8), every
  tensor's shape read from its lazy stand-in (no data materialised).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CHILD = {
    "open": "import zeroio\nc = zeroio.open(SRC)\nn = len(c.infos)\nc.close()\nprint(n)",
    "plan": (
        "import zeroio\nc = zeroio.open(SRC)\nn = 0\nfor name in c.infos:\n"
        "    n += len(c.byte_ranges(c.source_name(name)) or ())\nc.close()\nprint(n)"
    ),
    "ds_lazy": (
        "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g\n"
        "sd = g(SRC, lazy_mode=True)\nprint(sum(1 for k, v in sd.items() if v.shape is not None))"
    ),
}


def _measure(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Wall time and peak RSS of one fresh process (``ru_maxrss`` of a waited child: use a wrapper per run)."""
    wrapper = (
        "import resource, subprocess, sys, time, json\n"
        "t0 = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "dt = time.perf_counter() - t0\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps({'seconds': dt, 'peak_rss_bytes': rss, 'exit': p.returncode, "
        "'out': p.stdout.strip()[-200:], 'err': p.stderr.strip()[-800:]}))\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", wrapper, *cmd], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"seconds": None, "timed_out": timeout}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tree_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def build(work: Path, layers: int) -> Path:
    """The 2-rank source checkpoint (real DeepSpeed ZeRO-3)."""
    src = work / f"src-{layers}"
    if not (src / "manifest.json").is_file():
        sys.path.insert(0, str(HERE))
        import make_checkpoint as make

        cfg_params = str(make.GPTConfig(512, 64, layers, 64, True).num_params())
        make.make_checkpoint(src, params=cfg_params, vocab=512, n_ctx=64, world_size=2, overwrite=True)
    return src


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/zeroio-scale"))
    parser.add_argument("--layers", type=int, default=170)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--methods", nargs="+", default=["open", "inspect", "plan", "convert", "ds_lazy"])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    src = build(args.work, args.layers)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    sys.path.insert(0, str(REPO))
    import zeroio

    results: list[dict[str, Any]] = []
    for ranks in args.ranks:
        ckpt = args.work / f"r{ranks}"
        if not ckpt.is_dir():
            t0 = time.perf_counter()
            zeroio.reshard(src, ckpt, world_size=ranks)
            print(f"resharded to {ranks} ranks in {time.perf_counter() - t0:.1f} s", flush=True)
        files, nbytes = _tree_bytes(ckpt)
        subprocess.run(["cat", *map(str, ckpt.rglob("*.pt"))], stdout=subprocess.DEVNULL, check=False)  # warm
        for method in args.methods:
            if method in CHILD:
                cmd = [sys.executable, "-c", f"SRC = {str(ckpt)!r}\n" + CHILD[method]]
            elif method == "inspect":
                cmd = [sys.executable, "-m", "zeroio", "inspect", str(ckpt)]
            else:
                out = args.work / "out"
                shutil.rmtree(out, ignore_errors=True)
                cmd = [sys.executable, "-m", "zeroio", "convert", str(ckpt), str(out), "--quiet"]
            run = {"ranks": ranks, "files": files, "bytes": nbytes, "method": method}
            run.update(_measure(cmd, env, args.timeout))
            results.append(run)
            shown = {k: v for k, v in run.items() if k not in ("err",)}
            print(json.dumps(shown), flush=True)
            if run.get("exit"):
                print(run.get("err"), file=sys.stderr)
    tensors = None
    with zeroio.open(args.work / f"r{args.ranks[0]}") as c:
        tensors = len(c.infos)
    out = {"layers": args.layers, "tensors": tensors, "runs": results, "cpus": os.cpu_count()}
    out["load_avg"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    _ = resource  # peak RSS is read in the wrapper process
    return 0


if __name__ == "__main__":
    sys.exit(main())
