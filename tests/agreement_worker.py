"""One rank of the cross-rank error tests (started by tests/test_trust_ranks.py, not collected).

Usage: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/agreement_worker.py SPEC.json``

SPEC is ``{"timeout": s, "cases": [{"id", "src": [rank 0's path, rank 1's path], "shard", "broadcast",
"move_latest"}]}``. For each case this rank builds the fixtures' TinyLM sharded as tests/sharded_worker.py shards
it, calls ``zeroio.load`` and prints one line ``ZEROIO-RESULT {"id", "rank", "error", "message", "seconds"}``
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
from sharded_worker import make_model

import zeroio


def _move_latest(root: Path, marker: Path):
    """Rank 0's init hook: a new save lands (``latest`` moves to another step) after rank 0 opened the checkpoint
    and before rank 1 does (rank 1 waits for ``marker``)."""

    def hook(model: object) -> None:
        (root / "latest").write_text("global_step1")
        marker.write_text("moved")

    return hook


def run_case(case: dict, rank: int, world: int) -> dict:
    model = make_model(case, world)
    src = Path(case["src"][rank])
    hook = None
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
        zeroio.load(src, model, init_hook=hook, broadcast_from_rank0=bool(case.get("broadcast")))
    except Exception as exc:  # noqa: BLE001 - reported: the test asserts on its type and message
        error, message = type(exc).__name__, str(exc)
    finally:
        os.environ.pop("ZEROIO_STAGING_BYTES", None)
    return {"id": case["id"], "rank": rank, "error": error, "message": message, "seconds": time.monotonic() - start}


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
