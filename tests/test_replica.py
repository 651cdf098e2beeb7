"""Rank files repeating another's pickle (ZeRO-3 model states of ranks 1..) share its tree, with every reference to
stored bytes bound to their own file: the trees equal full parses, and the tensors DeepSpeed's engine held."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES

import zeroio
from zeroio._pickles import TensorRef, load_pickle
from zeroio.errors import CheckpointFormatError


def _plain(node: Any) -> Any:
    """A tree with each TensorRef as (file, storage key, offset, shape, stride): comparable across parses. A
    reference to a storage of no bytes (a ZeRO-3 placeholder) reads nothing from any file: its file is left out."""
    if isinstance(node, TensorRef):
        file = node.file.path.name if node.storage.numel else None
        return ("ref", file, node.storage.key, node.storage_offset, node.shape, node.stride)
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return repr(node) if hasattr(node, "__dict__") else node


def _model_files(ckpt: zeroio.Checkpoint) -> list[Path]:
    return [ckpt.metadata.path / name for name in ckpt.metadata.extra["model_files"]]


@pytest.mark.parametrize("name", ["z3_ws4_fp32", "z3_ws3_bf16"])
def test_replica_trees_equal_full_parses_and_read_their_own_files(name: str) -> None:
    """DeepSpeed's own 3- and 4-rank files: ranks 2.. share rank 1's tree; frozen fragments and buffers point at
    each rank's own file, and the whole tree equals a parse of that file alone."""
    with zeroio.open(FIXTURES / name) as ckpt:
        files = _model_files(ckpt)
        trees = [ckpt.file_tree(p) for p in files]
        assert trees[1]["param_shapes"] is trees[2]["param_shapes"]  # shared, not parsed again
        for path, tree in zip(files, trees):
            alone, file = load_pickle(path)
            file.close()
            assert _plain(tree) == _plain(alone), path.name
        fragments = [t["frozen_param_fragments"] for t in trees]
        assert fragments[1] and all(ref.file.path == files[2] for ref in fragments[2].values())
        placeholders = [k for k, v in trees[1]["module"].items() if not v.storage.numel]
        assert placeholders and all(trees[2]["module"][k] is trees[1]["module"][k] for k in placeholders)
        expected = torch.load(FIXTURES / name / "expected" / "engine.pt", weights_only=True)
        state = ckpt.state_dict()
        assert {k: v.dtype for k, v in state.items()} == {k: expected[k].dtype for k in state}
        assert all(torch.equal(state[k], expected[k]) for k in state)


def test_a_replica_missing_a_record_is_refused(tmp_path: Path) -> None:
    """A replica's archive is still checked: its pickle names a frozen fragment whose record holds too few bytes."""
    import zipfile

    copy = tmp_path / "z3_ws4_fp32"
    shutil.copytree(FIXTURES / "z3_ws4_fp32", copy)
    victim = copy / "global_step2" / "zero_pp_rank_2_mp_rank_00_model_states.pt"
    with zipfile.ZipFile(victim) as archive:
        names = [i.filename for i in archive.infolist()]
        data = {n: archive.read(n) for n in names}
    key = next(n for n in names if n.endswith("/data/10"))  # frozen.weight's fragment (13 floats)
    data[key] = data[key][:8]
    with zipfile.ZipFile(victim, "w", zipfile.ZIP_STORED) as archive:
        for n in names:
            archive.writestr(n, data[n])
    with pytest.raises(CheckpointFormatError, match="storage '10' needs 52 bytes, the archive holds 8"):
        zeroio.open(copy)
