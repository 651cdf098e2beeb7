"""A cold load to CUDA checked bit for bit, and how much of the files the page cache holds after it.

The checkpoint's files are evicted from the page cache, loaded with ``zeroio.load(device="cuda")`` (direct reads
as ``ZEROIO_DIRECT_READS`` says), then every tensor is compared with ``safetensors``' own CPU read of it. The
share of the files' pages left in the page cache (``mincore``) shows which path read them: buffered reads leave
them all, ``O_DIRECT`` reads none (but what was read ahead)::

    ZEROIO_DIRECT_READS=1 python benchmarks/check_direct.py --folder /tmp/zd/st --config /tmp/zd/st/manifest.json \\
        --json check-direct-on.json
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

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this tree's zeroio, whatever is installed

import run as bench


def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache (``mincore`` of a private mapping), None where it cannot be told."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(path, "rb") as fh:
            mapped = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        anchor = ctypes.c_char.from_buffer(mapped)
        vec = (ctypes.c_ubyte * pages)()
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        del anchor
        mapped.close()
    except (OSError, AttributeError, ValueError):
        return None
    return None if rc != 0 else sum(v & 1 for v in vec) * mmap.PAGESIZE


def main(argv: list[str] | None = None) -> int:
    import loaders_side_by_side as sbs
    import torch
    from safetensors import safe_open

    import zeroio
    from zeroio._io.direct_read import _fs_type, direct_reads_enabled, supports_direct

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    files = [Path(f) for f in sbs._files(args.folder)]
    model = sbs._model(args.config, torch.bfloat16)
    torch.cuda.init()
    bench.evict_files(files)
    before = sum(resident_bytes(f) or 0 for f in files)
    t0 = time.perf_counter()
    zeroio.load(args.folder, model, device="cuda", dtype=torch.bfloat16, strict=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = [resident_bytes(f) for f in files]
    state = model.state_dict()
    mismatched, compared, nbytes = [], 0, 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is no mapping)
                ref = st.get_tensor(key)
                got = state[key]
                compared += 1
                nbytes += ref.numel() * ref.element_size()
                if got.dtype != ref.dtype or not torch.equal(got, ref.to(got.device)):
                    mismatched.append(key)
    total = sum(f.stat().st_size for f in files)
    result = {
        "ZEROIO_DIRECT_READS": os.environ.get("ZEROIO_DIRECT_READS"),
        "direct_reads_enabled": direct_reads_enabled(),
        "file_system": _fs_type(os.path.realpath(args.folder)),
        "supports_direct": supports_direct(files[0]),
        "load_s": seconds,
        "file_bytes": total,
        "resident_before_load": before,
        "resident_after_load": None if None in after else sum(a or 0 for a in after),
        "tensors_compared": compared,
        "bytes_compared": nbytes,
        "mismatched": mismatched,
        "bit_exact": not mismatched and compared > 0,
        "machine": bench.machine_info(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
