"""Fourth red team: the read paths added last (read-ahead windows, CRC checks shared by processes, Megatron's
chained optimizer keys, pickle templates). Each case derives a hostile or damaged input from a committed fixture
at test time and expects a typed zeroio error naming the file, within seconds."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import shutil
from pathlib import Path

import pytest
from fixture_data import FIXTURES

import zeroio
from zeroio.errors import CheckpointFormatError

ZERO2 = "z2_ws2_fp32"
"""ZeRO-2, 2 ranks: emb.weight opens rank 0's first fp32 flat group (82 elements, 328 bytes)."""


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


def _flat_group_of(ckpt_path: Path, name: str) -> tuple[Path, int, int]:
    """(rank file, data offset, bytes) of the flat-group record holding ``name``'s first piece."""
    with zeroio.open(ckpt_path) as ckpt:
        plan = ckpt.read_plan(name)  # type: ignore[attr-defined]
        piece = next(iter(plan.pieces))
        ref = plan.groups[piece.rank][piece.group]
        return ref.file.path, ref.file.data_offset(ref.storage.key), ref.numel * ref.dtype.itemsize


BIG = 1_100_000
"""Elements of the parameter appended to z3_ws1_fp32's first param group: its flat group (4.4 MB) outgrows a
read-ahead window (at most 4 MiB), so a window holds only its start."""


def _big_flat_group(where: Path) -> Path:
    """z3_ws1_fp32 with ``big.weight`` (:data:`BIG` elements, values 0, 1, ...) appended to param group 0, as
    DeepSpeed would record it: in ``param_shapes`` and at the end of the fp32 flat group."""
    import torch

    root = where / "big"
    shutil.copytree(FIXTURES / "z3_ws1_fp32", root, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    states = root / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    tree = torch.load(states, weights_only=False)  # the committed fixture's own files
    tree["param_shapes"][0]["big.weight"] = torch.Size([BIG])
    torch.save(tree, states)
    optim = root / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    tree = torch.load(optim, weights_only=False)
    groups = tree["optimizer_state_dict"]["fp32_flat_groups"]
    groups[0] = torch.cat([groups[0], torch.arange(BIG, dtype=groups[0].dtype)])
    torch.save(tree, optim)
    return root


# ----------------------------------------------------------------- read-ahead windows


def test_a_window_read_after_its_record_failed_raises(tmp_path: Path) -> None:
    """A window holds the first 4 MiB of a 4.4 MB flat group and serves emb.weight's first chunk; the record's last
    byte is flipped. Once the record fails its check (finish_crc_checks reads the rest), every later read of it
    raises, as a read without windows does: before, the window went on serving its bytes without a word."""
    src = _big_flat_group(tmp_path)
    path, start, size = _flat_group_of(src, "big.weight")
    _flip(path, start + size - 1)
    with zeroio.open(src) as ckpt, ckpt.reading_in_order():
        next(ckpt.iter_chunks("emb.weight", chunk_bytes=8))  # from the window at the record's start
        with pytest.raises(CheckpointFormatError, match="fails its CRC-32 check"):
            ckpt.finish_crc_checks()
        with pytest.raises(CheckpointFormatError, match="fails its CRC-32 check"):
            next(ckpt.iter_chunks("emb.weight", chunk_bytes=8))
    with zeroio.open(src, verify_crc=False) as ckpt:  # the flip is where the test put it
        assert ckpt.get_tensor("big.weight")[-1].item() != BIG - 1


# ----------------------------------------------------------------- CRC checks shared between processes


def _a_record(src: Path) -> tuple[str, str, int, int, int]:
    """(file, record name, start, size, stored CRC) of a record a read of mlp_in.weight reads in part."""
    with zeroio.open(src) as ckpt:
        ckpt.get_tensor("mlp_in.weight")  # rank 1's flat group, in part
        for file in ckpt.checked_files():
            for name, start, size, crc, _ in file.partial_records():
                return file.name, name, start, size, crc
    raise AssertionError("no record read in part")


@pytest.mark.parametrize(
    "runs",
    [lambda size: [(0, size + 8, 0x12345678)], lambda size: [(-8, size, 0x12345678)], lambda size: [(4, 2, 0)]],
    ids=["past-the-end", "before-the-start", "backwards"],
)
def test_a_peer_run_outside_its_record_is_refused(runs) -> None:  # type: ignore[no-untyped-def]
    """Another process's report of a record (its runs and their CRCs) is folded into this file's check. A run
    reaching past the record's end covered every byte without ever settling, and the check returned silently:
    the record passed with a made-up CRC. Now the report is refused, naming the file."""
    src = FIXTURES / ZERO2
    file_name, name, start, size, crc = _a_record(src)
    with zeroio.open(src) as ckpt:  # nothing read here yet: the report alone would settle the record
        file = next(f for f in ckpt.checked_files() if f.name == file_name)
        with pytest.raises(CheckpointFormatError, match=f"'{file.name}': record '{name}'.*outside its {size} bytes"):
            file.finish_with((name, start, size, crc, runs(size)))


# ----------------------------------------------------------------- Megatron keys


def test_a_megatron_entry_shadowing_a_stacked_layer_is_refused(tmp_path: Path) -> None:
    """A plain ``decoder.layers.0.mlp.router.weight`` entry beside the stacked ``decoder.layers.mlp.router.weight``
    (whose layer 0 has that name): before, whichever came last was returned (here a (1, 2, 8) tensor in place of
    the (2, 8) layer, with the stacked entry's moments); now refused naming the .metadata file."""
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "megatron_optim" / "gpt_moe_ep2_distopt_reshardable", src)
    metadata_file = next(src.glob("iter_*/.metadata"))
    with open(metadata_file, "rb") as fh:
        metadata = pickle.load(fh)  # the fixture's own DCP metadata, written by torch
    stacked, twin = "decoder.layers.mlp.router.weight", "decoder.layers.0.mlp.router.weight"
    metadata.state_dict_metadata[twin] = copy.deepcopy(metadata.state_dict_metadata[stacked])
    for index, stored in list(metadata.storage_data.items()):
        if index.fqn == stacked:  # the twin's chunk: its own copy of the bytes, at the end of the same file
            data_file = metadata_file.parent / stored.relative_path
            data = data_file.read_bytes()
            moved = copy.deepcopy(stored)
            moved.offset = len(data)
            data_file.write_bytes(data + data[stored.offset : stored.offset + stored.length])
            metadata.storage_data[dataclasses.replace(index, fqn=twin)] = moved
    with open(metadata_file, "wb") as fh:
        pickle.dump(metadata, fh)
    with pytest.raises(
        CheckpointFormatError, match=r"\.metadata': .*'decoder\.layers\.0\.mlp\.router\.weight'"
    ) as info:
        zeroio.open(src)
    assert info.value.path == metadata_file
    assert len(str(info.value).splitlines()) == 1
