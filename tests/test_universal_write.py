"""``convert(fmt="universal")``: a DeepSpeed universal checkpoint, file by file what ``ds_to_universal`` writes.

Fast tests compare the output with DeepSpeed's own ``ds_to_universal`` output (``fixtures/universal/``) and read
it back for every ZeRO-1/2/3 fixture; the slow test resumes DeepSpeed engines from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES, assert_state_dicts_equal, fixture_names, reference

import zeroio
from zeroio import errors
from zeroio.cli import main

ROOT = Path(__file__).resolve().parent.parent
ZERO123 = [n for s in (1, 2, 3) for n in fixture_names(stage=s) if not n.startswith("moe")]
UNIVERSAL = {"z1_ws3_bf16": "universal_z1_ws3_bf16", "z3_ws2_fp32": "universal_z3_ws2_fp32"}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every ZeRO-1/2/3 fixture converted once: ``{fixture: output root}``."""
    root = tmp_path_factory.mktemp("universal")
    out = {}
    for name in ZERO123:
        zeroio.convert(FIXTURES / name, root / name, fmt="universal", progress=False)
        out[name] = root / name
    return out


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False, map_location="cpu")


def _files(root: Path) -> list[str]:
    skip = ("expected/", "manifest.json")
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not str(p.relative_to(root)).startswith(skip)
    )


def _assert_same(a: Any, b: Any, where: str) -> None:
    """Same containers, keys in order, types (DeepSpeed's classes), tensor dtypes, shapes and bits."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(b, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for key in b:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(b, (list, tuple)) and not isinstance(b, torch.Size):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}.{i}")
    elif hasattr(b, "__dict__") and not isinstance(b, type):
        assert type(a) is type(b), where
        _assert_same(vars(a), vars(b), where)
    else:
        assert type(a) is type(b) and a == b, where


# --------------------------------------------------------------------------- the files, against ds_to_universal


@pytest.mark.parametrize("src", sorted(UNIVERSAL))
def test_files_equal_ds_to_universal_output(written: dict[str, Path], src: str) -> None:
    """Same file names; model states byte for byte; every tensor, key and DeepSpeed class as ds_to_universal's.

    The one difference: from a ZeRO-3 source, ``zero/optimizer_state.pt`` leaves out rank 0's partitions
    (``fp32_flat_groups`` and the ``exp_avg``/``exp_avg_sq`` of each state entry), which ds_to_universal copies
    from rank 0's optimizer file and DeepSpeed's universal loader never reads (it takes ``state[0]["step"]``,
    ``param_groups`` and the loss-scaler values).
    """
    ours, theirs = written[src], FIXTURES / "universal" / UNIVERSAL[src]
    assert _files(ours) == _files(theirs)
    for rel in _files(theirs):
        a, b = ours / rel, theirs / rel
        if not rel.endswith(".pt") or rel.endswith("_model_states.pt"):
            assert a.read_bytes() == b.read_bytes(), rel
            continue
        mine, genuine = _load(a), _load(b)
        if rel.endswith("optimizer_state.pt") and src.startswith("z3"):
            flats = genuine.pop("fp32_flat_groups")
            assert len(flats) == 2 and "fp32_flat_groups" not in mine
            for entry in genuine["optimizer_state_dict"]["state"].values():
                del entry["exp_avg"], entry["exp_avg_sq"]
            assert mine["param_groups"] is mine["optimizer_state_dict"]["param_groups"]  # one list, as DeepSpeed's
        _assert_same(mine, genuine, rel)


@pytest.mark.parametrize("name", ZERO123)
def test_reads_back_as_the_engine_saved_it(written: dict[str, Path], name: str) -> None:
    """zeroio reads every output back equal to the live engine's tensors, with the source's optimizer state."""
    with zeroio.open(written[name]) as out, zeroio.open(FIXTURES / name) as src:
        assert out.metadata.format == "universal" and out.tied == src.tied
        assert out.metadata.zero_stage == src.metadata.zero_stage
        assert_state_dicts_equal(out.state_dict(), reference(name, "engine") or src.state_dict())
        for param, info in src.infos.items():
            if info.kind == "trainable" and param not in src.tied:
                x, y = src.optimizer_state(param), out.optimizer_state(param)
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(torch.as_tensor(x[key]), torch.as_tensor(y[key])), (param, key)
                assert {k: v for k, v in x.items() if k not in ("exp_avg", "exp_avg_sq", "step")} == {
                    k: v for k, v in y.items() if k not in ("exp_avg", "exp_avg_sq", "step")
                }


def test_tiny_chunks_write_the_same_files(written: dict[str, Path], tmp_path: Path) -> None:
    """Streaming in 12-byte chunks writes the same tensors; the archives' CRC-32s hold."""
    result = zeroio.convert(FIXTURES / "z1_ws3_bf16", tmp_path / "tiny", fmt="universal", chunk_bytes=12,
                            progress=False)  # fmt: skip
    assert result.index_path is None and result.num_tensors == 6 and result.tied == {"head.weight": "emb.weight"}
    for rel in _files(written["z1_ws3_bf16"]):
        if rel.endswith(".pt"):
            with zipfile.ZipFile(tmp_path / "tiny" / rel) as archive:
                assert archive.testzip() is None, rel
            _assert_same(_load(tmp_path / "tiny" / rel), _load(written["z1_ws3_bf16"] / rel), rel)


# --------------------------------------------------------------------------- what it refuses; atomic output


@pytest.mark.parametrize("name", ["moe_z2_ws2_fp32", "moe_z2_ws2_ep2_bf16"])
def test_moe_is_refused(tmp_path: Path, name: str) -> None:
    """Native MoE (expert files) is refused before anything is written (ds_to_universal crashes on ep=2)."""
    with pytest.raises(errors.UnsupportedCheckpointError, match="holds DeepSpeed MoE expert files"):
        zeroio.convert(FIXTURES / name, tmp_path / "out", fmt="universal", progress=False)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []


def test_other_sources_and_arguments_are_refused(written: dict[str, Path], tmp_path: Path) -> None:
    """Stage 0, a universal folder and a consolidated file are refused; dtype/exclude_frozen do not apply."""
    with pytest.raises(errors.UnsupportedCheckpointError) as info:
        zeroio.convert(FIXTURES / "z0_ws2_fp32", tmp_path / "out", fmt="universal", progress=False)
    assert str(info.value) == (
        f"'{FIXTURES / 'z0_ws2_fp32' / 'global_step2'}' is ZeRO stage 0; convert(fmt='universal') needs a DeepSpeed "
        "ZeRO-1/2/3 checkpoint with optimizer state (the folder engine.save_checkpoint() wrote)."
    )
    with pytest.raises(errors.UnsupportedCheckpointError, match="is a universal checkpoint; convert"):
        zeroio.convert(written["z3_ws2_fp32"], tmp_path / "out", fmt="universal", progress=False)
    with pytest.raises(ValueError, match="dtype, exclude_frozen and distributed do not apply"):
        zeroio.convert(FIXTURES / "z3_ws2_fp32", tmp_path / "out", fmt="universal", dtype="bf16", progress=False)
    assert not (tmp_path / "out").exists()


def test_tensor_parallel_rules_are_refused(tmp_path: Path) -> None:
    """A source whose universal_checkpoint_info sets Megatron-style merge rules is refused, not merged plainly."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "z2_ws2_fp32", src)
    model = src / "global_step2" / "mp_rank_00_model_states.pt"
    tree = _load(model)
    tree["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.2,
                                         "vocabulary_parameter_patterns": [r"emb\.weight"]}  # fmt: skip
    torch.save(tree, model)
    with pytest.raises(errors.UnsupportedCheckpointError, match=r"\(vocabulary_parameter_patterns\), which zeroio"):
        zeroio.convert(src, tmp_path / "out", fmt="universal", progress=False)
    assert not (tmp_path / "out").exists()


def test_overwrite_replaces_only_a_universal_output(tmp_path: Path) -> None:
    """An existing output is refused, replaced with overwrite=True; a folder with other files is never replaced."""
    dst = tmp_path / "out"
    zeroio.convert(FIXTURES / "z2_ws2_fp32", dst, fmt="universal", progress=False)
    with pytest.raises(errors.OutputError, match="already exists"):
        zeroio.convert(FIXTURES / "z2_ws2_fp32", dst, fmt="universal", progress=False)
    zeroio.convert(FIXTURES / "z3_ws2_fp32", dst, fmt="universal", overwrite=True, progress=False)
    assert (dst / "global_step2_universal" / "zero_pp_rank_1_mp_rank_00_model_states.pt").is_file()
    assert not (dst / "global_step2_universal" / "mp_rank_00_model_states.pt").exists()
    (dst / "global_step2_universal" / "zero" / "emb.weight" / "notes.txt").write_text("mine")
    with pytest.raises(errors.OutputError) as info:
        zeroio.convert(FIXTURES / "z3_ws2_fp32", dst, fmt="universal", overwrite=True, progress=False)
    assert "global_step2_universal/zero/emb.weight/notes.txt" in str(info.value)
    assert (dst / "global_step2_universal" / "zero" / "emb.weight" / "notes.txt").read_text() == "mine"


def test_corrupted_source_leaves_nothing(tmp_path: Path) -> None:
    """A record that fails its CRC-32 mid-way: the error names the file and no output (or temporary) remains."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "z3_ws2_fp32", src)
    optim = src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(optim) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("data/2"))  # an fp32 flat group
    with open(optim, "r+b") as fh:
        fh.seek(record.header_offset + 26)
        name_len, extra_len = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
        fh.seek(record.header_offset + 30 + name_len + extra_len)
        first = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([first[0] ^ 0x40]))
    with pytest.raises(errors.CheckpointFormatError, match="CRC"):
        zeroio.convert(src, tmp_path / "out", fmt="universal", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_cli_convert_universal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`zeroio convert SRC DST --format universal` writes it and says how to resume."""
    assert main(["convert", str(FIXTURES / "z3_ws2_fp32"), str(tmp_path / "out"), "--format", "universal"]) == 0
    assert capsys.readouterr().out == (
        f"Wrote a DeepSpeed universal checkpoint (6 parameters with optimizer state, 2.16 KB) in 22 files to "
        f'{tmp_path / "out"}; resume it with "checkpoint": {{"load_universal": true}}\n'
    )
    assert (tmp_path / "out" / "latest_universal").read_text() == "global_step2_universal"
    with pytest.raises(SystemExit):
        main(["convert", str(FIXTURES / "z3_ws2_fp32"), str(tmp_path / "x"), "--format", "universal",
              "--push-to-hub", "me/x"])  # fmt: skip


# --------------------------------------------------------------------------- DeepSpeed resumes


@pytest.mark.slow
def test_deepspeed_resumes_from_it(written: dict[str, Path], tmp_path: Path) -> None:
    """DeepSpeed (load_universal) resumes zeroio's output at 2 ranks: from ZeRO-3 at 2 ranks as ZeRO-3, and from
    ZeRO-1 at 3 ranks as ZeRO-2; the loaded fp32 masters and Adam moments equal the source's bit for bit.

    Across ZeRO-1/2 and ZeRO-3 DeepSpeed 0.19.8 cannot load a universal folder (ds_to_universal's or zeroio's,
    the same layout): a ZeRO-3 engine looks for ``zero_pp_rank_0_mp_rank_*_model_states.pt``, which a ZeRO-1/2
    source has not, a ZeRO-1/2 engine for ``mp_rank_*_model_states.pt``, which a ZeRO-3 source has not; both
    fail ``assert len(self.ckpt_list) > 0`` in DeepSpeed's state-dict loader.
    """
    from test_reshard import _free_ports

    out = tmp_path / "ws2.pt"
    loads = {
        "z3same": f"z3_ws2_fp32:3:{written['z3_ws2_fp32']}",
        "z1to2": f"z1_ws3_bf16:2:{written['z1_ws3_bf16']}",
        "z1to3": f"z1_ws3_bf16:3:{written['z1_ws3_bf16']}",
        "z3to1": f"z3_ws2_fp32:1:{written['z3_ws2_fp32']}",
    }
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    cmd = [
        "deepspeed", "--master_port", str(_free_ports(1)[0]), "--num_gpus", "2", "--num_nodes", "1",
        str(ROOT / "tests" / "universal_worker.py"), "--out", str(out), *(f"{k}={v}" for k, v in loads.items()),
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=ROOT / "tests", timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run = torch.load(out, weights_only=True)
    assert run["world_size"] == 2
    for name, src in (("z3same", "z3_ws2_fp32"), ("z1to2", "z1_ws3_bf16")):
        loaded = run[name]
        with zeroio.open(FIXTURES / src) as ckpt:
            trainable = [n for n, i in ckpt.infos.items() if i.kind == "trainable" and n not in ckpt.tied]
            assert sorted(loaded["exp_avg"]) == sorted(trainable)
            for param in trainable:
                assert torch.equal(loaded["weights"][param], ckpt[param]), (name, param)
                state = ckpt.optimizer_state(param)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(loaded[key][param], state[key]), (name, param, key)
        assert loaded["global_steps"] == 2
    assert run["z1to3"] == run["z3to1"] == {"error": "AssertionError: "}
