"""The read limit with Linux native AIO: one Python thread keeps D ``O_DIRECT`` reads of B bytes in flight.

``read_limit.py``'s threads each wait for their own read and take the GIL back after it, once per read; here one
thread submits D reads to the kernel at once (``io_submit``) and reaps them as they complete (``io_getevents``), so
the Python work per read is a few attribute stores, outside the disk's critical path. Comparing the two, and both
with fastsafetensors (the same 16 x 512 KiB ``O_DIRECT`` pattern from C++ threads), tells whether what Python
threads leave on the table is the read pattern or the per-read cost. x86-64 Linux only (syscall numbers)::

    python benchmarks/aio_read.py --files /tmp/zr/hf-bf16/*.safetensors --depth 16 32 --block-kib 512 4096
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ALIGN = 4096
SYS_IO_SETUP, SYS_IO_DESTROY, SYS_IO_GETEVENTS, SYS_IO_SUBMIT = 206, 207, 208, 209  # x86-64


class IOCB(ctypes.Structure):
    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class IOEvent(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def read_aio(ranges: list[tuple[Path, int, int]], depth: int, block: int) -> dict[str, Any]:
    """Read every byte of ``ranges`` once with ``O_DIRECT``, ``depth`` reads of ``block`` bytes in flight."""
    pieces = []
    for path, offset, nbytes in ranges:
        start, end = offset - offset % ALIGN, -(-(offset + nbytes) // ALIGN) * ALIGN
        pieces += [(path, at, min(block, end - at)) for at in range(start, end, block)]
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in {r[0] for r in ranges}}
    buffers = [mmap.mmap(-1, block) for _ in range(depth)]
    addresses = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in buffers]
    iocbs = [IOCB() for _ in range(depth)]
    pointers = (ctypes.POINTER(IOCB) * 1)()
    events = (IOEvent * depth)()
    ctx = ctypes.c_ulong(0)
    _check(_syscall(SYS_IO_SETUP, depth, ctypes.byref(ctx)), "io_setup")
    t0 = time.perf_counter()
    total, nxt, in_flight = 0, 0, 0

    def submit(slot: int) -> None:
        nonlocal nxt, in_flight
        path, at, n = pieces[nxt]
        cb = iocbs[slot]
        ctypes.memset(ctypes.addressof(cb), 0, ctypes.sizeof(cb))
        cb.aio_data, cb.aio_fildes, cb.aio_buf = slot, fds[path], addresses[slot]
        cb.aio_nbytes, cb.aio_offset = n, at
        pointers[0] = ctypes.pointer(cb)
        _check(_syscall(SYS_IO_SUBMIT, ctx, 1, pointers), "io_submit")
        nxt += 1
        in_flight += 1

    try:
        for slot in range(min(depth, len(pieces))):
            submit(slot)
        while in_flight:
            got = _check(_syscall(SYS_IO_GETEVENTS, ctx, 1, depth, events, None), "io_getevents")
            for event in events[:got]:
                in_flight -= 1
                if event.res <= 0:
                    raise OSError(f"AIO read failed: {event.res}")
                total += event.res
                if nxt < len(pieces):
                    submit(int(event.data))
    finally:
        seconds = time.perf_counter() - t0
        _syscall(SYS_IO_DESTROY, ctx)
        for fd in fds.values():
            os.close(fd)
    return {"seconds": seconds, "bytes": total, "GBps": total / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    import run as bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", nargs="+", required=True)
    parser.add_argument("--depth", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[512])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    ranges = [(Path(f), 0, Path(f).stat().st_size) for f in args.files]
    runs = []
    for kib in args.block_kib:
        for depth in args.depth:
            bench.evict_files(sorted({r[0] for r in ranges}))
            run = {"depth": depth, "block_kib": kib, **read_aio(ranges, depth, kib << 10)}
            runs.append(run)
            print(json.dumps(run), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": bench.machine_info(), "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
