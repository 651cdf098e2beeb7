"""One rank of a gloo job whose every rank calls ``zeroio.convert`` (or the zero_to_fp32 drop-in) with one
destination, as code written for DeepSpeed does (started by tests/test_every_rank.py, not collected).

Usage: ``RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/every_rank_worker.py SPEC.json``

SPEC is ``{"jobs": [{"call", "src", "dst", "kwargs", "hook", "ranks"}]}``: ``call`` is ``convert`` or ``dropin``
(``convert_zero_checkpoint_to_fp32_state_dict``); ``ranks`` (default: all) lists the ranks that call. ``hook`` is
``"raise"`` or ``"kill"``: the progress callback every caller passes raises or SIGKILLs its process once bytes
flow, which only the writing rank's does. Each outcome is one line ``ZEROIO-RESULT {json}`` on stdout, with
``"wrote"``: whether this rank's progress callback saw bytes (it wrote).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import zeroio
from zeroio.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    for job in spec["jobs"]:
        # every job starts on every rank together: a rank that skips a job (or writes fast) must not run on into
        # the last job, where the writer kills itself and takes the job's store (rank 0's) with it, while the
        # other rank still has earlier jobs to do ("the job's store does not answer", 2-4 runs in 10 before)
        dist.barrier()
        if rank not in job.get("ranks", range(dist.get_world_size())):
            print("ZEROIO-RESULT " + json.dumps({"skipped": True, "process": rank}), flush=True)
            continue
        seen: list[int] = []

        def progress(done: int, total: int, hook: str | None = job.get("hook"), seen: list[int] = seen) -> None:
            if done:
                seen.append(done)
                if hook == "raise":
                    raise RuntimeError(f"injected failure on rank {rank}")
                if hook == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)

        started = time.monotonic()
        try:
            if job["call"] == "dropin":
                convert_zero_checkpoint_to_fp32_state_dict(job["src"], job["dst"], **job["kwargs"])
                outcome: dict = {"ok": True}
            else:
                result = zeroio.convert(job["src"], job["dst"], progress=progress, **job["kwargs"])
                outcome = {
                    "ok": True, "files": [str(p) for p in result.files], "total_size": result.total_size,
                    "num_tensors": result.num_tensors, "tied": result.tied, "card_facts": result.card_facts,
                }  # fmt: skip
        except zeroio.errors.ZeroIOError as exc:
            outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc), "error_rank": exc.rank}
        outcome.update(process=rank, wrote=bool(seen), seconds=time.monotonic() - started)
        print("ZEROIO-RESULT " + json.dumps(outcome), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no teardown: after a "kill" job a peer is gone, and destroying the group would wait for it


if __name__ == "__main__":
    raise SystemExit(main())
