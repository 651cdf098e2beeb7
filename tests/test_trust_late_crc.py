"""CRC-32 checks for every record read, however late its file is opened (issue 30, item 2): a DCP data file holding
no pickled value is first opened by a tensor read, a universal checkpoint's optimizer files by ``optimizer_state``;
a flipped bit in either converted with exit 0 and wrong values."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
from fixture_data import FIXTURES

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError

DCP = FIXTURES / "dcp" / "dcp_fsdp2_ws2_fp32"
UNIVERSAL = FIXTURES / "universal" / "universal_z3_ws2_fp32"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture
def dcp_flipped(tmp_path: Path) -> Path:
    """``__0_0.distcp`` (the pickled values live in ``__1_0.distcp``, opened at open) with one bit of
    ``emb.weight``'s first chunk flipped."""
    folder = tmp_path / "ckpt"
    shutil.copytree(DCP, folder, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    with zeroio.open(folder) as ckpt:
        ranges = ckpt.byte_ranges("emb.weight")
    assert ranges is not None
    source, offset, nbytes = ranges[0]
    assert Path(source.name).name == "__0_0.distcp" and nbytes > 100
    _flip(folder / "__0_0.distcp", offset + 100)
    return folder


def test_flipped_bit_in_a_dcp_data_file_opened_late_fails_its_crc(dcp_flipped, tmp_path):
    with zeroio.open(dcp_flipped) as ckpt, pytest.raises(CheckpointFormatError, match="fails its CRC-32 check"):
        ckpt["emb.weight"]
    with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp': record 'model\.emb\.weight\[0\]'"):
        zeroio.convert(dcp_flipped, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(dcp_flipped), str(tmp_path / "cli"), "--quiet"]) == 1


def test_verify_crc_false_still_reads_a_late_dcp_file(dcp_flipped):
    """The opt-out reaches files opened late too: the flipped value is returned, as asked."""
    with zeroio.open(DCP) as good, zeroio.open(dcp_flipped, verify_crc=False) as bad:
        differ = (good["emb.weight"] != bad["emb.weight"]).sum().item()
    assert differ == 1


def test_flipped_bit_in_a_universal_optimizer_file_fails_its_crc(tmp_path):
    folder = tmp_path / "universal"
    shutil.copytree(UNIVERSAL, folder, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    path = folder / "global_step2_universal" / "zero" / "emb.weight" / "exp_avg.pt"
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    with path.open("rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
    _flip(path, info.header_offset + 30 + name_len + extra_len + 5)
    with zeroio.open(folder) as ckpt, pytest.raises(CheckpointFormatError, match="exp_avg.pt': record"):
        ckpt.optimizer_state("emb.weight")
    with zeroio.open(folder, verify_crc=False) as ckpt:
        assert ckpt.optimizer_state("emb.weight")["exp_avg"].shape == (13, 7)
