"""CRC-32 checks of the zip records zeroio reads: a flipped byte in a genuine checkpoint fails loudly, never silently."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES

import zeroio
from zeroio._io.crc32 import crc32_combine
from zeroio._pickles import load_pickle
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError

FIXTURE = "z3_ws2_bf16"
"""ZeRO-3, 2 ranks: rank 1's first fp32 flat group ends with 3 padding elements no tensor uses."""
TENSOR = "emb.weight"


# --------------------------------------------------------------------------- crc32_combine


def test_crc32_combine_matches_zlib_on_random_data() -> None:
    rng = random.Random(15)
    for _ in range(300):
        a = rng.randbytes(rng.randint(0, 3000))
        b = rng.randbytes(rng.choice([0, 1, 7, rng.randint(0, 100_000)]))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_combine_of_many_pieces_in_any_order() -> None:
    rng = random.Random(3)
    data = rng.randbytes(200_000)
    cuts = sorted(rng.sample(range(1, len(data)), 40))
    bounds = list(zip([0, *cuts], [*cuts, len(data)]))
    crc = 0
    for lo, hi in bounds:
        crc = crc32_combine(crc, zlib.crc32(data[lo:hi]), hi - lo)
    assert crc == zlib.crc32(data)


@pytest.mark.parametrize("order", ["in order", "reversed", "shuffled", "4 threads"])
@pytest.mark.parametrize("flip", [None, 0, 12_345, 49_999])
def test_a_record_read_in_pieces_is_checked_in_any_order(tmp_path: Path, order: str, flip: int | None) -> None:
    """Pieces read right after a run already seen continue its CRC (no combine); any order, from any thread, a
    clean record verifies and a flipped byte anywhere fails."""
    rng = random.Random(f"{order}-{flip}")
    path = tmp_path / "record.pt"
    torch.save({"x": torch.frombuffer(bytearray(rng.randbytes(50_000)), dtype=torch.uint8)}, path)
    if flip is not None:
        with zipfile.ZipFile(path) as archive:
            info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
        header = path.read_bytes()[info.header_offset : info.header_offset + 30]
        name_len, extra_len = struct.unpack_from("<HH", header, 26)
        _flip(path, info.header_offset + 30 + name_len + extra_len + flip)
    tree, file = load_pickle(path)
    file.source.verify = True
    cuts = sorted(rng.sample(range(1, 50_000), 80))
    bounds = list(zip([0, *cuts], [*cuts, 50_000]))
    if order == "reversed":
        bounds.reverse()
    elif order != "in order":
        rng.shuffle(bounds)

    def read(lo: int, hi: int) -> None:
        tree["x"].read(lo, hi - lo)

    with pytest.raises(CheckpointFormatError) if flip is not None else contextlib.nullcontext():
        if order == "4 threads":
            with ThreadPoolExecutor(4) as pool:
                for future in [pool.submit(read, lo, hi) for lo, hi in bounds]:
                    future.result()
        else:
            for lo, hi in bounds:
                read(lo, hi)
        file.source.finish()
    file.close()


# --------------------------------------------------------------------------- helpers


def _copy(tmp_path: Path, name: str = FIXTURE) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


def _tensor_byte(ckpt: zeroio.Checkpoint, name: str, root: Path, copy: Path) -> tuple[Path, int]:
    """(file in ``copy``, byte offset) of a byte inside ``name``'s data, found through the archive's records."""
    plan = ckpt.read_plan(name)  # type: ignore[attr-defined]
    assert hasattr(plan, "pieces")  # a plan over the ranks' flat partitions
    piece = plan.pieces[0]
    ref = plan.groups[piece.rank][piece.group]
    offset = ref.file.data_offset(ref.storage.key) + (ref.storage_offset + piece.start + 1) * ref.dtype.itemsize
    return copy / ref.file.path.relative_to(root), offset


def _padding_byte(ckpt: zeroio.Checkpoint, root: Path, copy: Path) -> tuple[Path, int]:
    """(file in ``copy``, byte offset) of the last byte of a flat-group record that no tensor covers."""
    covered: dict[tuple[int, int], int] = {}
    refs = {}
    for plan in ckpt.plans.values():  # type: ignore[attr-defined]
        if hasattr(plan, "pieces"):  # plans over the ranks' flat partitions
            for p in plan.pieces:
                covered[(p.rank, p.group)] = max(covered.get((p.rank, p.group), 0), p.start + p.length)
                refs[(p.rank, p.group)] = plan.groups[p.rank][p.group]
    for key, end in covered.items():
        ref = refs[key]
        if ref.storage_offset + end < ref.storage.numel:
            nbytes = ref.storage.numel * ref.dtype.itemsize
            return copy / ref.file.path.relative_to(root), ref.file.data_offset(ref.storage.key) + nbytes - 1
    raise AssertionError("fixture has no padding")


@pytest.fixture
def corrupted(tmp_path: Path) -> Path:
    """A copy of the fixture with one byte of TENSOR's data flipped."""
    copy = _copy(tmp_path)
    with zeroio.open(FIXTURES / FIXTURE) as ckpt:
        path, offset = _tensor_byte(ckpt, TENSOR, (FIXTURES / FIXTURE).resolve(), copy)
    _flip(path, offset)
    return copy


@pytest.fixture
def corrupted_padding(tmp_path: Path) -> Path:
    copy = _copy(tmp_path)
    with zeroio.open(FIXTURES / FIXTURE) as ckpt:
        path, offset = _padding_byte(ckpt, (FIXTURES / FIXTURE).resolve(), copy)
    _flip(path, offset)
    return copy


# --------------------------------------------------------------------------- reading


def test_open_reads_no_tensor_bytes_and_reading_the_tensor_raises(corrupted: Path) -> None:
    """One tensor's read reads only its bytes (its record, a flat group, is shared): the record is checked when
    the reads are finished, and a whole-checkpoint read finishes them itself."""
    with zeroio.open(corrupted) as ckpt:  # metadata only: nothing to check yet
        assert TENSOR in ckpt
        ckpt[TENSOR]
        with pytest.raises(CheckpointFormatError) as info:
            ckpt.finish_crc_checks()
    with zeroio.open(corrupted) as ckpt, pytest.raises(CheckpointFormatError):
        ckpt.state_dict()
    message = str(info.value)
    assert "optim_states.pt" in message and "/data/" in message  # the file and the record
    assert "the file is corrupted; copy it again" in message
    assert "CRC-32" in message


def test_every_later_read_of_a_bad_record_raises_too(corrupted: Path) -> None:
    with zeroio.open(corrupted) as ckpt:
        with pytest.raises(CheckpointFormatError):
            ckpt.state_dict()
        for _ in range(2):
            with pytest.raises(CheckpointFormatError):
                ckpt.get_tensor(TENSOR)


def test_opt_out_reads_the_corrupted_bytes_silently(corrupted: Path) -> None:
    with zeroio.open(FIXTURES / FIXTURE) as clean:
        expected = clean[TENSOR]
    with zeroio.open(corrupted, verify_crc=False) as ckpt:
        assert ckpt.verify_crc is False
        got = ckpt[TENSOR]
        ckpt.finish_crc_checks()  # a no-op when switched off
    assert not torch.equal(got, expected)


def test_clean_checkpoint_reads_and_checks_every_record(tmp_path: Path) -> None:
    with zeroio.open(FIXTURES / FIXTURE) as ckpt:
        assert ckpt.verify_crc is True
        state = ckpt.state_dict()
        ckpt.finish_crc_checks()
    assert state


def test_padding_corruption_is_caught_when_the_record_is_finished(corrupted_padding: Path) -> None:
    with zeroio.open(corrupted_padding) as ckpt, pytest.raises(CheckpointFormatError, match="copy it again"):
        for name in ckpt:
            ckpt.get_tensor(name)
        ckpt.finish_crc_checks()


def test_torch_bin_record_corruption(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"a": torch.arange(100, dtype=torch.float32), "b": torch.ones(7)}, path)
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0") and i.file_size == 400)
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        header = fh.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    _flip(path, info.header_offset + 30 + name_len + extra_len + 10)
    with zeroio.open(path) as ckpt:
        assert torch.equal(ckpt["b"], torch.ones(7))  # another record: unaffected
        with pytest.raises(CheckpointFormatError, match="data/0"):
            ckpt["a"]
    with zeroio.open(path, verify_crc=False) as ckpt:
        assert not torch.equal(ckpt["a"], torch.arange(100, dtype=torch.float32))


# --------------------------------------------------------------------------- converting


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["kernel-copy", "streaming"])
@pytest.mark.parametrize("which", ["tensor", "padding"])
def test_convert_of_a_corrupted_checkpoint_fails_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_copy: bool, which: str
) -> None:
    copy = _copy(tmp_path)
    with zeroio.open(FIXTURES / FIXTURE) as ckpt:
        root = (FIXTURES / FIXTURE).resolve()
        path, offset = _tensor_byte(ckpt, TENSOR, root, copy) if which == "tensor" else _padding_byte(ckpt, root, copy)
    _flip(path, offset)
    if not kernel_copy:
        monkeypatch.setenv("ZEROIO_NO_COPY_FILE_RANGE", "1")
    out = tmp_path / "out"
    with pytest.raises(CheckpointFormatError, match="the file is corrupted; copy it again"):
        zeroio.convert(copy, out, progress=False)
    assert not out.exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temporary folder left
    result = zeroio.convert(copy, out, progress=False, verify_crc=False)  # the explicit opt-out
    assert result.num_tensors > 0


@pytest.mark.parametrize("fmt", ["torch", "lightning"])
def test_convert_other_formats_catch_corruption(tmp_path: Path, corrupted: Path, fmt: str) -> None:
    out = tmp_path / ("out.ckpt" if fmt == "lightning" else "out")
    with pytest.raises(CheckpointFormatError):
        zeroio.convert(corrupted, out, fmt=fmt, progress=False)  # type: ignore[arg-type]
    assert not out.exists()


def test_verify_catches_corruption(tmp_path: Path, corrupted: Path) -> None:
    reference = tmp_path / "ref"
    zeroio.convert(FIXTURES / FIXTURE, reference, progress=False)
    with pytest.raises(CheckpointFormatError):
        zeroio.verify(corrupted, reference)
    assert not zeroio.verify(corrupted, reference, verify_crc=False).ok  # the bytes differ: reported as values


def test_cli_convert_fails_without_and_converts_with_no_verify_crc(
    tmp_path: Path, corrupted: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli-out"
    assert main(["convert", str(corrupted), str(out), "--quiet"]) != 0
    assert "the file is corrupted; copy it again" in capsys.readouterr().err
    assert not out.exists()
    assert main(["convert", str(corrupted), str(out), "--quiet", "--no-verify-crc"]) == 0
    assert out.is_dir()


def test_safetensors_inputs_have_nothing_to_check(tmp_path: Path) -> None:
    out = tmp_path / "st"
    zeroio.convert(FIXTURES / FIXTURE, out, progress=False)
    with zeroio.open(out) as ckpt:
        ckpt.state_dict()
        ckpt.finish_crc_checks()


def test_no_stray_file_descriptors_after_checks(corrupted: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    with zeroio.open(corrupted) as ckpt, pytest.raises(CheckpointFormatError):
        ckpt.state_dict()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_small_read_of_a_big_record_stays_lazy_until_finished(tmp_path: Path) -> None:
    """Reading 10 elements of an 80 MB record reads 40 bytes: the record is checked only when finished."""
    path = tmp_path / "big.pt"
    big = torch.zeros(20_000_000)
    torch.save({"small": big[:10]}, path)  # torch saves the whole 80 MB storage: one record
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
    end = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.file_size
    _flip(path, end - 1)  # the record's last byte, far from the tensor
    with zeroio.open(path) as ckpt:
        assert torch.equal(ckpt["small"], torch.zeros(10))  # the rest of the record is not read
        with pytest.raises(CheckpointFormatError, match="fails its CRC-32 check"):
            ckpt.finish_crc_checks()
