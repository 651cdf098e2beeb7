"""Which files make a verl FSDP checkpoint, by name only: ``fsdp_config.json`` and ``model_world_size_W_rank_R.pt``.

verl (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``) writes per rank ``model_``, ``optim_`` and
``extra_state_world_size_W_rank_R.pt``, and on rank 0 ``fsdp_config.json`` (``{"FSDP_version": 2, "world_size":
W}``) and ``huggingface/`` (config, tokenizer), into ``<root>/global_step_N/actor/`` (``critic/`` for the critic);
``<root>/latest_checkpointed_iteration.txt`` names the newest N.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError, WorldSizeMismatchError

__all__ = ["FSDP_CONFIG", "VerlFiles", "find_verl_files", "is_verl", "verl_folder"]

FSDP_CONFIG = "fsdp_config.json"
LATEST = "latest_checkpointed_iteration.txt"
ROLES = ("actor", "critic")
"""The sub-folders verl saves a ``global_step_N`` into, the actor first (what a bare step folder opens)."""
_RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
_STEP = re.compile(r"^global_step_(\d+)$")
MAX_CONFIG_BYTES = 1 << 20


def _is_rank_folder(path: Path) -> bool:
    return (path / FSDP_CONFIG).is_file() and any(
        (m := _RANK_FILE.match(p.name)) is not None and m.group(1) == "model" for p in path.iterdir()
    )


def _step_folders(root: Path) -> dict[int, Path]:
    found = {}
    for child in root.iterdir():
        m = _STEP.match(child.name)
        if m and child.is_dir():
            found[int(m.group(1))] = child
    return found


def is_verl(path: Path) -> bool:
    """True for a verl FSDP rank folder (``actor/``), a ``global_step_N`` folder holding one, or a root with
    ``latest_checkpointed_iteration.txt`` and ``global_step_N`` folders (names only)."""
    if not path.is_dir():
        return False
    if _is_rank_folder(path):
        return True
    if any(_is_rank_folder(path / role) for role in ROLES if (path / role).is_dir()):
        return True
    steps = _step_folders(path) if (path / LATEST).is_file() else {}
    # verl's Megatron backend uses the same root and step names (global_step_N/actor/dist_ckpt): only a step
    # holding FSDP rank files is ours.
    return bool(steps) and any(_is_rank_folder(steps[max(steps)] / role) for role in ROLES)


def verl_folder(path: Path, tag: str | None) -> tuple[Path, str | None]:
    """The rank folder to read and its step folder's name (``global_step_N``): ``path`` itself, its ``actor/``
    (else ``critic/``), or, from a root, ``tag`` (default: the step ``latest_checkpointed_iteration.txt`` names)."""
    if _is_rank_folder(path):
        return path, path.parent.name if _STEP.match(path.parent.name) else None
    step = path
    if not any((path / role).is_dir() for role in ROLES):
        steps = _step_folders(path)
        name = tag if tag is not None else _latest(path, steps)
        step = path / name
        if not step.is_dir():
            found = ", ".join(p.name for _, p in sorted(steps.items())) or "none"
            raise CheckpointNotFoundError(f"'{path}' has no step folder '{name}' (found: {found}).", path=step)
    for role in ROLES:
        if _is_rank_folder(step / role):
            return step / role, step.name
    raise CheckpointNotFoundError(
        f"'{step}' holds no verl rank folder ({' or '.join(ROLES)}/ with {FSDP_CONFIG} and model_world_size_*.pt).",
        path=step,
    )


def _latest(root: Path, steps: dict[int, Path]) -> str:
    try:
        text = (root / LATEST).read_text(encoding="utf-8", errors="replace")[:64].strip()
    except OSError:
        text = ""
    if text.isdigit() and int(text) in steps:
        return steps[int(text)].name
    return steps[max(steps)].name


@dataclass(frozen=True, slots=True)
class VerlFiles:
    """A verl rank folder's files, checked against ``fsdp_config.json``."""

    folder: Path
    world_size: int
    fsdp_version: int
    model: tuple[Path, ...]
    """``model_world_size_W_rank_R.pt`` by rank."""
    optim: tuple[Path, ...]
    """``optim_world_size_W_rank_R.pt`` by rank; empty when the optimizer was not saved."""
    extra: tuple[Path, ...]


def _read_config(folder: Path) -> tuple[int, int]:
    path = folder / FSDP_CONFIG
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise CheckpointFormatError(f"'{path}' is {path.stat().st_size} bytes; verl writes a few.", path=path)
        config = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointFormatError(
            f"Cannot read '{path}' as JSON ({exc}). Copy it again from the run.", path=path
        ) from exc
    version: Any = config.get("FSDP_version") if isinstance(config, dict) else None
    world: Any = config.get("world_size") if isinstance(config, dict) else None
    if not (_positive(version) and _positive(world)):
        raise CheckpointFormatError(
            f"'{path}' does not hold positive integers FSDP_version and world_size (found {str(config)[:80]}).",
            path=path,
        )
    return int(version), int(world)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def find_verl_files(folder: Path) -> VerlFiles:
    """The rank files of ``folder``; refuses unknown FSDP versions, mixed world sizes and missing ranks by name."""
    version, world = _read_config(folder)
    if version not in (1, 2):
        raise UnsupportedCheckpointError(
            f"'{folder}' says FSDP_version {version} in its {FSDP_CONFIG}; zeroio reads verl's FSDP1 and FSDP2 "
            "checkpoints. Convert it with verl's own model merger (python -m verl.model_merger merge --backend fsdp).",
            path=folder / FSDP_CONFIG,
            found=version,
        )
    by_kind: dict[str, dict[int, Path]] = {"model": {}, "optim": {}, "extra_state": {}}
    sizes: set[int] = set()
    for p in folder.iterdir():
        m = _RANK_FILE.match(p.name)
        if m:
            sizes.add(int(m.group(2)))
            if int(m.group(2)) == world:
                by_kind[m.group(1)][int(m.group(3))] = p
    if sizes != {world}:
        raise WorldSizeMismatchError(
            f"'{folder}' holds rank files of world sizes {sorted(sizes)}, its {FSDP_CONFIG} says {world}. Files of "
            "two runs are mixed: keep only the files of the save you want.",
            path=folder,
            expected=world,
            found=sorted(sizes),
        )
    for kind in ("model", "optim", "extra_state"):
        ranks = by_kind[kind]
        if kind != "model" and not ranks:
            continue  # not saved (checkpoint.save_contents without it)
        missing = list(itertools.islice((r for r in range(world) if r not in ranks), 5))  # world may be 10**12
        extra = sorted(r for r in ranks if r >= world)
        if missing or extra:
            raise WorldSizeMismatchError(
                f"'{folder}' lacks {kind}_world_size_{world}_rank_R.pt for rank(s) {missing[:5]}"
                + (f" and has rank(s) {extra[:5]} beyond world size {world}" if extra else "")
                + ". A rank failed to save or the folder was copied in part: copy the whole folder.",
                path=folder,
                expected=world,
                found=len(ranks),
            )
    return VerlFiles(
        folder,
        world,
        version,
        tuple(by_kind["model"][r] for r in range(world)),
        tuple(by_kind["optim"][r] for r in range(world)) if by_kind["optim"] else (),
        tuple(by_kind["extra_state"][r] for r in range(world)) if by_kind["extra_state"] else (),
    )
