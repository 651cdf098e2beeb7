"""Find a checkpoint's tag folder and its per-rank files from a path; never unpickles."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from ... import _constants as C
from ..._io.confine import require_regular_file
from ..._io.nearest import did_you_mean
from ..._messages import listing
from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError, WorldSizeMismatchError

__all__ = ["ZeroLayout", "find_tag_dir", "is_zero_checkpoint", "model_parallel_ranks", "scan_tag_dir"]


def _truncate(items: list[str], limit: int = 5) -> str:
    return listing(items, limit=limit)


def _has_states(folder: Path) -> bool:
    return any(p.name.endswith(C.STATES_SUFFIX) for p in folder.iterdir() if p.is_file())


def _candidate_tags(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir() and _has_states(p))
    except OSError:
        return []


def _inside_root(tag: str) -> bool:
    """True when ``tag`` is a relative path that stays inside the root: no absolute path, no ``..`` component.

    DeepSpeed joins a tag to the save folder (``os.path.join(save_dir, tag)``), so a nested tag (``run/step``)
    is legitimate; the check is on the text, so a tag folder that is a symlink still opens.
    """
    parts = tag.replace("\\", "/").split("/")
    return not PurePosixPath(tag).is_absolute() and not PureWindowsPath(tag).drive and ".." not in parts


def is_zero_checkpoint(path: Path) -> bool:
    """True when ``path`` looks like a DeepSpeed checkpoint root, tag folder or rank file."""
    if path.is_file():
        return path.name.endswith(C.STATES_SUFFIX)
    if not path.is_dir():
        return False
    return (path / C.LATEST_FILE).is_file() or _has_states(path) or bool(_candidate_tags(path))


def find_tag_dir(path: Path, tag: str | None, *, latest_file: str = C.LATEST_FILE) -> tuple[Path, str | None]:
    """Resolve ``path`` (root, tag folder or rank file) and ``tag`` to the folder holding the rank files.

    ``latest_file`` names the root file that names the default tag (``latest_universal`` for universal roots).

    Returns the folder and the tag name (``None`` when ``path`` already was the tag folder).
    """
    if not path.exists():
        raise CheckpointNotFoundError(f"Checkpoint path '{path}' does not exist.{did_you_mean(path)}", path=path)
    if path.is_file():
        if not path.name.endswith(C.STATES_SUFFIX):
            raise CheckpointNotFoundError(
                f"'{path}' is not a DeepSpeed rank file (expected a name ending in '{C.STATES_SUFFIX}'). "
                "Pass the checkpoint folder instead.",
                path=path,
            )
        return path.parent, path.parent.name
    if tag is not None:
        if not _inside_root(tag):
            raise CheckpointNotFoundError(
                f"Tag '{tag}' leads outside '{path}': tag= names a folder inside the checkpoint root. To open another "
                "folder, pass that folder as the path.",
                path=path,
                expected=tag,
            )
        tag_dir = path / tag
        if not tag_dir.is_dir() and _has_states(path):  # a tag folder given, with --tag (issue 32)
            if tag == path.name:
                return path, tag
            siblings = _candidate_tags(path.parent)
            raise CheckpointNotFoundError(
                f"'{path}' is itself a tag folder ('{path.name}'), so it holds no tag '{tag}'. Pass the checkpoint "
                f"root '{path.parent}' with tag='{tag}' (available there: {_truncate(siblings) or 'none'}), or drop "
                "the tag to read this folder.",
                path=tag_dir,
                expected=tag,
                found=siblings,
            )
        if not tag_dir.is_dir():
            available = _candidate_tags(path)
            close = difflib.get_close_matches(tag, available, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise CheckpointNotFoundError(
                f"Tag '{tag}' not found in '{path}' (available: {_truncate(available) or 'none'}).{hint}",
                path=tag_dir,
                expected=tag,
                found=available,
            )
        return tag_dir, tag
    if _has_states(path):
        return path, path.name
    latest = path / latest_file
    if latest.is_file():
        name = latest.read_text(encoding="utf-8", errors="replace").strip()
        if name and not _inside_root(name):
            raise CheckpointFormatError(
                f"'{latest}' names '{name}', which is outside the checkpoint folder; zeroio opens only tags inside "
                f"'{path}'. Fix the 'latest' file, or pass tag= to choose another folder.",
                path=latest,
                found=name,
            )
        tag_dir = path / name
        if not name or not tag_dir.is_dir():
            available = _candidate_tags(path)
            raise CheckpointNotFoundError(
                f"'{latest}' names tag '{name}', but '{tag_dir}' does not exist. "
                f"Pass tag= explicitly (available: {_truncate(available) or 'none'}).",
                path=tag_dir,
                expected=name,
                found=available,
            )
        return tag_dir, name
    available = _candidate_tags(path)
    if len(available) == 1:
        return path / available[0], available[0]
    if available:
        raise CheckpointNotFoundError(
            f"No 'latest' file in '{path}' and no tag was given. Pass tag='{available[-1]}' "
            f"(available: {_truncate(available)}).",
            path=path,
            found=available,
        )
    trainer = _trainer_checkpoints(path)
    if trainer:  # an HF Trainer output_dir: the checkpoints are its checkpoint-N/ folders
        raise CheckpointNotFoundError(
            f"'{path}' is not a DeepSpeed checkpoint but a Hugging Face Trainer output_dir holding "
            f"{_truncate(trainer)}. Pass one of those folders, e.g. '{path / trainer[-1]}'.",
            path=path,
            found=trainer,
        )
    inside = _checkpoint_subfolders(path)
    if inside:  # e.g. torchtitan's step-N/ holding consolidated safetensors, a run folder of several checkpoints
        raise CheckpointNotFoundError(
            f"'{path}' is not a checkpoint itself but holds folders that look like checkpoints: {_truncate(inside)}. "
            f"Pass one of them, e.g. '{path / inside[-1]}'.",
            path=path,
            found=inside,
        )
    raise CheckpointNotFoundError(
        f"'{path}' is not a DeepSpeed checkpoint: it has no '*_model_states.pt' files, no 'latest' file and no "
        "tag folders. Point zeroio at the folder passed to engine.save_checkpoint().",
        path=path,
    )


_CHECKPOINT_FILES = re.compile(
    r".*\.safetensors|\.metadata|latest|.*_model_states\.pt|pytorch_model\.bin(\.index\.json)?"
)
"""A file whose presence makes a folder look like a checkpoint of some format zeroio reads."""
_LOOK_AT = 256
"""Entries looked at per folder: a hint, not a search (a folder of 100,000 files answers at once)."""


def _checkpoint_subfolders(root: Path) -> list[str]:
    """``root``'s folders holding a checkpoint-looking file (:data:`_CHECKPOINT_FILES`), in name order, numbers by
    value (``step-9`` before ``step-10``)."""

    def looks_like_one(folder: Path) -> bool:
        try:
            for i, entry in enumerate(folder.iterdir()):
                if i >= _LOOK_AT:
                    return False
                if _CHECKPOINT_FILES.fullmatch(entry.name):
                    return True
        except OSError:
            return False
        return False

    try:
        folders = [p for i, p in enumerate(root.iterdir()) if i < _LOOK_AT and p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
    found = [p.name for p in folders if looks_like_one(p)]
    return sorted(found, key=lambda name: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)])


def _trainer_checkpoints(root: Path) -> list[str]:
    """The ``checkpoint-N`` folders with a 'latest' file in ``root``, by step (the HF Trainer's ``output_dir``)."""
    try:
        found = [p.name for p in root.iterdir() if _TRAINER_CHECKPOINT.fullmatch(p.name) and (p / "latest").is_file()]
    except OSError:
        return []
    return sorted(found, key=lambda name: int(name.rsplit("-", 1)[1]))


_TRAINER_CHECKPOINT = re.compile(r"checkpoint-[0-9]{1,18}")


@dataclass(frozen=True, slots=True)
class ZeroLayout:
    """The rank files of one tag folder, by kind and data-parallel rank."""

    tag_dir: Path
    """Folder holding the rank files."""
    optim_files: tuple[Path, ...]
    """``*_optim_states.pt`` per data-parallel rank, in rank order."""
    model_files: tuple[Path, ...]
    """ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank; otherwise the one ``mp_rank_00_model_states.pt``."""
    partitioned_model_files: bool
    """True for ZeRO-3's per-rank model files."""
    expert_files: tuple[Path, ...] = ()
    """MoE: ``layer_L_expert_E_mp_rank_00_model_states.pt`` (one per expert, global ids), sorted by (L, E)."""
    placeholder_optim_files: tuple[Path, ...] = ()
    """MoE saved by DeepSpeed <= 0.18 under ZeRO-1/2: ``expp_rank_E_mp_rank_00_optim_states.pt``, which should hold
    ``{"optimizer": None}`` (see ``moe_legacy.py``)."""


_RANKED_FILE = re.compile(r".*mp_rank_(?P<mp>\d+)_(model|optim)_states\.pt$")


def _ranked(files: dict[int, Path], kind: str, tag_dir: Path) -> tuple[Path, ...]:
    if not files:
        return ()
    count = max(files) + 1
    missing = [r for r in range(count) if r not in files]
    if missing:
        example = files[min(files)].name
        names = [re.sub(r"rank_\d+_mp", f"rank_{r}_mp", example, count=1) for r in missing]
        raise CheckpointNotFoundError(
            f"Missing {kind} file(s) for rank(s) {_truncate([str(r) for r in missing])} in '{tag_dir}': "
            f"{_truncate(names)}. A rank failed to save or the copy is incomplete; copy the whole tag folder again.",
            path=tag_dir / names[0],
            rank=missing[0],
        )
    return tuple(files[r] for r in range(count))


def _check_one_prefix(optim: dict[int, Path], prefixes: dict[int, str]) -> None:
    """One save names every optimizer file alike: all with DeepSpeed's ``bf16_`` prefix (bf16 optimizer) or none."""
    if len(set(prefixes.values())) < 2:
        return
    common = max(sorted(set(prefixes.values())), key=list(prefixes.values()).count)
    rank = min(r for r, p in prefixes.items() if p != common)
    raise CheckpointFormatError(
        f"'{optim[rank]}' is named {'without a' if not prefixes[rank] else f'with the {prefixes[rank]!r}'} prefix, "
        f"unlike the other ranks' optimizer files: the folder mixes files from different saves; copy the whole tag "
        "folder again.",
        path=optim[rank],
        rank=rank,
    )


def model_parallel_ranks(tag_dir: Path) -> list[int]:
    """The model-parallel ranks (``mp_rank_NN``) the rank files of ``tag_dir`` are named for, by names only."""
    ranks: set[int] = set()
    for path in tag_dir.iterdir():
        m = C.ZERO_OPTIM_FILE.match(path.name) or C.ZERO3_MODEL_FILE.match(path.name) or C.MODEL_FILE.match(path.name)
        if m:
            ranks.add(int(m["mp"]))
    return sorted(ranks)


def scan_tag_dir(tag_dir: Path, mp_rank: int | None = None) -> ZeroLayout:
    """Classify the files of ``tag_dir``; refuse layouts zeroio does not read (yet).

    ``mp_rank`` keeps only the files of that model-parallel rank (a tensor-parallel reader opens each rank's
    ZeRO files on their own); without it, a folder of several model-parallel ranks is refused.
    """
    # Every entry but folders (and dangling links): a FIFO or device named like a rank file is refused by name
    # below, not silently skipped into a misleading world-size mismatch.
    names = sorted(p.name for p in tag_dir.iterdir() if p.exists() and not p.is_dir())
    if mp_rank is not None:
        names = [n for n in names if (m := _RANKED_FILE.match(n)) is None or int(m["mp"]) == mp_rank]
    # MoE without ZeRO writes per-expert-parallel-rank optimizer files (DeepSpeed 0.19.8 _save_moe_checkpoint);
    # DeepSpeed <= 0.18 also writes them, empty, next to ZeRO-1/2's own optimizer files.
    moe_optim = [n for n in names if C.MOE_OPTIM_FILE.match(n)]
    if moe_optim and not any(C.ZERO_OPTIM_FILE.match(n) for n in names):
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' is a Mixture-of-Experts checkpoint saved without ZeRO ({_truncate(moe_optim)}); zeroio "
            "reads MoE checkpoints of ZeRO stages 1 and 2 only. Use DeepSpeed's ds_to_universal.py for this one.",
            path=tag_dir,
            found=moe_optim,
        )
    experts = sorted(
        (n for n in names if C.MOE_EXPERT_FILE.match(n)),
        key=lambda n: tuple(int(x) for x in re.findall(r"\d+", n)[:2]),
    )
    pipeline = [n for n in names if C.PIPELINE_LAYER_FILE.match(n)]
    if pipeline:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' is a pipeline-parallel checkpoint ({_truncate(pipeline)}); zeroio does not merge "
            "pipeline stages yet. Use DeepSpeed's ds_to_universal.py for this one.",
            path=tag_dir,
            found=pipeline,
        )
    optim: dict[int, Path] = {}
    prefixes: dict[int, str] = {}
    zero3_model: dict[int, Path] = {}
    plain_model: list[str] = []
    mp_ranks: set[int] = set()
    for name in names:
        if C.ZERO_OPTIM_FILE.match(name) or C.ZERO3_MODEL_FILE.match(name) or C.MODEL_FILE.match(name):
            require_regular_file(tag_dir / name)
        if m := C.ZERO_OPTIM_FILE.match(name):
            optim[int(m["rank"])] = tag_dir / name
            prefixes[int(m["rank"])] = m["prefix"] or ""
            mp_ranks.add(int(m["mp"]))
        elif m := C.ZERO3_MODEL_FILE.match(name):
            zero3_model[int(m["rank"])] = tag_dir / name
            mp_ranks.add(int(m["mp"]))
        elif m := C.MODEL_FILE.match(name):
            plain_model.append(name)
            mp_ranks.add(int(m["mp"]))
    if len(mp_ranks) > 1:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' holds {len(mp_ranks)} model-parallel ranks (mp_rank_{', mp_rank_'.join(f'{r:02d}' for r in sorted(mp_ranks))}); "
            "zeroio reads data-parallel ZeRO checkpoints only (tensor parallelism is not merged yet).",
            path=tag_dir,
            found=sorted(mp_ranks),
        )
    _check_one_prefix(optim, prefixes)
    if experts and (zero3_model or not plain_model):
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' is a Mixture-of-Experts checkpoint ({_truncate(experts)}) without "
            f"'mp_rank_00_model_states.pt'{' (ZeRO-3)' if zero3_model else ''}; zeroio reads MoE checkpoints of ZeRO "
            "stages 1 and 2 only. Use DeepSpeed's ds_to_universal.py for this one.",
            path=tag_dir,
            found=experts,
        )
    if zero3_model:
        model_files = _ranked(zero3_model, "ZeRO-3 model states", tag_dir)
        optim_files = _ranked(optim, "optimizer states", tag_dir)
        if optim_files and len(optim_files) != len(model_files):
            raise WorldSizeMismatchError(
                f"'{tag_dir}' holds {len(model_files)} '*_model_states.pt' files but {len(optim_files)} "
                "'*_optim_states.pt' files; each rank writes one of each. Copy the whole tag folder again.",
                path=tag_dir,
                expected=len(model_files),
                found=len(optim_files),
            )
        return ZeroLayout(tag_dir, optim_files, model_files, True)
    if plain_model:
        return ZeroLayout(
            tag_dir,
            _ranked(optim, "optimizer states", tag_dir),
            (tag_dir / plain_model[0],),
            False,
            tuple(tag_dir / n for n in experts),
            tuple(tag_dir / n for n in moe_optim),
        )
    if optim:
        raise CheckpointNotFoundError(
            f"'{tag_dir}' has optimizer files but no '*_model_states.pt' file; the parameter names and shapes "
            "live there. Copy the whole tag folder again.",
            path=tag_dir,
        )
    raise CheckpointNotFoundError(
        f"'{tag_dir}' holds no DeepSpeed rank files ('*_model_states.pt'). Point zeroio at the folder passed to "
        "engine.save_checkpoint().",
        path=tag_dir,
    )
