"""Torch state-dict files (``.bin``/``.pt``/``.pth``, Lightning ``.ckpt``, sharded ``.bin``) read without running pickle code."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._dtypes import FLOAT32
from ..._io.byte_map import ConcatMap
from ..._io.integrity import CheckedFile
from ..._messages import get_logger
from ..._pickles import RankFile, TensorRef, load_pickle
from ...errors import CheckpointFormatError
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo
from .shard_index import read_index, shard_paths

if TYPE_CHECKING:
    import torch

__all__ = ["TorchCheckpoint", "open_torch"]

logger = get_logger(__name__)

# Where a state dict sits inside a torch file written by a framework: Lightning's .ckpt ("state_dict"),
# common training scripts ("model_state_dict", "model"), DeepSpeed's model_states ("module").
_NESTED_STATE_DICT_KEYS = ("state_dict", "model_state_dict", "module", "model")


class TorchCheckpoint(Checkpoint):
    """A ``torch.save``'d state dict (``.bin``/``.pt``/``.pth``, Lightning ``.ckpt``, or a sharded ``.bin`` folder).

    Parsed with zeroio's restricted unpickler only: nothing in the file can run code.
    """

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        refs: dict[str, TensorRef],
        files: list[RankFile],
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._refs = refs
        self._files = files

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        self._refs[name].read(start, out.numel(), out)

    def byte_map(self, name: str) -> ConcatMap | None:
        ref = self._refs[name]
        whole = ref.byte_range(0, ref.numel)
        return None if whole is None else ConcatMap([whole], ref.dtype_spec.itemsize)

    def _release(self) -> None:
        for file in self._files:
            file.close()

    def _checked_files(self) -> list[CheckedFile]:
        return [file.source for file in self._files]


def _has_tensors(value: Any) -> bool:
    return isinstance(value, dict) and any(isinstance(v, TensorRef) for v in value.values())


def _find_state_dict(tree: Any, path: Path) -> tuple[dict[Any, Any], str | None]:
    """The state dict inside a torch file and the key it sat under (None for a bare state dict)."""
    if not isinstance(tree, dict):
        raise CheckpointFormatError(
            f"'{path}' holds a {type(tree).__name__}, not a state dict. Save model.state_dict() with torch.save.",
            path=path,
        )
    if _has_tensors(tree):
        return tree, None
    for key in _NESTED_STATE_DICT_KEYS:
        if _has_tensors(tree.get(key)):
            return tree[key], key
    keys = ", ".join(sorted(map(str, tree))[:8])
    raise CheckpointFormatError(
        f"'{path}' holds no tensors at its top level nor under {', '.join(repr(k) for k in _NESTED_STATE_DICT_KEYS)} "
        f"(top-level keys: {keys or 'none'}). Save model.state_dict() with torch.save.",
        path=path,
    )


def _tie_key(ref: TensorRef) -> tuple[Any, ...]:
    return (id(ref.file), ref.storage.key, ref.storage.dtype, ref.storage_offset, ref.shape, ref.stride)


def open_torch(path: Path, index_path: Path | None, trusted: frozenset[str]) -> TorchCheckpoint:
    """Open one torch file, or the shards ``index_path`` names; tensors stay references into the archives."""
    # 1. Unpickle each file (restricted, lazy: tensors are references into the archive).
    files: list[RankFile] = []
    refs: dict[str, TensorRef] = {}
    skipped: list[str] = []
    nested_key: str | None = None
    client: dict[str, Any] = {}
    if index_path is None:
        paths_by_shard = {path.name: path}
        weight_map: dict[str, str] | None = None
    else:
        weight_map, _ = read_index(index_path)
        paths_by_shard = shard_paths(index_path, weight_map)
    try:
        for shard, shard_path in paths_by_shard.items():
            tree, file = load_pickle(shard_path, trusted_globals=trusted)
            files.append(file)
            state, nested_key = _find_state_dict(tree, shard_path)
            if nested_key is not None:
                client = {str(k): v for k, v in tree.items() if k != nested_key}
            for key, value in state.items():
                if not isinstance(key, str) or not isinstance(value, TensorRef):
                    skipped.append(str(key))  # e.g. a module's `_extra_state`; not a tensor
                    continue
                if weight_map is not None and weight_map.get(key) != shard:
                    continue  # the index is the truth for which shard holds a name (Hugging Face semantics)
                refs[key] = value
        if weight_map is not None:
            absent = [k for k in weight_map if k not in refs]
            if absent:
                raise CheckpointFormatError(
                    f"'{index_path}' maps '{absent[0]}' to '{weight_map[absent[0]]}', which holds no such tensor "
                    f"({len(absent)} names missing). The index and its shards come from different saves.",
                    path=paths_by_shard[weight_map[absent[0]]],
                    name=absent[0],
                )
    except BaseException:
        for file in files:
            file.close()
        raise

    # 2. Tensors that share one storage view (torch.save keeps ties) become aliases of the first name.
    first: dict[tuple[Any, ...], str] = {}
    tied: dict[str, str] = {}
    infos: dict[str, TensorInfo] = {}
    for name, ref in refs.items():
        source = first.setdefault(_tie_key(ref), name)
        if source != name:
            tied[name] = source
        infos[name] = TensorInfo(
            name, ref.shape, ref.dtype_spec, "tensor", (ref.file.path,), None, source if source != name else None
        )

    step = client.get("global_step")
    dtypes = {r.dtype_spec for r in refs.values() if r.dtype_spec.is_floating_point}
    metadata = CheckpointMetadata(
        format="torch",
        path=index_path.parent if index_path is not None else path,
        global_step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        train_dtype=dtypes.pop() if len(dtypes) == 1 else None,
        has_fp32_master=FLOAT32 in {r.dtype_spec for r in refs.values()},
        extra={
            "files": [f.path.name for f in files],
            "index": index_path.name if index_path is not None else None,
            "state_dict_key": nested_key,
            "client_state_keys": sorted(client),
            "lightning_version": client.get("pytorch-lightning_version"),
            "skipped_keys": skipped,
        },
    )
    logger.debug("opened %s: torch, %d files, %d tensors", metadata.path, len(files), len(infos))
    return TorchCheckpoint(metadata, infos, tied, refs, files)
