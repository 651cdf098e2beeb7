"""Write one consolidated PyTorch Lightning ``.ckpt`` file: the state dict plus Lightning's saved client state."""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._formats import Checkpoint, PartitionedCheckpoint, ReadOptions, open_checkpoint, output_spec
from .._io.remote_path import as_path
from .._messages import get_logger
from .._pickles import Walk, Where, ZeroStageEnum, inert_parts, is_inert, load_pickle, to_plain, where_text
from .._types import DTypeLike, StrPath
from ..errors import OutputError, UnsupportedCheckpointError
from .atomic import AtomicDir, clean_stale, write_file_atomically
from .options import WriteOptions
from .result import CardInputs, Written

__all__ = [
    "DEEPSPEED_STATE_KEYS",
    "LIGHTNING_FORMAT_VERSION",
    "LIGHTNING_PREFIX",
    "LIGHTNING_VERSION_KEY",
    "LightningCheckpointResult",
    "write_lightning",
    "write_lightning_ckpt",
]

logger = get_logger(__name__)

LIGHTNING_PREFIX = "_forward_module."
"""Key prefix of Lightning < 2.1 DeepSpeed checkpoints (its ``_LightningModuleWrapperBase``); stripped on write,
as Lightning's own ``convert_zero_checkpoint_to_fp32_state_dict`` does. Lightning 2.6 writes no prefix."""

LIGHTNING_VERSION_KEY = "pytorch-lightning_version"
"""The key ``LightningModule.load_from_checkpoint`` reads first (Lightning 2.6.6 ``_pl_migrate_checkpoint``):
without it loading fails with ``KeyError``."""

LIGHTNING_FORMAT_VERSION = "2.0.0"
"""The version written into a ``.ckpt`` made from a checkpoint without Lightning state: the first release of
Lightning 2.x's layout (``state_dict`` at the top, no legacy loop keys). Every Lightning 2.x loads it as is (no
migration runs: those for < 2.0.0 expect a trainer's ``global_step`` and ``loops``); 1.x warns it is newer."""

DEEPSPEED_STATE_KEYS = frozenset(
    {
        # DeepSpeed 0.19.8 engine._common_checkpoint_state / _save_checkpoint: the engine's own model_states keys.
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "csr_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "num_experts",
        "ds_autoep_layers",
        "autoep_layers",
        "universal_checkpoint_info",
        "folding",
        # Lightning's own single-file keys that describe training, not the model (never in ZeRO client state,
        # but present when re-writing a Lightning .ckpt whose optimizer state cannot be consolidated here).
        "optimizer_states",
    }
)
"""model_states keys written by DeepSpeed itself (and ``optimizer_states``); every other key is client state."""

# Plain-data classes the unpickler rebuilds inert; the writer gives them back as the real objects.
_REBUILD: dict[str, Any] = {
    "pathlib.PosixPath": pathlib.PurePosixPath if os.name == "nt" else pathlib.PosixPath,
    "pathlib.WindowsPath": pathlib.PureWindowsPath if os.name != "nt" else pathlib.WindowsPath,
    "pathlib.PurePosixPath": pathlib.PurePosixPath,
    "pathlib.PureWindowsPath": pathlib.PureWindowsPath,
    "datetime.datetime": datetime.datetime,
    "datetime.date": datetime.date,
    "datetime.timedelta": datetime.timedelta,
}


@dataclass(frozen=True, slots=True)
class LightningCheckpointResult:
    """What :func:`write_lightning_ckpt` wrote."""

    path: Path
    """The ``.ckpt`` file."""
    num_tensors: int
    """Distinct tensors in ``state_dict`` (a tied alias shares its source's tensor and is not counted)."""
    total_size: int
    """Bytes of tensor data in ``state_dict`` (each tied group once)."""
    tied: dict[str, str] = field(default_factory=dict)
    """Tied aliases in ``state_dict``, ``{alias: source}``; both names share one tensor in the file."""
    client_state_keys: tuple[str, ...] = ()
    """Top-level keys copied from the source's client state (``epoch``, ``global_step``, ``hyper_parameters``,
    ``loops``, ``callbacks``, ``pytorch-lightning_version``, ...), in file order."""
    stripped_prefix: str | None = None
    """``"_forward_module."`` when the source's keys carried it (Lightning < 2.1), else None."""


def _client_state_file(ckpt: Checkpoint) -> Path | None:
    """The file holding the source's client state: ZeRO rank-0 model_states, or a Lightning ``.ckpt`` itself."""
    meta = ckpt.metadata
    if meta.format == "zero":
        model_files = meta.extra.get("model_files") or []
        return as_path(meta.path) / str(model_files[0]) if model_files else None
    if meta.format == "torch" and meta.extra.get("index") is None and meta.extra.get("state_dict_key") == "state_dict":
        return as_path(meta.path)
    return None


def _rebuild_standin(obj: Any, where: Where, walk: Walk, *, path: Path) -> Any:
    """A stand-in as the real object Lightning saved: Namespace, path or date; anything else is refused."""
    if isinstance(obj, ZeroStageEnum):  # DeepSpeed's enum: an int loads everywhere
        return int(obj)
    if not is_inert(obj):
        return obj
    parts = inert_parts(obj)
    if parts.name == "argparse.Namespace" and not parts.args and not parts.kwargs:
        return argparse.Namespace(**{k: walk(v, (*where, k)) for k, v in parts.state.items()})
    if parts.name in _REBUILD and not parts.state and not parts.kwargs:
        try:
            return _REBUILD[parts.name](*parts.args)
        except (TypeError, ValueError):
            pass
    raise UnsupportedCheckpointError(
        f"Cannot write the client state '{where_text(where)}' of '{path}' into a Lightning checkpoint: it holds a "
        f"'{parts.name}' object, which zeroio read as inert data and cannot rebuild. Remove it from what "
        "on_save_checkpoint() stores, or write fmt='safetensors' (weights only).",
        path=path,
        name=where_text(where),
        found=parts.name,
    )


def _read_client_state(ckpt: Checkpoint, path: Path, trusted_globals: frozenset[str]) -> dict[str, Any]:
    """Client state as real objects: tensors read to CPU, Lightning's AttributeDict a dict, stand-ins rebuilt.

    A ZeRO checkpoint's rank-0 model states were parsed by ``zeroio.open`` (with its ``trusted_globals``): that
    tree is used as is. A Lightning ``.ckpt`` file is parsed here.
    """
    file = None
    try:
        if isinstance(ckpt, PartitionedCheckpoint):  # open() always parses rank 0's model states
            tree = ckpt.file_tree(path)
        else:
            tree, file = load_pickle(path, trusted_globals=trusted_globals)
        if not isinstance(tree, dict):
            return {}

        def standin(obj: Any, where: Where, walk: Walk) -> Any:
            return _rebuild_standin(obj, where, walk, path=path)

        return {
            str(key): to_plain(value, (str(key),), standin=standin)
            for key, value in tree.items()
            if key not in DEEPSPEED_STATE_KEYS and key != "state_dict"
        }
    finally:
        if file is not None:
            file.close()


def _state_dict_key(name: str) -> str:
    return name.removeprefix(LIGHTNING_PREFIX)


def write_lightning_ckpt(
    ckpt: Checkpoint,
    dst_file: StrPath,
    *,
    dtype: DTypeLike | None = None,
    overwrite: bool = False,
    trusted_globals: Iterable[str] = (),
    loadable: bool = False,
) -> LightningCheckpointResult:
    """Write one consolidated Lightning ``.ckpt``: ``state_dict`` plus the client state Lightning saved.

    The client state (``epoch``, ``global_step``, ``hyper_parameters``, ``callbacks``, ``loops``,
    ``pytorch-lightning_version``, ... every model_states key DeepSpeed did not write itself) is read from the
    ZeRO checkpoint's rank-0 model_states file with zeroio's restricted unpickler; tensors in it are read to
    CPU, whatever device they were saved from. Keys lose Lightning < 2.1's ``_forward_module.`` prefix, tied
    names share one tensor, and the file loads with ``torch.load(weights_only=True)`` unless the client state
    itself holds paths, dates or ``argparse.Namespace`` objects (rebuilt as the real objects, as Lightning saved
    them). ``LightningModule.load_from_checkpoint(dst_file)`` restores the module; Lightning 2.x calls
    ``configure_model()`` before loading the weights. The whole state dict is held in memory while writing
    (a torch pickle cannot be streamed).

    Args:
        ckpt: an open checkpoint, usually ``zeroio.open("<run>/epoch=3-step=100.ckpt")`` (the folder
            DeepSpeedStrategy saves). Other checkpoints work too; without Lightning client state the file
            holds only ``state_dict`` (and the version below with ``loadable``).
        dst_file: the ``.ckpt`` file to write (atomically: a temporary sibling renamed into place).
        dtype: cast floating tensors (``"bf16"``, ``torch.float16``, ...); default: as stored (fp32 masters).
        overwrite: replace an existing file.
        trusted_globals: pickle globals to accept in the client state of a Lightning ``.ckpt`` file, as given to
            ``zeroio.open``; a ZeRO checkpoint's client state is the tree ``zeroio.open`` parsed (with its own).
        loadable: add ``"pytorch-lightning_version": LIGHTNING_FORMAT_VERSION`` when the client state has no
            version (a plain DeepSpeed checkpoint), which ``load_from_checkpoint`` needs (``zeroio.convert`` does).

    Returns:
        A :class:`LightningCheckpointResult` (path, tensor count and bytes, ties, client-state keys).

    Raises:
        OutputError: ``dst_file`` exists (without ``overwrite``), is a folder, or cannot be written.
        UnsupportedCheckpointError: the client state holds an object zeroio cannot rebuild.

    Example:
        >>> import zeroio
        >>> from zeroio._write.lightning_writer import write_lightning_ckpt
        >>> with zeroio.open("fixtures/lightning_z3_fp32/model.ckpt") as ckpt:  # doctest: +SKIP
        ...     result = write_lightning_ckpt(ckpt, "model.ckpt")
        >>> result.client_state_keys[:2]  # doctest: +SKIP
        ('epoch', 'global_step')
    """
    # 1. Check the destination before reading anything.
    dst = Path(os.path.abspath(dst_file))
    if dst.is_dir():
        raise OutputError(
            f"Output path '{dst}' is a folder; a Lightning checkpoint is one file. Pass a file path such as "
            f"'{dst / 'model.ckpt'}'.",
            path=dst,
        )
    if os.path.lexists(dst) and not overwrite:
        raise OutputError(
            f"Output file '{dst}' already exists. Pass overwrite=True (--overwrite) to replace it, "
            "or choose another destination.",
            path=dst,
        )
    if not dst.parent.is_dir():
        raise OutputError(f"Cannot write '{dst}': folder '{dst.parent}' does not exist. Create it first.", path=dst)
    clean_stale(dst.parent)

    # 2. Client state from the source (metadata-sized; tensors in it are small, e.g. callback scores).
    source = _client_state_file(ckpt)
    client = _read_client_state(ckpt, source, frozenset(trusted_globals)) if source is not None else {}

    # 3. The consolidated state dict: tied names share one tensor; Lightning < 2.1's wrapper prefix dropped.
    state_dict: dict[str, torch.Tensor] = {}
    stripped = False
    for name, tensor in ckpt.iter_tensors(dtype=dtype):
        key = _state_dict_key(name)
        stripped = stripped or key != name
        state_dict[key] = tensor
    tied = {_state_dict_key(a): _state_dict_key(s) for a, s in ckpt.tied.items()}

    # 4. Lightning's layout: client state keys in their saved order, then state_dict (as Lightning's converter).
    obj = dict(client)
    if loadable and LIGHTNING_VERSION_KEY not in obj:
        logger.info("'%s' holds no Lightning state: writing %s %s", ckpt.metadata.path, LIGHTNING_VERSION_KEY,
                    LIGHTNING_FORMAT_VERSION)  # fmt: skip
        obj[LIGHTNING_VERSION_KEY] = LIGHTNING_FORMAT_VERSION
    obj["state_dict"] = state_dict
    write_file_atomically(dst, lambda fh: torch.save(obj, fh))
    distinct = [t for k, t in state_dict.items() if k not in tied]
    logger.debug("wrote %s: %d tensors, client state %s", dst, len(state_dict), sorted(client))
    return LightningCheckpointResult(
        path=dst,
        num_tensors=len(distinct),
        total_size=sum(t.numel() * t.element_size() for t in distinct),
        tied=tied,
        client_state_keys=tuple(client),
        stripped_prefix=LIGHTNING_PREFIX if stripped else None,
    )


def write_lightning(src: Path, dst: Path, read: ReadOptions, write: WriteOptions) -> Written:
    """``fmt="lightning"``: one consolidated ``.ckpt`` file at ``dst``, written atomically by
    :func:`write_lightning_ckpt` (the ``WRITERS`` entry)."""
    # 1. Refuse an existing file (or a file in the way of a parent folder) before reading anything, as for folders;
    #    a folder at dst is refused by write_lightning_ckpt, overwrite or not (a Lightning checkpoint is one file).
    dst = Path(os.path.abspath(dst))
    overwrite, target = write.overwrite, write.dtype
    if not dst.is_dir():
        AtomicDir(dst, source=src, overwrite=overwrite).check()
    with open_checkpoint(src, read) as ckpt:
        # 2. Missing parent folders are created, as convert creates them for an output folder.
        if not dst.is_dir():
            try:
                dst.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputError(
                    f"Cannot write '{dst}': cannot create the folder '{dst.parent}' ({exc.strerror or exc}). "
                    "Check the permissions of the destination's folder or choose another destination.",
                    path=dst,
                ) from exc
        written = write_lightning_ckpt(
            ckpt,
            dst,
            dtype=None if target is None else target.torch,
            overwrite=overwrite,
            trusted_globals=read.trusted_globals,
            loadable=True,
        )
        infos = ckpt.infos
        card = CardInputs(
            ckpt.metadata, fmt="lightning", target=target, out_dtypes=[output_spec(i, target) for i in infos.values()],
            excluded=[], num_params=sum(info.numel for name, info in infos.items() if name not in ckpt.tied),
        )  # fmt: skip
    logger.info("wrote %d tensors (%d bytes) to %s", written.num_tensors, written.total_size, written.path)
    return Written(
        files=(written.path,),
        index_path=None,
        total_size=written.total_size,
        num_tensors=written.num_tensors,
        tied=written.tied,
        card=card,
    )
