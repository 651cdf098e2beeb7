"""Red team of zeroio's own torch zip reader (zeroio/_pickles/zip_directory.py, archive.py) and of the replica trees
ZeRO-3 model states share (zeroio/_pickles/replica.py).

Each zip attack (tests/hostile_zips.py) is one lie in a directory entry, a local header or the end records, read
entry by entry (0 empty records) and at once (600, numpy). Where zipfile or torch's reader refuses such a file, or
where the two would read different bytes, zeroio refuses it by name; the layouts both read alike give zeroio the
same bytes as both. Before: the duplicate name and the misplaced zip64 end record read bytes torch never reads, and
every other attack here but two was read without complaint.
"""

from __future__ import annotations

import functools
import io
import os
import re
import shutil
import struct
import threading
import time
import zipfile
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from fixture_data import FIXTURES
from hostile_zips import A_BYTES, B_BYTES, CHUNK_ATTACKS, EVIL, ZIP_ATTACKS, build, chunk, edited, entries

import zeroio
from zeroio.errors import CheckpointFormatError, UnsupportedCheckpointError

SAYS = {
    "two_entries_one_header": "two records sharing one local header",
    "encrypted_storage": "encrypted or patched record (flags 0x0809)",
    "strongly_encrypted_storage": "encrypted or patched record (flags 0x0848)",
    "patched_storage": "encrypted or patched record (flags 0x0828)",
    "encrypted_pickle": "encrypted or patched record (flags 0x0809)",
    "duplicate_storage": "'archive/data/0' listed twice",
    "duplicate_storage_zipfile": "'archive/data/0' listed twice",
    "one_name_two_encodings": "'archive/data/\u00e9' listed twice",
    "nul_in_name": "a record name holding a NUL byte",
    "nul_in_name_zipfile": "a record name holding a NUL byte",
    "overlapping_records": "the bytes of storage '1' (24 from byte",
    "overlapping_directory": "reach into the next record or the zip directory",
    "record_longer_than_storage": "storage '1' needs 16 bytes, the archive holds 24",
    "zip64_blocks_twice": "a malformed extra field",
    "stored_sizes_differ": "a stored record of 16 bytes whose compressed size says 20",
    "record_on_another_disk": "a record on another disk",
    "record_marked_as_a_folder": "a record marked as a folder",
    "extra_field_overruns": "Corrupt extra field",
    "version_needed_9_9": "zip file version 9.9",
    "zip64_locator_elsewhere": "a zip64 end record away from where its locator points",
    "zip64_locator_elsewhere_zipfile": "a zip64 end record away from where its locator points",
    "bytes_before_archive": "a zip64 end record away from where its locator points",
    "counts_disagree": "records whose end record counts",
    "counts_huge": "whose end record counts 4611686018427387904",
    "pickle_not_in_a_folder": "its pickle 'data.pkl' outside the folder",
    "pickle_in_two_folders": "its pickle 'x/archive/data.pkl' outside the folder",
    "first_record_elsewhere": "outside the folder of its first record 'xdata.pkl'",
}
"""What zeroio's one-line refusal says, for each attack."""

DIFFERENTIALS = {"duplicate_storage_zipfile", "zip64_locator_elsewhere", "zip64_locator_elsewhere_zipfile"}
"""Attacks where zipfile reads EVIL as 'a' and torch's reader reads the true bytes: reading either way is wrong."""


def _torch_reads(path: Path) -> dict[str, bytes] | None:
    try:
        state = torch.load(path, weights_only=True)
    except RuntimeError:  # torch's reader refuses
        return None
    return {k: state[k].numpy().tobytes() for k in ("a", "b")}


def _zipfile_reads(path: Path) -> bytes | None:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.read("archive/data/0")
    except (zipfile.BadZipFile, KeyError, RuntimeError, NotImplementedError):  # zipfile refuses
        return None


def test_every_attack_says_what_it_is() -> None:
    assert set(SAYS) == set(ZIP_ATTACKS)


@pytest.mark.parametrize("empties", [0, 600], ids=["one by one", "at once"])
@pytest.mark.parametrize("attack", sorted(ZIP_ATTACKS))
def test_zip_attacks_are_refused_by_name(tmp_path: Path, attack: str, empties: int) -> None:
    path = tmp_path / f"{attack}.pt"
    path.write_bytes(ZIP_ATTACKS[attack](empties))
    if attack in DIFFERENTIALS and empties == 0:
        assert _zipfile_reads(path) == EVIL and _torch_reads(path) == {"a": A_BYTES, "b": B_BYTES}
    with pytest.raises((CheckpointFormatError, UnsupportedCheckpointError)) as caught, zeroio.open(path) as ckpt:
        ckpt.state_dict()
    message = str(caught.value)
    assert SAYS[attack] in message and str(path) in message
    assert "\n" not in message and message.endswith(".")


def _pickle_last(empties: int) -> bytes:
    records = entries(empties)
    return build([*records[1:], records[0]])


ACCEPTED = {
    "torch's layout": lambda n: build(entries(n)),
    "a comment (zipfile reads it)": lambda n: build(entries(n), comment=b"note"),
    "data.pkl last": _pickle_last,
    "an entry comment": lambda n: build(edited(n, "0", comment=b"hi")),
    "an ASCII name without the UTF-8 flag": lambda n: build(edited(n, "0", flags=0x8)),
}


@pytest.mark.parametrize("empties", [0, 600], ids=["one by one", "at once"])
@pytest.mark.parametrize("layout", sorted(ACCEPTED))
def test_layouts_both_readers_accept_read_the_same_bytes(tmp_path: Path, layout: str, empties: int) -> None:
    """What zeroio accepts, it reads as torch and zipfile do, byte for byte."""
    path = tmp_path / "ok.pt"
    path.write_bytes(ACCEPTED[layout](empties))
    assert _torch_reads(path) == {"a": A_BYTES, "b": B_BYTES} and _zipfile_reads(path) == A_BYTES
    with zeroio.open(path) as ckpt:
        assert {k: ckpt[k].numpy().tobytes() for k in ("a", "b")} == {"a": A_BYTES, "b": B_BYTES}


@pytest.mark.parametrize("empties", [0, 600], ids=["one by one", "at once"])
def test_a_local_header_naming_another_record_reads_as_torch_reads_it(tmp_path: Path, empties: int) -> None:
    """zipfile refuses a record whose local header names another; torch reads its bytes, and so does zeroio (the
    name is not read: no two entries may share a header, and each record's bytes end by the next one)."""
    path = tmp_path / "renamed.pt"
    path.write_bytes(build(edited(empties, "0", local_name=b"archive/data/9")))
    assert _zipfile_reads(path) is None and _torch_reads(path) == {"a": A_BYTES, "b": B_BYTES}
    with zeroio.open(path) as ckpt:
        assert {k: ckpt[k].numpy().tobytes() for k in ("a", "b")} == {"a": A_BYTES, "b": B_BYTES}


def _huge_directory(count: int) -> bytes:
    """``count`` empty records after data.pkl, with a comment (zipfile's turn): a directory of about 35 MiB."""
    pickle = entries(0)[0]
    alone = build([pickle])
    at = 30 + len(pickle.name) + len(pickle.data)
    head, first = alone[:at], alone[at : at + 46 + len(pickle.name)]
    entry = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, 0x800, 0, 0, 0, 0, 0, 0, 20, 0, 0, 0, 0, 0, 0)
    rows = np.tile(np.frombuffer(entry + b"archive/data/0000000", dtype=np.uint8), (count, 1))
    index = np.arange(count)
    for digit in range(7):  # the 7 digits of each name, last first
        rows[:, 46 + 19 - digit] = ord("0") + (index // 10**digit) % 10
    directory = first + rows.tobytes()
    n = count + 1
    eocd64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x31E, 45, 0, 0, n, n, len(directory), len(head))
    locator = struct.pack("<IIQI", 0x07064B50, 0, len(head) + len(directory), 1)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 4) + b"note"
    return head + directory + eocd64 + locator + end


def test_a_directory_past_zipfiles_limit_is_refused_before_zipfile_parses_it(tmp_path: Path) -> None:
    """540,000 records (35 MiB of directory, an archive comment sending it to zipfile): zipfile's objects for them
    took 3 s and 300 MB before; now a typed refusal before any is made."""
    path = tmp_path / "huge.pt"
    path.write_bytes(_huge_directory(540_000))
    start = time.monotonic()
    with pytest.raises(UnsupportedCheckpointError, match=r"zip directory in a layout torch.save does not write"):
        zeroio.open(path)
    assert time.monotonic() - start < 1.0


# --- replicas: ZeRO-3 model states of ranks 1.. sharing rank 1's parsed tree ----------------------------------


def _rewrite_record(path: Path, key: str, data: bytes) -> None:
    """``path`` written again by zipfile with record ``<root>/data/<key>`` holding ``data`` (pickle unchanged)."""
    with zipfile.ZipFile(path) as archive:
        names = [i.filename for i in archive.infolist()]
        contents = {n: archive.read(n) for n in names}
    contents[next(n for n in names if n.endswith(f"/data/{key}"))] = data
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name in names:
            archive.writestr(name, contents[name])


@pytest.fixture
def z3(tmp_path: Path) -> Path:
    """DeepSpeed's own 4-rank ZeRO-3 save: ranks 1..3 repeat one model-states pickle byte for byte."""
    copy = tmp_path / "z3_ws4_fp32"
    shutil.copytree(FIXTURES / "z3_ws4_fp32", copy, ignore=shutil.ignore_patterns("expected"))
    return copy


def _model_states(root: Path, rank: int) -> Path:
    return root / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _record(path: Path, key: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith(f"/data/{key}")))


def test_a_replica_whose_record_holds_more_than_its_storage_is_refused(z3: Path) -> None:
    """Rank 2's frozen fragment record (storage '10', 13 floats) carries 4 bytes more, its pickle byte for byte
    rank 1's: torch refuses the file (record size); zeroio read the first 52 bytes."""
    victim = _model_states(z3, 2)
    _rewrite_record(victim, "10", _record(victim, "10") + b"\x00" * 4)
    with pytest.raises(RuntimeError, match="record size"):
        torch.load(victim, weights_only=True)
    with pytest.raises(CheckpointFormatError, match=r"storage '10' needs 52 bytes, the archive holds 56"):
        zeroio.open(z3)


def test_a_replica_whose_placeholder_holds_bytes_is_refused(z3: Path) -> None:
    """Rank 3's record of a placeholder (storage '2', no elements) holds 8 bytes: the shared tree's empty storage
    must be empty in every file, as torch requires."""
    victim = _model_states(z3, 3)
    _rewrite_record(victim, "2", b"\x01" * 8)
    with pytest.raises(RuntimeError, match="record size"):
        torch.load(victim, weights_only=True)
    with pytest.raises(CheckpointFormatError, match=r"'.*rank_3.*' is truncated or corrupted: storage '2' needs 0"):
        zeroio.open(z3)


def test_a_replica_replaced_after_open_is_refused_at_its_first_read(z3: Path) -> None:
    """Rank 2's model states replaced (same bytes, another inode) after open: its replica tree reads through the
    file its directory was read from, so the swap is caught at the first read."""
    victim = _model_states(z3, 2)
    with zeroio.open(z3) as ckpt:
        fragment = next(iter(ckpt.file_tree(victim)["frozen_param_fragments"].values()))
        assert fragment.file.path == victim
        data = victim.read_bytes()
        os.replace(victim, victim.with_suffix(".old"))
        victim.write_bytes(data)
        with pytest.raises(CheckpointFormatError, match="changed"):
            fragment.read()


def test_replica_trees_read_their_own_bytes_after_a_hostile_sibling(z3: Path) -> None:
    """Rank 2's frozen fragment record replaced by other bytes of the same size and CRC-correct: ranks 1 and 3
    (sharing its tree) still read their own bytes, rank 2 reads its new ones."""
    originals = {r: _record(_model_states(z3, r), "10") for r in (1, 2, 3)}
    _rewrite_record(_model_states(z3, 2), "10", bytes(len(originals[2])))
    with zeroio.open(z3) as ckpt:
        for rank in (1, 2, 3):
            tree = ckpt.file_tree(_model_states(z3, rank))
            ref = next(r for r in tree["frozen_param_fragments"].values() if r.storage.key == "10")
            expected = bytes(len(originals[2])) if rank == 2 else originals[rank]
            assert ref.read().numpy().tobytes() == expected, rank


def test_hostile_zip_files_join_the_fuzz_corpus() -> None:
    """tests/test_errors.py damages each zip attack too (only results or one-line ZeroIOErrors may come out)."""
    import test_errors

    assert {f"zip_{name}" for name in ZIP_ATTACKS} <= set(test_errors.CORPUS)


# --- DCP chunks: the same attacks on a torch.save archive inside a data file (read through zipfile) -------------


def _dcp_with_chunk(where: Path, blob: bytes) -> Path:
    """The genuine DCP fixture plus 'model.evil' (4 floats, one chunk) stored as ``blob`` in its own data file."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    root = where / "ckpt"
    shutil.copytree(FIXTURES / "dcp" / "dcp_fsdp2_ws2_fp32", root, ignore=shutil.ignore_patterns("expected"))
    (root / "__9_0.distcp").write_bytes(b"\0" * 64 + blob)
    with open(root / ".metadata", "rb") as fh:
        meta = pickle.load(fh)  # our own genuine fixture, read to be rewritten
    box = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    meta.state_dict_metadata["model.evil"] = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size([4]), chunks=[box]
    )
    info = _StorageInfo(relative_path="__9_0.distcp", offset=64, length=len(blob))
    meta.storage_data[MetadataIndex("model.evil", box.offsets)] = info
    with open(root / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)
    return root


def test_a_dcp_chunk_archive_torch_writes_reads_as_torch_reads_it(tmp_path: Path) -> None:
    root = _dcp_with_chunk(tmp_path, build(chunk()))
    assert torch.load(io.BytesIO(build(chunk())), weights_only=True).numpy().tobytes() == A_BYTES
    with zeroio.open(root) as ckpt:
        assert ckpt["evil"].numpy().tobytes() == A_BYTES


@pytest.mark.parametrize("attack", sorted(CHUNK_ATTACKS))
def test_dcp_chunk_archive_attacks_are_refused_by_name(tmp_path: Path, attack: str) -> None:
    """A chunk's archive is read with zipfile: each lie is refused naming the data file. Before, all seven were
    read, the duplicate name and the moved zip64 locator as EVIL where torch.load of the chunk reads A_BYTES."""
    build_attack, says = CHUNK_ATTACKS[attack]
    blob = build_attack()
    if attack in ("duplicate_storage", "zip64_locator_elsewhere"):
        assert zipfile.ZipFile(io.BytesIO(blob)).read("archive/data/0") == EVIL
        assert torch.load(io.BytesIO(blob), weights_only=True).numpy().tobytes() == A_BYTES
    root = _dcp_with_chunk(tmp_path, blob)
    with pytest.raises((CheckpointFormatError, UnsupportedCheckpointError)) as caught, zeroio.open(root) as ckpt:
        ckpt["evil"]
    message = str(caught.value)
    assert says in message and "__9_0.distcp" in message and "\n" not in message and message.endswith(".")


class _Ranged(SimpleHTTPRequestHandler):
    """A static file server answering ``Range: bytes=A-B`` with exactly those bytes, as object stores do."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        path = Path(self.translate_path(self.path))
        if match is None or not path.is_file():
            return super().do_GET()
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            start, end = int(match[1]), min(int(match[2]), size - 1)
            fh.seek(start)
            data = fh.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return None


def test_a_remote_directory_past_zipfiles_limit_is_refused_before_zipfile_parses_it(tmp_path: Path) -> None:
    """A URL source is always read with zipfile: the same 35 MiB directory is refused from its end records."""
    pytest.importorskip("aiohttp")  # fsspec's HTTP filesystem
    (tmp_path / "huge.pt").write_bytes(_huge_directory(540_000))
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Ranged, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/huge.pt"
        with pytest.raises(UnsupportedCheckpointError, match=r"zip directory in a layout torch.save does not write"):
            zeroio.open(url)
    finally:
        server.shutdown()
        server.server_close()


def test_a_rank_file_read_for_its_names_only_is_held_to_the_same_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MiCS replica's model states are read for their recorded names first: that read went to zipfile directly,
    so the 35 MiB directory became 540,000 objects (3 s) before anything refused it. Now it has the same reading
    and limit as every other: refused from its end records, zipfile never given it."""
    root = tmp_path / "mics"
    shutil.copytree(FIXTURES / "layouts" / "mics_z3_ws4_shard2_fp32", root, ignore=shutil.ignore_patterns("expected"))
    huge = _model_states(root, 3)
    huge.write_bytes(_huge_directory(540_000))
    given = []
    real = zipfile.ZipFile

    def spied(file: object, *args: object, **kwargs: object) -> zipfile.ZipFile:
        given.append(Path(getattr(file, "name", "")))
        return real(file, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(zipfile, "ZipFile", spied)
    with pytest.raises(UnsupportedCheckpointError, match=r"rank_3.*zip directory in a layout torch.save does not"):
        zeroio.open(root)
    assert huge not in given
