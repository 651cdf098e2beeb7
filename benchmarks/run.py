"""Benchmark ``zeroio convert`` against DeepSpeed's ``zero_to_fp32`` and against the disk, in one run.

Every method converts the same checkpoint to fp32 weights; runs alternate
between methods (and rotate their order each repeat), so machine load hits
all of them alike. Each run is timed to *durable completion*: the process's
wall time plus ``sync FILE...`` of everything it wrote (zeroio already fsyncs,
so its sync is ~0; DeepSpeed's tool does not). Memory is the peak RSS
(``VmHWM`` of the process, plus the summed ``VmRSS`` of any children) and the peak anonymous memory (``RssAnon`` of
the process tree, sampled every 10 ms; mmapped checkpoint pages are file
memory, not anonymous).

Methods (``--methods``):

* ``zeroio``: ``python -m zeroio convert SRC DST`` (safetensors, fp32, fsynced).
* ``ds_bin``: DeepSpeed's ``zero_to_fp32.py SRC DST`` (its default ``.bin`` output).
* ``ds_safe``: ``zero_to_fp32.py --safe_serialization`` (fails on tied weights: recorded as failed once).
* ``ds_lazy``: ``get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)``, each tensor's
  ``.contiguous()`` bytes appended to one raw file (no file format: favourable to DeepSpeed).
* ``zeroio_stream``: ``zeroio.open(SRC).iter_chunks`` appended to one raw file (the same raw output).
* ``limit``: ``dd`` reads exactly the fp32 master-weight byte ranges of the optimizer files once and
  a second ``dd`` writes them (``conv=fdatasync``): the physical copy limit of this disk.
* ``limit_kernel``: the same ranges copied in the kernel with ``copy_file_range`` and fsynced (a tighter
  limit than ``dd``'s pipe on this machine); its in-process time is used.
* warm only: ``zeroio_tmpfs`` and ``limit_tmpfs`` (the same, writing to ``/dev/shm``) and ``memcpy``
  (an in-memory copy of the same number of bytes) for the warm-cache target.
* ``startup``: ``python -c "import zeroio.cli._app, zeroio; zeroio.convert"``: the interpreter and the imports
  every ``zeroio convert`` run pays (torch no longer among them: convert imports it only for tensor arithmetic).

Cold runs drop the page cache first (``sync; echo 3 > /proc/sys/vm/drop_caches``, root only).

    python benchmarks/run.py --make 125M 350M 470M --untied 350M --repeats 3 \\
        --json benchmarks/results/results.json --plot docs/benchmarks-sweep.png --markdown benchmarks/results/table.md
    python benchmarks/run.py --checkpoint fixtures/z3_ws2_fp32 --repeats 1 --cache warm   # smoke

``--memory-cap 256MiB`` additionally runs every method once inside a cgroup v1 memory
controller with that hard limit and records whether it completed or was OOM-killed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
TMPFS = Path("/dev/shm")

COLD_METHODS = ["zeroio", "ds_bin", "ds_safe", "ds_lazy", "zeroio_stream", "limit", "limit_kernel"]
WARM_EXTRA = ["zeroio_tmpfs", "limit_tmpfs", "memcpy"]
DEFAULT_METHODS = COLD_METHODS + WARM_EXTRA + ["startup"]


# --------------------------------------------------------------------------- small helpers


def parse_bytes(text: str) -> int:
    """``"256MiB"`` / ``"1GB"`` / ``"1048576"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    power = "KMGT".find(match.group(2).upper()) + 1 if match.group(2) else 0
    base = 1024 if match.group(3) else 1000
    return int(float(match.group(1)) * base**power)


def zero_to_fp32_script(work: Path) -> Path:
    """A copy of DeepSpeed's ``zero_to_fp32.py`` in ``work``, run the way users run the copy DeepSpeed saves
    next to every checkpoint (run in place, ``deepspeed/utils/torch.py`` would shadow ``torch``)."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        raise SystemExit("DeepSpeed is not installed: pip install deepspeed (needed for the comparison)")
    (work / "bin").mkdir(parents=True, exist_ok=True)
    copy = work / "bin" / "zero_to_fp32.py"
    shutil.copyfile(Path(spec.origin).parent / "utils" / "zero_to_fp32.py", copy)
    return copy


def can_drop_caches() -> bool:
    """True when this process may write /proc/sys/vm/drop_caches (root)."""
    return os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    """Flush dirty pages, then drop the page cache, dentries and inodes."""
    subprocess.run(["sync"], check=True)
    DROP_CACHES.write_text("3\n")


def evict_files(paths: list[Path]) -> None:
    """Flush dirty pages, then drop these files' pages from the page cache (``POSIX_FADV_DONTNEED``): a cold
    checkpoint while the interpreter, torch and the loaders stay cached, as on a host that ran them before."""
    subprocess.run(["sync"], check=True)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fp32_ranges(checkpoint: Path) -> list[tuple[Path, int, int]]:
    """``(file, byte offset, byte count)`` of every fp32 master-weight record in the optimizer files."""
    sys.path.insert(0, str(REPO))
    from zeroio._pickles import load_pickle

    tag_dir = _tag_dir(checkpoint)
    ranges = []
    for path in sorted(tag_dir.glob("*optim_states.pt")):
        tree, rank_file = load_pickle(path)
        osd = tree["optimizer_state_dict"]
        refs = osd.get("fp32_flat_groups") or osd.get("single_partition_of_fp32_groups") or []
        for ref in refs:
            itemsize = ref.storage.dtype.itemsize
            start = rank_file.data_offset(ref.storage.key) + ref.storage_offset * itemsize
            ranges.append((path, start, ref.numel * itemsize))
        rank_file.close()
    return ranges


def _tag_dir(checkpoint: Path) -> Path:
    latest = checkpoint / "latest"
    if latest.is_file():
        return checkpoint / latest.read_text().strip()
    return checkpoint


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path`` (or of ``path`` itself)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _output_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return [p for p in path.rglob("*") if p.is_file()] + [path]
    return []


# --------------------------------------------------------------------------- memory sampling


def _descendants(pid: int) -> list[int]:
    pids, stack = [], [pid]
    while stack:
        p = stack.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    stack.extend(int(c) for c in fh.read().split())
        except OSError:
            continue
    return pids


def _status_kib(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    out = dict.fromkeys(keys, 0)
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


class _Sampler(threading.Thread):
    """Samples the summed RssAnon / VmRSS of a process tree until stopped; keeps the peaks (bytes)."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_anon = 0
        self.peak_rss = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            anon = rss = 0
            for p in _descendants(self.pid):
                st = _status_kib(p, ("RssAnon", "VmRSS", "VmHWM"))
                anon += st["RssAnon"]
                rss += st["VmRSS"]
                if p == self.pid:  # the kernel's exact high-water mark of the main process since exec
                    self.peak_rss = max(self.peak_rss, st["VmHWM"] * 1024)
            self.peak_anon = max(self.peak_anon, anon * 1024)
            self.peak_rss = max(self.peak_rss, rss * 1024)
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


# --------------------------------------------------------------------------- cgroup v1 memory caps


def cgroup_available() -> str | None:
    """None when a cgroup v1 memory controller can be created here, else the reason why not."""
    if not CGROUP_ROOT.is_dir() or not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (needs root)"
    return None


@dataclass
class MemoryCgroup:
    """A cgroup v1 memory controller with a hard limit (swap included); remove it with :meth:`remove`."""

    limit: int
    path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.path = CGROUP_ROOT / f"zeroio-bench-{os.getpid()}-{time.monotonic_ns()}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        with contextlib.suppress(OSError):  # absent without swap accounting
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit))

    def join(self) -> None:
        """Move the calling process in (use as a ``preexec_fn``: only the child joins)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def stats(self) -> dict[str, int]:
        """``max_usage`` (bytes, page cache included), ``failcnt`` and ``oom_kill`` count."""
        oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {
            "max_usage_bytes": int((self.path / "memory.max_usage_in_bytes").read_text()),
            "failcnt": int((self.path / "memory.failcnt").read_text()),
            "oom_kill": int(oom.get("oom_kill", 0)),
        }

    def remove(self) -> None:
        """Delete the cgroup (its page-cache charges move to the parent)."""
        with contextlib.suppress(OSError):
            (self.path / "memory.force_empty").write_text("0")
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


# --------------------------------------------------------------------------- one measured run


@dataclass
class Run:
    """One timed run of one method."""

    method: str
    cache: str
    repeat: int
    ok: bool
    seconds: float  # to durable completion
    process_seconds: float  # the process alone
    sync_seconds: float
    peak_rss_bytes: int
    peak_anon_bytes: int
    output_bytes: int
    inner_seconds: float | None = None  # the timed section reported by an in-process worker
    error: str | None = None
    cgroup: dict[str, int] | None = None


def measure(
    method: str,
    cmd: list[str],
    *,
    cache: str,
    repeat: int,
    output: Path | None,
    cgroup: MemoryCgroup | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 3600,
) -> Run:
    """Run ``cmd``, sample its memory, then ``sync`` what it wrote; the time is to durable completion."""
    if cache == "cold":
        drop_caches()
    err_path = Path(os.environ.get("TMPDIR", "/tmp")) / f".zeroio-bench-{os.getpid()}.err"
    with open(err_path, "w+") as err, open(os.devnull, "w") as devnull:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
            # The child joins the cgroup before exec; no other thread of ours runs while Popen forks.
            preexec_fn=cgroup.join if cgroup else None,  # noqa: PLW1509
        )
        sampler = _Sampler(proc.pid)
        sampler.start()
        stdout_text = proc.stdout.read() if proc.stdout else ""
        if proc.stdout:
            proc.stdout.close()
        _, status = os.waitpid(proc.pid, 0)
        t1 = time.perf_counter()
        sampler.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
        files = _output_files(output) if output is not None else []
        if files:
            subprocess.run(["sync", *map(str, files)], check=False, stdout=devnull, stderr=devnull)
        t2 = time.perf_counter()
        err.seek(0)
        err_text = err.read()
    err_path.unlink(missing_ok=True)
    inner = None
    match = re.search(r"ZEROIO_BENCH_INNER_SECONDS=([0-9.eE+-]+)", stdout_text)
    if match:
        inner = float(match.group(1))
    ok = proc.returncode == 0
    error = None
    if not ok:
        lines = [ln.strip() for ln in err_text.strip().splitlines() if ln.strip()]
        raised = [i for i, ln in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)]
        # The exception line and its continuation (safetensors' message spans several lines).
        last = " ".join(lines[raised[-1] : raised[-1] + 4]) if raised else (lines[-1] if lines else "(no stderr)")
        killed = " (killed by SIGKILL: out of memory?)" if proc.returncode == -9 else ""
        error = f"exit {proc.returncode}{killed}: {last[:300]}"
    return Run(
        method=method,
        cache=cache,
        repeat=repeat,
        ok=ok,
        seconds=t2 - t0,
        process_seconds=t1 - t0,
        sync_seconds=t2 - t1,
        # Not wait4's ru_maxrss: it includes the parent's RSS copied at fork time.
        peak_rss_bytes=sampler.peak_rss,
        peak_anon_bytes=sampler.peak_anon,
        output_bytes=dir_bytes(output) if output is not None and output.exists() else 0,
        inner_seconds=inner,
        error=error,
        cgroup=cgroup.stats() if cgroup else None,
    )


# --------------------------------------------------------------------------- the methods


def has_zeroio_convert() -> bool:
    """True once ``zeroio._convert.convert`` exists (it is what ``zeroio convert`` calls)."""
    return (REPO / "zeroio" / "_convert.py").exists()


def command_for(
    method: str,
    src: Path,
    dst: Path,
    *,
    fp32_bytes: int,
    ranges: list[tuple[Path, int, int]],
    work: Path,
    workers: int | None = None,
) -> list[str] | None:
    """The command line of ``method`` converting ``src`` into ``dst`` (None: not applicable here)."""
    py = sys.executable
    if method in ("zeroio", "zeroio_tmpfs"):
        if not has_zeroio_convert():
            return None
        cmd = [py, "-m", "zeroio", "convert", str(src), str(dst), "--quiet"]
        return cmd + (["--workers", str(workers)] if workers else [])
    if method == "ds_bin":
        return [py, str(zero_to_fp32_script(work)), str(src), str(dst)]
    if method == "ds_safe":
        return [py, str(zero_to_fp32_script(work)), str(src), str(dst), "--safe_serialization"]
    if method in ("ds_lazy", "zeroio_stream"):
        return [py, str(HERE), "--_worker", method, str(src), str(dst)]
    if method == "memcpy":
        return [py, str(HERE), "--_worker", "memcpy", str(fp32_bytes), str(dst)]
    if method == "startup":
        return [py, "-c", "import zeroio.cli._app, zeroio; zeroio.convert"]
    if method == "limit_kernel":
        spec = json.dumps([[str(path), start, count] for path, start, count in ranges])
        return [py, "-S", str(HERE), "--_worker", "limit_kernel", spec, str(dst)]
    if method in ("limit", "limit_tmpfs"):
        reads = "; ".join(
            f"dd if={shlex.quote(str(path))} bs=16M iflag=skip_bytes,count_bytes skip={start} count={count} status=none"
            for path, start, count in ranges
        )
        write = f"dd of={shlex.quote(str(dst))} bs=16M iflag=fullblock conv=fdatasync status=none"
        return ["bash", "-o", "pipefail", "-c", f"{{ {reads}; }} | {write}"]
    raise ValueError(f"unknown method {method!r}")


def _worker(mode: str, args: list[str]) -> int:
    """In-process halves of ``ds_lazy``, ``zeroio_stream`` and ``memcpy`` (run as subprocesses)."""
    if mode == "memcpy":
        import torch

        nbytes, _ = int(args[0]), args[1]
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        t0 = time.perf_counter()
        dst.copy_(src)
        print(f"ZEROIO_BENCH_INNER_SECONDS={time.perf_counter() - t0}")
        return 0
    if mode == "limit_kernel":
        # The same fp32 byte ranges as `limit`, copied in the kernel (copy_file_range: no user-space copy).
        t0 = time.perf_counter()
        out = os.open(args[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pos = 0
        for path, start, count in json.loads(args[0]):
            src_fd = os.open(path, os.O_RDONLY)
            while count:
                done = os.copy_file_range(src_fd, out, count, start, pos)
                if done <= 0:
                    raise SystemExit(f"copy_file_range returned {done} for {path}")
                start, pos, count = start + done, pos + done, count - done
            os.close(src_fd)
        os.fsync(out)
        os.close(out)
        print(f"ZEROIO_BENCH_INNER_SECONDS={time.perf_counter() - t0}")
        return 0
    src, dst = Path(args[0]), Path(args[1])
    t0 = time.perf_counter()
    with open(dst, "wb", buffering=0) as fh:
        if mode == "ds_lazy":
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(str(src), lazy_mode=True)
            seen: set[int] = set()
            for name in list(state):
                lazy = state.pop(name)
                if id(lazy) in seen:  # tied: written once
                    continue
                seen.add(id(lazy))
                tensor = lazy.contiguous()
                fh.write(memoryview(tensor.reshape(-1).view(torch_uint8()).numpy()))
                del tensor
        elif mode == "zeroio_stream":
            sys.path.insert(0, str(REPO))
            import zeroio

            with zeroio.open(src) as ckpt:
                tied = ckpt.tied
                for name in ckpt:
                    if name in tied:
                        continue
                    fh.writelines(memoryview(chunk.view(torch_uint8()).numpy()) for chunk in ckpt.iter_chunks(name))
        else:
            raise SystemExit(f"unknown worker mode {mode!r}")
        os.fsync(fh.fileno())
    print(f"ZEROIO_BENCH_INNER_SECONDS={time.perf_counter() - t0}")
    return 0


def torch_uint8():  # type: ignore[no-untyped-def]
    import torch

    return torch.uint8


# --------------------------------------------------------------------------- one checkpoint


@dataclass
class Subject:
    """A checkpoint under test."""

    path: Path
    label: str
    params: int
    tied: bool
    fp32_bytes: int
    ranges: list[tuple[Path, int, int]]
    manifest: dict[str, Any]


def load_subject(path: Path) -> Subject:
    """Describe ``path`` (via zeroio's metadata only) and find its fp32 master-weight byte ranges."""
    sys.path.insert(0, str(REPO))
    import zeroio

    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    with zeroio.open(path) as ckpt:
        summary = ckpt.describe()
    params = summary["num_params"]
    tied = bool(summary["tied"])
    size = f"{params / 1e6:.0f}M" if params >= 10**6 else f"{params / 1e3:.1f}K"
    label = size + ("" if tied else " untied")
    ranges = fp32_ranges(path)
    return Subject(path, label, params, tied, sum(r[2] for r in ranges), ranges, manifest)


def applicable(method: str, subject: Subject, cache: str) -> bool:
    """Which methods run on which checkpoint and cache state."""
    if method in WARM_EXTRA:
        return cache == "warm"
    if method == "ds_safe":
        return True  # fails on tied weights; recorded once, then skipped
    return True


def prewarm(subject: Subject) -> None:
    """Read every byte a converter touches, so warm runs start from the page cache."""
    for path in sorted(_tag_dir(subject.path).iterdir()):
        if path.name.endswith("model_states.pt"):
            path.read_bytes()
    for path, start, count in subject.ranges:
        with open(path, "rb", buffering=0) as fh:
            fh.seek(start)
            left = count
            while left:
                got = len(fh.read(min(left, 64 << 20)))
                if not got:
                    break
                left -= got


def bench_subject(
    subject: Subject,
    *,
    methods: list[str],
    caches: list[str],
    repeats: int,
    work: Path,
    workers: list[int],
    log: Any = print,
) -> list[Run]:
    """All repeats of all methods on one checkpoint, alternating methods within each repeat."""
    runs: list[Run] = []
    failed: set[tuple[str, str]] = set()
    variants = [(m, None) for m in methods if m != "zeroio"] + ([("zeroio", None)] if "zeroio" in methods else [])
    variants += [(f"zeroio_w{w}", w) for w in workers] if "zeroio" in methods else []
    out_root = work / "out"
    out_root.mkdir(parents=True, exist_ok=True)
    for cache in caches:
        if cache == "warm":
            prewarm(subject)
        for rep in range(repeats):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]  # rotate per repeat
            for method, w in order:
                base = "zeroio" if method.startswith("zeroio_w") else method
                if not applicable(base, subject, cache) or (method, cache) in failed:
                    continue
                target_root = TMPFS if base.endswith("_tmpfs") or base == "memcpy" else out_root
                dst = target_root / f"zeroio-bench-{os.getpid()}-{method}"
                if base in ("limit", "limit_kernel", "limit_tmpfs", "ds_lazy", "zeroio_stream"):
                    dst = dst.with_suffix(".raw")
                cmd = command_for(
                    base, subject.path, dst, fp32_bytes=subject.fp32_bytes, ranges=subject.ranges, work=work, workers=w
                )
                if cmd is None:
                    continue
                _remove(dst)
                run = measure(method, cmd, cache=cache, repeat=rep, output=None if base == "startup" else dst)
                _remove(dst)
                runs.append(run)
                status = "ok" if run.ok else f"FAILED ({run.error})"
                log(
                    f"  {subject.label:>12} {cache:<4} rep{rep} {method:<14} {run.seconds:7.2f}s "
                    f"anon {run.peak_anon_bytes / 2**20:8.0f} MiB rss {run.peak_rss_bytes / 2**20:8.0f} MiB  {status}"
                )
                if not run.ok:
                    failed.add((method, cache))
                    failed.add((method, "cold" if cache == "warm" else "warm"))
    return runs


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def bench_memory_cap(subject: Subject, *, methods: list[str], cap: int, work: Path, log: Any = print) -> list[Run]:
    """Each conversion method once inside a memory cgroup of ``cap`` bytes: completed or OOM-killed?"""
    runs = []
    out_root = work / "out"
    out_root.mkdir(parents=True, exist_ok=True)
    variants = [(m, None) for m in methods if m in ("zeroio", "ds_bin", "ds_safe", "ds_lazy", "zeroio_stream")]
    if "zeroio" in methods:
        variants.insert(1, ("zeroio_w1", 1))
    for method, w in variants:
        base = "zeroio" if method.startswith("zeroio_w") else method
        dst = out_root / f"zeroio-bench-cap-{method}"
        if base in ("ds_lazy", "zeroio_stream"):
            dst = dst.with_suffix(".raw")
        cmd = command_for(
            base, subject.path, dst, fp32_bytes=subject.fp32_bytes, ranges=subject.ranges, work=work, workers=w
        )
        if cmd is None:
            continue
        _remove(dst)
        group = MemoryCgroup(cap)
        try:
            run = measure(method, cmd, cache="warm", repeat=0, output=dst, cgroup=group)
        finally:
            group.remove()
        _remove(dst)
        runs.append(run)
        outcome = "completed" if run.ok else ("OOM-killed" if run.cgroup and run.cgroup["oom_kill"] else run.error)
        log(
            f"  cap {cap / 2**20:.0f} MiB {subject.label:>12} {method:<14} {outcome} "
            f"({run.seconds:.1f}s, cgroup max {run.cgroup['max_usage_bytes'] / 2**20 if run.cgroup else 0:.0f} MiB)"
        )
    return runs


def time_open_and_inspect(subject: Subject, *, repeats: int, caches: list[str]) -> dict[str, Any]:
    """``zeroio.open`` in-process and ``zeroio inspect`` as a CLI (interpreter start included), cold and warm."""
    code = (
        "import time,sys; t0=time.perf_counter(); import zeroio; t1=time.perf_counter(); "
        "c=zeroio.open(sys.argv[1]); c.describe(); c.close(); t2=time.perf_counter(); "
        "print(f'IMPORT={t1-t0} OPEN={t2-t1}')"
    )
    result: dict[str, Any] = {}
    for cache in caches:
        opens, imports, clis = [], [], []
        for _ in range(repeats):
            if cache == "cold":
                drop_caches()
            out = subprocess.run(
                [sys.executable, "-c", code, str(subject.path)], capture_output=True, text=True, check=True, cwd=REPO
            ).stdout
            imports.append(float(re.search(r"IMPORT=(\S+)", out).group(1)))  # type: ignore[union-attr]
            opens.append(float(re.search(r"OPEN=(\S+)", out).group(1)))  # type: ignore[union-attr]
            if cache == "cold":
                drop_caches()
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "zeroio", "inspect", str(subject.path)],
                capture_output=True,
                check=True,
                cwd=REPO,
            )
            clis.append(time.perf_counter() - t0)
        result[cache] = {"import_zeroio": _stats(imports), "open_describe": _stats(opens), "inspect_cli": _stats(clis)}
    return result


# --------------------------------------------------------------------------- summaries


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[Run], subject: Subject) -> dict[str, Any]:
    """Per (cache, method): medians with min/max of time, memory and throughput, plus the ratios the targets use."""
    table: dict[str, dict[str, Any]] = {}
    for cache in ("cold", "warm"):
        rows: dict[str, Any] = {}
        for method in dict.fromkeys(r.method for r in runs if r.cache == cache):
            mine = [r for r in runs if r.cache == cache and r.method == method]
            good = [r for r in mine if r.ok]
            if not good:
                rows[method] = {"ok": False, "error": mine[0].error}
                continue
            row: dict[str, Any] = {
                "ok": True,
                "seconds": _stats([r.seconds for r in good]),
                "sync_seconds": _stats([r.sync_seconds for r in good]),
                "peak_anon_bytes": _stats([r.peak_anon_bytes for r in good]),
                "peak_rss_bytes": _stats([r.peak_rss_bytes for r in good]),
                "output_bytes": good[0].output_bytes,
            }
            inner = [r.inner_seconds for r in good if r.inner_seconds is not None]
            if inner:
                row["inner_seconds"] = _stats(inner)
            rows[method] = row
        if rows:
            table[cache] = rows
    ratios: dict[str, Any] = {}
    for cache, rows in table.items():

        def med(method: str, key: str = "seconds", rows: dict[str, Any] = rows) -> float | None:
            row = rows.get(method)
            return row[key]["median"] if row and row.get("ok") and key in row else None

        r: dict[str, Any] = {}
        startup = med("startup")
        for method in rows:
            t = med(method)
            if t is None or method in ("limit", "limit_kernel", "limit_tmpfs", "memcpy", "startup"):
                continue
            entry: dict[str, Any] = {"throughput_GBps": subject.fp32_bytes / t / 1e9}
            if med("ds_bin"):
                entry["time_vs_ds_bin"] = t / med("ds_bin")  # type: ignore[operator]
                anon_ds = med("ds_bin", "peak_anon_bytes")
                entry["anon_vs_ds_bin"] = med(method, "peak_anon_bytes") / anon_ds if anon_ds else None  # type: ignore[operator]
            limit = med("limit_tmpfs") if method.endswith("_tmpfs") else med("limit")
            if limit:
                entry["throughput_vs_limit"] = limit / t
                if startup and method.startswith("zeroio") and t > startup:
                    entry["throughput_vs_limit_excl_startup"] = limit / (t - startup)
            kernel = med("limit_kernel")
            if kernel and not method.endswith("_tmpfs"):
                entry["throughput_vs_kernel_copy"] = kernel / t
            if cache == "warm" and med("memcpy", "inner_seconds"):
                entry["throughput_vs_memcpy"] = med("memcpy", "inner_seconds") / t  # type: ignore[operator]
                if startup and method.startswith("zeroio") and t > startup:
                    entry["throughput_vs_memcpy_excl_startup"] = med("memcpy", "inner_seconds") / (t - startup)  # type: ignore[operator]
            r[method] = entry
        ratios[cache] = r
    return {
        "checkpoint": str(subject.path),
        "label": subject.label,
        "params": subject.params,
        "tied": subject.tied,
        "fp32_bytes": subject.fp32_bytes,
        "manifest": {k: v for k, v in subject.manifest.items() if k != "files"},
        "results": table,
        "ratios": ratios,
        "runs": [asdict(r) for r in runs],
    }


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    """The docs table: per checkpoint, cache and method: median [min-max] time, memory and ratios."""
    lines = [
        (
            "| model | cache | method | time s, median [min–max] | peak anon MiB | peak RSS MiB | GB/s "
            "| vs zero_to_fp32 time | vs zero_to_fp32 anon | vs dd limit | vs kernel copy |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        for cache, rows in s["results"].items():
            for method, row in rows.items():
                if not row.get("ok"):
                    lines.append(
                        f"| {s['label']} | {cache} | {method} | failed: {row['error'][:110]}... | | | | | | | |"
                    )
                    continue
                t = row["seconds"]
                ratio = s["ratios"].get(cache, {}).get(method, {})

                def fmt(key: str, r: dict[str, Any] = ratio) -> str:
                    v = r.get(key)
                    return f"{v:.2f}" if isinstance(v, float) else ""

                secs = row.get("inner_seconds", t) if method == "memcpy" else t
                lines.append(
                    f"| {s['label']} | {cache} | {method} | {secs['median']:.2f} [{secs['min']:.2f}–{secs['max']:.2f}] "
                    f"| {row['peak_anon_bytes']['median'] / 2**20:.0f} | {row['peak_rss_bytes']['median'] / 2**20:.0f} "
                    f"| {fmt('throughput_GBps')} | {fmt('time_vs_ds_bin')} | {fmt('anon_vs_ds_bin')} "
                    f"| {fmt('throughput_vs_limit')} | {fmt('throughput_vs_kernel_copy')} |"
                )
    return "\n".join(lines) + "\n"


def plot(summaries: list[dict[str, Any]], path: Path) -> bool:
    """Time (cold, warm) and peak anonymous memory vs model size, median with min/max bars. False: no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tied = [s for s in summaries if s["tied"]] or summaries
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [
        ("cold", "seconds", "cold cache: time to durable completion (s)"),
        ("warm", "seconds", "warm cache: time to durable completion (s)"),
        ("cold", "peak_anon_bytes", "peak anonymous memory (MiB)"),
    ]
    styles = {
        "zeroio": "o-",
        "zeroio_w1": "o--",
        "ds_bin": "s-",
        "ds_lazy": "^-",
        "zeroio_stream": "d--",
        "limit": "k:",
        "limit_kernel": "k--",
        "ds_safe": "v-",
        "startup": "c-.",
    }
    for ax, (cache, key, title) in zip(axes, panels):
        methods = dict.fromkeys(m for s in tied for m in s["results"].get(cache, {}))
        for method in methods:
            if method not in styles or (key == "peak_anon_bytes" and method.startswith("limit")):
                continue
            xs, ys, lo, hi = [], [], [], []
            for s in sorted(tied, key=lambda s: s["params"]):
                row = s["results"].get(cache, {}).get(method)
                if not row or not row.get("ok"):
                    continue
                scale = 2**20 if key.endswith("bytes") else 1
                st = row[key]
                xs.append(s["params"] / 1e6)
                ys.append(st["median"] / scale)
                lo.append((st["median"] - st["min"]) / scale)
                hi.append((st["max"] - st["median"]) / scale)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=styles[method], label=method, capsize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("parameters (M)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, including the load other users put on it."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    with contextlib.suppress(OSError):
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        info["mem_total"] = mem["MemTotal"].strip()
        info["mem_available_start"] = mem["MemAvailable"].strip()
    with contextlib.suppress(OSError):
        model = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
        info["cpu"] = model[0].split(":", 1)[1].strip() if model else None
    with contextlib.suppress(Exception):
        import deepspeed
        import torch

        info["torch"] = torch.__version__
        info["deepspeed"] = deepspeed.__version__
    with contextlib.suppress(Exception):
        # ZEROIO_COMMIT first: a copy of the tree sent to another machine may carry a stale .git (the GPU host's did).
        info["zeroio_commit"] = os.environ.get("ZEROIO_COMMIT") or subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    return info


# --------------------------------------------------------------------------- main


def ensure_checkpoints(sizes: list[str], untied: list[str], work: Path, log: Any = print) -> list[Path]:
    """Build the requested sizes under ``work`` with make_checkpoint.py unless already there."""
    sys.path.insert(0, str(HERE.parent))
    from make_checkpoint import make_checkpoint

    paths = []
    for size, tied in [(s, True) for s in sizes] + [(s, False) for s in untied]:
        path = work / f"gpt-{size}{'' if tied else '-untied'}"
        if not (path / "manifest.json").exists():
            log(f"building {path} ...")
            manifest = make_checkpoint(path, params=size, tied=tied, overwrite=True)
            log(f"  built in {manifest['build_seconds']} s, {manifest['bytes_on_disk'] / 1e9:.2f} GB")
        paths.append(path)
    return paths


def report_only(paths: list[Path], *, json_path: Path | None, markdown: Path | None, plot_path: Path | None) -> int:
    """Merge result files (later ones win per checkpoint) and write the JSON, table and plot again."""
    merged: dict[str, Any] = {}
    by_checkpoint: dict[str, Any] = {}
    for path in paths:
        result = json.loads(path.read_text())
        merged.setdefault("machine", result["machine"])
        merged.setdefault("notes", []).extend(result.get("notes", []))
        merged.setdefault("sources", []).append(
            {
                "file": path.name,
                "machine": result["machine"],
                "seconds_total": result.get("seconds_total"),
                "checkpoints": [s["label"] for s in result["checkpoints"]],
            }
        )
        if "open_inspect" in result:
            largest = max(result["checkpoints"], key=lambda s: s["params"])
            if "open_inspect" not in merged or largest["params"] >= merged["_inspect_params"]:
                merged["open_inspect"], merged["_inspect_params"] = result["open_inspect"], largest["params"]
        for summary in result["checkpoints"]:
            by_checkpoint[summary["checkpoint"]] = summary
    merged.pop("_inspect_params", None)
    summaries = list(by_checkpoint.values())
    merged["checkpoints"] = summaries
    table = markdown_table(summaries)
    print(table)
    if json_path:
        json_path.write_text(json.dumps(merged, indent=2) + "\n")
    if markdown:
        markdown.write_text(table)
    if plot_path and not plot(summaries, plot_path):
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--_worker"]:
        return _worker(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, nargs="*", default=[], help="existing checkpoint roots")
    parser.add_argument("--make", nargs="*", default=[], help="sizes to build (tied) under --work, e.g. 125M 350M")
    parser.add_argument("--untied", nargs="*", default=[], help="sizes to build untied (for --safe_serialization)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/zeroio-bench"), help="checkpoints and outputs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=DEFAULT_METHODS)
    parser.add_argument(
        "--untied-methods",
        nargs="+",
        default=["zeroio", "ds_bin", "ds_safe", "limit"],
        choices=DEFAULT_METHODS,
        help="methods on untied checkpoints (there for ds_safe)",
    )
    parser.add_argument("--untied-cache", nargs="+", default=["cold"], choices=["cold", "warm"])
    parser.add_argument("--workers", type=int, nargs="*", default=[], help="also run zeroio with --workers N")
    parser.add_argument("--memory-cap", type=parse_bytes, help="also run each method once under this cgroup limit")
    parser.add_argument("--inspect-repeats", type=int, default=3, help="zeroio.open/inspect repeats (largest)")
    parser.add_argument(
        "--report-only",
        type=Path,
        nargs="+",
        help="run nothing: merge these results JSONs (a later file's checkpoint replaces an earlier "
        "one's) and write --json/--markdown/--plot from them",
    )
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--plot", type=Path, help="write the PNG plot here (needs matplotlib)")
    parser.add_argument("--markdown", type=Path, help="write the results table here")
    args = parser.parse_args(argv)

    if args.report_only:
        return report_only(args.report_only, json_path=args.json, markdown=args.markdown, plot_path=args.plot)
    caches = list(args.cache)
    notes = []
    if "cold" in caches and not can_drop_caches():
        caches.remove("cold")
        notes.append("cold-cache runs skipped: /proc/sys/vm/drop_caches is not writable (needs root)")
        print(notes[-1])
    if not has_zeroio_convert():
        notes.append("zeroio._convert is missing: 'zeroio convert' not benchmarked; zeroio_stream stands in")
        print(notes[-1])
    args.work.mkdir(parents=True, exist_ok=True)
    paths = list(args.checkpoint) + ensure_checkpoints(args.make, args.untied, args.work)
    if not paths:
        parser.error("give --checkpoint PATH or --make SIZE")
    info = machine_info()
    t_start = time.perf_counter()
    summaries = []
    for path in paths:
        subject = load_subject(path)
        print(f"{subject.label}: {subject.path} ({subject.fp32_bytes / 1e9:.2f} GB of fp32 master weights)")
        methods, subject_caches = args.methods, caches
        if not subject.tied:
            methods = [m for m in args.methods if m in args.untied_methods]
            subject_caches = [c for c in caches if c in args.untied_cache]
        runs = bench_subject(
            subject, methods=methods, caches=subject_caches, repeats=args.repeats, work=args.work, workers=args.workers
        )
        summary = summarize(runs, subject)
        if args.memory_cap:
            reason = cgroup_available()
            if reason:
                summary["memory_cap"] = {"skipped": reason}
            else:
                cap_runs = bench_memory_cap(subject, methods=methods, cap=args.memory_cap, work=args.work)
                summary["memory_cap"] = {"limit_bytes": args.memory_cap, "runs": [asdict(r) for r in cap_runs]}
        summaries.append(summary)
    largest = max(summaries, key=lambda s: s["params"])
    inspect = time_open_and_inspect(
        load_subject(Path(largest["checkpoint"])), repeats=args.inspect_repeats, caches=caches
    )
    print("open/inspect on", largest["label"], json.dumps(inspect))
    info["loadavg_end"] = os.getloadavg()
    result = {
        "machine": info,
        "notes": notes,
        "seconds_total": time.perf_counter() - t_start,
        "open_inspect": {"checkpoint": largest["label"], **inspect},
        "checkpoints": summaries,
    }
    table = markdown_table(summaries)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    if args.plot and not plot(summaries, args.plot):
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
