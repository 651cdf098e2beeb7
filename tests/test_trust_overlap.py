"""No output overlaps its source (issue 30, item 1): every writer and verb refuses a destination that is the source,
lies inside it or holds it (links resolved), before anything is created or deleted; ``overwrite`` replaces
zeroio's own earlier DCP output."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from fixture_data import FIXTURES

from zeroio import convert, reshard
from zeroio.cli import main
from zeroio.errors import OutputError

_WRITERS: dict[str, Callable[[Path, Path], object]] = {
    "safetensors": lambda s, d: convert(s, d, overwrite=True, progress=False),
    "torch": lambda s, d: convert(s, d, fmt="torch", overwrite=True, progress=False),
    "universal": lambda s, d: convert(s, d, fmt="universal", overwrite=True, progress=False),
    "dcp": lambda s, d: convert(s, d, fmt="dcp", overwrite=True, progress=False),
    "dcp-accelerate": lambda s, d: convert(s, d, fmt="dcp", dcp_layout="accelerate", overwrite=True, progress=False),
    "reshard": lambda s, d: reshard(s, d, world_size=1, overwrite=True, progress=False),
}


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {p.relative_to(folder).as_posix(): None if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def rank_files_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ZeRO-3 checkpoint holding only what DeepSpeed wrote (no zero_to_fp32.py, no expected/): overwrite's rules
    took it for zeroio's own reshard output and deleted it."""
    src = tmp_path_factory.mktemp("overlap") / "ckpt"
    shutil.copytree(FIXTURES / "z3_ws2_fp32", src, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return src


def _message(dst: Path, why: str, src: Path) -> str:
    return (
        f"Refusing to write '{dst}': {why} '{src}', whose files would be replaced or deleted while they are read. "
        "Write to another path."
    )


@pytest.mark.parametrize("writer", sorted(_WRITERS))
def test_output_onto_its_source_is_refused_and_the_source_kept(rank_files_only, tmp_path, writer):
    """dst == src, dst inside src, src inside dst, src named through a link: refused, nothing changed."""
    src = rank_files_only
    link = tmp_path / "link"
    link.symlink_to(src)
    before = _tree(src)
    cases = [
        (src, src, "it is the source"),
        (src, src / "global_step2", "it is inside the source"),
        (src / "global_step2", src, "it holds the source"),
        (link, src, "it is the source"),
        (src, link / "out", "it is inside the source"),
    ]
    for source, dst, why in cases:
        with pytest.raises(OutputError) as info:
            _WRITERS[writer](source, dst)
        assert str(info.value) == _message(dst, why, source)
        assert str(info.value.path) == str(dst)
    assert _tree(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_lightning_file_onto_itself_is_refused(tmp_path):
    src = tmp_path / "model.ckpt"
    shutil.copy(FIXTURES / "frameworks" / "lightning_z3_fp32" / "expected" / "lightning_fp32.ckpt", src)
    before = src.read_bytes()
    with pytest.raises(OutputError) as info:
        convert(src, src, fmt="lightning", overwrite=True, progress=False)
    assert str(info.value) == _message(src, "it is the source", src)
    assert src.read_bytes() == before


def test_cli_convert_and_reshard_onto_the_source_exit_1(rank_files_only, capsys):
    before = _tree(rank_files_only)
    for argv in (
        ["convert", str(rank_files_only), str(rank_files_only), "--format", "universal", "--overwrite", "--quiet"],
        ["convert", str(rank_files_only), str(rank_files_only), "--format", "dcp", "--overwrite", "--quiet"],
        ["reshard", str(rank_files_only), str(rank_files_only), "--world-size", "1", "--overwrite", "--quiet"],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"Output error: {_message(rank_files_only, 'it is the source', rank_files_only)}\n")
    assert _tree(rank_files_only) == before


@pytest.mark.parametrize("layout", ["torchtitan", "accelerate"])
def test_overwrite_replaces_zeroios_own_dcp_output(tmp_path, layout):
    """``--overwrite`` onto an earlier ``fmt="dcp"`` output was refused as "files zeroio did not write"."""
    dst = tmp_path / "step-2"
    convert(FIXTURES / "z3_ws2_fp32", dst, fmt="dcp", dcp_layout=layout, progress=False)
    first = _tree(dst)
    convert(FIXTURES / "z3_ws2_fp32", dst, fmt="dcp", dcp_layout=layout, overwrite=True, progress=False)
    assert _tree(dst) == first
    (dst / ("notes.txt" if layout == "torchtitan" else "pytorch_model_fsdp_0/notes.txt")).write_text("mine")
    with pytest.raises(OutputError, match="it holds files zeroio did not write"):
        convert(FIXTURES / "z3_ws2_fp32", dst, fmt="dcp", dcp_layout=layout, overwrite=True, progress=False)
