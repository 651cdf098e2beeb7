"""Rank files are read through a bounded pool of descriptors (issue 23, item 8): a checkpoint with more rank files
than RLIMIT_NOFILE allows converts to the same bytes, and a rank file swapped while evicted is refused."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES

import zeroio
from zeroio._io.fd_pool import DescriptorPool

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_NOFILE is POSIX")

WS4 = FIXTURES / "z3_ws4_fp32"  # 4 ranks: 8 rank files


def _limited(code: str, limit: int) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose RLIMIT_NOFILE is ``limit`` (set after the imports)."""
    script = textwrap.dedent(
        f"""
        import resource, sys
        from pathlib import Path
        import zeroio, zeroio.errors
        {"import torch" if "torch" in code else ""}
        resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
        """
    ) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_more_rank_files_than_the_limit_convert_to_the_same_bytes(tmp_path: Path, fmt: str) -> None:
    # safetensors: the copy_file_range path (a descriptor leased per copy); torch: reads into tensors
    """Under RLIMIT_NOFILE=8 (5 descriptors free), the 8 rank files of a 4-rank checkpoint convert, bit for bit."""
    zeroio.convert(WS4, tmp_path / "free", fmt=fmt, progress=False)
    result = _limited(f"zeroio.convert(Path({str(WS4)!r}), Path({str(tmp_path / 'tight')!r}), fmt={fmt!r})", 8)
    assert result.returncode == 0, result.stderr
    for path in sorted((tmp_path / "free").iterdir()):
        if fmt == "torch":  # torch.save archives carry a random serialization id: compare what they hold
            free, tight = (
                torch.load(p / path.name, weights_only=True) for p in (tmp_path / "free", tmp_path / "tight")
            )
            assert free.keys() == tight.keys() and all(free[k].equal(tight[k]) for k in free)
        else:
            assert (tmp_path / "tight" / path.name).read_bytes() == path.read_bytes()


def test_reading_every_tensor_twice_holds_few_descriptors(tmp_path: Path) -> None:
    """With RLIMIT_NOFILE=16 (a pool of 4), reading the whole checkpoint twice holds at most 4 rank files open and
    returns what an unlimited read does."""
    out = tmp_path / "tensors.pt"
    code = f"""
        import os
        before = len(os.listdir("/proc/self/fd"))
        with zeroio.open(Path({str(WS4)!r})) as ckpt:
            for _ in range(2):
                got = ckpt.state_dict()
                assert len(os.listdir("/proc/self/fd")) <= before + 4, os.listdir("/proc/self/fd")
        torch.save(got, {str(out)!r})
    """
    result = _limited(code, 16)
    assert result.returncode == 0, result.stderr
    got = torch.load(out, weights_only=True)
    with zeroio.open(WS4) as ckpt:
        expected = ckpt.state_dict()
        assert got.keys() == expected.keys() and all(got[k].equal(expected[k]) for k in got)


def test_a_rank_file_swapped_after_eviction_is_refused(tmp_path: Path) -> None:
    """Rank files replaced (new inode, same bytes) while their descriptors were evicted: the reopen is refused."""
    root = tmp_path / "ckpt"
    shutil.copytree(WS4, root)
    code = f"""
        import shutil
        root = Path({str(root)!r})
        with zeroio.open(root) as ckpt:
            ckpt.state_dict()  # 8 rank files through a pool of 4: at least 4 evicted
            for path in sorted((root / "global_step2").glob("*.pt")):
                shutil.copy2(path, path.with_suffix(".new"))
                path.with_suffix(".new").replace(path)
            try:
                ckpt.state_dict()
            except zeroio.errors.CheckpointFormatError as exc:
                print(exc)
    """
    result = _limited(code, 16)
    assert result.returncode == 0, result.stderr
    assert "changed while zeroio was reading it (inode differs from when it was opened)" in result.stdout


# The pool's thread contract, on a pool of its own whose opener stands for the file system: no public call can make
# another thread sit inside the process's pool (a slow open holds its lock), or run a finalizer there.


def _descriptors_of(path: Path) -> int:
    """How many of this process's descriptors are open on ``path`` (read from /proc)."""
    found, target = 0, str(path.resolve())
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found += os.readlink(f"/proc/self/fd/{fd}") == target
    return found


def _open(path: Path) -> tuple[int, object]:
    """A descriptor and an identity, as the file system gives them: the pool's thread contract is under test here,
    not the identity check (``open_regular``, tested through the public API in test_trust_low.py)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    return fd, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


RANK0, RANK1 = sorted((WS4 / "global_step2").glob("*_optim_states.pt"))[:2]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_release_while_another_thread_opens_closes_before_returning() -> None:
    """A file released while another thread is inside the pool for a second (an open on a loaded NFS server holds
    its lock) is closed when release returns, not at some later read: a closed checkpoint's files are closed, a
    deleted one's space is freed, and an NFS folder keeps no .nfs file that blocks its removal."""
    inside = threading.Event()

    def opener(path: Path, identity: object) -> tuple[int, object]:
        if path == RANK1:
            inside.set()
            time.sleep(1.0)
        return _open(path)

    pool = DescriptorPool(8, opener)
    pool.acquire("rank0", RANK0, None)
    pool.end_lease("rank0")
    slow = threading.Thread(target=lambda: (pool.acquire("rank1", RANK1, None), pool.end_lease("rank1")))
    slow.start()
    inside.wait()
    before = _descriptors_of(RANK0)
    pool.release("rank0")
    after = _descriptors_of(RANK0)
    slow.join()
    pool.release("rank1")
    assert (before, after) == (1, 0)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_release_inside_the_pool_never_waits_for_its_own_thread() -> None:
    """A release run inside the pool by the thread that is in it (the garbage collector closing a dropped
    checkpoint during an allocation there) returns at once; the file is closed when that thread's lease ends."""

    def opener(path: Path, identity: object) -> tuple[int, object]:
        if path == RANK1:
            pool.release("rank0")  # as a finalizer run by the collector inside the pool's lock
        return _open(path)

    pool = DescriptorPool(8, opener)
    pool.acquire("rank0", RANK0, None)
    pool.end_lease("rank0")
    took: list[float] = []

    def inside() -> None:
        start = time.monotonic()
        pool.acquire("rank1", RANK1, None)
        took.append(time.monotonic() - start)
        pool.end_lease("rank1")

    thread = threading.Thread(target=inside, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the release waited for its own thread"
    assert took[0] < 5 and _descriptors_of(RANK0) == 0
    pool.release("rank1")
