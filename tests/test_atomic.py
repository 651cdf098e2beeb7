"""Nothing half-written: existing outputs refused, and every failure (full disk, Ctrl-C, SIGKILL) leaves no output."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from fixture_data import FIXTURES, ROOT, reference
from safetensors.torch import load_file

from zeroio import convert
from zeroio.errors import OutputError

SRC = FIXTURES / "z3_ws2_fp32"
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _leftovers(folder) -> list[str]:
    """Names in ``folder`` that zeroio's temporary outputs would use."""
    return sorted(p.name for p in folder.iterdir() if ".zeroio-" in p.name)


def _assert_valid_output(folder) -> None:
    tensors = load_file(folder / "model.safetensors")
    expected = reference("z3_ws2_fp32")
    assert all(tensors[k].equal(v) for k, v in expected.items() if k != "head.weight")


@contextlib.contextmanager
def _tmpfs(path, options: str):
    """Mount a small tmpfs (root only), unmounting afterwards."""
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False, capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


# --------------------------------------------------------------------------- existing destinations


def test_existing_folder_is_refused_before_reading(tmp_path):
    """An existing destination raises OutputError before the source is even opened."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(OutputError) as excinfo:
        convert(tmp_path / "no-such-source", tmp_path / "out", progress=False)
    assert str(excinfo.value) == (
        f"Output folder '{tmp_path / 'out'}' already exists. Pass overwrite=True (--overwrite) to replace it, "
        "or choose another destination."
    )
    assert excinfo.value.path == tmp_path / "out"
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_existing_file_is_refused(tmp_path):
    """An existing file at the destination is refused too."""
    (tmp_path / "out").write_text("x")
    with pytest.raises(OutputError) as excinfo:
        convert(SRC, tmp_path / "out", progress=False)
    assert str(excinfo.value) == (
        f"Output file '{tmp_path / 'out'}' already exists. Pass overwrite=True (--overwrite) to replace it, "
        "or choose another destination."
    )


@pytest.mark.parametrize("existing", ["folder", "file"])
def test_overwrite_replaces_the_whole_destination(tmp_path, existing):
    """overwrite=True swaps the new folder in: nothing of the old one remains, no temporary names are left."""
    dst = tmp_path / "out"
    if existing == "folder":
        dst.mkdir()
        (dst / "pytorch_model.bin").write_text("stale")
    else:
        dst.write_text("stale")
    convert(SRC, dst, overwrite=True, progress=False)
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]
    _assert_valid_output(dst)
    assert _leftovers(tmp_path) == []


def test_overwrite_refuses_a_destination_holding_the_source(tmp_path):
    """Overwriting a folder that contains the source would destroy it: refused."""
    first = tmp_path / "first"
    convert(SRC, first, progress=False)
    with pytest.raises(OutputError) as excinfo:
        convert(first / "model.safetensors", first, overwrite=True, progress=False)
    assert str(excinfo.value) == (
        f"Refusing to write '{first}': it holds the source '{first / 'model.safetensors'}', whose files would be "
        "replaced or deleted while they are read. Write to another path."
    )
    _assert_valid_output(first)


# --------------------------------------------------------------------------- failures mid-way


@pytest.mark.parametrize("workers", [1, 4])
def test_keyboard_interrupt_removes_the_partial_output(tmp_path, workers, ctrl_c_raises):
    """A real SIGINT mid-conversion removes the temporary folder and raises OutputError from KeyboardInterrupt."""
    dst = tmp_path / "out"
    once = threading.Lock()

    def interrupt(done, total):
        if done > 0 and once.acquire(blocking=False):  # one Ctrl-C (IO threads may call back concurrently)
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(OutputError) as excinfo:
        convert(SRC, dst, progress=interrupt, workers=workers, max_shard_size=1, chunk_bytes=8)
    assert str(excinfo.value) == (
        f"Cannot write '{dst}': interrupted (KeyboardInterrupt). Removed the partial output. Run the conversion again."
    )
    assert isinstance(excinfo.value.__cause__, KeyboardInterrupt)
    assert list(tmp_path.iterdir()) == []


def test_any_exception_removes_the_partial_output(tmp_path):
    """An unexpected exception is wrapped in OutputError naming the destination; the cause is kept."""

    def broken(done, total):
        if done > 100:
            raise RuntimeError("progress sink went away")

    with pytest.raises(OutputError) as excinfo:
        convert(SRC, tmp_path / "out", progress=broken, chunk_bytes=8)
    assert str(excinfo.value) == (
        f"Cannot write '{tmp_path / 'out'}': RuntimeError: progress sink went away. Removed the partial output. "
        "Fix the cause and run the conversion again."
    )
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize(
    "fmt, file", [("safetensors", "model-00005-of-00010.safetensors"), ("torch", "pytorch_model-00005-of-00010.bin")]
)
def test_disk_full_on_a_real_small_filesystem(tmp_path, fmt, file):
    """On a 16 KiB tmpfs the 5th shard does not fit: OutputError names it, and the file system is left empty."""
    with _tmpfs(tmp_path / "disk", "size=16k") as disk:
        dst = disk / "out"
        with pytest.raises(OutputError) as excinfo:
            convert(SRC, dst, fmt=fmt, max_shard_size=1, progress=False)
        assert str(excinfo.value) == (
            f"Cannot write '{dst}': No space left on device ('{dst / file}'). Removed the partial output. "
            "Free disk space or choose another destination."
        )
        assert excinfo.value.__cause__.errno == 28
        assert list(disk.iterdir()) == []
        assert os.statvfs(disk).f_bfree == os.statvfs(disk).f_blocks  # every block released


def test_file_size_limit_in_a_subprocess(tmp_path):
    """With RLIMIT_FSIZE below the output size, the write fails (EFBIG), cleanly, before reading tensors."""
    dst = tmp_path / "out"
    script = textwrap.dedent(
        f"""
        import resource
        from zeroio import convert
        from zeroio.errors import OutputError
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        try:
            convert({str(SRC)!r}, {str(dst)!r}, progress=False)
        except OutputError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"Cannot write '{dst}': File too large ('{dst / 'model.safetensors'}'). Removed the partial output. "
        "Raise the file size limit (ulimit -f) or use a smaller max_shard_size.\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_destination_under_a_file_is_refused(tmp_path):
    """A destination whose parent is a file fails before reading, naming that file."""
    (tmp_path / "afile").write_text("x")
    dst = tmp_path / "afile" / "sub" / "out"
    with pytest.raises(OutputError) as excinfo:
        convert(SRC, dst, progress=False)
    assert str(excinfo.value) == (
        f"Cannot write '{dst}': '{tmp_path / 'afile'}' is a file, not a folder. Choose another destination."
    )


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
def test_read_only_destination(tmp_path):
    """An unwritable (read-only) destination folder raises OutputError naming it and the cause."""
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        with pytest.raises(OutputError) as excinfo:
            convert(SRC, ro / "out", progress=False)
        assert str(excinfo.value) == (
            f"Cannot write '{ro / 'out'}': Read-only file system ('{ro}'). Check the permissions of the "
            "destination's folder or choose another destination."
        )


# --------------------------------------------------------------------------- SIGKILL and stale temporary folders


def test_sigkill_leaves_no_output_and_the_next_run_cleans_up(tmp_path):
    """A converter killed with SIGKILL mid-way leaves no `dst`; the next conversion removes its temporary folder."""
    dst = tmp_path / "out"
    marker = tmp_path / "started"
    script = textwrap.dedent(
        f"""
        import pathlib, time
        from zeroio import convert

        def stall(done, total):
            if done > 0:
                pathlib.Path({str(marker)!r}).touch()
                time.sleep(120)

        convert({str(SRC)!r}, {str(dst)!r}, progress=stall, workers=1, chunk_bytes=8, max_shard_size=300)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, "the converter exited before it started writing"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists()
    (stale,) = _leftovers(tmp_path)
    assert stale.startswith(f".out.zeroio-tmp-{proc.pid}-")
    assert (tmp_path / stale / "model-00001-of-00004.safetensors").exists()  # half-written, out of sight

    convert(SRC, dst, progress=False)
    assert _leftovers(tmp_path) == []
    _assert_valid_output(dst)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_clean_stale_spares_live_processes_and_foreign_names(tmp_path):
    """Only zeroio's temporary names of dead processes are removed; live ones and other names stay."""
    dead = _dead_pid()
    (tmp_path / f".a.zeroio-tmp-{dead}-0123abcd").mkdir()
    (tmp_path / f".b.zeroio-tmp-{os.getpid()}-0123abcd").mkdir()
    (tmp_path / f".c.zeroio-tmp-{dead}-not-hex").mkdir()
    (tmp_path / "d.zeroio-tmp-1-0123abcd").mkdir()
    convert(SRC, tmp_path / "out", progress=False)  # a conversion cleans its destination's parent first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".b.zeroio-tmp-{os.getpid()}-0123abcd", f".c.zeroio-tmp-{dead}-not-hex", "d.zeroio-tmp-1-0123abcd", "out"]
    )


def test_interrupted_overwrite_is_rolled_back(tmp_path):
    """Killed between moving the old output aside and moving the new one in: the old output is restored."""
    old = tmp_path / f".out.zeroio-old-{_dead_pid()}-0123abcd"
    old.mkdir()
    (old / "model.safetensors").write_text("previous output")
    convert(SRC, tmp_path / "other", progress=False)  # the next conversion in the same folder restores it
    assert (tmp_path / "out" / "model.safetensors").read_text() == "previous output"
    assert _leftovers(tmp_path) == []
    _assert_valid_output(tmp_path / "other")


def test_atomic_dir_commits_only_on_success(tmp_path, monkeypatch):
    """The output is written in a temporary folder beside it, renamed into place on success, removed on failure."""
    seen: list[list[str]] = []

    def watch(done, total):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))

    convert(SRC, tmp_path / "ok", progress=watch)
    (during,) = {tuple(names) for names in seen if names}
    (tmp,) = during
    assert tmp.startswith(f".ok.zeroio-tmp-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]
    _assert_valid_output(tmp_path / "ok")

    def disk_full(fd, data, offset):  # the file system, not zeroio, fails: ENOSPC as a full disk reports it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", disk_full)
    with pytest.raises(OutputError) as excinfo:
        convert(SRC, tmp_path / "bad", progress=False)
    assert str(excinfo.value) == (
        f"Cannot write '{tmp_path / 'bad'}': No space left on device ('{tmp_path / 'bad' / 'model.safetensors'}'). "
        "Removed the partial output. Free disk space or choose another destination."
    )
    assert excinfo.value.__cause__.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]
