"""One process of a local distributed-conversion test job (started by tests/test_distributed.py, not collected).

Usage: ``RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/dist_worker.py SPEC.json``

SPEC is ``{"jobs": [{"src", "dst", "kwargs", "hook"}]}``; each job is one ``zeroio.convert(..., distributed=True)``
call. A hook ``{"rank": r, "action": "kill" | "raise" | "hang" | "slow"}`` makes that rank SIGKILL itself, raise,
hang, or sleep 0.25 s per chunk in its progress callback once it has written its first bytes (so its temporary
shard exists); several hooks are a list. ``"chdir": {"<rank>": folder}`` runs that rank's call from another
working folder (a relative ``src`` then names a different checkpoint there, as on a node without the shared
filesystem). The failure
injection lives here, in the test launcher, not in zeroio. Each job's outcome is printed as one line
``ZEROIO-RESULT {json}`` on stdout, with ``"wrote"``: the bytes of shards this process wrote (its progress).
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


def _hook(hooks: dict | list | None, rank: int):
    mine = [h for h in (hooks if isinstance(hooks, list) else [hooks] if hooks else []) if h["rank"] == rank]
    if not mine:
        return False
    (hook,) = mine

    def callback(done: int, total: int) -> None:
        if done == 0:
            return
        if hook["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif hook["action"] == "raise":
            raise RuntimeError(f"injected failure on rank {rank}")
        elif hook["action"] == "hang":
            time.sleep(3600)
        elif hook["action"] == "slow":
            time.sleep(0.25)

    return callback


class _Written:
    """A progress callback that keeps the bytes this process wrote, then calls the hook's callback, if any."""

    def __init__(self, hook) -> None:
        self.hook = hook
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        self.done = max(self.done, done)
        if self.hook:
            self.hook(done, total)


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    # The job's own process group, as a training script would have it; zeroio adds its gloo group with its timeout.
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    for job in spec["jobs"]:
        started = time.monotonic()
        cwd = os.getcwd()
        os.chdir(job.get("chdir", {}).get(str(rank), cwd))
        written = _Written(_hook(job.get("hook"), rank))
        try:
            result = zeroio.convert(job["src"], job["dst"], distributed=True, progress=written, **job["kwargs"])
            outcome = {
                "ok": True,
                "files": [str(p) for p in result.files],
                "index_path": str(result.index_path) if result.index_path else None,
                "total_size": result.total_size,
                "num_tensors": result.num_tensors,
                "tied": result.tied,
            }
        except zeroio.errors.ZeroIOError as exc:
            outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc), "error_rank": exc.rank}
        finally:
            os.chdir(cwd)
        outcome["process"] = rank
        outcome["seconds"] = time.monotonic() - started
        outcome["wrote"] = written.done
        print("ZEROIO-RESULT " + json.dumps(outcome), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
