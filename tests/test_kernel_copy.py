"""The in-kernel copy path (copy_file_range) writes exactly the bytes the streaming path writes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
from fixture_data import FIXTURES, ROOT

import zeroio

pytestmark = pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="needs os.copy_file_range (Linux)")

CASES = ["z3_ws3_fp32", "z1_ws3_bf16", "moe_z2_ws2_ep2_bf16"]


def _convert(src, dst, *, kernel_copy: bool, extra=()):
    env = dict(os.environ, ZEROIO_NO_COPY_FILE_RANGE="0" if kernel_copy else "1")
    cmd = [sys.executable, "-m", "zeroio", "convert", str(src), str(dst), "--quiet", "--max-shard-size", "600", *extra]
    proc = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", CASES)
def test_kernel_copy_output_is_byte_identical_to_streaming(tmp_path, name):
    """Every output file is byte for byte the same with and without copy_file_range (several shards)."""
    _convert(FIXTURES / name, tmp_path / "kernel", kernel_copy=True)
    _convert(FIXTURES / name, tmp_path / "stream", kernel_copy=False)
    kernel = sorted(p.name for p in (tmp_path / "kernel").iterdir())
    assert kernel == sorted(p.name for p in (tmp_path / "stream").iterdir()) and len(kernel) > 2
    for filename in kernel:
        assert (tmp_path / "kernel" / filename).read_bytes() == (tmp_path / "stream" / filename).read_bytes()


def _watch_copy_file_range(monkeypatch) -> list[tuple[str, str, int, int]]:
    """Wrap os.copy_file_range (the OS call, not zeroio's code): record (source, destination, offset, count)."""
    calls: list[tuple[str, str, int, int]] = []
    real = os.copy_file_range

    def recording(src, dst, count, offset_src=None, offset_dst=None):
        done = real(src, dst, count, offset_src, offset_dst)
        name = os.path.basename(os.readlink(f"/proc/self/fd/{src}"))
        calls.append((name, os.readlink(f"/proc/self/fd/{dst}"), offset_dst, done))
        return done

    monkeypatch.setenv("ZEROIO_NO_COPY_FILE_RANGE", "0")  # every run, however short (the fixtures' are bytes)
    monkeypatch.setattr(os, "copy_file_range", recording)
    return calls


def _data_range(path, name: str) -> tuple[int, int]:
    """Where ``name``'s bytes lie in a safetensors file (absolute offsets)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(length))[name]["data_offsets"]
    return 8 + length + begin, 8 + length + end


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="names file descriptors through /proc")
def test_trainable_tensors_take_the_kernel_path(tmp_path, monkeypatch):
    """A ZeRO-3 fp32 master needing no cast is copied by copy_file_range, across its ranks' partitions."""
    calls = _watch_copy_file_range(monkeypatch)
    src = FIXTURES / "z3_ws4_fp32"
    zeroio.convert(src, tmp_path / "out", progress=False)
    out = tmp_path / "out" / "model.safetensors"
    begin, end = _data_range(out, "emb.weight")
    into_emb = sorted(
        (offset, count, name)
        for name, dst, offset, count in calls
        if dst.endswith("/model.safetensors") and begin <= offset < end
    )
    # The copies tile emb.weight's bytes exactly, and they come from every rank's optimizer file.
    covered = begin
    for offset, count, _ in into_emb:
        assert offset == covered
        covered += count
    assert covered == end
    assert {name for *_, name in into_emb} == {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)}
    with zeroio.open(src) as ckpt:
        assert out.read_bytes()[begin:end] == ckpt["emb.weight"].numpy().tobytes()

    # A cast cannot be a byte copy: with dtype="bf16" no floating tensor goes through copy_file_range.
    calls.clear()
    zeroio.convert(src, tmp_path / "bf16", dtype="bf16", progress=False)
    begin, end = _data_range(tmp_path / "bf16" / "model.safetensors", "emb.weight")
    assert not [c for c in calls if c[1].endswith("model.safetensors") and begin <= c[2] < end]


def test_short_runs_are_packed_into_one_write(tmp_path, monkeypatch):
    """By default runs shorter than KERNEL_RUN (a ZeRO-3 parameter over many ranks) are read into one buffer and
    written once: no copy_file_range, one pwrite for all of emb.weight's 4 rank pieces, the same bytes."""
    calls = _watch_copy_file_range(monkeypatch)
    monkeypatch.delenv("ZEROIO_NO_COPY_FILE_RANGE")
    writes: list[tuple[int, int]] = []
    real = os.pwrite

    def recording(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("model.safetensors"):
            writes.append((offset, len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recording)
    src = FIXTURES / "z3_ws4_fp32"
    zeroio.convert(src, tmp_path / "out", progress=False)
    out = tmp_path / "out" / "model.safetensors"
    begin, end = _data_range(out, "emb.weight")
    assert not [c for c in calls if c[1].endswith("model.safetensors")]
    assert [(o, n) for o, n in writes if begin <= o < end] == [(begin, end - begin)]
    with zeroio.open(src) as ckpt:
        assert out.read_bytes()[begin:end] == ckpt["emb.weight"].numpy().tobytes()


@pytest.mark.parametrize("verify_crc", [True, False])
def test_checked_records_on_a_local_file_system_are_written_from_the_bytes_read(tmp_path, monkeypatch, verify_crc):
    """Every byte of a CRC-checked record is read into user space for its CRC: on a local file system it is written
    from there (``pwrite``: the copy declines, the converter writes through memory), not read once more by
    ``copy_file_range`` (the H100 host: 1.4 s less CPU for 5.25 GB). Unchecked, nothing needs reading: the kernel
    copies it. ``ZEROIO_NO_COPY_FILE_RANGE=0`` still copies every run in the kernel."""
    from zeroio._io.direct_read import on_local_file_system

    src = FIXTURES / "z3_ws4_fp32"
    if not on_local_file_system(src / "latest"):
        pytest.skip(f"{src} is not on a local file system")
    monkeypatch.delenv("ZEROIO_NO_COPY_FILE_RANGE", raising=False)
    with zeroio.open(src, verify_crc=verify_crc) as ckpt:
        expected = ckpt["emb.weight"].numpy().tobytes()
        source, offset, nbytes = ckpt.byte_ranges(ckpt.source_name("emb.weight"))[0]
        fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            got = source.copy_to(fd, offset, nbytes, 0)
            assert got == (None if verify_crc else nbytes)
            monkeypatch.setenv("ZEROIO_NO_COPY_FILE_RANGE", "0")
            assert source.copy_to(fd, offset, nbytes, 0) == nbytes
        finally:
            os.close(fd)
    assert (tmp_path / "out").read_bytes() == expected[:nbytes]
