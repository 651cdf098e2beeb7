"""DCP -> one consolidated file: ``zeroio convert`` vs torch's ``dcp_to_torch_save`` vs ``accelerate merge-weights``
vs the disk's copy limit of the same bytes (issue 25, goal 6).

Each run is a fresh process, cold page cache first when allowed (root), timed to durable completion (the process,
then ``sync`` of what it wrote; zeroio fsyncs itself), with its memory sampled every 10 ms (``benchmarks/run.py``'s
``measure``: peak RSS of the process, peak anonymous memory of its tree). Methods rotate per repeat.

- ``zeroio``: ``python -m zeroio convert DCP OUT --quiet`` (safetensors, fp32 as stored, streamed by chunks);
- ``dcp_to_torch_save``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DCP, OUT/model.pt)`` (a
  torch file: torch has no DCP -> safetensors for ``.distcp`` data);
- ``accelerate``: ``accelerate merge-weights DCP OUT`` (``model.safetensors``);
- ``zeroio_dcp`` / ``zeroio_dcp_wN``: ``zeroio convert DCP OUT --format dcp`` (a DCP folder again, through torch;
  ``--workers N`` blocks read ahead);
- ``limit``: ``copy_file_range`` of every ``.distcp`` file into one file + ``fsync`` (``python -S``, no torch):
  the bytes read and written, in the kernel; ``read_limit``: ``cat`` of the ``.distcp`` files to ``/dev/null``.

After the runs, the zeroio and accelerate outputs are compared tensor by tensor (bit for bit). Usage::

    python benchmarks/dcp_convert.py --dcp /tmp/ck-dcp --work /tmp/dcpconv --repeats 1 --json results.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench

LIMIT = """
import os, sys
out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for path in sys.argv[2:]:
    fd = os.open(path, os.O_RDONLY)
    size, done = os.fstat(fd).st_size, 0
    while done < size:
        n = os.copy_file_range(fd, out, size - done)
        if n <= 0:
            raise OSError("short copy")
        done += n
    os.close(fd)
os.fsync(out)
os.close(out)
"""


def command(method: str, dcp: Path, out: Path) -> list[str]:
    files = [str(p) for p in sorted(dcp.glob("*.distcp"))]
    if method == "zeroio":
        return [sys.executable, "-m", "zeroio", "convert", str(dcp), str(out), "--quiet"]
    if method.startswith("zeroio_dcp"):  # DCP rewritten as DCP (--format dcp); zeroio_dcp_wN: N read-ahead threads
        workers = ["--workers", method.removeprefix("zeroio_dcp_w")] if method.startswith("zeroio_dcp_w") else []
        return [sys.executable, "-m", "zeroio", "convert", str(dcp), str(out), "--format", "dcp", "--quiet", *workers]
    if method == "dcp_to_torch_save":
        code = ("import sys, os; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                "os.makedirs(sys.argv[2]); dcp_to_torch_save(sys.argv[1], os.path.join(sys.argv[2], 'model.pt'))")  # fmt: skip
        return [sys.executable, "-c", code, str(dcp), str(out)]
    if method == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights", str(dcp), str(out)]
    if method == "limit":
        return [sys.executable, "-S", "-c", LIMIT, str(out), *files]
    if method == "read_limit":
        return ["sh", "-c", 'cat "$@" > /dev/null', "sh", *files]
    raise SystemExit(f"unknown method {method!r}")


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Every tensor of the safetensors files under ``a`` equals, bit for bit, the same-named one under ``b``."""
    import torch
    from safetensors import safe_open

    def index(root: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(root.rglob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                out.update(dict.fromkeys(fh.keys(), f))
        return out

    ia, ib = index(a), index(b)
    differ = []
    for name in sorted(set(ia) & set(ib)):
        with safe_open(str(ia[name]), "pt") as fa, safe_open(str(ib[name]), "pt") as fb:
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
        if ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)):
            differ.append(name)
    return {"only_in_first": sorted(set(ia) - set(ib)), "only_in_second": sorted(set(ib) - set(ia)),
            "compared": len(set(ia) & set(ib)), "differ": differ}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dcp", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zeroio-dcp-bench"))
    parser.add_argument("--methods", nargs="+", default=["limit", "read_limit", "zeroio", "dcp_to_torch_save",
                                                          "accelerate"])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the last outputs (and compare them)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cache = "cold" if bench.can_drop_caches() else "warm"
    results: dict[str, Any] = {"machine": bench.machine_info(), "cache": cache, "dcp": str(args.dcp),
                               "dcp_bytes": bench.dir_bytes(args.dcp), "runs": []}  # fmt: skip
    args.work.mkdir(parents=True, exist_ok=True)
    for repeat in range(args.repeats):
        k = repeat % len(args.methods)
        for method in args.methods[k:] + args.methods[:k]:
            out = args.work / method
            shutil.rmtree(out, ignore_errors=True)
            out.unlink(missing_ok=True)
            wrote = None if method == "read_limit" else out
            run = bench.measure(method, command(method, args.dcp, out), cache=cache, repeat=repeat, output=wrote)
            results["runs"].append(asdict(run))
            print(json.dumps(asdict(run)), flush=True)
            last = repeat == args.repeats - 1
            if not (args.keep and last and method in ("zeroio", "accelerate")):
                shutil.rmtree(out, ignore_errors=True)
                out.unlink(missing_ok=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.keep and (args.work / "zeroio").exists() and (args.work / "accelerate").exists():
        results["zeroio_vs_accelerate"] = compare(args.work / "zeroio", args.work / "accelerate")
        print(json.dumps(results["zeroio_vs_accelerate"]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
