"""Where the bytes a ``zeroio convert`` reads go: every read of the checkpoint's files, by purpose.

Each run is a fresh process (``--child`` mode) that wraps the ``os`` calls zeroio reads its sources with
(``pread``, ``preadv``, ``read``, ``readv``, ``copy_file_range``, ``sendfile``), records each call's file, byte range
and purpose (from the Python stack that made it: a read-ahead window, a CRC-32 read before an in-kernel copy, the
rest of a record read to finish its check, a tensor read through memory, metadata...), then runs
``zeroio.cli.main(["convert", ...])``. It reports:

* bytes and calls per purpose, and how many of those bytes this process had already read in user space from
  the same file before (``again``: a re-read; the page cache serves it, but it is copied and counted once more);
* ``rchar`` / ``read_bytes`` of ``/proc/self/io`` over the conversion: every byte read through a syscall
  (``copy_file_range`` counts too) and what reached the block device; what the wrappers did not see
  (buffered file objects: zip directories, pickles, lazy imports) is ``rchar`` minus the traced total;
* the output's size and SHA-256 per file (``--hash``), to check two trees write the same bytes.

The tracing costs a stack walk per call: time conversions with ``--no-trace`` (wall seconds, ``rchar`` only).

    python benchmarks/read_bytes.py --checkpoint /tmp/zeroio-bench/gpt-125M --dtype fp32 bf16 --hash
    python benchmarks/read_bytes.py --checkpoint CK --tree /tmp/zeroio-2b6f88d --json before.json   # another tree
    python benchmarks/read_bytes.py --checkpoint CK --no-trace --cache cold-files --repeats 3         # timing

``--cache cold-files`` evicts the checkpoint's files from the page cache before each run (``POSIX_FADV_DONTNEED``,
no root needed); ``--cache cold`` drops every cache (root: ``echo 1 > /proc/sys/vm/drop_caches``, everyone's).
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
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

# ------------------------------------------------------------------ child: trace one conversion

PURPOSES = {
    "copy": "in-kernel copy (copy_file_range)",
    "crc_copy": "CRC read before an in-kernel copy",
    "crc_finish": "CRC read of a record's unread rest (finish)",
    "window": "read-ahead window",
    "memory": "tensor read through memory (pread, cast, pwrite)",
    "torch": "tensor read on the torch path (chunks)",
    "metadata": "metadata (zip directory, pickles, headers)",
    "other": "other",
}


def _purpose(kind: str, frame: Any) -> str:
    """The purpose of one read, from the Python frames that made it (innermost first)."""
    if kind == "copy":
        return "copy"
    names: list[str] = []
    files: list[str] = []
    while frame is not None and len(names) < 60:
        names.append(frame.f_code.co_name)
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    if "_read_and_check" in names:
        return "crc_copy" if "copy_to" in names else "crc_finish"
    for name, path in zip(names, files):
        if name == "_fill" and path.endswith("read_ahead.py"):
            return "window"
        if name == "copy_through_memory":
            return "memory"
        if name in ("chunks", "write_chunks", "iter_chunks", "read_into_tensor"):
            return "torch"
        if "/_pickles/" in path or name in ("open_checkpoint", "open_zero", "expect", "read_header"):
            return "metadata"
    return "other"


class Tracer:
    """Wraps the ``os`` read calls; each call's ``(seq, path, kind, lo, hi, purpose)`` kept in order."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str, str, int, int, str]] = []
        self._seq = 0
        self.saved: dict[str, Any] = {}

    def _note(self, fd: int, kind: str, offset: int | None, got: int) -> None:
        if got <= 0:
            return
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = f"fd:{fd}"
        self._seq += 1
        lo = -1 if offset is None else offset
        self.events.append((self._seq, path, kind, lo, lo + got, _purpose(kind, sys._getframe(2))))

    def install(self) -> None:
        tracer = self
        pread, preadv, read, readv = os.pread, os.preadv, os.read, os.readv
        copy_file_range = os.copy_file_range
        self.saved = {
            "pread": pread,
            "preadv": preadv,
            "read": read,
            "readv": readv,
            "copy_file_range": copy_file_range,
        }

        def w_pread(fd: int, n: int, offset: int) -> bytes:
            data = pread(fd, n, offset)
            tracer._note(fd, "read", offset, len(data))
            return data

        def w_preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
            got = preadv(fd, buffers, offset, flags)
            tracer._note(fd, "read", offset, got)
            return got

        def w_read(fd: int, n: int) -> bytes:
            data = read(fd, n)
            tracer._note(fd, "read", None, len(data))
            return data

        def w_readv(fd: int, buffers: Any) -> int:
            got = readv(fd, buffers)
            tracer._note(fd, "read", None, got)
            return got

        def w_copy_file_range(src: int, dst: int, count: int, offset_src: Any = None, offset_dst: Any = None) -> int:
            got = copy_file_range(src, dst, count, offset_src, offset_dst)
            tracer._note(src, "copy", offset_src, got)
            return got

        os.pread, os.preadv, os.read, os.readv = w_pread, w_preadv, w_read, w_readv  # type: ignore[assignment]
        os.copy_file_range = w_copy_file_range  # type: ignore[assignment]

    def uninstall(self) -> None:
        for name, fn in self.saved.items():
            setattr(os, name, fn)


class _Seen:
    """Disjoint sorted byte intervals of one file read so far; ``add`` returns how many bytes were there already."""

    def __init__(self) -> None:
        self.lo: list[int] = []
        self.hi: list[int] = []

    def add(self, lo: int, hi: int) -> int:
        i = bisect.bisect_right(self.hi, lo)  # first interval ending after lo
        again, j = 0, i
        new_lo, new_hi = lo, hi
        while j < len(self.lo) and self.lo[j] <= hi:
            again += max(0, min(hi, self.hi[j]) - max(lo, self.lo[j]))
            new_lo, new_hi = min(new_lo, self.lo[j]), max(new_hi, self.hi[j])
            j += 1
        self.lo[i:j] = [new_lo]
        self.hi[i:j] = [new_hi]
        return again


def summarize(events: list[tuple[int, str, str, int, int, str]], source: Path) -> dict[str, Any]:
    """Bytes and calls per purpose for the files under ``source``, with the bytes read again."""
    root = str(source.resolve())
    rows: dict[str, dict[str, int]] = {}
    seen: dict[str, _Seen] = {}
    copied_unread = 0
    for _, path, kind, lo, hi, purpose in sorted(events):
        if not path.startswith(root):
            purpose = "outside"  # not the checkpoint (imports, /proc, pipes)
        row = rows.setdefault(purpose, {"calls": 0, "bytes": 0, "again": 0})
        row["calls"] += 1
        row["bytes"] += hi - lo
        if purpose == "outside" or lo < 0:
            continue
        mine = seen.setdefault(path, _Seen())
        if kind == "copy":
            copied_unread += (hi - lo) - _overlap(mine, lo, hi)
        else:
            row["again"] += mine.add(lo, hi)
    distinct = sum(sum(h - l for l, h in zip(s.lo, s.hi)) for s in seen.values())
    return {"purposes": rows, "copied_without_user_read": copied_unread, "distinct": distinct}


def _overlap(seen: _Seen, lo: int, hi: int) -> int:
    i = bisect.bisect_right(seen.hi, lo)
    total = 0
    while i < len(seen.lo) and seen.lo[i] < hi:
        total += max(0, min(hi, seen.hi[i]) - max(lo, seen.lo[i]))
        i += 1
    return total


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as fh:
        return {k.strip(): int(v) for k, v in (line.split(":") for line in fh)}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, spec["tree"] or str(REPO))  # before an editable install of another tree
    tracer = Tracer()
    import zeroio.cli

    argv = ["convert", spec["src"], spec["dst"], "--quiet", *spec["args"]]
    if spec["trace"]:
        tracer.install()
    before, t0, cpu0 = _proc_io(), time.perf_counter(), os.times()
    try:
        code = zeroio.cli.main(argv)
    finally:
        tracer.uninstall()
    seconds, after, cpu1 = time.perf_counter() - t0, _proc_io(), os.times()
    out = {
        "exit": code,
        "zeroio": zeroio.__file__,
        "convert_s": round(seconds, 3),
        "cpu_s": round(cpu1.user + cpu1.system - cpu0.user - cpu0.system, 3),
        **{k: after[k] - before[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes", "syscr")},
    }
    if spec["trace"]:
        out.update(summarize(tracer.events, Path(spec["src"])))
        out["traced"] = sum(hi - lo for _, _, _, lo, hi, _ in tracer.events)
    return out


# ------------------------------------------------------------------ driver


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (clean pages: no root needed)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def drop_all_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def hash_outputs(dst: Path) -> dict[str, str]:
    out = {}
    for path in sorted(dst.rglob("*")):
        if path.is_file():
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(16 * 2**20):
                    digest.update(chunk)
            out[str(path.relative_to(dst))] = digest.hexdigest()
    return out


def run_one(args: argparse.Namespace, dtype: str, dst: Path) -> dict[str, Any]:
    shutil.rmtree(dst, ignore_errors=True)
    extra = [*(["--dtype", dtype] if dtype != "stored" else []), *args.convert_args]
    spec = {"src": str(args.checkpoint), "dst": str(dst), "args": extra, "trace": args.trace,
            "tree": str(args.tree) if args.tree else ""}  # fmt: skip
    if args.cache == "cold-files":
        evict(args.checkpoint)
    elif args.cache == "cold":
        drop_all_caches()
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE), "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=str(args.tree or REPO), check=False)  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(wall, 3)
    result["output_bytes"] = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file() and p.suffix == ".safetensors")
    if args.hash:
        result["sha256"] = hash_outputs(dst)
    return result


def table(result: dict[str, Any]) -> str:
    """The purposes (traced runs), then ``rchar`` against the bytes needed (the distinct bytes read, traced) or the
    output (untraced runs)."""
    out_bytes = result["output_bytes"]
    lines = []
    if "distinct" in result:
        distinct = result["distinct"] or 1
        lines.append(f"{'purpose':52s} {'calls':>8s} {'MB':>9s} {'read again MB':>14s} {'x needed':>9s}")
        for key, row in sorted(result["purposes"].items(), key=lambda kv: -kv[1]["bytes"]):
            label = PURPOSES.get(key, "outside the checkpoint (imports, /proc)")
            lines.append(
                f"{label:52s} {row['calls']:8d} {row['bytes'] / 1e6:9.1f} {row['again'] / 1e6:14.1f} "
                f"{row['bytes'] / distinct:9.3f}"
            )
        untraced = result["rchar"] - result["traced"]
        lines.append(f"{'not traced (buffered file objects: zip/pickle/imports)':52s} {'':8s} {untraced / 1e6:9.1f}")
        lines.append(
            f"needed: {distinct / 1e6:.1f} MB of the checkpoint (distinct bytes read); kernel-copied "
            f"without a user-space read first: {result['copied_without_user_read'] / 1e6:.1f} MB"
        )
        ratio = f"{result['rchar'] / distinct:.3f} x needed"
    else:
        ratio = f"{result['rchar'] / out_bytes:.3f} x output"
    lines.append(
        f"rchar {result['rchar'] / 1e6:.1f} MB = {ratio}; output {out_bytes / 1e6:.1f} MB; from the device "
        f"{result['read_bytes'] / 1e6:.1f} MB; convert {result['convert_s']:.2f} s, cpu {result['cpu_s']:.2f} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zeroio-read-bytes"), help="outputs go here")
    parser.add_argument("--tree", type=Path, help="import zeroio from this source tree (default: this one)")
    parser.add_argument("--dtype", nargs="+", default=["stored"], help="stored, fp32, bf16, fp16 (one run each)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cache", choices=["warm", "cold-files", "cold"], default="warm")
    parser.add_argument("--no-trace", dest="trace", action="store_false", help="time only: no wrappers")
    parser.add_argument("--hash", action="store_true", help="SHA-256 of each output file")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("convert_args", nargs="*", help="after --: more `zeroio convert` flags")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.checkpoint is None:
        parser.error("--checkpoint is required")
    args.checkpoint = args.checkpoint.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"checkpoint": str(args.checkpoint), "tree": str(args.tree or REPO),
                              "cache": args.cache, "argv": sys.argv[1:], "runs": {}}  # fmt: skip
    if args.cache == "warm":
        for path in args.checkpoint.rglob("*"):  # read once so every run finds the files cached
            if path.is_file():
                with open(path, "rb") as fh:
                    while fh.read(16 * 2**20):
                        pass
    for dtype in args.dtype:
        runs = [run_one(args, dtype, args.work / f"out-{dtype}") for _ in range(args.repeats)]
        report["runs"][dtype] = runs
        print(f"== {args.checkpoint.name} -> {dtype} ({args.cache}; zeroio {runs[0]['zeroio']})")
        print(table(runs[-1]))
        if len(runs) > 1:
            walls = [r["convert_s"] for r in runs]
            print(f"convert s: median {statistics.median(walls):.2f} of {walls}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
