"""Hostile and damaged Megatron checkpoints: typed zeroio errors at open, nothing run, bounded time and memory.

Each case copies a genuine fixture (fixtures/megatron/gpt_tp2_tied, written by megatron-core 0.16.1) and rewrites
one file as an attacker, a bad copy or another Megatron backend would.
"""

from __future__ import annotations

import io
import shutil
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest

import zeroio
from zeroio.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafePickleError,
    UnsupportedCheckpointError,
)

SOURCE = Path(__file__).resolve().parent.parent / "fixtures" / "megatron" / "gpt_tp2_tied"
ITER = "iter_0000003"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(SOURCE, out, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return out


def _refused(path: Path, error: type[Exception], match: str) -> Exception:
    start = time.monotonic()
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match) as info:
            zeroio.open(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 5 and peak < 64 << 20, (time.monotonic() - start, peak)
    assert len(str(info.value).splitlines()) == 1
    return info.value


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"{not json", "is not valid JSON"),
        (b'{"common_backend": "torch"}', "has no 'sharded_backend' string"),
        (b'["torch_dist"]', "has no 'sharded_backend' string"),
        (b'{"sharded_backend": 7}', "has no 'sharded_backend' string"),
        (b" " * (2 << 20) + b"{}", "Megatron writes about 120"),
    ],
    ids=["not-json", "no-backend", "not-an-object", "backend-not-text", "huge"],
)
def test_bad_metadata_json(root, text, match):
    (root / ITER / "metadata.json").write_bytes(text)
    error = _refused(root, CheckpointFormatError, match)
    assert error.path == root / ITER / "metadata.json"


@pytest.mark.parametrize("backend", ["zarr", "torch", "fsdp_dtensor"])
def test_unknown_backend_is_refused_by_name(root, backend):
    (root / ITER / "metadata.json").write_text(f'{{"sharded_backend": "{backend}", "sharded_backend_version": 1}}')
    error = _refused(root, UnsupportedCheckpointError, f"Megatron's '{backend}' backend; zeroio reads 'torch_dist'")
    assert error.name == backend


def _torch_zip(pickle_bytes: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/version", b"3\n")
    return out.getvalue()


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x02cposix\nsystem\nX\x0b\x00\x00\x00touch PWNED\x85R.",
        (
            b"\x80\x02}X\x04\x00\x00\x00argscargparse\nNamespace\n)\x81}X\x01\x00\x00\x00xcbuiltins\neval\n"
            b"X\x15\x00\x00\x00open('PWNED', 'w')\x85Rsbs."
        ),
    ],
    ids=["posix.system", "eval-inside-args"],
)
def test_common_pt_naming_a_forbidden_global_runs_nothing_and_weights_stay_readable(root, payload, monkeypatch):
    monkeypatch.chdir(root)
    (root / ITER / "common.pt").write_bytes(_torch_zip(payload))
    with zeroio.open(root) as ckpt:
        assert ckpt.metadata.extra["common"].startswith("<not read: it names ")
        assert ckpt.metadata.global_step is None
        assert ckpt["decoder.layers.2.mlp.linear_fc2.weight"].shape == (16, 20)
    assert not (root / "PWNED").exists()


def test_common_pt_that_is_not_a_torch_file(root):
    (root / ITER / "common.pt").write_bytes(b"\x00" * 100)
    _refused(root, CheckpointFormatError, "common.pt")


def test_dcp_metadata_naming_a_forbidden_global(root, monkeypatch):
    monkeypatch.chdir(root)
    payload = b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81cposix\nsystem\n(S'touch PWNED'\ntRb."
    (root / ITER / ".metadata").write_bytes(payload)
    _refused(root, UnsafePickleError, r"Refusing to unpickle global 'posix\.system'")
    assert not (root / "PWNED").exists()


@pytest.mark.parametrize("text", ["banana", "-3", "9" * 40])
def test_tracker_that_names_no_iteration(root, text):
    (root / "latest_checkpointed_iteration.txt").write_text(text)
    _refused(root, CheckpointFormatError, "not an iteration number or 'release'")


def test_tracker_pointing_at_a_missing_or_legacy_folder(root):
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    _refused(root, CheckpointNotFoundError, "iter_0000007")
    (root / "iter_0000007" / "mp_rank_00").mkdir(parents=True)
    _refused(root, CheckpointNotFoundError, "legacy torch format")


def test_missing_data_file_is_not_found(root):
    (root / ITER / "__1_0.distcp").unlink()
    _refused(root, CheckpointNotFoundError, "__1_0.distcp")
