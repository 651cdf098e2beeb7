"""Prototype, not part of zeroio: three ways to copy a ZeRO-3 checkpoint's fp32 weights into one raw file.

Measures what ``zeroio convert``'s copy loop could gain for outputs that need no cast (fp32 out of fp32
master weights). Every mode writes the same bytes (tensors in key order, tied aliases once) and fsyncs:

* ``user``: what zeroio does today: ``_read_into`` (``preadv``) into one reused 16 MiB buffer, then ``pwrite``.
* ``user_sfr``: the same, plus ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` after each chunk (early writeback).
* ``cfr``: ``os.copy_file_range`` per ZeRO piece, straight from the rank file to the output (in-kernel copy).
* ``sendfile``: ``os.sendfile`` per piece (works across file systems, e.g. into tmpfs).

    python benchmarks/copy_paths.py /tmp/zeroio-bench/gpt-470M /tmp/zeroio-bench/out/p.raw cfr

It uses zeroio internals (``_sources``, ``RankFile._data_offset``) on purpose; see docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import zeroio
from zeroio._formats.read_plans import FlatPlan

_libc = ctypes.CDLL(None, use_errno=True)
_SYNC_FILE_RANGE_WRITE = 2
CHUNK = 16 << 20


def main(src: str, out: str, mode: str) -> float:
    ckpt = zeroio.open(src)
    t0 = time.perf_counter()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    offset = 0
    buf = torch.empty(CHUNK, dtype=torch.uint8)
    for name in ckpt:
        if name in ckpt.tied:
            continue
        info = ckpt.info(name)
        stored = ckpt.stored_dtype(name)
        source = ckpt._sources[name]  # type: ignore[attr-defined]
        if mode in ("cfr", "sendfile") and isinstance(source, FlatPlan):
            for piece in source.pieces:
                ref = source.groups[piece.rank][piece.group]
                itemsize = ref.storage.dtype.itemsize
                src_off = ref.file.data_offset(ref.storage.key) + (ref.storage_offset + piece.start) * itemsize
                left, dst_off = piece.length * itemsize, offset + piece.dest * itemsize
                src_fd = ref.file.source.fileno()
                while left:
                    if mode == "cfr":
                        done = os.copy_file_range(src_fd, fd, left, src_off, dst_off)
                    else:  # sendfile writes at the output's file position
                        os.lseek(fd, dst_off, os.SEEK_SET)
                        done = os.sendfile(fd, src_fd, src_off, left)
                    left, src_off, dst_off = left - done, src_off + done, dst_off + done
        else:
            step = CHUNK // stored.itemsize
            for start in range(0, info.numel, step):
                n = min(step, info.numel - start)
                nbytes = n * stored.itemsize
                ckpt.read_into(name, start, buf[:nbytes].view(stored))
                at = offset + start * stored.itemsize
                os.pwrite(fd, memoryview(buf[:nbytes].numpy()), at)
                if mode == "user_sfr":
                    _libc.sync_file_range(fd, ctypes.c_longlong(at), ctypes.c_longlong(nbytes), _SYNC_FILE_RANGE_WRITE)
        offset += info.numel * stored.itemsize
    os.fsync(fd)
    os.close(fd)
    ckpt.close()
    return time.perf_counter() - t0


if __name__ == "__main__":
    seconds = main(*sys.argv[1:4])
    print(f"ZEROIO_BENCH_INNER_SECONDS={seconds}")
