"""Fourth red team: the read paths added last (read-ahead windows, CRC checks shared by processes, Megatron's
chained optimizer keys, pickle templates). Each case derives a hostile or damaged input from a committed fixture
at test time and expects a typed zeroio error naming the file, within seconds."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES
from hostile_dcp import twin_entry
from hostile_files import Ops, archive, tuple_dag
from hostile_folders import copy_fixture, edit_model_states
from legacy_files import floats, legacy_tensor, stream

import zeroio
from zeroio.cli import main
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
    stacked, twin = "decoder.layers.mlp.router.weight", "decoder.layers.0.mlp.router.weight"
    metadata_file = twin_entry(FIXTURES / "megatron_optim" / "gpt_moe_ep2_distopt_reshardable", src, stacked, twin)
    with pytest.raises(
        CheckpointFormatError, match=r"\.metadata': .*'decoder\.layers\.0\.mlp\.router\.weight'"
    ) as info:
        zeroio.open(src)
    assert info.value.path == metadata_file
    assert len(str(info.value).splitlines()) == 1


# ----------------------------------------------------------------- values a pickle chose, shown or copied


def _dag(depth: int = 40) -> list[Any]:
    """A list holding the level below twice, ``depth`` levels deep: 2**depth paths, a few hundred bytes pickled."""
    found: list[Any] = []
    for _ in range(depth):
        found = [found, found]
    return found


def _inspect(root: Path) -> subprocess.CompletedProcess[str]:
    """``zeroio inspect`` in a subprocess: the old code ran for hours, so the timeout is the regression check."""
    return subprocess.run(
        [sys.executable, "-m", "zeroio", "inspect", str(root)], capture_output=True, text=True, timeout=60, check=False
    )


def _shape_dag(tree: dict[str, Any]) -> None:
    group = tree["param_shapes"][0]
    group[next(iter(group))] = _dag()


def _ds_version_dag(tree: dict[str, Any]) -> None:
    tree["ds_version"] = _dag()


@pytest.mark.parametrize(
    ("fixture", "edit", "pattern", "match"),
    [
        ("z2_ws2_fp32", _shape_dag, "*model_states.pt", "the shape recorded for 'emb.weight' is [[[[...], [...]]"),
        ("z3_ws2_fp32", _ds_version_dag, "zero_pp_rank_0_*model_states.pt", "records ds_version"),
    ],
    ids=["shape-in-message", "provenance-compared"],
)
def test_a_shared_list_value_is_refused_in_seconds(tmp_path: Path, fixture, edit, pattern, match) -> None:  # type: ignore[no-untyped-def]
    """A recorded shape, or a counter every rank's model states must agree on, that is a list holding the level
    below twice, 40 levels deep: its ``repr`` (an error message, the provenance comparison) never ended (depth 24:
    23 s and a megabyte-long message). Now shown bounded, refused in seconds on one line."""
    root = copy_fixture(FIXTURES / fixture, tmp_path / "ckpt")
    edit_model_states(root / "global_step2", edit, pattern=pattern)
    started = time.monotonic()
    result = _inspect(root)
    assert time.monotonic() - started < 30
    assert result.returncode == 1, result.stderr
    first = result.stderr.splitlines()[0]
    assert match in first and len(first) < 600, first


def test_a_step_counter_past_int64_is_not_a_step(tmp_path: Path) -> None:
    """``global_steps`` pickled as 10**5000: ``inspect`` exited 2 with Python's 'Exceeds the limit (4300 digits)'
    as 'Invalid arguments'; now the step is unknown (None) and the checkpoint reads."""
    root = copy_fixture(FIXTURES / ZERO2, tmp_path / "ckpt")

    def edit(tree: dict[str, Any]) -> None:
        tree["global_steps"] = 10**5000

    edit_model_states(root / "global_step2", edit)
    with zeroio.open(root) as ckpt:
        assert ckpt.metadata.global_step is None
    assert main(["inspect", str(root)]) == 0
    assert main(["inspect", "--json", str(root)]) == 0


def test_megatron_param_groups_sharing_values_open_in_bounded_time(tmp_path: Path) -> None:
    """common.pt's optimizer param groups: 1,000 references to one dict of 10 references to one 9,000-int list
    (a 31 KB file). Each group's values were copied with a budget of their own: 35 s and 946 MB at open. Now one
    budget covers every group (and another common.pt's other values)."""
    import torch

    root = tmp_path / "ckpt"
    shutil.copytree(
        FIXTURES / "megatron" / "gpt_tp2_tied", root, ignore=shutil.ignore_patterns("expected", "manifest.json")
    )
    common = root / "iter_0000003" / "common.pt"
    tree = torch.load(common, weights_only=False)  # the committed fixture's own file
    shared = list(range(9000))
    group = {f"k{i}": shared for i in range(10)}
    tree["optimizer"] = {0: {"optimizer": {"param_groups": [group] * 1000, "state": {}}}}
    for i in range(100):
        tree[f"extra{i}"] = shared
    torch.save(tree, common)
    started = time.monotonic()
    tracemalloc.start()
    try:
        with zeroio.open(root) as ckpt:
            common_values = ckpt.metadata.extra["common"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 5 and peak < 64 << 20, (time.monotonic() - started, peak)
    assert common_values["iteration"] == 3  # what comes first is still shown


# ----------------------------------------------------------------- tuples hashed over and over


def _hashed_dag_key(depth: int = 40) -> Ops:
    """A dict whose key is a :func:`tuple_dag` (2**depth tuples to hash); memo slots from 1000 on."""
    return tuple_dag(Ops(), depth).dict().get(1000 + depth).int(1).setitem()


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter (this checkout first): the old code never returned, so the timeout is the
    regression check."""
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("where", ["header", "tree"])
def test_a_legacy_stream_hashing_a_tuple_dag_is_refused(tmp_path: Path, where: str) -> None:
    """A legacy (non-zip) rank file whose sys-info header or object tree keys a dict by a tuple holding the level
    below twice, 40 levels deep: both pickles are walked before they are unpickled."""
    tree = legacy_tensor(Ops().dict().text("w"), (1,), (1,), numel=1, key="0").setitem()
    if where == "tree":
        tree.text("x").raw(_hashed_dag_key().out[2:]).setitem()
    header = None
    if where == "header":
        header = (
            b"".join(pickle.dumps(v, protocol=2) for v in (0x1950A86A20F9469CFC6C, 1001)) + _hashed_dag_key().stop()
        )
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(stream(tree.stop(), ["0"], [(1, floats(1.0))], header=header))
    started = time.monotonic()
    done = _run("import sys; from zeroio._pickles import load_pickle; load_pickle(sys.argv[1], legacy=True)", str(path))
    assert time.monotonic() - started < 30
    assert "CheckpointFormatError" in done.stderr and "tuple hashes" in done.stderr, done.stderr[-2000:]


def test_a_dcp_metadata_hashing_a_tuple_dag_is_refused(tmp_path: Path) -> None:
    """DCP's .metadata, read by its own unpickler: a planner_data dict keyed by a 40-level tuple DAG (spliced into
    the fixture's own metadata, pickled by pickle itself) is refused at open, naming the file."""
    root = copy_fixture(FIXTURES / "dcp" / "dcp_fsdp2_ws2_fp32", tmp_path / "ckpt")
    with open(root / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)  # the fixture's own metadata, written by torch
    placeholder = "zeroio-placeholder-key"
    metadata.planner_data = {placeholder: 1}
    data = pickle.dumps(metadata, protocol=2)
    text = placeholder.encode()
    spliced = tuple_dag(Ops(), 40, first=100_000).get(100_040).out[2:]
    (root / ".metadata").write_bytes(data.replace(b"X" + len(text).to_bytes(4, "little") + text, bytes(spliced), 1))
    result = _inspect(root)
    assert result.returncode == 1, result.stderr
    assert f"'{root / '.metadata'}': its pickle asks for more than" in result.stderr.splitlines()[0]


def test_an_empty_megatron_stacked_entry_of_a_million_layers_stays_one_entry(tmp_path: Path) -> None:
    """A layer-stacked Megatron entry recorded as an empty (10**6, 0) tensor with one chunk: it was un-stacked into
    10**6 layers (13 s at open, a million tensors listed; 10**9 ran out of memory) from a 27 KB .metadata. Now
    un-stacked only where every layer has a chunk: the entry stays one empty tensor."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    root = copy_fixture(FIXTURES / "megatron" / "gpt_tp2_tied", tmp_path / "ckpt")
    metadata_file = next(root.glob("iter_*/.metadata"))
    with open(metadata_file, "rb") as fh:
        metadata = pickle.load(fh)  # the fixture's own DCP metadata, written by torch
    properties = next(iter(metadata.state_dict_metadata.values())).properties
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 0]))
    metadata.state_dict_metadata["decoder.layers.empty.weight"] = TensorStorageMetadata(
        properties=properties, size=torch.Size([10**6, 0]), chunks=[chunk]
    )
    with open(metadata_file, "wb") as fh:
        pickle.dump(metadata, fh)
    started = time.monotonic()
    with zeroio.open(root) as ckpt:
        names = list(ckpt.infos)
        assert ckpt.get_tensor("decoder.layers.empty.weight").shape == (10**6, 0)
    assert time.monotonic() - started < 5
    assert len(names) < 100 and "decoder.layers.empty.weight" in names


# ----------------------------------------------------------------- keys of one hash (hash-collision floods)

_P = 2**61 - 1
"""CPython's int hash is ``n mod _P`` (with the sign): ints differing by multiples of it share a hash."""
_M = 2**64
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
"""The xxHash primes of CPython 3.11's tuple hash."""


def _colliding_ints(n: int) -> list[int]:
    """``n`` distinct ints of one hash (each past 2**61: LONG1 in a pickle)."""
    ints = [_P * (i + 1) + 7 for i in range(n)]
    assert len({hash(k) for k in ints}) == 1
    return ints


def _colliding_pairs(n: int) -> list[tuple[int, int]]:
    """``n`` distinct 2-tuples of ints of one hash: for each first item, the second solved by inverting CPython's
    tuple hash (acc = P5; per item acc = rotl(acc + hash(item) * P2, 31) * P1; then acc += len ^ (P5 ^ 3527539))."""
    target = hash((1, 2)) % _M
    last = pow(_P1, -1, _M) * ((target - (2 ^ (_P5 ^ 3527539))) % _M) % _M
    before = ((last >> 31) | (last << 33)) % _M  # rotr 31
    pairs = []
    for first in range(10, 100_000):
        acc = (_P5 + first * _P2) % _M
        acc = ((acc << 31) | (acc >> 33)) % _M * _P1 % _M
        lane = (before - acc) * pow(_P2, -1, _M) % _M
        second = lane - _M if lane >= 2**63 else lane
        if abs(second) < _P and second != -1:  # an int hashes to itself there
            pairs.append((first, second))
            if len(pairs) == n:
                break
    assert len(set(pairs)) == n and {hash(p) for p in pairs} == {hash((1, 2))}, "the tuple hash inverse is wrong"
    return pairs


def _floods() -> dict[str, Any]:
    keys = _colliding_ints(100)
    return {
        "dict": dict.fromkeys(keys, 0),
        "set": set(keys),
        "frozenset": frozenset(keys),
        "OrderedDict": OrderedDict.fromkeys(keys, 0),
        "dict of pairs": dict.fromkeys(_colliding_pairs(100), 0),
        "set of pairs": set(_colliding_pairs(100)),
        "negative ints": {-k for k in keys},
    }


@pytest.mark.parametrize("protocol", [0, 2, 4])
@pytest.mark.parametrize("kind", list(_floods()))
def test_keys_of_one_hash_are_refused(tmp_path: Path, kind: str, protocol: int) -> None:
    """A dict, set, frozenset or OrderedDict of 100 distinct ints (or 2-tuples of ints) of one hash, pickled by
    pickle itself: 20,000 such keys took 3.7 s to unpickle, quadratic in their count (inside C code). Refused by
    the walk before unpickling, naming the file; the old walk passed them (and the unpickler hashed them all)."""
    path = tmp_path / "flood.pt"
    path.write_bytes(archive(pickle.dumps({"x": _floods()[kind]}, protocol=protocol)))
    with pytest.raises(CheckpointFormatError) as excinfo:
        zeroio.open(path)
    assert str(excinfo.value) == (
        f"'{path}': its pickle puts more than 32 distinct keys of one hash in a dict or set "
        f"({len(zipfile.ZipFile(path).read('archive/data.pkl'))} bytes; ints that differ by multiples of 2**61 - 1, or "
        "tuples built to collide): torch.save never writes one. The file is corrupted or hostile; do not use it."
    )


def test_a_rank_file_of_keys_of_one_hash_is_refused(tmp_path: Path) -> None:
    """A ZeRO checkpoint whose model states (written by torch.save) hold a set and a dict of colliding ints: the
    folder is refused at open, naming the rank file; 32 of them (the most allowed) open."""
    keys = _colliding_ints(33)
    for allowed in (True, False):
        root = copy_fixture(FIXTURES / ZERO2, tmp_path / f"ckpt{allowed}")
        edit = {"flood": set(keys[:32] if allowed else keys), "ids": dict.fromkeys(keys[:32], 1)}
        states = edit_model_states(root / "global_step2", lambda tree: tree.update(edit))  # noqa: B023
        if allowed:
            with zeroio.open(root) as ckpt:
                assert ckpt.infos
            continue
        with pytest.raises(CheckpointFormatError, match="distinct keys of one hash") as excinfo:
            zeroio.open(root)
        assert str(excinfo.value).startswith(f"'{states}': ")


def test_equal_keys_are_not_a_flood(tmp_path: Path) -> None:
    """The same keys put in a dict over and over (each costs one compare: 2**61 + 6 and 7 share a hash, 1.0 equals
    True), and a set of 1,000 ints of distinct hashes, pass the walk; the file opens (as a checkpoint of no
    tensors: what the walk let through is then the format's business)."""
    ops = Ops().dict().text("x").dict().mark()
    for _ in range(100):
        ops.int(_P + 7).int(0).int(7).int(0).raw(b"G" + struct.pack(">d", 1.0)).int(1).raw(b"\x88").int(2)
    ops.raw(b"u").setitem().text("y").glob("builtins.set").mark()
    for i in range(1000):
        ops.int(i * 1_000_003)
    path = tmp_path / "equal.pt"
    path.write_bytes(archive(ops.raw(b"l").tuple(1).reduce().setitem().stop()))
    assert dict(pickle.loads(zipfile.ZipFile(path).read("archive/data.pkl"))["x"]) == {_P + 7: 0, 7: 0, 1.0: 2}
    try:
        zeroio.open(path).close()
    except CheckpointFormatError as exc:
        assert "one hash" not in str(exc), exc


# ----------------------------------------------------------------- counts that no folder holds


_OPEN_BOUNDED = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # the old code asked for terabytes: fail, not swap
import zeroio
start = time.monotonic()
try:
    zeroio.open(sys.argv[1]).close()
    outcome = ["read", ""]
except Exception as exc:
    outcome = [type(exc).__name__, str(exc)]
print(json.dumps([*outcome, time.monotonic() - start]))
"""


def _open_bounded(root: Path) -> tuple[str, str, float]:
    """``zeroio.open(root)`` in a child limited to 3 GB of address space: (error type, message, seconds)."""
    done = _run(_OPEN_BOUNDED, str(root))
    assert done.returncode == 0, done.stderr[-2000:]
    kind, message, seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return kind, message, seconds


def _verl_world(root: Path, world: int) -> None:
    config = json.loads((root / "fsdp_config.json").read_text())
    config["world_size"] = world
    (root / "fsdp_config.json").write_text(json.dumps(config))
    for path in root.glob("*_world_size_2_rank_*.pt"):
        path.rename(path.with_name(path.name.replace("world_size_2_", f"world_size_{world}_")))


def _moe_experts(root: Path, count: int) -> None:
    def edit(tree: dict[str, Any]) -> None:
        tree["num_experts"] = [count] * len(tree["num_experts"])

    edit_model_states(root / "global_step2", edit, pattern="mp_rank_00_model_states.pt")


def _moe_layer_name(root: Path, layer: int) -> None:
    """Expert 1's file renamed to MoE layer ``layer``, its parameters to a module of their own (a layer apart)."""

    def edit(tree: dict[str, Any]) -> None:
        tree["num_experts"] = []  # not recorded: counted from the file names

    edit_model_states(root / "global_step2", edit, pattern="mp_rank_00_model_states.pt")

    def elsewhere(tree: dict[str, Any]) -> None:
        for name in list(tree):
            tree["far." + name.partition(".deepspeed_moe.")[2].join(["deepspeed_moe.", ""])] = tree.pop(name)

    edit_model_states(root / "global_step2", elsewhere, pattern="layer_0_expert_1_*")
    for path in (root / "global_step2").glob("layer_0_expert_1_*"):
        path.rename(path.with_name(path.name.replace("layer_0_", f"layer_{layer}_")))


def _autoep(key: str, value: int) -> Any:
    """An edit of every rank's AutoEP records: ``key`` (and its twin in ``expert_placement``) set to ``value``."""

    def change(root: Path) -> None:
        def edit(tree: dict[str, Any]) -> None:
            for entry in tree["ds_autoep_layers"]:
                entry[key] = value
                if key in entry["expert_placement"]:
                    entry["expert_placement"][key] = value

        edit_model_states(root / "global_step3", edit, pattern="*model_states.pt")

    return change


@pytest.mark.parametrize(
    ("fixture", "change", "error", "match"),
    [
        (
            "verl/verl_fsdp2_ws2_fp32",
            lambda root: _verl_world(root, 10**12),
            "WorldSizeMismatchError",
            r"rank\(s\) \[2, 3",
        ),
        ("moe_z2_ws2_fp32", lambda root: _moe_experts(root, 10**12), "CheckpointNotFoundError", r"expert\(s\) \[2, 3"),
        ("moe_z2_ws2_fp32", lambda root: _moe_layer_name(root, 10**12), "CheckpointNotFoundError", "layer 1 "),
        ("layouts/autoep_z3_ws2_ep2_bf16", _autoep("num_experts", 10**12), "CheckpointFormatError", "num_experts"),
        ("layouts/autoep_z3_ws2_ep2_bf16", _autoep("ep_size", 10**12), "CheckpointFormatError", "ep_size"),
        (
            "layouts/autoep_z3_ws2_ep2_bf16",
            _autoep("expert_data_parallel_world_size", 10**12),
            "CheckpointFormatError",
            "expert_data_parallel_world_size",
        ),
    ],
    ids=["verl-world-size", "moe-num-experts", "moe-layer-in-a-file-name", "autoep-experts", "autoep-ep", "autoep-edp"],
)
def test_a_recorded_count_no_folder_holds_is_refused_at_once(tmp_path: Path, fixture, change, error, match) -> None:  # type: ignore[no-untyped-def]
    """A count a pickle or a file name chose (world size 10**12 in verl's config and file names, 10**12 experts
    recorded by DeepSpeed's MoE or AutoEP, an EP size of 10**12, a MoE layer numbered 10**12): each built a
    list or set of that many entries before anything compared it with the files there (the child ran out of
    its 3 GB or past 60 s). Now the first missing ranks or experts are named, or the count is refused by name."""
    root = copy_fixture(FIXTURES / fixture, tmp_path / "ckpt")
    change(root)
    kind, message, seconds = _open_bounded(root)
    assert (kind, seconds < 10) == (error, True), (kind, message, seconds)
    assert re.search(match, message), message
