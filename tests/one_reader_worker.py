"""One process of a one-host distributed conversion test job (started by tests/test_one_reader.py, not collected).

Usage: ``RANK=r WORLD_SIZE=n LOCAL_WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/one_reader_worker.py
SPEC.json``

Unlike tests/dist_worker.py, no process group is initialised first and torch is never imported here: this is
``zeroio convert --distributed`` under torchrun, as a script calls it, so zeroio's one-reader path runs. SPEC is
``{"src", "dst", "kwargs", "kill": bool, "ready": path, "chdir": {rank: folder}}``; ``chdir`` runs that rank
from another working folder (a relative ``src`` names another checkpoint there, or none); with ``kill``, process 1 creates ``ready`` once it waits
for process 0's word (its debug log says so), and process 0 SIGKILLs itself at its first written bytes once
``ready`` exists. The outcome is printed as one line ``ZEROIO-RESULT {json}`` on stdout, with whether this process
imported torch and whether it still has a child process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import zeroio


def _kill_when_ready(ready: Path):
    """Process 0's progress callback: at its first bytes, wait for process 1 to be waiting, then die."""

    def callback(done: int, total: int) -> None:
        if done:
            deadline = time.monotonic() + 60
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

    return callback


class _SayReady(logging.Handler):
    """Process 1: create ``ready`` when zeroio logs that it waits for process 0's word."""

    def __init__(self, ready: Path) -> None:
        super().__init__(logging.DEBUG)
        self.ready = ready

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting for process 0's word" in record.getMessage():
            self.ready.touch()


def _has_children() -> bool:
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return True  # a child that is still running (pid 0) or one nobody reaped


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    progress = False
    if spec.get("kill") and rank == 0:
        progress = _kill_when_ready(Path(spec["ready"]))
    elif spec.get("kill"):
        log = logging.getLogger("zeroio")
        log.setLevel(logging.DEBUG)
        log.addHandler(_SayReady(Path(spec["ready"])))
    started = time.monotonic()
    os.chdir(spec.get("chdir", {}).get(str(rank), os.getcwd()))
    try:
        result = zeroio.convert(spec["src"], spec["dst"], distributed=True, progress=progress, **spec["kwargs"])
        outcome = {"ok": True, "files": [str(p) for p in result.files], "num_tensors": result.num_tensors}
    except zeroio.errors.ZeroIOError as exc:
        outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc), "error_rank": exc.rank}
    outcome.update(
        process=rank,
        seconds=time.monotonic() - started,
        torch_imported="torch" in sys.modules,
        children=_has_children(),
    )
    print("ZEROIO-RESULT " + json.dumps(outcome), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
