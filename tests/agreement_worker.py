"""One rank of the cross-rank error tests (started by tests/test_trust_ranks.py, not collected).

Usage: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/agreement_worker.py SPEC.json``

SPEC is ``{"timeout": s, "cases": [{"id", "src": [rank 0's path, rank 1's path], "shard", "broadcast",
"move_latest", "shard_in_hook", "fail_progress_on", "slow_progress"}]}``. For each case this rank builds the fixtures' TinyLM sharded
as tests/sharded_worker.py shards it (``shard_in_hook``: unsharded, and sharded so by the init hook), calls
``zeroio.load`` (``fail_progress_on``: the ranks whose progress callback raises once bytes are loaded;
``slow_progress``: ``{rank: seconds}`` it sleeps per tensor) and prints one line ``ZEROIO-RESULT {"id", "rank", "error", "message", "seconds", "tensors"}``
(``error`` None when the load returned). The process group's timeout is short, so a rank left waiting in a
collective reports the backend's timeout error instead of hanging the test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded_worker import make_model, shard

import zeroio


def _move_latest(root: Path, marker: Path):
    """Rank 0's init hook: a new save lands (``latest`` moves to another step) after rank 0 opened the checkpoint
    and before rank 1 does (rank 1 waits for ``marker``)."""

    def hook(model: object) -> None:
        (root / "latest").write_text("global_step1")
        marker.write_text("moved")

    return hook


class _Progress:
    """The progress callback: counts the tensors this rank loaded; raises once bytes are loaded (``fail``), or
    sleeps ``slow`` seconds per tensor (a rank with a long share to read)."""

    def __init__(self, rank: int, fail: bool, slow: float) -> None:
        self.rank, self.fail, self.slow = rank, fail, slow
        self.calls = 0

    def __call__(self, done: int, total: int) -> None:
        if not done:
            return
        self.calls += 1
        if self.fail:
            raise RuntimeError(f"injected failure on rank {self.rank}")
        time.sleep(self.slow)


def run_case(case: dict, rank: int, world: int) -> dict:
    in_hook = case.get("shard_in_hook")
    model = make_model({**case, "shard": "none"} if in_hook else case, world)
    src = Path(case["src"][rank])
    hook = (lambda m: shard(m, {**case, "shard": in_hook}, world)) if in_hook else None
    progress = _Progress(
        rank, rank in case.get("fail_progress_on", ()), case.get("slow_progress", {}).get(str(rank), 0)
    )
    if case.get("move_latest"):
        marker = Path(case["move_latest"])
        if rank == 0:
            hook = _move_latest(src, marker)
        else:
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    start = time.monotonic()
    error, message = None, None
    if case.get("staging"):
        os.environ["ZEROIO_STAGING_BYTES"] = case["staging"]
    try:
        zeroio.load(src, model, init_hook=hook, broadcast_from_rank0=bool(case.get("broadcast")), progress=progress)
    except Exception as exc:  # noqa: BLE001 - reported: the test asserts on its type and message
        error, message = type(exc).__name__, str(exc)
    finally:
        os.environ.pop("ZEROIO_STAGING_BYTES", None)
    seconds = time.monotonic() - start
    return {"id": case["id"], "rank": rank, "error": error, "message": message, "seconds": seconds,
            "tensors": progress.calls}  # fmt: skip


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=float(spec["timeout"])))
    try:
        for case in spec["cases"]:
            print("ZEROIO-RESULT " + json.dumps(run_case(case, rank, world)), flush=True)
    finally:
        os._exit(0)  # a rank whose peer timed out cannot tear the group down cleanly: skip it
    return 0


if __name__ == "__main__":
    sys.exit(main())
