"""Loaders side by side, one run, one safetensors checkpoint, onto one GPU: cold and warm page cache.

Every measurement runs in a fresh process, methods rotated per round, the page cache dropped before each cold run
(root). In each process torch is imported and the checkpoint's GPT is built on ``meta`` in the files' dtype first;
the clock starts before the loader's import and stops after ``torch.cuda.synchronize()`` once every weight of the
model is on the GPU. Methods:

- ``zeroio``: ``zeroio.load(folder, model, device="cuda")`` (``zeroio@tT`` / ``zeroio@tTcC``: with
  ``ZEROIO_READ_THREADS=T`` and ``ZEROIO_STAGING_BYTES=C`` MiB; ``zeroio-direct`` / ``zeroio-buffered``: with
  ``ZEROIO_DIRECT_READS=1`` / ``0``; ``zeroio@b=512KiB,d=1,p=0,t=16,c=16MiB``: ``ZEROIO_READ_BLOCK``,
  ``ZEROIO_DIRECT_READS``, ``ZEROIO_PREFETCH_BYTES``, ``ZEROIO_READ_THREADS``, ``ZEROIO_STAGING_BYTES``).
- ``zeroio-zero3``: the same from the ZeRO-3 checkpoint the files were converted from (``--zero``; its fp32
  records, cast on the GPU to the files' dtype).
- ``safetensors``: ``safetensors.torch.load_file(f, device="cuda")`` per file + ``load_state_dict(assign=True)``.
- ``fastsafetensors``: ``fastsafe_open(files, device="cuda:0", nogds=True)`` + ``load_state_dict(assign=True)``.
- ``runai``: runai-model-streamer's ``SafetensorsStreamer.stream_files`` to host memory, each tensor ``.to("cuda")``
  as vLLM does, + ``load_state_dict(assign=True)``.
- ``read-limit``: 16 threads of 32 MiB positioned reads of the files (benchmarks/read_limit.py), no GPU;
  ``read-limit-zero3``: the same of the ZeRO checkpoint's fp32 master-weight records (what ``zeroio-zero3`` reads);
  ``read-limit-direct``: 16 threads of 16 MiB ``O_DIRECT`` reads of the files (no page cache);
  ``read-limit@d16x512`` / ``read-limit@b16x32768``: T threads of K KiB reads, ``d`` ``O_DIRECT``, ``b`` buffered
  (``read-limit-zero3@...``: of the ZeRO records).
- ``transformers`` (with ``--hf``: a GPT-2 folder of ``make_safetensors.py --hf``): ``from_pretrained(folder,
  device_map="cuda", dtype=...)``, timed from before the import of transformers, its own model build included.

Usage::

    python benchmarks/loaders_side_by_side.py --folder /tmp/zb/st-bf16 --zero /tmp/zb/ck --config manifest.json \\
        --rounds 2 --json side-by-side-bf16.json
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

import read_limit
import run as bench

METHODS = ["zeroio", "safetensors", "fastsafetensors", "runai", "read-limit"]


def _files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.glob("*.safetensors"))


def _model(config: Path, dtype: Any, hf: Path | None = None) -> Any:
    import torch

    if hf is not None:  # a transformers model of the folder's config.json, built on meta
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(hf)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    import make_checkpoint as make

    cfg = make.GPTConfig(**json.loads(config.read_text())["config"])
    with torch.device("meta"):
        return make.build_model(cfg).to(dtype)


def _load(method: str, args: argparse.Namespace, model: Any) -> None:
    import torch

    files = _files(args.folder)
    if method == "transformers":
        import transformers

        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(args.folder, device_map="cuda", dtype=dtype)
        torch.cuda.synchronize()
        model.loaded = loaded  # counted below as the model on the GPU
        return
    if method.startswith("zeroio"):
        import zeroio

        source = args.zero if method.startswith("zeroio-zero3") else args.folder
        assert Path(zeroio.__file__).parent.parent != HERE.parent or not method.endswith("-before")
        dtype = next(model.parameters()).dtype
        zeroio.load(source, model, device="cuda", dtype=dtype, strict=False)
        return
    state: dict[str, Any] = {}
    if method == "safetensors":
        from safetensors.torch import load_file

        for f in files:
            state.update(load_file(f, device="cuda"))
    elif method == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        with fastsafe_open(filenames=files, device="cuda:0", nogds=True) as f:
            for key in f.keys():  # noqa: SIM118 (fastsafe_open is no mapping)
                state[key] = f.get_tensor(key)
    elif method == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for key, tensor in streamer.get_tensors():
                state[key] = tensor.to("cuda")
    else:
        raise SystemExit(f"unknown method {method}")
    model.load_state_dict(state, strict=False, assign=True)
    del state
    torch.cuda.synchronize()


def child(method: str, args: argparse.Namespace) -> dict[str, Any]:
    if method.startswith("read-limit"):  # read-limit-zero3: the ZeRO checkpoint's fp32 records
        if method.startswith("read-limit-zero3"):
            ranges = bench.fp32_ranges(args.zero)
        else:
            ranges = [(Path(f), 0, Path(f).stat().st_size) for f in _files(args.folder)]
        if "@" in method:  # read-limit@d16x512: 16 threads of 512 KiB O_DIRECT reads (b: buffered)
            spec = method.split("@", 1)[1]
            threads, kib = (int(x) for x in spec[1:].split("x"))
            r = read_limit.read_parallel(ranges, threads, kib << 10, direct=spec[0] == "d")
        elif method == "read-limit-direct":  # O_DIRECT
            r = read_limit.read_parallel(ranges, 16, 16 << 20, direct=True)
        else:
            r = read_limit.read_parallel(ranges, 16, 32 << 20)
        return {"seconds": r["seconds"], "bytes": r["bytes"]}
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = _model(args.config, dtype, args.folder if args.hf else None)
    torch.cuda.init()
    before = set(sys.modules)
    t0 = time.perf_counter()
    _load(method, args, model)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new = set(sys.modules) - before
    model = getattr(model, "loaded", model)
    on_gpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    return {
        "seconds": seconds,
        "gpu_bytes": on_gpu,
        "modules_imported": len(new),
        "dynamo_imported": "torch._dynamo" in new,
        "sympy_imported": "sympy" in new,
        "gpu_peak_mib": torch.cuda.max_memory_allocated() / 2**20,
    }


def _env(method: str, before: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    tree = str(before) if before is not None and method.endswith("-before") else str(HERE.parent)
    env["PYTHONPATH"] = os.pathsep.join([tree, str(HERE), env.get("PYTHONPATH", "")])
    if method.startswith(("zeroio-direct", "zeroio-buffered")):
        env["ZEROIO_DIRECT_READS"] = "1" if method.startswith("zeroio-direct") else "0"
    if "@" in method and "=" in method:  # zeroio@b=512KiB,d=1,p=0,t=16,c=16MiB
        names = {"b": "ZEROIO_READ_BLOCK", "d": "ZEROIO_DIRECT_READS", "p": "ZEROIO_PREFETCH_BYTES"}
        names.update(t="ZEROIO_READ_THREADS", c="ZEROIO_STAGING_BYTES")
        for item in method.split("@", 1)[1].split(","):
            key, _, value = item.partition("=")
            env[names[key]] = value
    elif "@" in method and method.startswith("zeroio"):  # zeroio@t16c32: reader threads, staging MiB
        spec = method.split("@", 1)[1]
        threads, _, chunk = spec.lstrip("t").partition("c")
        env["ZEROIO_READ_THREADS"] = threads
        if chunk:
            env["ZEROIO_STAGING_BYTES"] = str(int(chunk) << 20)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", type=Path, required=True, help="safetensors folder (zeroio convert output)")
    parser.add_argument("--zero", type=Path, help="the ZeRO checkpoint it came from (zeroio-zero3)")
    parser.add_argument("--config", type=Path, required=True, help="make_checkpoint's manifest.json")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], required=True, help="the files' dtype")
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--before", type=Path, help="another tree: methods ending in -before import its zeroio")
    parser.add_argument(
        "--cache", nargs="+", default=["cold", "warm"], choices=["cold", "cold-files", "warm"],
        help="cold: every cache dropped; cold-files: only the checkpoint files evicted (torch and the loaders cached)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hf", action="store_true", help="the folder is a transformers model (config.json)")
    parser.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: stop starting runs after it")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    if "cold" in args.cache and not (bench.can_drop_caches() and not os.environ.get("NO_COLD")):
        args.cache = [c for c in args.cache if c != "cold"] or ["warm"]
    evict = [Path(f) for f in _files(args.folder)]
    if args.zero:
        evict += [p for p in sorted(args.zero.rglob("*")) if p.is_file()]
    runs: list[dict[str, Any]] = []
    base = [sys.executable, __file__, "--folder", str(args.folder), "--config", str(args.config)]
    base += ["--dtype", args.dtype] + (["--zero", str(args.zero)] if args.zero else []) + (["--hf"] if args.hf else [])
    warm_ranges = [(Path(f), 0, Path(f).stat().st_size) for f in _files(args.folder)]
    if args.zero:
        warm_ranges += bench.fp32_ranges(args.zero)
    for cache in args.cache:
        for i in range(args.rounds):
            order = args.methods[i % len(args.methods) :] + args.methods[: i % len(args.methods)]
            for method in order:
                if args.deadline and time.time() > args.deadline:
                    break
                if cache == "cold":
                    bench.drop_caches()
                elif cache == "cold-files":
                    bench.evict_files(evict)
                else:
                    read_limit.read_parallel(warm_ranges, 16, 32 << 20)
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [*base, "--child", method],
                    env=_env(method, args.before),
                    capture_output=True,
                    text=True,
                    check=False,
                )
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    result: dict[str, Any] = {"error": proc.stderr[-1500:]}
                else:
                    result = json.loads(proc.stdout.strip().splitlines()[-1])
                run = {"method": method, "cache": cache, "round": i, "process_s": wall, **result}
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "error"}), flush=True)
                if "error" in run:
                    print(run["error"], file=sys.stderr)
    summary: dict[str, Any] = {}
    for cache in args.cache:
        for method in args.methods:
            times = [r["seconds"] for r in runs if r["method"] == method and r["cache"] == cache and "seconds" in r]
            if times:
                summary[f"{method}/{cache}"] = {"median_s": statistics.median(times), "runs_s": times}
    print(json.dumps(summary, indent=1))
    if args.json:
        out = {"machine": bench.machine_info(), "dtype": args.dtype, "folder": str(args.folder)}
        out["bytes"] = sum(r[2] for r in warm_ranges[: len(_files(args.folder))])
        args.json.write_text(json.dumps({**out, "runs": runs, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
