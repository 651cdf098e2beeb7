"""The low items of the third red team (issue 30), each reproduced with a crafted file built from a genuine fixture
(tests/hostile_dcp.py; also in the fuzz corpus of tests/test_errors.py): a typed zeroio error naming the file, one
line on the CLI, nothing written, nothing read from outside the checkpoint.

- a DCP chunk whose recorded shape disagrees with its archive's (transposed) was returned scrambled;
- a size of ``(0, 2**64)`` raised a bare TypeError, and ``convert`` wrote a safetensors file safetensors refuses;
- a data-file name too long for the file system gave a bare OSError and a traceback on the CLI;
- a Hub cache whose ``blobs`` folder is itself a link was followed outside the cache;
- a data file swapped for a link (or a FIFO) after ``open`` and before its first read was read through it (a FIFO
  gave a bare OSError).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES
from hostile_dcp import hub_blobs_link_out, long_data_file_name, size_past_int64, transposed_chunks
from hostile_files import archive, state_dict
from no_blocking import refused_without_blocking
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError, CheckpointNotFoundError

DCP = FIXTURES / "dcp" / "dcp_fsdp2_ws2_fp32"
HINT = "(set ZEROIO_DEBUG=1 for the full traceback)"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``zeroio *argv`` (in process)."""
    code = main(list(argv))
    return code, capsys.readouterr().err


def _one_line_error(err: str, start: str) -> None:
    """The CLI printed one error line (and the usual hint), no traceback."""
    lines = err.splitlines()
    assert lines == [lines[0], HINT] and lines[0].startswith(start), err


# --------------------------------------------------------------------------- chunks recorded transposed


def test_transposed_chunk_is_refused_naming_file_and_key(tmp_path, capsys):
    root, _ = transposed_chunks(tmp_path)
    with zeroio.open(root) as ckpt:
        genuine = zeroio.open(DCP)
        assert torch.equal(ckpt["emb.weight"], genuine["emb.weight"])  # the other tensors read as before
        genuine.close()
        with pytest.raises(CheckpointFormatError) as excinfo:
            ckpt["mlp_out.weight"]
    message = str(excinfo.value)
    rows = message.split("tensor of shape (")[1][0]  # the archive's row block: (4, 5) or (3, 5)
    assert f"holds a float32 tensor of shape ({rows}, 5) at byte " in message
    assert f"places a float32 chunk of 'model.mlp_out.weight' of shape (5, {rows})" in message
    assert excinfo.value.name == "model.mlp_out.weight"
    assert excinfo.value.path.parent == root and excinfo.value.path.suffix == ".distcp"
    code, err = _cli(capsys, "convert", str(root), str(tmp_path / "out"), "--quiet")
    assert code == 1 and not (tmp_path / "out").exists()
    _one_line_error(err, f"Error: '{root}/__")


# --------------------------------------------------------------------------- sizes past int64


@pytest.mark.parametrize("size", [(0, 2**64), (2**62, 4, 0), (0, 2**80)])
def test_dcp_sizes_past_int64_are_refused_at_open(tmp_path, capsys, size):
    root, meta = size_past_int64(tmp_path, size)
    with pytest.raises(CheckpointFormatError, match=r"the size of 'model.huge' is \(.+\), larger than any tensor"):
        zeroio.open(root)
    code, err = _cli(capsys, "convert", str(root), str(tmp_path / "out"), "--quiet")
    assert code == 1 and not (tmp_path / "out").exists()
    _one_line_error(err, f"Error: '{meta}' is not valid DCP metadata: the size of 'model.huge' is ")


def test_dcp_size_at_int64_converts_to_a_file_safetensors_loads(tmp_path):
    """The bound is torch's own: an empty ``(0, 2**63 - 1)`` tensor is read and written, and safetensors loads it."""
    root, _ = size_past_int64(tmp_path, (0, 2**63 - 1))
    zeroio.convert(root, tmp_path / "out", progress=False)
    assert load_file(tmp_path / "out" / "model.safetensors")["huge"].shape == (0, 2**63 - 1)


def test_torch_file_size_past_int64_is_refused(tmp_path):
    path = tmp_path / "huge.pt"
    path.write_bytes(archive(state_dict(lambda o: o.tensor((0, 2**64), (2**64, 1), numel=0)).stop(), {"0": b""}))
    with pytest.raises(CheckpointFormatError, match=r"invalid view \(size \(0, 18446744073709551616\)"):
        zeroio.open(path)


def test_safetensors_size_past_int64_is_refused(tmp_path):
    header = json.dumps({"huge": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointFormatError, match="'huge' has an invalid shape"):
        zeroio.open(path)


# --------------------------------------------------------------------------- names too long


def test_data_file_name_too_long_is_one_line_on_the_cli(tmp_path, capsys):
    root, meta = long_data_file_name(tmp_path)
    with pytest.raises(CheckpointFormatError, match="with a component of 300 bytes, longer than the file system") as e:
        zeroio.open(root)
    assert e.value.path == meta and e.value.name == "x" * 300
    code, err = _cli(capsys, "inspect", str(root))
    assert code == 1
    _one_line_error(err, f"Error: '{meta}' names a data file 'xxx")


def test_source_path_too_long_is_one_line_on_the_cli(tmp_path, capsys):
    code, err = _cli(capsys, "inspect", str(tmp_path / ("x" * 300)))
    assert code == 1
    _one_line_error(err, "Error: Checkpoint path '")
    assert "cannot be looked up (File name too long): check the path." in err
    with pytest.raises(CheckpointNotFoundError):
        zeroio.open(tmp_path / ("x" * 300))


def test_data_file_in_a_loop_of_links_is_refused(tmp_path):
    root = shutil.copytree(DCP, tmp_path / "ckpt")
    (root / "__0_0.distcp").unlink()
    (root / "__0_0.distcp").symlink_to("__0_0.distcp")
    with pytest.raises(CheckpointFormatError, match=r"__0_0.distcp' of '.*\.metadata'\) is a loop of links"):
        zeroio.open(root)


# --------------------------------------------------------------------------- Hub cache blobs


def test_hub_cache_whose_blobs_folder_links_out_is_refused(tmp_path):
    snapshot, meta = hub_blobs_link_out(tmp_path)
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["__0_0.distcp", "__1_0.distcp"]
    with pytest.raises(CheckpointFormatError, match=r"models--org--name/blobs' \(the Hugging Face cache folder") as e:
        zeroio.open(snapshot)
    assert "is a link leading outside" in str(e.value) and e.value.path == meta


def test_hub_cache_reached_through_a_linked_cache_root_still_reads(tmp_path):
    """``HF_HOME`` on another disk, linked: the repository folder and its ``blobs/`` resolve together."""
    real = tmp_path / "disk" / "hub" / "models--org--name"
    snapshot = real / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (real / "blobs").mkdir()
    for path in sorted(DCP.iterdir()):
        if path.suffix == ".distcp":
            shutil.copy(path, real / "blobs" / path.name)
            (snapshot / path.name).symlink_to(os.path.join("..", "..", "blobs", path.name))
        elif path.name == ".metadata":
            shutil.copy(path, snapshot / path.name)
    (tmp_path / "hub").symlink_to(tmp_path / "disk" / "hub")
    with zeroio.open(tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123") as ckpt, zeroio.open(DCP) as ok:
        assert all(torch.equal(ckpt[name], ok[name]) for name in ok)


# --------------------------------------------------------------------------- files swapped after open


def _swap(victim: Path, kind: str, elsewhere: Path) -> None:
    """Replace ``victim`` by a link to a copy of its bytes outside the checkpoint, or by a FIFO."""
    shutil.copy(victim, elsewhere)
    victim.unlink()
    if kind == "link":
        victim.symlink_to(elsewhere)
    else:
        os.mkfifo(victim)


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_dcp_data_file_swapped_after_open_is_refused_at_first_read(tmp_path, kind):
    """``__0_0.distcp`` holds no pickled value, so ``open`` confines it but reads none of it."""
    root = shutil.copytree(DCP, tmp_path / "ckpt")
    victim = root / "__0_0.distcp"
    with zeroio.open(root) as ckpt:
        before = victim.stat()
        _swap(victim, kind, tmp_path / "secret.distcp")
        exc = refused_without_blocking(ckpt.state_dict)
    now = victim.stat()  # a FIFO may take the freed inode's number: the message names what differs
    names = ("inode", "size", "modification time")
    differ = [n for n, a, b in zip(names, _identity(before), _identity(now), strict=True) if a != b]
    assert len(differ) >= 2 and differ[-1] == "modification time"  # a copy: a new time, and a new inode or size
    assert str(exc) == (
        f"'{victim}' changed while zeroio was reading it ({', '.join(differ[:-1])} and {differ[-1]} differ from when "
        "it was opened). Let the writer finish, then run zeroio again."
    )


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def test_a_file_replaced_by_an_identical_copy_is_refused_naming_the_inode(tmp_path):
    """A copy with the same bytes, size and modification time is a new inode: refused (a link swapped in for a file
    whose size and time were set to match looks the same), and the message says what a FUSE file system that
    numbers inodes anew (the same file under a new number) can do about it."""
    root = shutil.copytree(DCP, tmp_path / "ckpt")
    data = root / "__0_0.distcp"
    with zeroio.open(root) as ckpt:
        before = data.stat()
        shutil.copy2(data, tmp_path / "copy")
        os.replace(tmp_path / "copy", data)
        os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert (data.stat().st_size, data.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        exc = refused_without_blocking(ckpt.state_dict)
    assert str(exc).startswith(f"'{data}' changed while zeroio was reading it (inode differs from when it was opened)")
    assert str(exc).endswith(
        "Its size and modification time are the same: on a FUSE file system that numbers inodes anew (libfuse "
        "without -o use_ino or -o noforget), mount it with one of those, or raise `ulimit -n` so zeroio need not "
        "reopen files (it keeps up to min(4096, the limit / 4) open)."
    )


def test_a_file_touched_after_open_is_refused_naming_its_time(tmp_path):
    """The same file (its inode), its modification time changed: refused, naming only the time."""
    root = shutil.copytree(DCP, tmp_path / "ckpt")
    data = root / "__0_0.distcp"
    with zeroio.open(root) as ckpt:
        os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 1))
        exc = refused_without_blocking(ckpt.state_dict)
    assert str(exc) == (
        f"'{data}' changed while zeroio was reading it (modification time differs from when it was opened). Let "
        "the writer finish, then run zeroio again."
    )


@pytest.mark.parametrize("kind", ["link", "fifo"])
@pytest.mark.parametrize(
    "fixture, pattern",
    [
        ("z3_ws2_fp32", "global_step2/*optim_states.pt"),  # zip directory read at open, tensors later
        ("layouts/nvme_z3_ws2_bf16", "global_step2/offloaded_tensors/rank*/*.swp"),  # NVMe swap: checked, read later
    ],
)
def test_rank_files_swapped_after_open_are_refused_at_first_read(tmp_path, kind, fixture, pattern):
    """The same rule for every .pt archive and NVMe swap file: a file is read only if it is the one checked."""
    root = shutil.copytree(FIXTURES / fixture, tmp_path / "ckpt", symlinks=True)
    victims = sorted(root.glob(pattern))
    with zeroio.open(root) as ckpt:
        for i, victim in enumerate(victims):
            _swap(victim, kind, tmp_path / f"secret{i}")
        exc = refused_without_blocking(ckpt.state_dict)
    assert exc.path in victims and str(exc).startswith(f"'{exc.path}' changed while zeroio was reading it")
