"""Shared pytest set-up: Hub client isolation, the fixture folder, and DeepSpeed's leaked shared memory."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# The Hub client reads these at import time; keep tests away from real tokens, caches and progress bars.
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="zeroio-hf-home-"))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.pop("HF_TOKEN", None)

import pytest
from fixture_data import FIXTURES

SHM = Path("/dev/shm")
DS_SHM_PREFIX = "deepspeed_allreduce_buffer_"
"""DeepSpeed 0.19.8's CPU accelerator gives every rank of every launch a 69 MB /dev/shm workspace (its shm comm
op, ``deepspeed_allreduce_buffer_<n>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``) and never unlinks it: each launch leaks
69 MB of RAM per rank until reboot, gigabytes over the suite's DeepSpeed launches."""


def _mapped_paths() -> set[str]:
    """Every file some live process has mapped (a leaked workspace is mapped by nobody)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        mapped.update(
            line.split(None, 5)[5] for line in text.splitlines() if line.count(" ") >= 5 and "/dev/shm/" in line
        )
    return mapped


def remove_leaked_deepspeed_shm(min_age_s: float = 30.0) -> int:
    """Unlink DeepSpeed's workspaces that no live process maps (their launch is over); return how many.

    ``min_age_s`` spares a workspace its rank has just created and not yet mapped."""
    if not SHM.is_dir():
        return 0
    candidates = [p for p in SHM.glob(DS_SHM_PREFIX + "*") if p.is_file()]
    if not candidates:
        return 0
    mapped = _mapped_paths()
    now = time.time()
    removed = 0
    for path in candidates:
        try:
            if str(path) in mapped or now - path.stat().st_mtime < min_age_s:
                continue
            path.unlink()
            removed += 1
        except OSError:
            continue
    return removed


@pytest.fixture(scope="module", autouse=True)
def _free_deepspeed_shared_memory() -> Iterator[None]:
    """After each test module, free the shared memory its DeepSpeed launches leaked (RAM the later tests need)."""
    yield
    remove_leaked_deepspeed_shm()


@pytest.fixture
def fixtures_dir():
    """The folder of genuine DeepSpeed fixtures."""
    return FIXTURES


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Python's own Ctrl-C handler in this process, and so the default one in the processes it starts, even when
    the suite runs as a background job of a shell (started with SIGINT ignored, which children would inherit)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
