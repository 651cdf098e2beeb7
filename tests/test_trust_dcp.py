"""Hostile DCP folders: each gives a typed zeroio error at open, runs nothing and allocates nothing it names.

Each case copies a genuine fixture (fixtures/dcp/dcp_fsdp2_ws2_fp32) and rewrites its ``.metadata`` with torch's own
classes (or raw pickle opcodes), as an attacker would.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata

import zeroio
from zeroio.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafePickleError,
    UnsupportedCheckpointError,
    ZeroIOError,
)

SOURCE = Path(__file__).resolve().parent.parent / "fixtures" / "dcp" / "dcp_fsdp2_ws2_fp32"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(SOURCE, out, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return out


def _metadata(folder: Path) -> Metadata:
    with open(folder / ".metadata", "rb") as fh:
        return pickle.load(fh)  # our own genuine fixture, read to be rewritten


def _save(folder: Path, meta: Metadata) -> None:
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)


def _storage(meta: Metadata, fqn: str, index: int = 0):
    keys = [k for k in meta.storage_data if k.fqn == fqn]
    return keys[index]


def _refused(folder: Path, error: type[Exception], match: str) -> None:
    start = time.monotonic()
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match):
            zeroio.open(folder)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 5 and peak < 64 << 20, (time.monotonic() - start, peak)


@pytest.mark.parametrize(
    "payload",
    [
        b"cos\nsystem\n(S'touch PWNED'\ntR.",
        b'cbuiltins\neval\n(S\'open("PWNED", "w")\'\ntR.',
        b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81cposix\nsystem\n(S'touch PWNED'\ntRb.",
    ],
    ids=["os.system", "builtins.eval", "inside-Metadata"],
)
def test_metadata_naming_disallowed_globals_runs_nothing(folder, payload, monkeypatch):
    monkeypatch.chdir(folder)
    (folder / ".metadata").write_bytes(payload)
    _refused(folder, UnsafePickleError, r"Refusing to unpickle global '(os|posix)\.system'|'builtins\.eval'")
    assert not (folder / "PWNED").exists()


def test_unparsable_metadata_is_one_line(folder):
    """A pickle error whose text holds control characters (here a FLOAT of 'a\\x1cb') is reported on one line."""
    (folder / ".metadata").write_bytes(b"Fa\x1cb\n.")
    with pytest.raises(CheckpointFormatError, match="Cannot parse the DCP metadata") as info:
        zeroio.open(folder)
    assert len(str(info.value).splitlines()) == 1


def test_offset_past_the_end_of_a_file(folder):
    meta = _metadata(folder)
    key = _storage(meta, "model.emb.weight")
    size = (folder / meta.storage_data[key].relative_path).stat().st_size
    meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], offset=size - 10)
    _save(folder, meta)
    _refused(
        folder, CheckpointFormatError, r"'model.emb.weight' lies at bytes \[\d+, \d+\) of '__\d_0.distcp', which holds"
    )


def test_overlapping_chunks(folder):
    meta = _metadata(folder)
    entry = meta.state_dict_metadata["model.emb.weight"]
    old = entry.chunks[1]
    entry.chunks[1] = ChunkStorageMetadata(torch.Size([6, 0]), torch.Size([7, 7]))
    key = _storage(meta, "model.emb.weight", 1)
    meta.storage_data[dataclasses.replace(key, offset=torch.Size([6, 0]))] = meta.storage_data.pop(key)
    assert old.offsets == torch.Size([7, 0])
    _save(folder, meta)
    _refused(folder, CheckpointFormatError, r"chunks of 'model.emb.weight' at \(0, 0\) and \(6, 0\) overlap")


def test_chunks_that_do_not_cover_the_tensor(folder):
    meta = _metadata(folder)
    del meta.state_dict_metadata["model.emb.weight"].chunks[1]
    _save(folder, meta)
    _refused(
        folder, CheckpointFormatError, r"the chunks of 'model.emb.weight' hold 49 elements, its shape \(13, 7\) has 91"
    )


@pytest.mark.parametrize("path", ["../x.distcp", "/etc/passwd", "sub/../../x", ".metadata"])
def test_relative_path_leaving_the_folder(folder, path):
    meta = _metadata(folder)
    key = _storage(meta, "model.emb.weight")
    meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], relative_path=path)
    _save(folder, meta)
    _refused(folder, CheckpointFormatError, "which is not a file name inside the folder")


def test_missing_data_file_is_not_found(folder):
    (folder / "__1_0.distcp").unlink()
    _refused(folder, CheckpointNotFoundError, "__1_0.distcp' does not exist, yet")


def test_absurd_sizes(folder):
    """A tensor of 2**62 elements whose chunk claims them all: refused from the stored length, nothing allocated.
    (2**80 elements pass int64: refused from the size alone, test_sizes_past_int64.)"""
    meta = _metadata(folder)
    entry = meta.state_dict_metadata["model.scale"]
    huge = torch.Size([2**31, 2**31])
    meta.state_dict_metadata["model.scale"] = dataclasses.replace(
        entry, size=huge, chunks=[ChunkStorageMetadata(torch.Size([0, 0]), huge)]
    )
    key = _storage(meta, "model.scale")
    meta.storage_data[dataclasses.replace(key, offset=torch.Size([0, 0]))] = meta.storage_data.pop(key)
    _save(folder, meta)
    _refused(folder, CheckpointFormatError, r"a chunk of 'model.scale' of \d+ float32 elements is stored in 1577 bytes")


def test_many_chunks_are_checked_in_linear_time(folder):
    """10,000 one-element chunks side by side along dim 1 (each naming its own 4 bytes, appended to the data file:
    items never share bytes): the overlap and coverage check is linear, where comparing chunk pairs would take
    5 * 10**7 steps (a minute)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = _metadata(folder)
    info = meta.storage_data[_storage(meta, "model.scale")]
    n = 10_000
    entry = meta.state_dict_metadata["model.scale"]
    chunks = [ChunkStorageMetadata(torch.Size([0, j]), torch.Size([1, 1])) for j in range(n)]
    meta.state_dict_metadata["model.scale"] = TensorStorageMetadata(entry.properties, torch.Size([1, n]), chunks)
    for key in [k for k in meta.storage_data if k.fqn == "model.scale"]:
        del meta.storage_data[key]
    template = _storage(meta, "model.emb.weight")
    data = folder / info.relative_path
    base = data.stat().st_size
    with open(data, "ab") as fh:
        fh.write(bytes(4 * n))
    for j in range(n):
        own = _StorageInfo(info.relative_path, base + 4 * j, 4)
        meta.storage_data[dataclasses.replace(template, fqn="model.scale", offset=torch.Size([0, j]))] = own
    _save(folder, meta)
    start = time.monotonic()
    with zeroio.open(folder) as ckpt:
        assert ckpt.info("scale").shape == (1, n)
    assert time.monotonic() - start < 10


def test_overlap_found_among_many_chunks(folder):
    """The same layout with one chunk duplicated is refused as overlapping."""
    meta = _metadata(folder)
    entry = meta.state_dict_metadata["model.emb.weight"]
    entry.chunks.append(ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([1, 7])))
    key = _storage(meta, "model.emb.weight")
    meta.storage_data[dataclasses.replace(key, offset=torch.Size([3, 0]))] = meta.storage_data[key]
    _save(folder, meta)
    _refused(folder, CheckpointFormatError, r"chunks of 'model.emb.weight' at \(0, 0\) and \(3, 0\) overlap")


def test_a_value_sharing_its_lists_is_walked_once_per_list(folder):
    """A pickled value of 30 nested lists, each holding the one below ten times (10**30 paths, a few hundred
    bytes): summarised in the metadata within seconds, never walked path by path."""
    import io

    meta = _metadata(folder)
    value: list = []
    for _ in range(30):
        value = [value] * 10
    blob = io.BytesIO()
    torch.save(value, blob)
    key = _storage(meta, "optim.param_groups.0.lr")
    target = folder / meta.storage_data[key].relative_path
    offset = target.stat().st_size
    with open(target, "ab") as fh:
        fh.write(blob.getvalue())
    meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], offset=offset, length=len(blob.getvalue()))
    _save(folder, meta)
    start = time.monotonic()
    with zeroio.open(folder) as ckpt:
        shown = ckpt.metadata.extra["values"]["optim.param_groups.0.lr"]
    assert time.monotonic() - start < 10
    assert shown == f"<list of {sum(10**k for k in range(31))} nodes, not shown>"


def test_a_value_naming_a_disallowed_global_is_not_run_and_weights_stay_readable(folder, monkeypatch):
    """A pickled value (train_state, a scheduler) calling os.system: never run, shown as not read; tensors read."""
    import io
    import zipfile

    monkeypatch.chdir(folder)
    meta = _metadata(folder)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02cos\nsystem\nX\x0b\x00\x00\x00touch PWNED\x85R.")
    key = _storage(meta, "optim.param_groups.0.lr")
    target = folder / meta.storage_data[key].relative_path
    offset = target.stat().st_size
    with open(target, "ab") as fh:
        fh.write(archive.getvalue())
    meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], offset=offset, length=len(archive.getvalue()))
    _save(folder, meta)
    with zeroio.open(folder) as ckpt:
        assert ckpt.metadata.extra["values"]["optim.param_groups.0.lr"] == (
            "<not read: it names os.system, which is not on zeroio's allowlist>"
        )
        assert ckpt["emb.weight"].shape == (13, 7)
    assert not (folder / "PWNED").exists()


def test_absurd_length(folder):
    meta = _metadata(folder)
    key = _storage(meta, "optim.param_groups.0.lr")
    meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], length=2**62)
    _save(folder, meta)
    _refused(folder, CheckpointFormatError, r"'optim.param_groups.0.lr' lies at bytes")


def test_stream_transforms_are_refused_by_name(folder):
    meta = _metadata(folder)
    key = _storage(meta, "model.emb.weight")
    meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], transform_descriptors=["zstd/1.0"])
    _save(folder, meta)
    _refused(folder, UnsupportedCheckpointError, "stream transforms")


def test_chunk_archive_with_disallowed_global_runs_nothing(folder, monkeypatch):
    """A tensor chunk whose own archive's pickle names os.system fails on read, typed, without running it."""
    import io
    import zipfile

    monkeypatch.chdir(folder)
    meta = _metadata(folder)
    key = _storage(meta, "model.emb.weight")
    info = meta.storage_data[key]
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:  # a well-formed torch.save layout
        zf.writestr("archive/data.pkl", b"\x80\x02cos\nsystem\nX\x0b\x00\x00\x00touch PWNED\x85R.")
        zf.writestr("archive/data/0", bytes(196))
    target = folder / info.relative_path
    offset = target.stat().st_size
    with open(target, "ab") as fh:
        fh.write(archive.getvalue())
    meta.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(archive.getvalue()))
    _save(folder, meta)
    with zeroio.open(folder) as ckpt, pytest.raises(UnsafePickleError, match="Refusing to unpickle global 'os.system'"):
        ckpt["emb.weight"]
    assert not (folder / "PWNED").exists()


@example(target="__0_0.distcp", where=0.40464542385668417, flips=b"\x00", truncate=False)  # a record header at -1
@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.sampled_from([".metadata", "__0_0.distcp", "__1_0.distcp"]),
    where=st.floats(0, 1, exclude_max=True),
    flips=st.binary(min_size=1, max_size=4),
    truncate=st.booleans(),
)
def test_damaged_files_give_results_or_typed_errors(tmp_path_factory, target, where, flips, truncate):
    """Bytes flipped anywhere in .metadata or a data file, or the file cut there: reading every tensor, optimizer
    state and value either works or raises a ZeroIOError with a one-line message, never a raw Python error."""
    folder = tmp_path_factory.mktemp("fuzz") / "ckpt"
    shutil.copytree(SOURCE, folder, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    path = folder / target
    data = bytearray(path.read_bytes())
    at = int(where * len(data))
    if truncate:
        del data[at:]
    else:
        data[at : at + len(flips)] = bytes(b ^ 0xFF for b in flips)[: len(data) - at]
    path.write_bytes(bytes(data))
    try:
        with zeroio.open(folder) as ckpt:
            for key in ckpt:
                ckpt[key]
            ckpt.optimizer_state("emb.weight")
            ckpt.finish_crc_checks()
    except ZeroIOError as exc:
        assert "\n" not in str(exc), str(exc)


def test_data_file_linked_outside_the_folder_is_refused(folder, tmp_path):
    """A ``.distcp`` that is a link to a file outside the checkpoint (a secret, another run's weights) is refused
    by name before a byte of it is read; a link that stays inside the folder still reads."""
    with zeroio.open(folder) as ckpt:
        expected = {name: ckpt.get_tensor(name) for name in ckpt.infos}
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(folder / "__1_0.distcp", outside)
    (folder / "__1_0.distcp").symlink_to(outside)
    _refused(folder, CheckpointFormatError, r"__1_0\.distcp.*is a link leading outside")

    (folder / "__1_0.distcp").unlink()
    (folder / "kept").mkdir()
    shutil.move(outside, folder / "kept" / "real.distcp")
    (folder / "__1_0.distcp").symlink_to(Path("kept") / "real.distcp")
    with zeroio.open(folder) as ckpt:
        assert all(torch.equal(ckpt.get_tensor(n), t) for n, t in expected.items())
