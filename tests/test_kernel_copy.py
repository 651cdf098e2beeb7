"""The in-kernel copy path (copy_file_range) writes exactly the bytes the streaming path writes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from fixture_data import FIXTURES, ROOT

import zeroio
from zeroio._write_files import copy_in_kernel as _copy_in_kernel
from zeroio._safetensors_writer import plan_file

pytestmark = pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="needs os.copy_file_range (Linux)")

CASES = ["z3_ws3_fp32", "z1_ws3_bf16", "moe_z2_ws2_ep2_bf16"]


def _convert(src, dst, *, kernel_copy: bool, extra=()):
    env = dict(os.environ, ZEROIO_NO_COPY_FILE_RANGE="0" if kernel_copy else "1")
    cmd = [sys.executable, "-m", "zeroio", "convert", str(src), str(dst), "--quiet", "--max-shard-size", "600", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
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


def test_trainable_tensors_take_the_kernel_path(tmp_path):
    """A ZeRO-3 fp32 master needing no cast is copied by copy_file_range, across its ranks' partitions."""
    with zeroio.open(FIXTURES / "z3_ws4_fp32") as ckpt:
        info = ckpt.info("emb.weight")
        layout = plan_file([("emb.weight", info.dtype, info.shape)])
        out = tmp_path / "one.bin"
        fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, layout.header, 0)
            copied = []
            assert _copy_in_kernel(ckpt, "emb.weight", None, fd, layout.slots[0], 1 << 20, copied.append,
                                   threading.Event())
            # A cast cannot be a byte copy: that tensor falls back to streaming.
            assert not _copy_in_kernel(ckpt, "emb.weight", torch.bfloat16, fd, layout.slots[0], 1 << 20,
                                       copied.append, threading.Event())
        finally:
            os.close(fd)
        slot = layout.slots[0]
        assert sum(copied) == slot.nbytes
        assert out.read_bytes()[slot.begin : slot.end] == ckpt["emb.weight"].numpy().tobytes()
