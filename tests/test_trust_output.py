"""Output trust defects (issue 15): overwrite deletes only zeroio's own outputs (item 6); a live conversion's
temporary folder is never cleaned up, whatever PID namespace it runs in (item 10); ``fmt="lightning"`` from a
plain DeepSpeed checkpoint loads with ``load_from_checkpoint`` (item 15)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES, HF_CKPT, ROOT, reference
from safetensors.torch import load_file

import zeroio
from zeroio import convert, reshard
from zeroio.cli import main
from zeroio.errors import OutputError

SRC = FIXTURES / "z3_ws2_fp32"


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder)."""
    return {
        p.relative_to(folder).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))
    }


def _assert_valid_output(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    expected = reference("z3_ws2_fp32")
    assert all(tensors[k].equal(v) for k, v in expected.items() if k != "head.weight")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _distributed_convert(monkeypatch: pytest.MonkeyPatch) -> Callable[..., object]:
    """``convert(..., distributed=True)`` as rank 0 of a one-process torchrun job (the distributed write path)."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():  # fmt: skip
        monkeypatch.setenv(key, value)

    def run(src: Path, dst: Path, **kwargs: object) -> object:
        return convert(src, dst, distributed=True, progress=False, **kwargs)  # type: ignore[arg-type]

    return run


# =========================================================================== item 6: overwrite deletes only outputs


def _writers(monkeypatch: pytest.MonkeyPatch) -> dict[str, Callable[[Path], object]]:
    distributed = _distributed_convert(monkeypatch)
    return {
        "safetensors": lambda dst: convert(SRC, dst, overwrite=True, progress=False),
        "torch": lambda dst: convert(SRC, dst, fmt="torch", overwrite=True, progress=False),
        "distributed": lambda dst: distributed(SRC, dst, overwrite=True),
        "reshard": lambda dst: reshard(SRC, dst, world_size=3, overwrite=True),
    }


@pytest.mark.parametrize("writer", ["safetensors", "torch", "distributed", "reshard"])
def test_overwrite_refuses_a_folder_holding_other_files(tmp_path, monkeypatch, writer):
    """`zeroio convert ckpt ~/work --overwrite` must not wipe ~/work: a folder holding anything zeroio did not
    write is refused, naming those files, and nothing in it is touched."""
    dst = tmp_path / "work"
    (dst / "data").mkdir(parents=True)
    (dst / "data" / "train.jsonl").write_text("{}")
    (dst / "notes.txt").write_text("mine")
    (dst / "model.safetensors").write_text("an earlier output")
    before = _tree(dst)
    with pytest.raises(OutputError) as info:
        _writers(monkeypatch)[writer](dst)
    assert str(info.value) == (
        f"Refusing to overwrite '{dst}': it holds files zeroio did not write (data/, notes.txt), and overwrite "
        "replaces only a folder of zeroio's outputs. Move them away or choose another destination."
    )
    assert info.value.path == dst
    assert _tree(dst) == before
    assert [p.name for p in tmp_path.iterdir()] == ["work"]  # no temporary folder left


def test_overwrite_refusal_lists_a_few_names(tmp_path):
    """Many foreign files: the message names five and counts the rest (one line)."""
    dst = tmp_path / "home"
    dst.mkdir()
    for i in range(12):
        (dst / f"file{i:02d}.txt").write_text(str(i))
    with pytest.raises(OutputError) as info:
        convert(SRC, dst, overwrite=True, progress=False)
    assert "(file00.txt, file01.txt, file02.txt, file03.txt, file04.txt ... and 7 more)" in str(info.value)
    assert "\n" not in str(info.value)
    assert len(list(dst.iterdir())) == 12


def test_cli_overwrite_refuses_a_folder_holding_other_files(tmp_path, capsys):
    """The CLI says the same in one line and exits 1."""
    dst = tmp_path / "work"
    dst.mkdir()
    (dst / "thesis.tex").write_text("years of work")
    assert main(["convert", str(SRC), str(dst), "--overwrite", "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(
        f"Output error: Refusing to overwrite '{dst}': it holds files zeroio did not write (thesis.tex), and "
        "overwrite replaces only a folder of zeroio's outputs."
    )
    assert (dst / "thesis.tex").read_text() == "years of work"


def test_overwrite_refuses_a_stray_file_inside_a_tag_folder(tmp_path):
    """reshard's layout (latest + tag folders of rank files) is zeroio's; a foreign file inside a tag folder is not."""
    dst = tmp_path / "ws3"
    result = reshard(SRC, dst, world_size=3)
    (dst / result.tag / "zero_to_fp32.py").write_text("# DeepSpeed's script, not zeroio's")
    with pytest.raises(OutputError) as info:
        reshard(SRC, dst, world_size=2, overwrite=True)
    assert f"({result.tag}/zero_to_fp32.py)" in str(info.value)
    assert (dst / result.tag / "zero_to_fp32.py").exists()


def test_overwrite_still_replaces_every_kind_of_zeroio_output(tmp_path):
    """Outputs of every writer (weights, shards, index, optimizer files, copied config/tokenizer, reshard's
    layout), and an empty folder, are replaced with overwrite=True."""
    hf = tmp_path / "hf"
    first = convert(HF_CKPT, hf, max_shard_size=1000, progress=False)
    assert first.copied and first.index_path is not None
    convert(HF_CKPT, hf, overwrite=True, progress=False)
    assert (hf / "model.safetensors").exists() and not (hf / first.index_path.name).exists()

    optim = tmp_path / "optim"
    convert(SRC, optim, include_optimizer=True, max_shard_size=300, progress=False)
    convert(SRC, optim, overwrite=True, progress=False)
    assert sorted(p.name for p in optim.iterdir()) == ["model.safetensors"]

    torch_out = tmp_path / "torch"
    convert(SRC, torch_out, fmt="torch", max_shard_size=300, progress=False)
    convert(SRC, torch_out, overwrite=True, progress=False)
    _assert_valid_output(torch_out)

    resharded = tmp_path / "resharded"
    reshard(SRC, resharded, world_size=3)
    assert reshard(SRC, resharded, world_size=2, overwrite=True).world_size == 2
    convert(SRC, resharded, overwrite=True, progress=False)  # a folder zeroio wrote, whichever writer
    _assert_valid_output(resharded)

    empty = tmp_path / "empty"
    empty.mkdir()
    convert(SRC, empty, overwrite=True, progress=False)
    _assert_valid_output(empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf", "optim", "resharded", "torch"]


def test_lightning_output_never_replaces_a_folder(tmp_path):
    """fmt="lightning" writes one file: a folder at dst is refused with overwrite too, even one of outputs."""
    dst = tmp_path / "model.ckpt"
    convert(SRC, dst, progress=False)  # a folder of zeroio's outputs
    before = _tree(dst)
    with pytest.raises(OutputError, match="is a folder; a Lightning checkpoint is one file"):
        convert(SRC, dst, fmt="lightning", overwrite=True, progress=False)
    assert _tree(dst) == before


# =========================================================================== item 10: live temporary folders


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _stalled_converter(tmp_path: Path, dst: Path, *, prefix: list[str] | None = None, pid: int | None = None):
    """A real conversion in another process, stopped once it has written its first bytes until ``go`` exists.

    ``pid`` makes the process record that id in its temporary folder's name, as a process in another PID
    namespace records an id that means nothing (or another process) here.
    """
    started, go = tmp_path / "started", tmp_path / "go"
    fake = f"os.getpid = lambda: {pid}" if pid is not None else ""
    script = textwrap.dedent(
        f"""
        import os, pathlib, time
        {fake}
        from zeroio import convert

        def stall(done, total):
            if done > 0 and not pathlib.Path({str(go)!r}).exists():
                pathlib.Path({str(started)!r}).touch()
                while not pathlib.Path({str(go)!r}).exists():
                    time.sleep(0.05)

        convert({str(SRC)!r}, {str(dst)!r}, progress=stall, workers=1, chunk_bytes=8, max_shard_size=300)
        """
    )
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-c", script], cwd=ROOT, env={**os.environ})
    deadline = time.monotonic() + 120
    while not started.exists():
        if proc.poll() is not None:
            pytest.skip(f"the converter exited ({proc.returncode}) before it started writing")
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc, go


def _temp_folders(parent: Path, dst: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith(f".{dst.name}.zeroio-tmp-"))


def _live_conversion_survives_clean_up(tmp_path: Path, prefix: list[str] | None = None, pid: int | None = None):
    dst = tmp_path / "out"
    proc, go = _stalled_converter(tmp_path, dst, prefix=prefix, pid=pid)
    try:
        (live,) = _temp_folders(tmp_path, dst)
        recorded = int(live.name.split("-")[-2])
        with pytest.raises(ProcessLookupError):
            os.kill(recorded, 0)  # the recorded id looks dead from here: only the lock tells it is alive
        convert(SRC, tmp_path / "other", progress=False)  # another conversion into the same parent: it cleans up
        assert live.is_dir() and (live / "model-00001-of-00004.safetensors").exists()
        go.touch()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_valid_output(tmp_path / "other")
    assert sorted(p.name for p in dst.iterdir()) == [
        *(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)),
        "model.safetensors.index.json",
    ]
    assert _temp_folders(tmp_path, dst) == []


def test_live_temp_folder_with_a_dead_looking_pid_is_never_removed(tmp_path):
    """A conversion whose recorded pid is dead here (another PID namespace) holds its folder's lock: the clean-up
    of another conversion in the same parent folder leaves it alone, and it completes."""
    _live_conversion_survives_clean_up(tmp_path, pid=_dead_pid())


def test_live_conversion_in_another_pid_namespace_is_never_removed(tmp_path):
    """The same with a real PID namespace (``unshare --pid``, as a container sharing the filesystem): the
    converter's pid there is one that does not exist here."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = subprocess.run(
        ["unshare", "-Urpf", "--mount-proc", "sh", "-c", "echo 3999990 > /proc/sys/kernel/ns_last_pid; true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0 or probe.stderr:
        pytest.skip(f"cannot create a PID namespace here: {probe.stderr.strip()}")
    prefix = [
        "unshare",
        "-Urpf",
        "--mount-proc",
        "sh",
        "-c",
        'echo 3999990 > /proc/sys/kernel/ns_last_pid; "$@"; exit $?',
        "sh",
    ]
    _live_conversion_survives_clean_up(tmp_path, prefix=prefix)


def test_killed_conversion_is_cleaned_once_its_lock_is_free(tmp_path):
    """The lock dies with its process: a SIGKILLed conversion's folder is removed by the next conversion, even
    when its recorded pid looks alive here (pid 1)."""
    dst = tmp_path / "out"
    proc, _ = _stalled_converter(tmp_path, dst, pid=1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    (stale,) = _temp_folders(tmp_path, dst)
    assert stale.name.startswith(".out.zeroio-tmp-1-")
    convert(SRC, dst, progress=False)
    assert _temp_folders(tmp_path, dst) == []
    _assert_valid_output(dst)


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def _hold_lock(path: Path) -> subprocess.Popen[str]:
    """Another process holding an flock on ``path`` until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


def _clean_up(parent: Path) -> None:
    """Run a public conversion into ``parent`` (it cleans up stale temporary outputs there first), then remove it."""
    probe = parent / "zeroio-probe"
    zeroio.convert(SRC, probe, progress=False)
    shutil.rmtree(probe)


def _release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    proc.wait(timeout=60)
    proc.stdout.close()


def test_locked_lightning_temp_file_is_never_removed(tmp_path):
    """A ``.ckpt`` temporary file is locked by its writer: kept while locked, removed once released."""
    temp = tmp_path / f".model.ckpt.zeroio-tmp-{_dead_pid()}-0123abcd"
    holder = _hold_lock(temp)
    try:
        _clean_up(tmp_path)
        assert temp.exists()
    finally:
        _release(holder)
    _clean_up(tmp_path)
    assert not temp.exists()


def test_folder_moved_aside_by_a_live_overwrite_is_left_alone(tmp_path):
    """Mid-overwrite (no atomic exchange): the previous output is at ``-old-`` and the new one at its temporary
    name, still locked. The clean-up must neither put the old one back nor remove it."""
    pid = _dead_pid()
    old = tmp_path / f".out.zeroio-old-{pid}-0123abcd"
    new = tmp_path / f".out.zeroio-tmp-{pid}-4567cdef"
    old.mkdir()
    (old / "model.safetensors").write_text("previous output")
    new.mkdir()
    holder = _hold_lock(new / ".zeroio-lock")
    try:
        _clean_up(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([old.name, new.name])
    finally:
        _release(holder)
    _clean_up(tmp_path)  # the writer died: the old output goes back, the partial new one is removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (tmp_path / "out" / "model.safetensors").read_text() == "previous output"


def test_writer_holds_its_lock_until_commit(tmp_path):
    """Inside ``convert`` the temporary folder's lock is taken; after the commit no lock file is left."""
    seen: list[bool] = []

    def probe(done: int, total: int) -> None:
        if seen:
            return
        (tmp,) = _temp_folders(tmp_path, tmp_path / "out")
        fd = os.open(tmp / ".zeroio-lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append(False)
        except BlockingIOError:
            seen.append(True)
        finally:
            os.close(fd)

    convert(SRC, tmp_path / "out", progress=probe, workers=1)
    assert seen == [True]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


# =========================================================================== item 15: lightning from plain DeepSpeed


def test_lightning_from_plain_deepspeed_loads_with_load_from_checkpoint(tmp_path):
    """A plain DeepSpeed checkpoint (no Lightning state) converted with fmt="lightning" loads with the installed
    Lightning's ``load_from_checkpoint`` (it needs ``pytorch-lightning_version``), weights equal to the source."""
    lightning = pytest.importorskip("lightning")
    from torch import nn

    class TinyLM(lightning.LightningModule):  # the fixtures' model (fixtures/generate.py), as a LightningModule
        def __init__(self, vocab: int = 13, dim: int = 7, hidden: int = 5) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.frozen = nn.Linear(dim, dim)
            self.mlp_in = nn.Linear(dim, hidden)
            self.mlp_out = nn.Linear(hidden, dim, bias=False)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("scale", torch.ones(dim))
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    dst = tmp_path / "model.ckpt"
    convert(SRC, dst, fmt="lightning", progress=False)
    model = TinyLM.load_from_checkpoint(dst)  # Lightning's defaults
    expected = reference("z3_ws2_fp32")
    state = model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    assert model.head.weight is model.emb.weight
    assert torch.load(dst, weights_only=True)["pytorch-lightning_version"] == "2.0.0"


def test_an_empty_folder_is_a_destination_without_overwrite(tmp_path: Path) -> None:
    """`mkdir out && zeroio convert ckpt out`: an existing empty folder is used as it is (issue 15, item 6)."""
    for name, run in [
        ("convert", lambda dst: zeroio.convert(FIXTURES / "z3_ws2_fp32", dst, progress=False)),
        ("reshard", lambda dst: zeroio.reshard(FIXTURES / "z3_ws2_fp32", dst, world_size=3)),
    ]:
        dst = tmp_path / name
        dst.mkdir()
        run(dst)
        assert dst.is_dir() and any(dst.iterdir()), name
    cli_dst = tmp_path / "cli"
    cli_dst.mkdir()
    assert main(["convert", str(FIXTURES / "z3_ws2_fp32"), str(cli_dst), "--quiet"]) == 0
    assert sorted(p.name for p in cli_dst.iterdir()) == ["model.safetensors"]
