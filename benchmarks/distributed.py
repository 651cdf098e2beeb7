"""Benchmark ``zeroio convert`` in one process against ``torchrun --nproc-per-node P ... --distributed``.

Every run converts the same checkpoint to safetensors shards (``--max-shard-size``, default 500MB so that
there are several shards to share out) and is timed to completion (zeroio fsyncs what it writes). Runs
rotate their order each repeat so load from other processes falls on all alike. Each process of a run
reports, from inside (``--worker`` mode, which wraps ``zeroio.cli.main``):

* ``start_s``: from process creation to the start of the conversion (interpreter, torch import, rendezvous);
* ``plan_s``: opening the checkpoint's metadata and planning every file (distributed runs only, from the
  ``zeroio`` debug log), ``convert_s``: the whole ``convert`` call;
* ``rchar`` / ``wchar``: bytes it read and wrote through syscalls (``/proc/self/io``), ``read_bytes`` /
  ``write_bytes``: what reached the block device;
* ``cpu_s`` / ``convert_cpu_s``: user + system CPU seconds of the whole process and of its ``main()`` (the honest
  cost on a machine shared with other work, where wall times are noise);
* the shards and bytes it was assigned.

Every output is compared, file by file (SHA-256), with the single-process output.

    python benchmarks/distributed.py --checkpoint /tmp/zeroio-bench/gpt-470M --processes 1 2 --repeats 3 \\
        --json benchmarks/results/distributed.json

``ZEROIO_BENCH_PROFILE=<rank>`` runs that rank's ``main()`` under cProfile (``<report>.<rank>.prof`` beside
the reports, under ``--work``).

``--cache cold`` drops the page cache before every run (root only; ``sync; echo 3 > /proc/sys/vm/drop_caches``).

``--readers 1 2`` runs each torchrun variant once per ``ZEROIO_READERS_PER_HOST`` value up to its process count
(default: the environment's, or zeroio's default for the source).

``--source s3`` uploads the checkpoint to a loopback S3 server (benchmarks/s3_source.py: moto's server mode, with
ranged GETs answered by seeking into moto's stored objects) and converts ``s3://bench/<name>`` instead.
``--s3-cap-mbps 50`` paces every response to 50 MB/s (an object store's per-connection limit),
``--s3-first-byte-ms 20`` delays each one (its time to first byte). Each run then records the GETs the server
answered, their bytes, and the most in flight at once:

    python benchmarks/distributed.py --checkpoint /tmp/dist-s3/gpt-28M --source s3 --s3-cap-mbps 50 \
        --s3-first-byte-ms 20 --processes 2 --readers 1 2 --repeats 3 --max-shard-size 25MB --json out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# --------------------------------------------------------------------------- worker mode (inside each process)


def _proc_io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as fh:
        for line in fh:
            key, value = line.split(":")
            out[key.strip()] = int(value)
    return out


def _process_age() -> float:
    """Seconds since this process was created (``/proc/self/stat`` start time vs ``/proc/uptime``)."""
    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far, all threads."""
    times = os.times()
    return times.user + times.system


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def worker(report: Path, argv: list[str]) -> int:
    """Run ``zeroio <argv>`` in this process and write what it cost to ``report.<rank>.json``."""
    sys.path.insert(0, os.environ.get("ZEROIO_BENCH_TREE", str(REPO)))
    from zeroio.cli import main

    capture = _Capture()
    log = logging.getLogger("zeroio")  # the engine logs each process's share
    log.setLevel(logging.DEBUG)
    log.addHandler(capture)
    start_s = _process_age()
    io_before = _proc_io()
    cpu_before = _cpu_s()
    rank = int(os.environ.get("RANK", "0"))
    profile = os.environ.get("ZEROIO_BENCH_PROFILE") == str(rank)  # cProfile this rank's main()
    t0 = time.time()
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        code = profiler.runcall(main, argv)
        profiler.dump_stats(f"{report}.{rank}.prof")
    else:
        code = main(argv)
    t_end = time.time()
    cpu_after = _cpu_s()
    convert_s = t_end - t0
    io_after = _proc_io()
    plan = next((r for r in capture.records if r.getMessage().startswith("process ")), None)
    result: dict[str, Any] = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "exit_code": code,
        "start_s": start_s,
        "convert_s": convert_s,
        "cpu_s": cpu_after,  # user + system seconds of the whole process (interpreter and imports included)
        "convert_cpu_s": cpu_after - cpu_before,  # of main() alone
        "created_at": t0 - start_s,  # epoch seconds: when the process was created, when main() began and returned
        "main_start_at": t0,
        "main_end_at": t_end,
        "plan_s": plan.created - t0 if plan is not None else None,
        "assignment": plan.getMessage() if plan is not None else None,
        "shards": plan.args[2] if plan is not None else None,  # type: ignore[index]
        "shard_bytes": plan.args[4] if plan is not None else None,  # type: ignore[index]
        **{k: io_after[k] - io_before[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes")},
        # the zeroio debug log with its times: the process's timeline (benchmarks/timeline.py prints it)
        "events": [(r.created, r.threadName, r.getMessage()[:200]) for r in capture.records],
    }
    Path(f"{report}.{rank}.json").write_text(json.dumps(result))
    if os.environ.get("ZEROIO_BENCH_FAST_EXIT"):  # what skipping the interpreter's teardown would save
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# --------------------------------------------------------------------------- orchestration


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    DROP_CACHES.write_text("3\n")


def evict_files(folder: Path) -> None:
    """Drop only the checkpoint's files from the page cache (torch and the interpreter stay cached)."""
    subprocess.run(["sync"], check=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file of an output folder."""
    out = {}
    for path in sorted(folder.iterdir()):
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(16 << 20):
                h.update(chunk)
        out[path.name] = h.hexdigest()
    return out


def run_once(
    args: argparse.Namespace, processes: int, distributed: bool, dst: Path, reports: Path, readers: int | None = None
) -> dict[str, Any]:
    """One conversion (1 plain process, or ``processes`` under torchrun, ``readers`` of them reading per host:
    ``ZEROIO_READERS_PER_HOST``, None for the environment's); wall time and every process's report."""
    convert = ["convert", args.source_url or str(args.checkpoint), str(dst), "--max-shard-size", args.max_shard_size,
               "--quiet"]  # fmt: skip
    if args.workers:
        convert += ["--workers", str(args.workers)]
    if args.dtype:
        convert += ["--dtype", args.dtype]
    prefix = reports / f"{'dist' if distributed else 'plain'}-p{processes}-{time.time_ns()}"
    if distributed:
        convert.append("--distributed")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            str(HERE), "--worker", str(prefix), "--", *convert,
        ]  # fmt: skip
    else:
        command = [sys.executable, str(HERE), "--worker", str(prefix), "--", *convert]
    tree = str(args.tree or REPO)
    path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH", "")) if p)  # keep the wheels' path
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, ZEROIO_BENCH_TREE=tree)
    if args.fast_exit:
        env["ZEROIO_BENCH_FAST_EXIT"] = "1"
    if readers is not None:
        env["ZEROIO_READERS_PER_HOST"] = str(readers)
    if args.server is not None:
        env.update(args.server.env())
        args.server.served.reset()
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    if args.cache == "cold":
        drop_caches()
    elif args.cache == "cold-files":
        evict_files(args.checkpoint)
    load_avg = os.getloadavg()
    t0 = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.time() - t0
    served = args.server.served.snapshot() if args.server is not None else None
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    ranks = [json.loads(Path(f"{prefix}.{r}.json").read_text()) for r in range(processes)]
    # Where the wall time went: before the first worker existed (the launcher), inside the workers' main(), and
    # after the last main() returned (interpreter exit, the launcher noticing and stopping).
    phases = {
        "launch_s": min(r["created_at"] for r in ranks) - t0,
        "workers_s": max(r["main_end_at"] for r in ranks) - min(r["created_at"] for r in ranks),
        "exit_s": t0 + wall - max(r["main_end_at"] for r in ranks),
    }
    return {"processes": processes, "distributed": distributed, "readers": readers, "wall_s": wall, "phases": phases,
            "ranks": ranks, "load_avg": load_avg, "served": served}  # fmt: skip


def summarize(runs: list[dict[str, Any]], output_bytes: int) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["processes"], r["distributed"], r.get("readers") or 0) for r in runs})
    base = None
    for processes, distributed, readers in keys:
        mine = [r for r in runs if (r["processes"], r["distributed"], r.get("readers") or 0) == (processes, distributed,
                                                                                               readers)]  # fmt: skip
        walls = [r["wall_s"] for r in mine]
        converts = [max(rank["convert_s"] for rank in r["ranks"]) for r in mine]
        starts = [max(rank["start_s"] for rank in r["ranks"]) for r in mine]
        plans = [max(rank["plan_s"] or 0.0 for rank in r["ranks"]) for r in mine]
        # After planning: reading and writing the shards, checking, committing (the slowest process that planned)
        writes = [max(k["convert_s"] - k["plan_s"] for k in r["ranks"] if k["plan_s"] is not None) for r in mine]
        method = f"torchrun x{processes} --distributed" if distributed else "1 process (plain convert)"
        row = {
            "method": method + (f", {readers} reader(s) per host" if distributed and readers else ""),
            "processes": processes,
            "distributed": distributed,
            "readers": readers or None,
            "wall_s_median": statistics.median(walls),
            **{
                f"{k}_median": statistics.median(r["phases"][k] for r in mine)
                for k in ("launch_s", "workers_s", "exit_s")
                if all("phases" in r for r in mine)
            },
            "wall_s_min": min(walls),
            "wall_s_max": max(walls),
            "convert_s_median": statistics.median(converts),
            "start_s_median": statistics.median(starts),
            "plan_s_median": statistics.median(plans) if distributed else None,
            "after_plan_s_median": statistics.median(writes),
            "output_GBps_convert": output_bytes / statistics.median(converts) / 1e9,
            # What reached the block device (0 when the source was in the page cache): tells cold from warm runs.
            "device_read_GB_median": statistics.median(sum(k["read_bytes"] for k in r["ranks"]) / 1e9 for r in mine),
            "per_rank_rchar_GB": [round(rank["rchar"] / 1e9, 3) for rank in mine[-1]["ranks"]],
            "per_rank_wchar_GB": [round(rank["wchar"] / 1e9, 3) for rank in mine[-1]["ranks"]],
            "per_rank_shards": [rank["shards"] for rank in mine[-1]["ranks"]],
            "load_avg_1min": [r["load_avg"][0] for r in mine if "load_avg" in r],
            "served_max_concurrent_gets": [r["served"]["max_concurrent_gets"] for r in mine if r.get("served")],
            "served_gets_median": (
                statistics.median(r["served"]["gets"] for r in mine) if mine[0].get("served") else None
            ),
            # CPU seconds (user + system) per process, median over repeats: the honest cost on a shared machine
            "per_rank_cpu_s": [
                round(statistics.median(r["ranks"][i].get("cpu_s", 0.0) for r in mine), 2) for i in range(processes)
            ],
            "per_rank_convert_cpu_s": [
                round(statistics.median(r["ranks"][i].get("convert_cpu_s", 0.0) for r in mine), 2)
                for i in range(processes)
            ],
        }
        if not distributed and processes == 1:
            base = row
        rows.append(row)
    for row in rows:
        if base is not None:
            row["speedup_wall"] = base["wall_s_median"] / row["wall_s_median"]
            row["speedup_convert"] = base["convert_s_median"] / row["convert_s_median"]
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| method | wall s (median [min-max]) | convert s | start-up s | plan s | after plan s | output GB/s (convert) "
            "| speed-up wall / convert | read GB per process | written GB per process | shards per process "
            "| disk-read GB (median) | S3 GETs (most at once) | load avg |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plan = f"{r['plan_s_median']:.2f}" if r["plan_s_median"] is not None else ""
        lines.append(
            f"| {r['method']} | {r['wall_s_median']:.2f} [{r['wall_s_min']:.2f}-{r['wall_s_max']:.2f}] "
            f"| {r['convert_s_median']:.2f} | {r['start_s_median']:.2f} | {plan} | {r['after_plan_s_median']:.2f} "
            f"| {r['output_GBps_convert']:.2f} "
            f"| {r.get('speedup_wall', 1):.2f} / {r.get('speedup_convert', 1):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in r['per_rank_rchar_GB'])} "
            f"| {', '.join(f'{x:.2f}' for x in r['per_rank_wchar_GB'])} "
            f"| {', '.join(str(x) for x in r['per_rank_shards']) if r['distributed'] else ''} "
            f"| {r['device_read_GB_median']:.2f} "
            f"| {'' if r['served_gets_median'] is None else r['served_gets_median']}"
            f"{' (' + ', '.join(map(str, r['served_max_concurrent_gets'])) + ')' if r['served_max_concurrent_gets'] else ''} "
            f"| {', '.join(f'{x:.1f}' for x in r['load_avg_1min'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        rest = sys.argv[i + 2 :]
        return worker(Path(sys.argv[i + 1]), rest[1:] if rest[:1] == ["--"] else rest)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/zeroio-bench/gpt-470M"))
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="process counts under torchrun")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-shard-size", default="500MB")
    parser.add_argument("--workers", type=int, help="IO threads per process (default: zeroio's)")
    parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="cast floating tensors (default: as stored)")
    parser.add_argument("--cache", choices=["warm", "cold", "cold-files"], default="warm")
    parser.add_argument("--work", type=Path, default=Path("/tmp/zeroio-bench/distributed"))
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument("--tree", type=Path, help="the zeroio tree to run (default: this one), e.g. an older commit")
    parser.add_argument("--fast-exit", action="store_true", help="workers end with os._exit once their report is out")
    parser.add_argument("--readers", type=int, nargs="+", help="ZEROIO_READERS_PER_HOST values: one variant each")
    parser.add_argument("--source", choices=["local", "s3"], default="local", help="s3: from a loopback S3 server")
    parser.add_argument("--s3-cap-mbps", type=float, default=0.0, help="per-connection limit, MB/s (0: none)")
    parser.add_argument("--s3-first-byte-ms", type=float, default=0.0, help="delay before each ranged response")
    parser.add_argument(
        "--verify", choices=["all", "first", "none"], default="all",
        help="compare outputs with the single-process output: every run, the first of each variant, or none",
    )  # fmt: skip
    args = parser.parse_args()
    if args.cache == "cold" and not os.access(DROP_CACHES, os.W_OK):
        raise SystemExit("--cache cold needs root (writes /proc/sys/vm/drop_caches)")
    args.server, args.source_url, upload_s = None, None, None
    if args.source == "s3":
        sys.path.insert(0, str(HERE.parent))
        from s3_source import S3Source

        args.server = S3Source(cap_bytes_per_s=args.s3_cap_mbps * 1e6, first_byte_s=args.s3_first_byte_ms / 1e3)
        t_upload = time.time()
        args.source_url = args.server.upload_tree(args.checkpoint, "bench", args.checkpoint.name)
        upload_s = time.time() - t_upload

    args.work.mkdir(parents=True, exist_ok=True)
    reports = args.work / "reports"
    reports.mkdir(exist_ok=True)
    reference_dst = args.work / "reference"
    shutil.rmtree(reference_dst, ignore_errors=True)
    # The single-process output every run must reproduce (also warms the cache for warm runs).
    first = run_once(args, 1, False, reference_dst, reports)
    reference = digests(reference_dst)
    output_bytes = sum(p.stat().st_size for p in reference_dst.iterdir())
    shutil.rmtree(reference_dst)

    s3_facts = None
    if args.server is not None:
        s3_facts = {"cap_MBps_per_connection": args.s3_cap_mbps, "first_byte_ms": args.s3_first_byte_ms,
                    "upload_s": upload_s}  # fmt: skip
    info = {
        "checkpoint": str(args.checkpoint),
        "max_shard_size": args.max_shard_size,
        "dtype": args.dtype,
        "cache": args.cache,
        "output_bytes": output_bytes,
        "output_files": len(reference),
        "cpus": os.cpu_count(),
        "tree": str(args.tree or REPO),
        "fast_exit": args.fast_exit,
        "load_avg_start": os.getloadavg(),
        "source": args.source_url or str(args.checkpoint),
        "s3": s3_facts,
        "reference_run": first,
    }
    readers = args.readers or [None]
    # every readers value up to the processes (ZEROIO_READERS_PER_HOST above them means all of them)
    variants = [(1, False, None)] + [(p, True, n) for p in args.processes for n in readers if n is None or n <= p]
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for processes, distributed, n in variants[shift:] + variants[:shift]:
            dst = args.work / f"out-p{processes}-{'d' if distributed else 'plain'}-r{n}"
            shutil.rmtree(dst, ignore_errors=True)
            run = run_once(args, processes, distributed, dst, reports, n)
            run["repeat"] = repeat
            if args.verify == "all" or (args.verify == "first" and repeat == 0):
                run["identical"] = digests(dst) == reference
            else:
                run["identical"] = None
            if run["identical"] is False:
                raise SystemExit(f"{dst} differs from the single-process output")
            shutil.rmtree(dst)
            runs.append(run)
            if args.json:  # after every run, so an interrupted benchmark keeps what it measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"info": info, "summary": summarize(runs, output_bytes), "runs": runs}))
            print(
                f"repeat {repeat} processes={processes} distributed={distributed} readers={n}: "
                f"{run['wall_s']:.2f} s wall, served={run['served']}, "
                f"identical={run['identical']}",
                file=sys.stderr,
            )
    if args.server is not None:
        args.server.stop()
    rows = summarize(runs, output_bytes)
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"info": info, "summary": rows, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
