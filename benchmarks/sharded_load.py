"""Load a ZeRO-3 checkpoint into a bf16 FSDP2 model on several ranks, side by side (issue 24, goal 6).

Every run is a fresh job of W processes (one per rank, started here with torchrun's environment), cold page cache
first when allowed (root), methods alternating. Each rank builds the checkpoint's GPT (benchmarks/make_checkpoint.py)
on ``meta`` in bf16, shards it with FSDP2 (``fully_shard`` per block, then the root) and fills it by:

- ``zeroio``: ``zeroio.load(ckpt, model)`` on every rank: each rank reads only its rows of the fp32 masters;
- ``zeroio_bcast``: the same with ``broadcast_from_rank0=True`` (rank 0 reads, broadcasts 16 MiB chunks);
- ``rank0``: rank 0 consolidates with DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``, casts to bf16, and
  ``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` sends it out;
- ``dcp``: the same weights saved as DCP by FSDP2 (``--make-dcp``), ``to_empty`` + ``get_model_state_dict`` +
  ``dcp.load`` + ``set_model_state_dict`` (the torchtitan pattern);
- ``deepspeed``: a ``deepspeed.zero.Init`` model + ``deepspeed.initialize`` + ``engine.load_checkpoint`` at the
  checkpoint's own world size (``--ds-world``), the only world size it accepts.

Per rank it records the load's wall time (barrier to barrier), the bytes it read (``/proc/self/io``: ``rchar``
through read syscalls, ``read_bytes`` from the block device), its peak RSS (``VmHWM``) and, on CUDA, the GPU peak;
and a CRC-32 of its local shards, so the driver checks that every method filled identical shards. ``--limits``
adds the cold-read limits of the same bytes: the fp32 records zeroio reads (one thread, and W threads), and the
DCP files. ``--cuda-methods`` runs 1-rank jobs on CUDA (NCCL, model on the GPU). Usage::

    python benchmarks/make_checkpoint.py --params 1.3B --world-size 8 --out /tmp/ck
    python benchmarks/sharded_load.py --checkpoint /tmp/ck --dcp /tmp/ck-dcp --make-dcp --worlds 2 4 \\
        --methods zeroio zeroio_bcast rank0 dcp --cuda-methods zeroio rank0 dcp --limits --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import run as bench

CHUNK = 64 * 2**20
TIMES: dict[str, float] = {}
"""Parts of a rank's load timed apart (``open_seconds``), reported beside its total."""
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------- rank side


def _io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        out[key.strip()] = int(value)
    return out


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _config(checkpoint: Path) -> Any:
    import make_checkpoint as make

    return make.GPTConfig(**json.loads((checkpoint / "manifest.json").read_text())["config"])


def _fsdp_model(checkpoint: Path, device: str, dtype: Any) -> Any:
    """The checkpoint's GPT on ``meta`` in ``dtype``, sharded by FSDP2 over all ranks (per block, then the root)."""
    import make_checkpoint as make
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = make.build_model(_config(checkpoint)).to(dtype)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _digest(model: Any) -> dict[str, Any]:
    """CRC-32 of this rank's local shards (name order), their bytes, and where they live."""
    import torch
    from torch.distributed.tensor import DTensor

    crc, nbytes, devices = 0, 0, set()
    for name, p in sorted(model.state_dict().items()):
        local = p.to_local() if isinstance(p, DTensor) else p
        devices.add(str(local.device))
        data = local.detach().contiguous().cpu()
        raw = data.view(torch.uint8) if data.dim() else data.reshape(1).view(torch.uint8)
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(raw.numpy(), crc)
        nbytes += data.numel() * data.element_size()
    return {"crc32": crc, "local_bytes": nbytes, "devices": sorted(devices)}


def _load(method: str, args: argparse.Namespace, device: str) -> tuple[Any, float, dict[str, int], float]:
    """Build, then time the load between two barriers; ``(model, seconds, io delta, setup seconds)``."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t_setup = time.perf_counter()
    if method == "deepspeed":
        return _load_deepspeed(args, device)
    model = _fsdp_model(args.checkpoint, device, torch.bfloat16)
    setup = time.perf_counter() - t_setup
    dist.barrier()
    io0, t0 = _io(), time.perf_counter()
    if method.startswith("zeroio"):
        import zeroio
        import zeroio._load.sharded as tuning  # zeroio_rN: N reader threads per rank (a tuning run, not an API)

        if method.startswith("zeroio_r"):
            tuning.READERS = int(method.removeprefix("zeroio_r"))
        if method.startswith("zeroio_c"):  # zeroio_cN: staging chunks of N MiB
            os.environ["ZEROIO_STAGING_BYTES"] = str(int(method.removeprefix("zeroio_c")) * 2**20)
        with zeroio.open(args.checkpoint) as ckpt:  # timed apart: the metadata reads before any tensor bytes
            TIMES["open_seconds"] = time.perf_counter() - t0
            zeroio.load(ckpt, model, device=device if device == "cuda" else None, progress=False,
                        broadcast_from_rank0=method == "zeroio_bcast")  # fmt: skip
    elif method == "rank0":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, Any] = {}
        if rank == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            full = get_fp32_state_dict_from_zero_checkpoint(str(args.checkpoint))
            full = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full.items()}
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=opts)
        del full
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        model.to_empty(device=device)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=str(args.dcp))
        set_model_state_dict(model, state)
    else:
        raise SystemExit(f"unknown method {method!r}")
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t0
    io1 = _io()
    return model, seconds, {k: io1[k] - io0[k] for k in io0}, setup


def _load_deepspeed(args: argparse.Namespace, device: str) -> tuple[Any, float, dict[str, int], float]:
    """DeepSpeed's own route: zero.Init model, engine, ``load_checkpoint`` (only at the checkpoint's world size)."""
    import deepspeed
    import make_checkpoint as make
    import torch
    import torch.distributed as dist

    t_setup = time.perf_counter()
    config = make.ds_config()
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = make.build_model(_config(args.checkpoint))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    setup = time.perf_counter() - t_setup
    dist.barrier()
    io0, t0 = _io(), time.perf_counter()
    engine.load_checkpoint(str(args.checkpoint), load_optimizer_states=False, load_lr_scheduler_states=False)
    dist.barrier()
    seconds = time.perf_counter() - t0
    io1 = _io()
    return engine.module, seconds, {k: io1[k] - io0[k] for k in io0}, setup


def _save_dcp(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark's DCP source: FSDP2 (fp32, on these ranks) filled by zeroio, then ``dcp.save``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import zeroio

    model = _fsdp_model(args.checkpoint, "cpu", torch.float32)
    zeroio.load(args.checkpoint, model, progress=False)
    t0 = time.perf_counter()
    dcp.save(get_model_state_dict(model), checkpoint_id=str(args.dcp))
    return {"save_seconds": time.perf_counter() - t0}


def worker(method: str, args: argparse.Namespace) -> int:
    """One rank of a job: load by ``method`` and write ``report.<rank>.json``."""
    age0 = bench_age()
    import torch
    import torch.distributed as dist

    device = "cuda" if args.cuda else "cpu"
    if method == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if args.cuda else "gloo")
    else:
        dist.init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    if args.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.reset_peak_memory_stats()
    rss_before = _status_kib("VmRSS")
    if method == "save_dcp":
        out: dict[str, Any] = _save_dcp(args)
    else:
        model, seconds, io, setup = _load(method, args, device)
        out = {"seconds": seconds, "setup_seconds": setup, **{f"io_{k}": v for k, v in io.items()}}
        if args.cuda:
            out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_rss_bytes"] = _status_kib("VmHWM") * 1024
        out["rss_before_bytes"] = rss_before * 1024
        if method != "deepspeed":  # its parameters are partitions (ds_tensor): compared by the tests, not here
            out.update(_digest(model))
    out.update(rank=rank, startup_seconds=age0, process_seconds=bench_age(), **TIMES)
    (args.report / f"report.{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def bench_age() -> float:
    """Seconds since this process was created."""
    with open("/proc/self/stat") as fh:
        start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- driver side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(method: str, world: int, args: argparse.Namespace, *, cuda: bool, timeout: float) -> dict[str, Any]:
    """Run one job of ``world`` ranks; the per-rank reports and the job's wall time."""
    report = args.work / f"{method}-{world}{'-cuda' if cuda else ''}"
    report.mkdir(parents=True, exist_ok=True)
    for old in report.glob("report.*.json"):
        old.unlink()
    port = str(_free_port())
    threads = str(max(1, (os.cpu_count() or 1) // world))
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    paths = [str(HERE), str(REPO), base.get("PYTHONPATH", "")]
    base.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS=threads, MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    if method == "deepspeed" and not cuda:
        base["DS_ACCELERATOR"] = "cpu"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", method, "--checkpoint", str(args.checkpoint),
           "--dcp", str(args.dcp), "--report", str(report)] + (["--cuda"] if cuda else [])  # fmt: skip
    t0 = time.perf_counter()
    logs = [open(report / f"log.{r}.txt", "w") for r in range(world)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            cmd,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r if cuda else 0)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for fh in logs:
        fh.close()
    wall = time.perf_counter() - t0
    ranks = [json.loads(f.read_text()) for f in sorted(report.glob("report.*.json"))]
    result: dict[str, Any] = {"method": method, "world": world, "cuda": cuda, "wall_seconds": wall, "ranks": ranks}
    if len(ranks) != world or any(c != 0 for c in codes):
        tail = (report / "log.0.txt").read_text()[-1500:]
        result["error"] = f"exit codes {codes}; rank 0 log tail: {tail}"
        return result
    if method != "save_dcp":
        result["seconds"] = max(r["seconds"] for r in ranks)
        if all("open_seconds" in r for r in ranks):
            result["open_seconds"] = max(r["open_seconds"] for r in ranks)
        for key in ("io_rchar", "io_read_bytes"):
            result[f"total_{key}"] = sum(r[key] for r in ranks)
        result["peak_rss_bytes_per_rank"] = [r["peak_rss_bytes"] for r in ranks]
        result["crc32"] = [r.get("crc32") for r in ranks]
        if cuda:
            result["gpu_peak_bytes_per_rank"] = [r["gpu_peak_bytes"] for r in ranks]
    return result


def read_ranges(ranges: list[tuple[Path, int, int]], threads: int) -> dict[str, float]:
    """``pread`` the byte ranges, split into ``threads`` equal shares read at once, into reused buffers."""
    pieces = [(p, o + s, min(CHUNK, n - s)) for p, o, n in ranges for s in range(0, n, CHUNK)]
    total = sum(n for _, _, n in pieces)

    def read(share: list[tuple[Path, int, int]]) -> None:
        buf = memoryview(bytearray(CHUNK))
        fds: dict[Path, int] = {}
        for path, offset, nbytes in share:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [buf[: nbytes - done]], offset + done)
                if n <= 0:
                    raise OSError(f"short read in {path}")
                done += n
        for fd in fds.values():
            os.close(fd)

    per = -(-total // threads)
    shares: list[list[tuple[Path, int, int]]] = [[] for _ in range(threads)]
    acc = 0
    for piece in pieces:
        shares[min(threads - 1, acc // per)].append(piece)
        acc += piece[2]
    t0 = time.perf_counter()
    workers = [threading.Thread(target=read, args=(s,)) for s in shares]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"seconds": time.perf_counter() - t0, "bytes": total, "threads": threads}


def limits(args: argparse.Namespace, cold: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fp32 = bench.fp32_ranges(args.checkpoint)
    dcp_files = sorted(args.dcp.glob("*.distcp")) if args.dcp.is_dir() else []
    dcp = [(p, 0, p.stat().st_size) for p in dcp_files]
    for name, ranges in (("fp32_records", fp32), ("dcp_files", dcp)):
        for threads in sorted({1, *args.worlds}):
            if ranges:
                if cold:
                    bench.drop_caches()
                out[f"{name}/{threads}"] = read_ranges(ranges, threads)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--dcp", type=Path, default=Path("/nonexistent"), help="DCP copy of the same weights")
    parser.add_argument("--make-dcp", action="store_true", help="write --dcp first (FSDP2 fp32 dcp.save)")
    parser.add_argument("--dcp-world", type=int, default=4)
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--methods", nargs="*", default=["zeroio", "zeroio_bcast", "rank0", "dcp"])
    parser.add_argument("--cuda-methods", nargs="*", default=[], help="1-rank jobs on CUDA (NCCL)")
    parser.add_argument("--ds-world", type=int, default=0, help="also run 'deepspeed' at this world size")
    parser.add_argument("--limits", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zeroio-sharded-bench"))
    parser.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: start no run after it")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cuda", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args)
    cold = bench.can_drop_caches()
    results: dict[str, Any] = {"machine": bench.machine_info(), "cache": "cold" if cold else "warm",
                               "checkpoint": str(args.checkpoint), "runs": []}  # fmt: skip
    with_manifest = args.checkpoint / "manifest.json"
    if with_manifest.exists():
        results["manifest"] = {k: v for k, v in json.loads(with_manifest.read_text()).items() if k != "files"}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")

    def left() -> float:
        return args.deadline - time.time() if args.deadline else 3600.0

    def one(method: str, world: int, cuda: bool = False) -> None:
        if left() < 20:
            results["runs"].append({"method": method, "world": world, "cuda": cuda, "skipped": "out of time"})
            return
        if cold:
            bench.drop_caches()
        res = job(method, world, args, cuda=cuda, timeout=min(900.0, left()))
        results["runs"].append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "ranks"})[:2000], flush=True)
        save()

    if args.make_dcp and not (args.dcp / ".metadata").exists():
        one("save_dcp", args.dcp_world)
    if args.limits:
        results["limits"] = limits(args, cold)
        print(json.dumps(results["limits"]), flush=True)
        save()
    for repeat in range(args.repeats):
        for world in args.worlds:
            order = args.methods[repeat % len(args.methods) :] + args.methods[: repeat % len(args.methods)]
            for method in order:
                one(method, world)
        turn = repeat % max(1, len(args.cuda_methods))
        for method in args.cuda_methods[turn:] + args.cuda_methods[:turn]:
            one(method, 1, cuda=True)
    if args.ds_world:
        one("deepspeed", args.ds_world)
    by_world: dict[str, set[tuple[int, ...]]] = {}
    for r in results["runs"]:
        if r.get("crc32") and None not in r["crc32"]:
            by_world.setdefault(f"{r['world']}{'-cuda' if r['cuda'] else ''}", set()).add(tuple(r["crc32"]))
    results["identical_shards_across_methods"] = {w: len(s) == 1 for w, s in by_world.items()}
    save()
    print(json.dumps(results["identical_shards_across_methods"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
