"""Read-ahead of a conversion and of the passes over every tensor (verify, an unsharded load, ``state_dict``;
zeroio/_io/read_ahead.py): each ZeRO-3 rank file's partition is read in a few large reads, not one per parameter,
the tensors stay DeepSpeed's bit for bit, and a flipped byte anywhere in a window (in a parameter read after the one
that opened it, or in padding) still fails the conversion, the verify, the load."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES, assert_state_dicts_equal, reference
from safetensors.torch import load_file
from torch import nn

import zeroio
from zeroio.errors import CheckpointFormatError, OutputError

FIXTURE = "z3_ws4_fp32"
"""ZeRO-3, 4 ranks: 7 trainable parameters back to back in each rank's flat partition, 2 frozen ones in fragments."""


def _watch_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts ``os.preadv`` calls (every tensor byte read of a local file) per file name."""
    counts: dict[str, int] = {}
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        counts[name] = counts.get(name, 0) + 1
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    return counts


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_each_rank_partition_is_read_in_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    counts = _watch_reads(monkeypatch)
    zeroio.convert(FIXTURES / FIXTURE, tmp_path / "out", dtype=dtype, progress=False)  # type: ignore[arg-type]
    optim = {name: n for name, n in counts.items() if name.endswith("optim_states.pt")}
    with zeroio.open(FIXTURES / FIXTURE) as ckpt:
        groups = len(ckpt.read_plan("emb.weight").groups[0])  # type: ignore[attr-defined]
    assert groups == 2  # the fp32 partitions of the two param groups: the parameters' pieces alternate between them
    # One read of each fp32 partition per rank (7 parameters: 7 reads before), nothing left for the CRC check.
    assert optim == {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": groups for r in range(4)}
    if dtype is None:
        expected = reference(FIXTURE)
        assert expected is not None
        del expected["head.weight"]  # tied to emb.weight: stored once
        assert_state_dicts_equal(load_file(tmp_path / "out" / "model.safetensors"), expected)


def _flip_in(tmp_path: Path, name: str, rank_index: int) -> Path:
    """A copy of the fixture with one byte of ``name``'s piece on its ``rank_index``-th rank flipped."""
    copy = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / FIXTURE, copy)
    with zeroio.open(FIXTURES / FIXTURE) as ckpt:
        plan = ckpt.read_plan(name)  # type: ignore[attr-defined]
        piece = list(plan.pieces)[rank_index]
        ref = plan.groups[piece.rank][piece.group]
        each = ref.dtype.itemsize
        offset = ref.file.data_offset(ref.storage.key) + (ref.storage_offset + piece.start + piece.length - 1) * each
        path = copy / ref.file.path.relative_to((FIXTURES / FIXTURE).resolve())
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))
    return copy


@pytest.mark.parametrize(
    ("name", "rank_index"),
    [("emb.weight", 0), ("mlp_out.weight", 2), ("norm.bias", -1), ("frozen.bias", 1)],
    ids=["first-rank0", "middle-rank2", "last-lastrank", "frozen-fragment"],
)
def test_a_flipped_byte_served_from_a_window_fails_the_conversion(tmp_path: Path, name: str, rank_index: int) -> None:
    """The window of each rank file is read at the first parameter's piece: a byte of a later parameter is checked
    as part of the window, before it is copied out, and the conversion fails leaving nothing."""
    copy = _flip_in(tmp_path, name, rank_index)
    out = tmp_path / "out"
    with pytest.raises(CheckpointFormatError, match="fails its CRC-32 check"):
        zeroio.convert(copy, out, progress=False)
    assert not out.exists()
    assert zeroio.convert(copy, out, progress=False, verify_crc=False).num_tensors > 0  # the explicit opt-out


def _meta_model(path: Path) -> nn.Module:
    """A module holding every key of the checkpoint as a meta parameter (dots make submodules): what load fills."""
    model = nn.Module()
    with zeroio.open(path) as ckpt:
        for name, info in ckpt.infos.items():
            *parents, leaf = name.split(".")
            owner = model
            for part in parents:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]  # type: ignore[assignment]
            meta = torch.empty(info.shape, dtype=info.dtype, device="meta")
            owner.register_parameter(leaf, nn.Parameter(meta, requires_grad=False))
    return model


def _pass(how: str, ckpt: Path, converted: Path) -> dict[str, torch.Tensor] | None:
    """Read every tensor of ``ckpt`` by ``how``: its tensors (None for verify, which compares them itself)."""
    if how == "state_dict":
        with zeroio.open(ckpt) as opened:
            return opened.state_dict()
    if how == "load":
        model = _meta_model(ckpt)
        zeroio.load(ckpt, model)
        return dict(model.state_dict())
    assert zeroio.verify(ckpt, converted).ok
    return None


@pytest.mark.parametrize("how", ["verify", "load", "state_dict"])
def test_a_pass_over_every_tensor_reads_each_rank_partition_in_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """verify, an unsharded load and ``state_dict`` read through the conversion's windows (a read per parameter
    and rank before: 7 a file), and their tensors are DeepSpeed's bit for bit."""
    converted = tmp_path / "out"
    zeroio.convert(FIXTURES / FIXTURE, converted, progress=False)
    counts = _watch_reads(monkeypatch)
    got = _pass(how, FIXTURES / FIXTURE, converted)
    optim = {name: n for name, n in counts.items() if name.endswith("optim_states.pt")}
    assert optim == {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 2 for r in range(4)}  # 2 flat groups a file
    if got is not None:
        expected = reference(FIXTURE)
        assert expected is not None
        assert_state_dicts_equal(got, expected)


@pytest.mark.parametrize("how", ["verify", "load", "state_dict"])
@pytest.mark.parametrize(("name", "rank_index"), [("mlp_out.weight", 2), ("norm.bias", -1)], ids=["middle", "last"])
def test_a_flipped_byte_served_from_a_window_fails_the_pass(
    tmp_path: Path, how: str, name: str, rank_index: int
) -> None:
    """A byte of a later parameter, copied out of a window an earlier one opened, is checked with the window: the
    pass fails with the CRC error, however it reads."""
    converted = tmp_path / "out"
    zeroio.convert(FIXTURES / FIXTURE, converted, progress=False)
    copy = _flip_in(tmp_path, name, rank_index)
    with pytest.raises(CheckpointFormatError, match="fails its CRC-32 check"):
        _pass(how, copy, converted)


def test_chunks_of_a_pass_cut_pieces_and_stay_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """``iter_chunks`` in a pass, 5 elements a chunk (each rank's piece cut at the chunks' bounds, each part served
    from its window): still one read per rank file and flat group, and the chunks make DeepSpeed's tensor."""
    expected = reference(FIXTURE)
    assert expected is not None
    counts = _watch_reads(monkeypatch)
    with zeroio.open(FIXTURES / FIXTURE) as ckpt, ckpt.reading_in_order():
        for name in ckpt.infos:
            got = torch.cat(list(ckpt.iter_chunks(name, chunk_bytes=20)))
            assert torch.equal(got, expected[name].reshape(-1)), name
    optim = {name: n for name, n in counts.items() if name.endswith("optim_states.pt")}
    assert optim == {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 2 for r in range(4)}


GPT2 = FIXTURES / "frameworks" / "hf_trainer_gpt2_z3" / "checkpoint-3"
"""ZeRO-3, 2 ranks (HF Trainer): in each rank's fp32 partition, pieces of 16 bytes to 2 KiB lie side by side."""


def _watch_ranges(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[int, int]]]:
    """The ``(offset, end)`` of every ``os.preadv`` (every tensor byte read of a local file), per file name."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    real = os.preadv

    def recording(fd: int, buffers: list[memoryview], offset: int) -> int:
        got = real(fd, buffers, offset)
        ranges.setdefault(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), []).append((offset, offset + got))
        return got

    monkeypatch.setattr(os, "preadv", recording)
    return ranges


def _read_twice(ranges: list[tuple[int, int]]) -> int:
    """Bytes read more than once: the sum of the reads less the bytes they cover."""
    covered, end = 0, -1
    for lo, hi in sorted(ranges):
        covered += max(0, hi - max(lo, end))
        end = max(end, hi)
    return sum(hi - lo for lo, hi in ranges) - covered


def _read_gpt2(how: str, out: Path) -> dict[str, torch.Tensor]:
    if how == "state_dict":
        with zeroio.open(GPT2) as ckpt:
            return dict(ckpt.state_dict())
    zeroio.convert(GPT2, out, dtype=None if how == "fp32" else how, workers=1, progress=False)  # type: ignore[arg-type]
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("how", ["fp32", "bf16", "state_dict"])
def test_no_byte_is_read_twice_where_windows_meet_long_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Windows smaller than some pieces (4 KiB: ``ZEROIO_READ_AHEAD_BYTES=16KiB`` over 4 files): a window read
    ahead past a short piece into the long piece after it, which its own read then read again (a 1.3B conversion
    read 12.9 GB for 5.25 GB, docs/benchmarks.md). Each byte of the rank files is read once, one thread reading,
    and the tensors are those read with the default windows."""
    ranges = _watch_ranges(monkeypatch)
    expected = _read_gpt2(how, tmp_path / "default")
    default = {name: len(runs) for name, runs in ranges.items() if name.endswith("optim_states.pt")}
    ranges.clear()
    monkeypatch.setenv("ZEROIO_READ_AHEAD_BYTES", "16KiB")
    got = _read_gpt2(how, tmp_path / "small")
    optim = {name: runs for name, runs in ranges.items() if name.endswith("optim_states.pt")}
    assert len(optim) == 2 and all(len(optim[name]) > default[name] for name in optim)  # the smaller windows
    assert {name: _read_twice(runs) for name, runs in optim.items()} == dict.fromkeys(optim, 0)
    assert_state_dicts_equal(got, expected)


def test_a_bad_read_ahead_budget_is_refused_by_name_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget that is not a byte count fails the conversion naming the variable (as ``ZEROIO_STAGING_BYTES``
    does a load), and leaves nothing behind."""
    monkeypatch.setenv("ZEROIO_READ_AHEAD_BYTES", "1e6")
    with pytest.raises(OutputError, match="ZEROIO_READ_AHEAD_BYTES='1e6' is not a byte count"):
        zeroio.convert(GPT2, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []
    with zeroio.open(GPT2) as ckpt, pytest.raises(ValueError, match="ZEROIO_READ_AHEAD_BYTES='1e6'"):
        ckpt.state_dict()


def test_no_byte_of_a_long_piece_is_read_twice_when_its_read_comes_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows of 4 KiB (``ZEROIO_READ_AHEAD_BYTES=8KiB`` over 2 files), 4 IO threads, each long read (over 1 KiB)
    held until three more reads were made or 50 ms passed, as a thread busy on its tensor's other ranks comes late.
    A window that read past a short piece into a long one was refilled further on (one window a record) before the
    long piece's own read came, which read those bytes again (a 1.3B bf16 conversion on 8 ranks: 1.35 GB more than
    its 5.25 GB). Each byte of a long piece is read once (a short piece whose window was refilled before its read
    came may be read again: a few bytes), and the tensors are those read with the default windows."""
    expected = _read_gpt2("fp32", tmp_path / "default")
    long = _long_pieces(1024)
    assert {name: len(spans) for name, spans in long.items()} == {
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 7 for r in range(2)
    }
    monkeypatch.setenv("ZEROIO_READ_AHEAD_BYTES", "8KiB")
    ranges: dict[str, list[tuple[int, int]]] = {}
    made = [0]
    real = os.preadv

    def late(fd: int, buffers: list[memoryview], offset: int) -> int:
        if sum(len(b) for b in buffers) > 1024:
            seen, deadline = made[0], time.monotonic() + 0.05
            while made[0] < seen + 3 and time.monotonic() < deadline:
                time.sleep(0.001)
        got = real(fd, buffers, offset)
        ranges.setdefault(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), []).append((offset, offset + got))
        made[0] += 1
        return got

    monkeypatch.setattr(os, "preadv", late)
    for dtype in (None, "bf16"):
        ranges.clear()
        out = tmp_path / f"late-{dtype}"
        zeroio.convert(GPT2, out, dtype=dtype, workers=4, progress=False)  # type: ignore[arg-type]
        twice = {name: _read_twice(_within(ranges[name], spans)) for name, spans in long.items()}
        assert twice == dict.fromkeys(long, 0), dtype
        if dtype is None:
            assert_state_dicts_equal(load_file(out / "model.safetensors"), expected)


def _long_pieces(longer_than: int) -> dict[str, list[tuple[int, int]]]:
    """GPT2's pieces longer than ``longer_than`` bytes, as ``(start, end)`` file offsets by rank file name."""
    pieces: dict[str, list[tuple[int, int]]] = {}
    with zeroio.open(GPT2) as ckpt:
        for name in {ckpt.source_name(name) for name in ckpt.infos}:
            for source, offset, nbytes in ckpt.byte_ranges(name) or ():  # type: ignore[attr-defined]
                if nbytes > longer_than:
                    pieces.setdefault(os.path.basename(source.name), []).append((offset, offset + nbytes))
    return pieces


def _within(reads: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``reads`` inside ``spans``."""
    parts = [(max(lo, a), min(hi, b)) for lo, hi in reads for a, b in spans]
    return [(lo, hi) for lo, hi in parts if lo < hi]
