"""What a conversion writes, decided from a checkpoint's metadata before any tensor byte is read: the WritePlan."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .. import _constants as C
from .._dtypes import DType
from .._formats import Checkpoint, output_spec
from ..errors import UnsupportedCheckpointError
from .options import WriteOptions
from .safetensors_writer import SafetensorsLayout, plan_file, storable
from .sharding import ShardPlan, index_json, plan_shards

__all__ = ["WRITE_FORMATS", "WritePlan", "plan_write"]

WRITE_FORMATS = ("safetensors", "torch")
"""The folder formats the write engine produces (``fmt="lightning"``, one file, has its own writer)."""


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Every file to write and every byte offset in it, from metadata only; identical on every process."""

    fmt: str
    """``"safetensors"`` or ``"torch"``."""
    target: DType | None
    """The cast asked for (None: as stored)."""
    names: tuple[str, ...]
    """Tensors written, in source order (frozen ones left out with ``exclude_frozen``)."""
    excluded: tuple[str, ...]
    """Frozen parameters left out, in source order."""
    ties: Mapping[str, str]
    """Tied aliases among ``names``, ``{alias: source}``."""
    dtypes: Mapping[str, DType]
    """The dtype each tensor is written in (torch-free: ``.torch`` gives the ``torch.dtype``)."""
    shards: ShardPlan
    """Which tensors go in which file, in shard order."""
    index: str | None
    """The index file's text, or None for one file."""
    layouts: tuple[tuple[str, SafetensorsLayout], ...] = ()
    """safetensors only: each file's header and tensor byte ranges."""
    file_bytes: tuple[int, ...] = ()
    """Bytes of each shard on disk (safetensors) or of its tensors (torch): what balances processes."""
    data_bytes: tuple[int, ...] = ()
    """Bytes of tensor data of each shard (each tied group once)."""
    num_params: int = 0
    """Elements of the distinct tensors written (a tied group counted once)."""

    @property
    def index_name(self) -> str:
        """The index file's name for this format."""
        return C.SAFETENSORS_INDEX if self.fmt == "safetensors" else C.TORCH_INDEX

    @property
    def num_tensors(self) -> int:
        """Distinct tensors stored (a tied alias shares its source's bytes)."""
        return len([n for n in self.names if n not in self.ties])

    def fingerprint(self) -> str:
        """A digest of everything the plan decides, to check that every process planned the same output."""
        digest = hashlib.sha256(self.fmt.encode())
        digest.update(json.dumps([[f, list(names)] for f, names in self.shards.shards]).encode())
        for _, layout in self.layouts:
            digest.update(layout.header)
        digest.update((self.index or "").encode())
        return digest.hexdigest()

    def subset(self, shard_indices: Sequence[int]) -> WritePlan:
        """The plan of some shards only (one process's share), without the index: the whole plan's committer
        writes it."""
        if list(shard_indices) == list(range(len(self.shards.shards))):
            return self
        shards = tuple(self.shards.shards[i] for i in shard_indices)
        sub = ShardPlan(
            shards=shards,
            weight_map={name: filename for filename, names in shards for name in names},
            total_size=sum(self.data_bytes[i] for i in shard_indices),
        )
        return replace(
            self,
            shards=sub,
            index=None,
            layouts=tuple(self.layouts[i] for i in shard_indices) if self.layouts else (),
            file_bytes=tuple(self.file_bytes[i] for i in shard_indices),
            data_bytes=tuple(self.data_bytes[i] for i in shard_indices),
        )


def _check_safetensors_dtypes(ckpt: Checkpoint, dtypes: Mapping[str, DType]) -> None:
    """A tensor safetensors cannot encode (complex128, say) is the checkpoint's trait, not a bad argument: name it."""
    for name, dtype in dtypes.items():
        if not storable(dtype):
            raise UnsupportedCheckpointError(
                f"'{ckpt.metadata.path}': tensor '{name}' is {dtype}, which safetensors cannot store. Convert with "
                "fmt='torch'.",
                path=ckpt.metadata.path,
                name=name,
                found=str(dtype),
            )


def plan_write(ckpt: Checkpoint, write: WriteOptions) -> WritePlan:
    """Plan every file from metadata: names, ties, dtypes, shards, headers, offsets, index.

    Raises:
        UnsupportedCheckpointError: a dtype safetensors cannot hold (before anything is created).
    """
    fmt, target, max_shard_size, exclude_frozen = write.fmt, write.dtype, write.max_shard_size, write.exclude_frozen
    infos = ckpt.infos
    excluded = tuple(n for n, info in infos.items() if exclude_frozen and info.kind == "frozen")
    names = tuple(n for n in infos if n not in excluded)
    ties = {alias: source for alias, source in ckpt.tied.items() if alias in names and source in names}
    dtypes = {n: output_spec(infos[n], target) for n in names}
    nbytes = {n: infos[n].numel * dtypes[n].itemsize for n in names}
    if fmt == "safetensors":
        _check_safetensors_dtypes(ckpt, dtypes)
        # 1. Shards from sizes alone, as huggingface_hub splits (tied aliases are dropped, as it does for
        #    safetensors).
        stored = [n for n in names if n not in ties]
        shards = plan_shards({n: nbytes[n] for n in stored}, max_shard_size=max_shard_size,
                             filename_pattern="model{suffix}.safetensors")  # fmt: skip
        # 2. huggingface_hub's save_torch_state_dict records each dropped alias as `alias: kept name`: in the
        #    header of a single file, in the index's metadata when sharded.
        tie_meta = {alias: ties[alias] for alias in names if alias in ties}
        file_meta = {"format": "pt"} if shards.is_sharded else {"format": "pt", **tie_meta}
        # 3. Every file's header and byte offsets.
        layouts = tuple(
            (filename, plan_file([(n, dtypes[n], infos[n].shape) for n in shard_names], metadata=file_meta))
            for filename, shard_names in shards.shards
        )
        index = index_json(shards, extra_metadata=tie_meta) if shards.is_sharded else None
        file_bytes = tuple(layout.size for _, layout in layouts)
        data_bytes = tuple(layout.data_bytes for _, layout in layouts)
    else:
        # Tied names stay as keys sharing one tensor (torch.save stores the storage once), in one shard, as
        # huggingface_hub's save_torch_state_dict(safe_serialization=False) does.
        shards = plan_shards(nbytes, max_shard_size=max_shard_size, filename_pattern="pytorch_model{suffix}.bin",
                             aliases=ties)  # fmt: skip
        layouts = ()
        index = index_json(shards) if shards.is_sharded else None
        data_bytes = tuple(sum(nbytes[n] for n in shard if n not in ties) for _, shard in shards.shards)
        file_bytes = data_bytes
    return WritePlan(
        fmt=fmt,
        target=target,
        names=names,
        excluded=excluded,
        ties=ties,
        dtypes=dtypes,
        shards=shards,
        index=index,
        layouts=layouts,
        file_bytes=file_bytes,
        data_bytes=data_bytes,
        num_params=sum(infos[n].numel for n in names if n not in ties),
    )
