"""``zeroio.reshard``: a ZeRO-3 checkpoint rewritten for another world size, which DeepSpeed itself resumes.

Fast tests compare the written files with DeepSpeed's own checkpoints (unpickled by DeepSpeed's classes);
the slow test resumes training with DeepSpeed at the new world size.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES, fixture_names

import zeroio
from zeroio import ReshardResult, convert, errors, reshard
from zeroio._formats.partition import zero3_partition_numel, zero3_sub_groups
from zeroio.cli import main

ZERO3 = fixture_names(stage=3)
ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- sub-group arithmetic


@pytest.mark.parametrize(
    "numels, world_size, sub_group_size, expected",
    [
        pytest.param([91, 35, 35], 2, 10**9, [[0, 1, 2]], id="fits-one-sub-group"),
        pytest.param([91, 35, 35], 2, 50, [[0, 1], [2]], id="closed-once-it-reaches-the-size"),
        pytest.param([91, 35, 35], 3, 20, [[0], [1, 2]], id="partitions-at-ws3"),
        pytest.param([91, 35, 35], 1, 40, [[0], [1, 2]], id="ws1"),
        pytest.param([91, 35, 35], 8, 12, [[0], [1, 2]], id="ws8"),
        pytest.param([5, 7, 7], 2, 0, [[0], [1], [2]], id="size-0-one-each"),
        pytest.param([5, 7, 7], 2, 11, [[0, 1, 2]], id="equal-total-is-one"),
        pytest.param([], 4, 10, [[]], id="empty-group"),
        pytest.param([0, 3], 2, 1, [[0, 1]], id="empty-param"),
    ],
)
def test_zero3_sub_groups(numels: list[int], world_size: int, sub_group_size: int, expected: list[list[int]]) -> None:
    """Sub-groups follow DeepSpeed 0.19.8's _create_fp16_sub_groups over ceil(numel / world_size) partitions."""
    assert zero3_sub_groups(numels, world_size, sub_group_size) == expected


# --------------------------------------------------------------------------- the files DeepSpeed reads


def _load(path: Path) -> Any:
    """A rank file as DeepSpeed loads it (its own classes resolved by the unpickler)."""
    return torch.load(path, weights_only=False, map_location="cpu")


def _structure(obj: Any) -> Any:
    """Types, keys, shapes and dtypes of a tree; plain values as they are."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return (type(obj).__name__, [(k, _structure(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return (type(obj).__name__, [_structure(v) for v in obj])
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (f"{type(obj).__module__}.{type(obj).__qualname__}", _structure(vars(obj)))
    return (type(obj).__name__, obj)


def _rank_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*_states.pt"))


@pytest.mark.parametrize(
    "src, world_size, genuine",
    [
        ("z3_ws2_fp32", 3, "z3_ws3_fp32"),
        ("z3_ws2_fp32", 1, "z3_ws1_fp32"),
        ("z3_ws2_fp32", 4, "z3_ws4_fp32"),
        ("z3_ws4_fp32", 2, "z3_ws2_fp32"),
        ("z3_ws2_bf16", 3, "z3_ws3_bf16"),
    ],
)
def test_files_have_the_structure_deepspeed_writes_at_that_world_size(
    tmp_path: Path, src: str, world_size: int, genuine: str
) -> None:
    """Every rank file has DeepSpeed's own keys, types (its LossScaler, ZeroStageEnum), shapes and dtypes."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    result = reshard(FIXTURES / src, tmp_path / "out", world_size=world_size)
    ours = _rank_files(tmp_path / "out" / "global_step2")
    theirs = _rank_files(FIXTURES / genuine / "global_step2")
    assert [p.name for p in ours] == [p.name for p in theirs]
    assert sorted(result.files) == ours and result.world_size == world_size
    assert (tmp_path / "out" / "latest").read_text() == "global_step2"
    samples = _load(FIXTURES / src / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")["global_samples"]
    for mine, genuine_file in zip(ours, theirs):
        a, b = _load(mine), _load(genuine_file)
        if "model_states" in mine.name:  # samples seen so far: the source run's count, not the genuine run's
            assert a.pop("global_samples") == samples
            b.pop("global_samples")
        assert _structure(a) == _structure(b), mine.name
        if "optim_states" in mine.name:
            assert type(a["optimizer_state_dict"]["loss_scaler"]) is LossScaler
            assert a["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.weights
            assert a["optimizer_state_dict"]["partition_count"] == world_size
        else:
            assert a["dp_world_size"] == world_size


def _valid(numels: list[int], world_size: int, rank: int) -> torch.Tensor:
    """Which elements of rank ``rank``'s concatenated ZeRO-3 partitions are data (False: padding)."""
    parts = []
    for numel in numels:
        part = zero3_partition_numel(numel, world_size)
        count = max(0, min(part, numel - rank * part))
        parts.append(torch.cat([torch.ones(count, dtype=torch.bool), torch.zeros(part - count, dtype=torch.bool)]))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def _assert_same_except_padding(a: Any, b: Any, where: str, masks: dict[str, torch.Tensor]) -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        mask = masks.get(where)
        if mask is None:
            assert torch.equal(a, b), where
        else:  # DeepSpeed leaves padding arbitrary (even NaN); zeroio writes zeros
            assert torch.equal(a[mask], b[mask]) and not a[~mask].any(), where
    elif isinstance(b, dict):
        assert list(a) == list(b), where
        for key in b:
            _assert_same_except_padding(a[key], b[key], f"{where}.{key}", masks)
    elif isinstance(b, (list, tuple)) and not isinstance(b, torch.Size):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_except_padding(x, y, f"{where}.{i}", masks)
    elif hasattr(b, "__dict__") and not isinstance(b, type):
        assert type(a) is type(b), where
        _assert_same_except_padding(vars(a), vars(b), where, masks)
    else:
        assert a == b, where


@pytest.mark.parametrize("name", ["z3_ws3_fp32", "z3_ws4_fp32", "z3_ws2_fp16", "z3_ws3_bf16"])
def test_same_world_size_rewrites_deepspeeds_partitions(tmp_path: Path, name: str) -> None:
    """At the source's world size every tensor and value equals DeepSpeed's own file (padding aside)."""
    src = FIXTURES / name / "global_step2"
    world_size = len(list(src.glob("*_optim_states.pt")))
    reshard(FIXTURES / name, tmp_path / "out", world_size=world_size)
    for rank in range(world_size):
        model = _load(src / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        groups = [[s.numel() for s in g.values()] for g in model["param_shapes"]]
        masks = {f"model.frozen_param_fragments.{n}": _valid([s.numel()], world_size, rank)
                 for n, s in model["frozen_param_shapes"].items()}  # fmt: skip
        for s, numels in enumerate(groups):
            masks[f"optim.optimizer_state_dict.fp32_flat_groups.{s}"] = _valid(numels, world_size, rank)
            for key in ("exp_avg", "exp_avg_sq"):
                masks[f"optim.optimizer_state_dict.optimizer_state_dict.state.{s}.{key}"] = _valid(
                    numels, world_size, rank
                )
        for kind in ("model", "optim"):
            (theirs,) = src.glob(f"*zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")
            ours = tmp_path / "out" / "global_step2" / theirs.name
            _assert_same_except_padding(_load(ours), _load(theirs), kind, masks)


@pytest.mark.parametrize("name", ZERO3)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_round_trip_keeps_weights_and_optimizer_state(tmp_path: Path, name: str, world_size: int) -> None:
    """zeroio reads back, from any world size, the source's tensors and optimizer state bit for bit."""
    reshard(FIXTURES / name, tmp_path / "out", world_size=world_size)
    with zeroio.open(FIXTURES / name) as src, zeroio.open(tmp_path / "out") as out:
        assert out.metadata.world_size == world_size and out.metadata.zero_stage == 3
        assert out.metadata.global_step == src.metadata.global_step
        assert out.tied == src.tied and out.infos.keys() == src.infos.keys()
        a, b = src.state_dict(), out.state_dict()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            assert out.info(key).kind == src.info(key).kind
        for param, info in src.infos.items():
            if info.kind == "trainable":
                x, y = src.optimizer_state(param), out.optimizer_state(param)
                assert list(x) == list(y)
                for key in x:
                    assert torch.equal(x[key], y[key]) if isinstance(x[key], torch.Tensor) else x[key] == y[key]


def test_rank_files_are_valid_zip_archives(tmp_path: Path) -> None:
    """Each record's CRC-32 is set after its bytes are streamed in: zipfile's testzip passes."""
    result = reshard(FIXTURES / "z3_ws2_fp16", tmp_path / "out", world_size=3)
    for path in result.files:
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None, path


def test_sub_group_size_splits_flat_groups_as_deepspeed(tmp_path: Path) -> None:
    """sub_group_size=20 at world size 3: three fp32 flat groups and state entries; the state reads back."""
    reshard(FIXTURES / "z3_ws2_fp32", tmp_path / "sub", world_size=3, sub_group_size=20)
    osd = _load(tmp_path / "sub" / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    # emb.weight 31 (>= 20), mlp_in.weight + mlp_out.weight 12 + 12; the no-decay group's 2 + 3 + 3 fit in one.
    assert [t.numel() for t in osd["fp32_flat_groups"]] == [31, 24, 8]
    assert [g["params"] for g in osd["optimizer_state_dict"]["param_groups"]] == [[0, 1], [2]]
    assert sorted(osd["optimizer_state_dict"]["state"]) == [0, 1, 2]
    model = _load(tmp_path / "sub" / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert [list(g) for g in model["param_shapes"]] == [
        ["emb.weight"],
        ["mlp_in.weight", "mlp_out.weight"],
        ["mlp_in.bias", "norm.weight", "norm.bias"],
    ]
    # A sub-grouped source reshards back to the default single flat group per param group.
    reshard(tmp_path / "sub", tmp_path / "back", world_size=2)
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as src, zeroio.open(tmp_path / "back") as back:
        a, b = src.state_dict(), back.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert torch.equal(src.optimizer_state("mlp_out.weight")["exp_avg_sq"],
                           back.optimizer_state("mlp_out.weight")["exp_avg_sq"])  # fmt: skip


def test_tiny_chunks_write_the_same_tensors(tmp_path: Path) -> None:
    """Streaming in 12-byte chunks (reads across pieces, padding and records) writes the same tensors."""
    reshard(FIXTURES / "z3_ws3_bf16", tmp_path / "big", world_size=2)
    reshard(FIXTURES / "z3_ws3_bf16", tmp_path / "tiny", world_size=2, chunk_bytes=12)
    for path in _rank_files(tmp_path / "big" / "global_step2"):
        _assert_same_except_padding(_load(tmp_path / "tiny" / "global_step2" / path.name), _load(path), "", {})


def test_read_ahead_over_a_few_ranks_writes_the_same_bytes(tmp_path: Path) -> None:
    """Blocks and windows made once for several consecutive ranks (3 of 7 here, a chunk of 3 ranks' bytes) and for
    all of them (a big chunk) write the files that reading each rank's part alone (a chunk under one rank's) writes."""
    whole = reshard(FIXTURES / "z3_ws3_fp32", tmp_path / "all", world_size=7)
    per_rank = whole.total_size // 7
    reshard(FIXTURES / "z3_ws3_fp32", tmp_path / "three", world_size=7, chunk_bytes=3 * per_rank + 4)
    reshard(FIXTURES / "z3_ws3_fp32", tmp_path / "one", world_size=7, chunk_bytes=per_rank // 2)
    for path in whole.files:
        name = path.relative_to(tmp_path / "all")
        assert (tmp_path / "three" / name).read_bytes() == path.read_bytes(), name
        assert (tmp_path / "one" / name).read_bytes() == path.read_bytes(), name


@pytest.mark.parametrize("name", ["z3_ws2_bf16", "z3_ws3_fp32"])
def test_files_written_from_a_pickle_template_equal_those_pickled_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Rank files after the first of their kind replay its pickle (zeroio/_pickles/pickle_template.py): every file,
    frozen fragments and buffers included, is byte for byte the one torch.save writes pickling its own tree."""
    templated = reshard(FIXTURES / name, tmp_path / "templated", world_size=5)
    monkeypatch.setenv("ZEROIO_NO_PICKLE_TEMPLATES", "1")
    afresh = reshard(FIXTURES / name, tmp_path / "afresh", world_size=5)
    assert [p.relative_to(tmp_path / "afresh") for p in afresh.files] == [
        p.relative_to(tmp_path / "templated") for p in templated.files
    ]
    for a, b in zip(templated.files, afresh.files):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_torch_save_writes_the_first_file_of_each_kind_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The later files of a kind are written from the first one's archive (zeroio/_pickles/archive_layout.py), not
    by torch.save (10 calls for 5 ranks before): rank 0's model states, the other ranks' and the optimizer states';
    the files are byte for byte torch.save's (the test above)."""
    calls: list[object] = []
    save = torch.save

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(args[1])
        save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", counting)
    result = reshard(FIXTURES / "z3_ws2_bf16", tmp_path / "out", world_size=5)
    assert len(result.files) == 10 and len(calls) == 3


def test_output_tag_and_progress(tmp_path: Path) -> None:
    """output_tag names the tag folder and `latest`; a progress callback sees every byte."""
    seen: list[tuple[int, int]] = []
    result = reshard(FIXTURES / "z3_ws2_fp32", tmp_path / "out", world_size=2, output_tag="resharded",
                     progress=lambda done, total: seen.append((done, total)))  # fmt: skip
    assert (tmp_path / "out" / "latest").read_text() == "resharded"
    assert result.tag == "resharded" and result.path == tmp_path / "out" and result.source_world_size == 2
    assert seen[0] == (0, result.total_size) and seen[-1] == (result.total_size, result.total_size)


# --------------------------------------------------------------------------- what it refuses


def test_zero2_source_is_unsupported(tmp_path: Path) -> None:
    """A ZeRO-1/2 source is refused before anything is written."""
    with pytest.raises(errors.UnsupportedCheckpointError) as info:
        reshard(FIXTURES / "z2_ws2_fp32", tmp_path / "out", world_size=3)
    assert str(info.value) == (
        f"'{FIXTURES / 'z2_ws2_fp32' / 'global_step2'}' is ZeRO stage 2; zeroio reshards ZeRO-3 checkpoints only "
        "(yet). For ZeRO-1/2, write a universal checkpoint, which DeepSpeed resumes at any world size: `zeroio "
        f"convert {FIXTURES / 'z2_ws2_fp32'} {tmp_path / 'out'} --format universal`, then load it with "
        '"checkpoint": {"load_universal": true}.'
    )
    assert not (tmp_path / "out").exists()


def test_consolidated_source_is_unsupported(tmp_path: Path) -> None:
    """A consolidated safetensors file has no partitions or optimizer state to reshard."""
    convert(FIXTURES / "z3_ws2_fp32", tmp_path / "plain", progress=False)
    with pytest.raises(errors.UnsupportedCheckpointError, match="is a consolidated safetensors file; zeroio reshards"):
        reshard(tmp_path / "plain", tmp_path / "out", world_size=3)
    assert not (tmp_path / "out").exists()


def test_source_without_optimizer_state_is_refused(tmp_path: Path) -> None:
    """Stripped moments: a clear error before anything is written (the weights still read)."""
    src = tmp_path / "stripped"
    import shutil

    shutil.copytree(FIXTURES / "z3_ws2_fp32", src)
    for path in (src / "global_step2").glob("*_optim_states.pt"):
        tree = _load(path)
        del tree["optimizer_state_dict"]["optimizer_state_dict"]
        torch.save(tree, path)
    with pytest.raises(errors.CheckpointFormatError) as info:
        reshard(src, tmp_path / "out", world_size=3)
    assert str(info.value) == (
        f"'{src / 'global_step2' / 'zero_pp_rank_0_mp_rank_00_optim_states.pt'}' holds no optimizer moments (its base "
        "optimizer state is missing): it was stripped, or saved before the optimizer's first step, so reshard() "
        "cannot proceed. The weights can still be read (zeroio.open, zeroio.convert without include_optimizer)."
    )
    assert not (tmp_path / "out").exists()
    with zeroio.open(src) as ckpt:
        assert ckpt["emb.weight"].shape == (13, 7)


def test_checkpoint_without_frozen_parameters_reshards_without_them(tmp_path: Path) -> None:
    """Saved with exclude_frozen_parameters (simulated as DeepSpeed 0.19.8 writes it): resharded as it is."""
    src = tmp_path / "no_frozen"
    import shutil

    shutil.copytree(FIXTURES / "z3_ws2_fp32", src)
    for path in (src / "global_step2").glob("*_model_states.pt"):
        tree = _load(path)  # engine._save_checkpoint: no frozen shapes/fragments, module without frozen params
        tree["frozen_param_shapes"] = tree["frozen_param_fragments"] = None
        tree["module"] = type(tree["module"])((k, v) for k, v in tree["module"].items() if not k.startswith("frozen"))
        torch.save(tree, path)
    reshard(src, tmp_path / "out", world_size=3)
    model = _load(tmp_path / "out" / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    assert model["frozen_param_shapes"] is None and model["frozen_param_fragments"] is None
    with zeroio.open(src) as a, zeroio.open(tmp_path / "out") as b:
        assert list(a) == list(b) and "frozen.weight" not in b
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_existing_destination_and_bad_arguments(tmp_path: Path) -> None:
    """An existing dst is refused (overwrite replaces it); world_size must be a positive int."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "latest").write_text("global_step1")  # an earlier output (an empty folder would be used)
    with pytest.raises(errors.OutputError) as info:
        reshard(FIXTURES / "z3_ws2_fp32", tmp_path / "out", world_size=3)
    assert str(info.value) == (
        f"Output folder '{tmp_path / 'out'}' already exists. Pass overwrite=True (--overwrite) to replace it, or "
        "choose another destination."
    )
    assert reshard(FIXTURES / "z3_ws2_fp32", tmp_path / "out", world_size=3, overwrite=True).world_size == 3
    with pytest.raises(ValueError) as bad:
        reshard(FIXTURES / "z3_ws2_fp32", tmp_path / "x", world_size=0)
    assert str(bad.value) == "world_size must be a positive int, got 0."
    with pytest.raises(TypeError) as wrong:
        reshard(FIXTURES / "z3_ws2_fp32", tmp_path / "x", world_size=True)  # type: ignore[arg-type]
    assert str(wrong.value) == "world_size must be a positive int, got True."


# --------------------------------------------------------------------------- CLI


def test_cli_reshard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`zeroio reshard SRC DST --world-size M` writes the checkpoint and says so; errors exit 1 with one line."""
    assert main(["reshard", str(FIXTURES / "z3_ws2_fp32"), str(tmp_path / "out"), "--world-size", "3"]) == 0
    result = capsys.readouterr()
    assert result.out == (
        f"Wrote a ZeRO-3 checkpoint for world size 3 (from 2) to {tmp_path / 'out'}/global_step2: 6 files, 2.64 KB\n"
    )
    assert main(["reshard", str(FIXTURES / "z2_ws2_fp32"), str(tmp_path / "z2"), "--world-size", "3"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("Unsupported checkpoint: ") and "zeroio reshards ZeRO-3 checkpoints only" in err[0]
    assert main(["reshard", str(FIXTURES / "z3_ws2_fp32"), str(tmp_path / "q"), "--world-size", "1", "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert (tmp_path / "q" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()


# --------------------------------------------------------------------------- DeepSpeed resumes


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports nobody listens on now (bound together, so none is handed out twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def _start(world_size: int, loads: dict[str, Path], out: Path, port: int) -> subprocess.Popen[bytes]:
    """Start tests/reshard_worker.py at ``world_size`` CPU ranks (gloo) under torchrun; log to out.log.

    Jobs at different world sizes run side by side: each spends most of its time importing DeepSpeed. torchrun
    starts the same ranks as DeepSpeed's launcher (RANK, WORLD_SIZE, MASTER_ADDR/PORT for deepspeed.init_distributed)
    ~8 s sooner: DeepSpeed's runner and its launch.py each import DeepSpeed before the ranks do."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world_size),
        "--master_addr", "127.0.0.1", "--master_port", str(port),
        str(ROOT / "tests" / "reshard_worker.py"), "--out", str(out), *(f"{k}={v}" for k, v in loads.items()),
    ]  # fmt: skip
    with open(out.with_suffix(".log"), "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _finish(proc: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    """Wait for a job of :func:`_start` and return what its rank 0 saved."""
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.with_suffix(".log").read_text(errors="replace")[-6000:]
    return torch.load(out, weights_only=True)


def _reference_step(src: Path, world_size: int) -> dict[str, torch.Tensor]:
    """One uninterrupted AdamW step at ``world_size`` ranks from the consolidated state, in plain torch.

    The global batch is every rank's micro-batch; DeepSpeed averages the ranks' gradients, clips their global
    norm to its default ``gradient_clipping`` of 1.0 (coefficient ``1 / ((norm + 1e-6) / 1.0)``), then steps.
    """
    sys.path.insert(0, str(ROOT / "tests"))
    import reshard_worker as worker

    gen = worker.load_generate()
    torch.manual_seed(1234)
    model = gen._build_model(gen.FIXTURES[worker.FIXTURE])
    with zeroio.open(src) as ckpt:
        model.load_state_dict(ckpt.state_dict(), strict=False)  # `scratch` is not persistent
        states = {n: ckpt.optimizer_state(n) for n, i in ckpt.infos.items() if i.kind == "trainable"}
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in gen._param_groups(model):
        hyper = states[names[id(group["params"][0])]]
        groups.append({"params": group["params"], **{k: hyper[k] for k in ("lr", "betas", "eps", "weight_decay")}})
    optimizer = torch.optim.AdamW(groups, foreach=False)
    for group in groups:
        for p in group["params"]:
            state = states[names[id(p)]]
            optimizer.state[p] = {k: state[k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
    loss = sum(worker.loss_fn(model(worker.batch(r)), worker.batch(r)) for r in range(world_size)) / world_size
    loss.backward()
    params = [p for g in groups for p in g["params"]]
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        for p in params:
            p.grad.mul_(1.0 / torch.clamp((norm + 1e-6) / 1.0, min=1.0))
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# fp32 after one step: the all-reduce sums the ranks' gradients in another order than the reference does, and the
# clip coefficient is computed as 1/((n + 1e-6)/c) rather than torch's c/(n + 1e-6): a few float32 ulps of the
# gradient, which Adam's m/sqrt(v) passes on to an update of lr = 0.05. Measured: bit for bit at one rank, at
# most 1.2e-7 (one float32 ulp of a weight near 1) at three ranks.
ATOL = 1e-6


@pytest.mark.slow
def test_deepspeed_resumes_resharded_checkpoint(tmp_path: Path) -> None:
    """DeepSpeed loads the checkpoint resharded from 2 to 3 and to 1 ranks and trains on as if uninterrupted."""
    # The source: fixtures/z3_ws2_fp32, trained by DeepSpeed at 2 ranks for 2 steps (fixtures/generate.py).
    src = FIXTURES / "z3_ws2_fp32"
    with zeroio.open(src) as ckpt:
        consolidated = ckpt.state_dict()
        tied = ckpt.tied
        trainable = [n for n, i in ckpt.infos.items() if i.kind == "trainable" and n not in ckpt.tied]
        moments = {n: ckpt.optimizer_state(n) for n in trainable}
    for n in (3, 1):
        reshard(src, tmp_path / f"ws{n}", world_size=n)
    reshard(src, tmp_path / "ws1_sub", world_size=1, sub_group_size=40)
    # DeepSpeed's own route to another world size: its universal checkpoint.
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src / "global_step2"),
         "--output_folder", str(tmp_path / "universal" / "global_step2_universal"), "--num_extract_workers", "1",
         "--num_merge_workers", "1"],
        env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip

    ports = _free_ports(2)
    jobs = {
        3: _start(3, {"zeroio": tmp_path / "ws3", "universal": tmp_path / "universal"}, tmp_path / "ws3.pt", ports[0]),
        1: _start(
            1,
            {
                "zeroio": tmp_path / "ws1",
                "zeroio_subgroups40": tmp_path / "ws1_sub",
                "universal": tmp_path / "universal",
            },
            tmp_path / "ws1.pt",
            ports[1],
        ),
    }
    try:
        runs = {n: _finish(job, tmp_path / f"ws{n}.pt") for n, job in jobs.items()}
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
    for world_size, run in runs.items():
        assert run["world_size"] == world_size
        reference = _reference_step(src, world_size)
        for name in [k for k in run if k.startswith("zeroio")]:
            loaded, stepped = run[name]["loaded"], run[name]["stepped"]
            # 1. What DeepSpeed loaded is the checkpoint: fp32 masters, frozen params, buffers, moments, step count.
            assert loaded["global_steps"] == 2 and stepped["global_steps"] == 3
            for key, want in consolidated.items():
                if key in loaded["weights"]:
                    assert torch.equal(loaded["weights"][key], want), (world_size, name, key)
            # named_parameters() lists a tie once; `scratch` is a non-persistent buffer (not in any checkpoint).
            assert sorted(loaded["weights"]) == sorted({*consolidated, "scratch"} - set(tied))
            for param in trainable:
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(loaded[key][param], moments[param][key]), (world_size, name, param, key)
            # 2. One more step equals the uninterrupted step from the consolidated state.
            for param, want in reference.items():
                torch.testing.assert_close(stepped["weights"][param], want, rtol=0, atol=ATOL)
        # 3. Against DeepSpeed's universal-checkpoint route: the decay group's weights are bit for bit the same;
        #    DeepSpeed 0.19.8's ZeRO-3 universal loader copies param group 0's hyper-parameters into every group
        #    (weight_decay 0.1 on the no-decay group) and restores no buffers: it still gets those wrong.
        ours, theirs = run["zeroio"]["stepped"], run["universal"]["stepped"]
        for param in ("emb.weight", "mlp_in.weight", "mlp_out.weight"):
            assert torch.equal(ours["weights"][param], theirs["weights"][param]), (world_size, param)
        for param in ("mlp_in.bias", "norm.weight", "norm.bias"):
            assert not torch.equal(ours["weights"][param], theirs["weights"][param]), (world_size, param)
        assert int(run["universal"]["loaded"]["weights"]["calls"]) == 0
        assert int(run["zeroio"]["loaded"]["weights"]["calls"]) == 2


def test_resharded_result_type() -> None:
    """ReshardResult is a frozen value object."""
    result = ReshardResult(Path("x"), "t", 2, (), 0, 1)
    with pytest.raises(AttributeError):
        result.tag = "u"  # type: ignore[misc]
