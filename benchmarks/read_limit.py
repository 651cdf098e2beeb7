"""The read limit of a checkpoint's bytes with parallel positioned reads, and the pinned host-to-device copy limit.

A loader is compared with what the storage gives, and one stream (``cat``, one ``pread`` loop) understates what a
local NVMe disk gives several readers. This times, for exactly the bytes a load reads (the fp32 master-weight
records of a ZeRO checkpoint, or whole ``.safetensors`` files):

- ``read``: T threads taking the next block of B MiB from a shared queue in storage order (how ``zeroio.load``'s
  reader threads read), each ``preadv`` into its own reused buffer; cold (page cache dropped before each run,
  root only) or warm. ``--direct`` adds ``O_DIRECT`` runs (no page cache at all, aligned buffers).
- ``h2d``: a copy of the same number of bytes from pinned host memory to the GPU, in blocks of B MiB on one stream
  (``non_blocking=True``, as zeroio's staging ring) and as one copy: the warm limit of a load to CUDA.

Usage (writes JSON; prints one line per run and a table)::

    python benchmarks/read_limit.py --checkpoint /tmp/zb/ck --threads 1 4 8 16 32 --block-mib 8 32 \\
        --direct --h2d --json read-limit.json
    python benchmarks/read_limit.py --files /tmp/zb/st-bf16/*.safetensors --threads 1 16 --json st.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench

Range = tuple[Path, int, int]


def blocks(ranges: list[Range], block: int, align: int = 1) -> list[Range]:
    """The ranges cut into blocks of at most ``block`` bytes (widened to ``align`` for O_DIRECT)."""
    out = []
    for path, offset, nbytes in ranges:
        start, end = offset - offset % align, offset + nbytes
        end = -(-end // align) * align
        for at in range(start, end, block):
            out.append((path, at, min(block, end - at)))
    return out


ADVICE = {"none": None, "sequential": "POSIX_FADV_SEQUENTIAL", "willneed": "POSIX_FADV_WILLNEED"}


def read_parallel(
    ranges: list[Range], threads: int, block: int, direct: bool = False, split: str = "queue", advice: str = "none"
) -> dict[str, Any]:
    """Read every block once with ``threads`` threads: pulling blocks from one queue in storage order (``queue``),
    or each reading its own contiguous 1/threads of the bytes in order (``shares``). ``advice``: a
    ``posix_fadvise`` of each whole file first (``sequential``: a larger read-ahead window; ``willneed``: the
    kernel starts reading all of it at once)."""
    align = 4096 if direct else 1
    pieces = blocks(ranges, block, align)
    if split == "shares":  # reorder so that queue position k*threads+i is thread i's k-th block of its share
        per = -(-len(pieces) // threads)
        parts = [pieces[i * per : (i + 1) * per] for i in range(threads)]
        pieces = [part[k] for k in range(per) for part in parts if k < len(part)]
    sizes = {p: p.stat().st_size for p in {r[0] for r in ranges}}
    lock = threading.Lock()
    nxt = [0]
    got = [0] * threads
    errors: list[BaseException] = []
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {p: os.open(p, flags) for p in sizes}
    t0 = time.perf_counter()
    if ADVICE[advice]:
        for fd in fds.values():
            os.posix_fadvise(fd, 0, 0, getattr(os, ADVICE[advice]))

    def work(i: int) -> None:
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        try:
            while True:
                with lock:
                    k = nxt[0]
                    nxt[0] += 1
                if k >= len(pieces):
                    return
                path, offset, nbytes = pieces[k]
                nbytes = min(nbytes, sizes[path] - offset)
                want = -(-nbytes // align) * align
                done = 0
                while done < nbytes:
                    n = os.preadv(fds[path], [view[done:want]], offset + done)
                    if n <= 0:
                        raise OSError(f"short read in {path} at {offset + done}")
                    done += n
                got[i] += nbytes
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            view.release()
            buf.close()

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    if errors:
        raise errors[0]
    total = sum(got)
    return {"seconds": seconds, "bytes": total, "GBps": total / seconds / 1e9}


def h2d(total: int, block: int, repeats: int = 3) -> dict[str, Any]:
    """Pinned host -> GPU copy of ``total`` bytes: in ``block``-byte copies on one stream, and as one copy."""
    import torch

    ring = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    for buf in ring:
        buf.fill_(7)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes": total, "block": block}
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, at in enumerate(range(0, total, block)):
            n = min(block, total - at)
            dev[at : at + n].copy_(ring[i % 4][:n], non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["blocks_s"] = statistics.median(times)
    out["blocks_GBps"] = total / out["blocks_s"] / 1e9
    big = torch.empty(min(total, 2 << 30), dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev[: big.numel()].copy_(big, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["one_copy_GBps"] = big.numel() / statistics.median(times) / 1e9
    out["one_copy_s_scaled"] = total / out["one_copy_GBps"] / 1e9
    return out


def source_ranges(args: argparse.Namespace) -> list[Range]:
    if args.checkpoint:
        return bench.fp32_ranges(args.checkpoint)
    return [(Path(f), 0, Path(f).stat().st_size) for f in args.files]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", type=Path, help="ZeRO checkpoint: its fp32 master-weight records")
    what.add_argument("--files", nargs="+", help="whole files (e.g. *.safetensors)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--block-mib", type=int, nargs="+", default=[32])
    parser.add_argument("--block-kib", type=int, nargs="+", help="block sizes in KiB (instead of --block-mib)")
    parser.add_argument("--advice", nargs="+", default=["none"], choices=sorted(ADVICE))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--split", nargs="+", default=["queue"], choices=["queue", "shares"])
    parser.add_argument("--direct", action="store_true", help="also O_DIRECT runs")
    parser.add_argument("--modes", nargs="+", choices=["cold", "warm", "direct"], help="exactly these runs")
    parser.add_argument("--warm", action="store_true", help="also warm runs (page cache filled first)")
    parser.add_argument("--h2d", action="store_true", help="also the pinned host-to-device copy limit")
    parser.add_argument("--no-cold", action="store_true", help="never drop the page cache (a shared machine)")
    parser.add_argument("--evict", action="store_true", help="cold: evict only the files read (POSIX_FADV_DONTNEED)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    ranges = source_ranges(args)
    total = sum(n for _, _, n in ranges)
    cold = bench.can_drop_caches() and not args.no_cold
    if not cold:
        print("cannot drop the page cache (needs root): warm runs only", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    modes = (
        (["cold"] if cold else []) + (["warm"] if args.warm or not cold else []) + (["direct"] if args.direct else [])
    )
    if args.modes:
        modes = [m for m in args.modes if m != "cold" or cold]
    for mode in modes:
        kibs = args.block_kib or [m << 10 for m in args.block_mib]
        combos = [(t, s, a) for t in args.threads for s in args.split for a in args.advice if t > 1 or s == "queue"]
        for kib in kibs:
            for threads, split, advice in combos:
                if mode == "direct" and advice != "none":
                    continue
                for _ in range(args.repeats):
                    if mode in ("cold", "direct") and args.evict:
                        bench.evict_files(sorted({r[0] for r in ranges}))
                    elif mode == "cold":
                        bench.drop_caches()
                    elif mode == "warm":
                        read_parallel(ranges, 16, 32 << 20)
                    r = read_parallel(ranges, threads, kib << 10, mode == "direct", split, advice)
                    run = {"kind": "read", "mode": mode, "threads": threads, "block_mib": kib / 1024, "split": split}
                    run.update(advice=advice, **r)
                    runs.append(run)
                    print(json.dumps(run), flush=True)
    out: dict[str, Any] = {"machine": bench.machine_info(), "bytes": total, "files": len({r[0] for r in ranges})}
    out["runs"] = runs
    best: dict[str, Any] = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            top = min(mine, key=lambda r: r["seconds"])
            best[mode] = {k: top[k] for k in ("threads", "block_mib", "split", "advice", "seconds", "GBps")}
            one = [r["seconds"] for r in mine if r["threads"] == 1]
            if one:
                best[mode]["one_thread_s"] = min(one)
    out["best"] = best
    if args.h2d:
        out["h2d"] = h2d(total, 32 << 20)
        print(json.dumps(out["h2d"]), flush=True)
    print(json.dumps(best, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
