"""verl FSDP checkpoints read lazily: each rank's ``torch.save``'d DTensor shards, reassembled by ``torch.chunk``.

Every rank file is parsed by zeroio's restricted unpickler, DTensors becoming inert records (no DTensor, mesh or
placement code runs); tensor bytes are read from the rank files only when asked, piece by piece (the DCP chunk
arithmetic of :mod:`..dcp.chunk_plans`). Names are the Hugging Face model's own; ``huggingface/`` holds its config.
FSDP2 (``strategy: fsdp2``) is read whole; FSDP1 with a device mesh saves DTensors too, whose weights are read (its
optimizer files hold flattened-parameter state, refused by name).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._dtypes import FLOAT32
from ..._io.integrity import CheckedFile
from ..._io.sources import ByteRange, ByteSource
from ..._messages import get_logger
from ..._pickles import RankFile, TensorRef, inert_parts, load_pickle
from ...errors import CheckpointFormatError, TensorNotFoundError, UnsafePickleError, UnsupportedCheckpointError
from ..checkpoint import Checkpoint
from ..dcp.chunk_plans import EntryMap, concat_ranges, read_entry_into
from ..metadata import CheckpointMetadata, TensorInfo, TensorKind
from ..options import ReadOptions
from .dtensors import Assembled, assemble, is_dtensor
from .files import VerlFiles, find_verl_files, verl_folder
from .optim import OptimizerShards, UnmappedOptimizer, read_optimizer

if TYPE_CHECKING:
    import torch

__all__ = ["VerlCheckpoint", "open_verl"]

logger = get_logger(__name__)

_STEP = re.compile(r"^global_step_(\d+)$")


def _place(piece: Assembled) -> Any:
    def place(i: int) -> tuple[ByteSource, int]:
        ref = piece.refs[i]
        found = ref.byte_range(0, ref.numel)
        if found is None:  # only asked for contiguous pieces (see Assembled.contiguous)
            raise CheckpointFormatError(f"'{ref.file.path}' holds a non-contiguous piece.", path=ref.file.path)
        return found[0], found[1]

    return place


def _read(piece: Assembled, start: int, out: torch.Tensor) -> None:
    def read(i: int, first: int, dest: torch.Tensor) -> None:
        piece.refs[i].read(first, dest.numel(), dest)

    read_entry_into(piece.entry, start, out, read)


class VerlCheckpoint(Checkpoint):
    """A verl FSDP checkpoint folder (``global_step_N/actor``); build it with ``zeroio.open``."""

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        pieces: dict[str, Assembled],
        optim: tuple[dict[str, dict[str, Assembled]], dict[str, dict[str, Any]], dict[str, TensorRef]],
        files: list[RankFile],
        unmapped: str | None = None,
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._pieces = pieces
        self._moments, self._hyper, self._steps = optim
        self._files = files
        self._unmapped = unmapped  # why the optimizer files' indices cannot be given names

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        _read(self._pieces[name], start, out)

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        piece = self._pieces[name]
        return concat_ranges(piece.entry, _place(piece)) if piece.contiguous else None

    def byte_map(self, name: str) -> EntryMap | None:
        piece = self._pieces[name]
        return EntryMap(piece.entry, _place(piece)) if piece.contiguous else None

    def _release(self) -> None:
        for file in self._files:
            file.close()

    def _checked_files(self) -> list[CheckedFile]:
        return [file.source for file in self._files]

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The optimizer state of one parameter (``exp_avg``, ``exp_avg_sq`` reassembled from every rank's
        ``optim_*.pt``, ``step``, and its param group's hyper-parameters), in the stored dtype."""
        return self._optimizer_state(name, meta=False)

    def optimizer_state_spec(self, name: str) -> dict[str, Any]:
        """:meth:`optimizer_state` with the moments on the ``meta`` device (nothing read but the step)."""
        return self._optimizer_state(name, meta=True)

    def _optimizer_state(self, name: str, *, meta: bool) -> dict[str, Any]:
        self._resolve(name)
        name = self._tied.get(name, name)
        if self._metadata.layout == "fsdp1":
            raise UnsupportedCheckpointError(
                f"No optimizer state for '{name}' in '{self._metadata.path}': {FSDP1_OPTIMIZER}",
                path=self._metadata.path,
                name=name,
            )
        if self._unmapped is not None:
            raise UnsupportedCheckpointError(
                f"No optimizer state for '{name}': {self._unmapped}. zeroio reads the weights only; resume with the "
                "training code that built the optimizer.",
                path=self._metadata.path,
                name=name,
            )
        if name not in self._hyper:
            owned = ", ".join(list(self._hyper)[:8]) or "none: the folder has no optim_*.pt files"
            raise TensorNotFoundError(
                f"No optimizer state for '{name}' in '{self._metadata.path}' (parameters with optimizer state: "
                f"{owned}).",
                path=self._metadata.path,
                name=name,
            )
        import torch

        result: dict[str, Any] = {}
        for key, piece in self._moments.get(name, {}).items():
            out = torch.empty(piece.entry.numel, dtype=piece.entry.dtype.torch, device="meta" if meta else None)
            if not meta and piece.entry.numel:
                _read(piece, 0, out)
            result[key] = out.view(piece.entry.shape)
        step = self._steps.get(name)
        if step is not None:
            result["step"] = step.read().view(step.shape)
        for key, value in self._hyper[name].items():
            result.setdefault(key, value)
        return result


FSDP1_OPTIMIZER = (
    "verl's FSDP1 optimizer files hold FSDP's flattened-parameter state, which zeroio does not map to parameters; "
    "zeroio reads an FSDP1 checkpoint's weights only. Resume with verl, or train with strategy fsdp2."
)


def _load_rank_file(path: Path, trusted: frozenset[str], fsdp_version: int) -> tuple[Any, RankFile]:
    try:
        return load_pickle(path, trusted_globals=trusted)
    except UnsafePickleError as exc:
        if fsdp_version != 1 or "sharded_tensor" not in (exc.name or "").lower():
            raise
        raise UnsupportedCheckpointError(
            f"'{path}' is a verl FSDP1 checkpoint whose shards are ShardedTensors (FSDP1 without a device mesh, or "
            "an older torch); zeroio reads FSDP1 and FSDP2 shards saved as DTensors. Convert it with verl's own "
            "model merger (python -m verl.model_merger merge --backend fsdp).",
            path=path,
            name=exc.name,
        ) from exc


def _model_trees(files: VerlFiles, trusted: frozenset[str], opened: list[RankFile]) -> list[dict[Any, Any]]:
    trees = []
    for rank, path in enumerate(files.model):
        tree, file = _load_rank_file(path, trusted, files.fsdp_version)
        opened.append(file)
        if not isinstance(tree, dict) or not all(isinstance(k, str) for k in tree):
            raise CheckpointFormatError(
                f"'{path}' holds a {type(tree).__name__}, not the state dict verl saves (names to DTensors).",
                path=path,
                rank=rank,
            )
        trees.append(tree)
    names = list(trees[0])
    for rank, tree in enumerate(trees[1:], start=1):
        if list(tree) != names:
            odd = sorted(set(tree) ^ set(names))[:3]
            raise CheckpointFormatError(
                f"'{files.model[rank]}' and '{files.model[0]}' hold different names ({', '.join(odd) or 'order'}). "
                "The rank files come from different saves: copy the folder of one save.",
                path=files.model[rank],
                rank=rank,
            )
    return trees


def _tie_key(value: Any) -> tuple[Any, ...]:
    """Two names of one tensor (tied embeddings): FSDP2's state dict gives each name its own DTensor, over the
    same local storage view."""
    parts = inert_parts(value) if is_dtensor(value) else None
    ref = parts.state.get("_local_tensor") if parts is not None else value
    if not isinstance(ref, TensorRef):
        return (id(value),)
    return (ref.storage.key, ref.storage_offset, ref.shape, ref.stride, parts.args[:2] if parts is not None else None)


def _model(
    files: VerlFiles, trees: list[dict[Any, Any]]
) -> tuple[dict[str, Assembled], dict[str, str], list[str], list[str]]:
    """Pieces of every tensor, ties (one object under two names), the parameters in ``parameters()`` order (the
    DTensors, a tie once) and the names skipped (non-tensor values)."""
    pieces: dict[str, Assembled] = {}
    tied: dict[str, str] = {}
    params: list[str] = []
    skipped: list[str] = []
    first_name: dict[tuple[Any, ...], str] = {}
    for name, value in trees[0].items():
        if not (is_dtensor(value) or isinstance(value, TensorRef)):
            skipped.append(name)  # e.g. a module's `_extra_state`
            continue
        source = first_name.setdefault(_tie_key(value), name)
        if source != name:
            tied[name] = source
            continue
        pieces[name] = assemble(name, [tree[name] for tree in trees], files.model)
        if is_dtensor(value):
            params.append(name)
    return pieces, tied, params, skipped


def open_verl(path: Path, options: ReadOptions) -> VerlCheckpoint:
    """Open a verl FSDP checkpoint: every rank file's pickle parsed (inert), no tensor bytes read."""
    tag, trusted_globals = options.tag, options.trusted_globals
    # 1. Which folder and files: unknown FSDP versions, mixed world sizes and missing ranks are refused first.
    folder, step_name = verl_folder(path, tag)
    files = find_verl_files(folder)
    opened: list[RankFile] = []
    try:
        # 2. The model: rank files parsed, DTensors checked against their specs and torch.chunk, ties found.
        trees = _model_trees(files, trusted_globals, opened)
        pieces, tied, params, skipped = _model(files, trees)
        # 3. The optimizer (FSDP2, if saved): indices mapped to names in parameters() order, shapes checked.
        shapes = {name: pieces[name].entry.shape for name in params}
        read = files.optim and files.fsdp_version == 2
        optim: OptimizerShards = ({}, {}, {})
        unmapped = None
        try:
            if read:
                optim = read_optimizer(files.optim, params, shapes, trusted_globals, opened)
        except UnmappedOptimizer as exc:
            unmapped = str(exc)
    except BaseException:
        for file in opened:
            file.close()
        raise
    infos: dict[str, TensorInfo] = {}
    for name in trees[0]:
        if name in pieces:
            piece = pieces[name]
            kind: TensorKind = "trainable" if name in optim[1] else ("tensor" if name in params else "buffer")
            where = tuple(dict.fromkeys(r.file.path for r in piece.refs))
            infos[name] = TensorInfo(name, piece.entry.shape, piece.entry.dtype, kind, where)
        elif name in tied:
            base = infos[tied[name]]
            infos[name] = TensorInfo(name, base.shape, base.dtype_spec, base.kind, base.files, None, tied[name])
    floats = {p.entry.dtype for n, p in pieces.items() if n in params and p.entry.dtype.is_floating_point}
    train = floats.pop() if len(floats) == 1 else None
    step = _STEP.match(step_name or "")
    moments = {k for states in optim[0].values() for k in states}
    metadata = CheckpointMetadata(
        format="verl",
        path=folder,
        tag=step_name,
        world_size=files.world_size,
        train_dtype=train,
        global_step=int(step.group(1)) if step else None,
        has_fp32_master=train == FLOAT32,
        layout=f"fsdp{files.fsdp_version}",
        parallel={"fsdp": files.world_size},
        optimizer="Adam" if {"exp_avg", "exp_avg_sq"} <= moments else None,
        extra={
            "fsdp_version": files.fsdp_version,
            "files": [p.name for p in (*files.model, *files.optim, *files.extra)],
            "huggingface": (folder / "huggingface").is_dir(),
            "skipped_keys": skipped,
        },
    )
    logger.debug("opened %s: verl FSDP2, %d ranks, %d tensors", folder, files.world_size, len(infos))
    return VerlCheckpoint(metadata, infos, tied, pieces, optim, opened, unmapped)
