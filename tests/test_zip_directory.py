"""zeroio's own reading of a torch zip archive's central directory agrees with :mod:`zipfile` on every file it
accepts, and hands every other file to zipfile (None)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES

from zeroio._pickles import load_pickle
from zeroio._pickles import zip_directory as zd

GENUINE = sorted(p for p in FIXTURES.rglob("*.pt") if p.read_bytes()[:2] == b"PK")


def _zipfile_view(data: bytes) -> tuple[set[tuple[object, ...]], set[str], int]:
    """What zipfile reads: the records but the empty storage records, those records' keys, the directory start."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = archive.infolist()
        start = archive.start_dir
    prefix = infos[0].filename[: -len("data.pkl")] + "data/"

    def empty(i: zipfile.ZipInfo) -> bool:
        return i.file_size == 0 and i.compress_size == 0 and i.compress_type == 0 and i.filename.startswith(prefix)

    fields = {(i.filename, i.header_offset, i.compress_type, i.compress_size, i.file_size, i.CRC, i.flag_bits)
              for i in infos if not empty(i)}  # fmt: skip
    return fields, {i.filename[len(prefix) :] for i in infos if empty(i)}, start


def _ours(data: bytes) -> tuple[set[tuple[object, ...]], set[str], int] | None:
    found = zd.read_directory(io.BytesIO(data), len(data))
    if found is None:
        return None
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        headers = sorted([*(i.header_offset for i in archive.infolist()), archive.start_dir])
    for r in found.records:  # each record's bytes end by the next local header (any record's) or the directory
        assert r.limit == next(h for h in headers if h > r.header_offset), r
    return {tuple(r)[:7] for r in found.records}, set(found.empty_keys), found.start


@pytest.fixture(params=["one by one", "at once"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(zd, "_VECTORIZE", 1 if request.param == "at once" else 10**9)
    return str(request.param)


def test_genuine_files_read_as_zipfile_reads_them(way: str) -> None:
    """Every zip rank file of the fixtures (DeepSpeed's, torch's, zeroio's): the same records, both ways."""
    assert len(GENUINE) > 100
    for path in GENUINE:
        data = path.read_bytes()
        assert _ours(data) == _zipfile_view(data), path


def _placeholders(tmp_path: Path, count: int = 600) -> bytes:
    """A torch.save of ``count`` empty tensors and two with bytes, like a ZeRO-3 model-states file."""
    tree = {f"layer.{i}.weight": torch.empty(0) for i in range(count)}
    tree["buffer"], tree["frozen"] = torch.arange(5.0), torch.ones(3, dtype=torch.bfloat16)
    path = tmp_path / "placeholders.pt"
    torch.save(tree, path)
    return path.read_bytes()


def test_many_empty_records(tmp_path: Path, way: str) -> None:
    data = _placeholders(tmp_path)
    ours = _ours(data)
    assert ours is not None and len(ours[1]) == 600 and ours == _zipfile_view(data)


def _rewritten(data: bytes, *, comment: bytes = b"", duplicate: bool = False, rename: str = "") -> bytes:
    """The archive written again by zipfile: with a comment, a record listed twice, or one key renamed."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        infos = src.infolist()
        for info in infos:
            name = info.filename
            if rename and name.endswith("/data/7"):
                name = name[: -len("7")] + rename
            dst.writestr(name, src.read(info))
        if duplicate:
            with pytest.warns(UserWarning, match="Duplicate name"):
                dst.writestr(infos[-1].filename, src.read(infos[-1]))
        dst.comment = comment
    return out.getvalue()


def test_other_layouts_go_to_zipfile(tmp_path: Path, way: str) -> None:
    """A comment, bytes before the archive, a name listed twice, a cut file: None, zipfile's turn."""
    data = _placeholders(tmp_path)
    assert _ours(_rewritten(data)) == _zipfile_view(_rewritten(data))  # zipfile's own writing, no zip64 records
    assert _ours(_rewritten(data, comment=b"note")) is None
    assert _ours(b"junk" + data) is None
    assert _ours(_rewritten(data, duplicate=True)) is None
    assert _ours(data[:-30]) is None
    assert _ours(data[: len(data) // 2]) is None


def test_a_signature_inside_a_name_is_read_one_by_one(tmp_path: Path) -> None:
    """A key holding the entry signature defeats the at-once reading, not the reading: the same records."""
    data = _rewritten(_placeholders(tmp_path), rename="PK\x01\x02")
    assert zd._entries_at_once(*_directory_args(data)) is None
    assert _ours(data) == _zipfile_view(data)


def _directory_args(data: bytes) -> tuple[bytes, int, int]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        start, count = archive.start_dir, len(archive.infolist())
    end = data.rfind(b"PK\x05\x06")
    return data[start : start + int.from_bytes(data[end + 12 : end + 16], "little")], count, start


def test_load_pickle_reads_the_fallback_files_too(tmp_path: Path) -> None:
    """A file zeroio's reader declines (a comment) still opens, through zipfile, to the same tree."""
    data = _placeholders(tmp_path, count=20)
    (tmp_path / "plain.pt").write_bytes(data)
    (tmp_path / "comment.pt").write_bytes(_rewritten(data, comment=b"note"))
    plain, a = load_pickle(tmp_path / "plain.pt")
    commented, b = load_pickle(tmp_path / "comment.pt")
    assert plain.keys() == commented.keys()
    assert torch.equal(plain["buffer"].read(), commented["buffer"].read())
    a.close()
    b.close()
