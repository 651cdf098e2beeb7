"""Lazy views over an open PEFT checkpoint: one adapter under PEFT's names, or the base model with LoRA merged in.

Both are :class:`Checkpoint` mappings, so every writer and ``load`` consume them unchanged. A merged weight is
computed when read, chunk by chunk: ``W[chunk] + delta[chunk]`` in fp32, ``delta = transpose(B @ A) * scale``
computed once per weight, so memory holds the weights in flight and their factors, never the model.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._dtypes import DType, as_dtype
from ..._io.byte_map import ByteMap
from ..._io.remote_path import RemotePath
from ..._io.sources import ByteRange
from ...errors import CheckpointFormatError, UnsupportedCheckpointError
from ..checkpoint import Checkpoint
from ..metadata import TensorInfo
from ..view import CheckpointView
from .config import AdapterConfig, AdapterConfigSource, read_adapter_configs
from .names import PEFT_PREFIX, LoraPair, adapter_keys, adapter_names, base_names, lora_pairs, unmergeable_tensors

if TYPE_CHECKING:
    import torch

    from ..._io.read_ahead import ReadAhead

__all__ = ["RenamedView", "adapter_configs", "adapter_view", "merged_lora_view", "peft_adapters"]

_FP32 = as_dtype("float32")
_DELTAS_KEPT = 8
"""Deltas kept for weights read in chunks (the writers read up to 4 weights at once, one per IO thread)."""


class RenamedView(CheckpointView):
    """Some tensors of an open checkpoint under other names; reads, byte ranges and CRC checks go to it."""

    def __init__(self, inner: Checkpoint, names: Mapping[str, str], infos: dict[str, TensorInfo] | None = None) -> None:
        self._stored = dict(names)  # view name -> inner stored name
        inner_infos = inner.infos
        renamed = {stored: view_name for view_name, stored in self._stored.items()}
        tied = {renamed[a]: renamed[s] for a, s in inner.tied.items() if a in renamed and s in renamed}
        infos = infos if infos is not None else {}
        for view_name, stored in self._stored.items():
            if view_name in infos:
                continue
            info = inner_infos[stored]
            infos[view_name] = TensorInfo(
                view_name, info.shape, info.dtype_spec, info.kind, info.files, inner.stored_spec(stored),
                tied.get(view_name),
            )  # fmt: skip
        super().__init__(inner, inner.metadata, {n: infos[n] for n in self._stored}, tied)

    def read_ahead_into(self, name: str, start: int, out: torch.Tensor, read_ahead: ReadAhead | None) -> None:
        self._inner.read_ahead_into(self._inner.source_name(self._stored[name]), start, out, read_ahead)

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        return self._inner.byte_ranges(self._inner.source_name(self._stored[name]))

    def byte_map(self, name: str) -> ByteMap | None:
        return self._inner.byte_map(self._inner.source_name(self._stored[name]))

    def stored_spec(self, name: str) -> DType:
        info = self.info(name)
        return info.stored_spec or info.dtype_spec

    def optimizer_state(self, name: str) -> dict[str, Any]:
        raise UnsupportedCheckpointError(
            f"'{self.metadata.path}': a LoRA view (merge_lora, fmt='peft') has no optimizer state; convert the "
            "weights alone (no include_optimizer).",
            path=self.metadata.path, name=name,
        )  # fmt: skip


class _MergedView(RenamedView):
    """The base model's names; each LoRA-wrapped weight read as ``W + scale * B @ A`` computed in fp32."""

    def __init__(
        self, inner: Checkpoint, names: Mapping[str, str], merges: dict[str, tuple[LoraPair, float, bool]]
    ) -> None:
        inner_infos = inner.infos
        infos = {}
        for view_name, stored in names.items():
            if stored in merges:
                base, (pair, _, _) = inner_infos[stored], merges[stored]
                files = tuple(
                    dict.fromkeys(base.files + inner_infos[pair.lora_a].files + inner_infos[pair.lora_b].files)
                )
                # Computed and returned in fp32, as trained parameters' fp32 masters are: a cast (dtype=, or the
                # model's own dtype in load) rounds once, never a bf16 base rounded before and after the merge.
                infos[view_name] = TensorInfo(view_name, base.shape, _FP32, "trainable", files)
        super().__init__(inner, names, infos)
        self._merges = merges
        self._deltas: dict[str, torch.Tensor] = {}  # weights being read in chunks: their deltas
        self._lock = threading.Lock()

    def read_ahead_into(self, name: str, start: int, out: torch.Tensor, read_ahead: ReadAhead | None) -> None:
        stored = self._stored[name]
        if stored not in self._merges:
            super().read_ahead_into(name, start, out, read_ahead)
            return
        count, numel = out.numel(), self.info(name).numel
        base = self._inner.stored_dtype(stored)
        raw = out if base == out.dtype else out.new_empty(count, dtype=base)
        self._inner.read_ahead_into(self._inner.source_name(stored), start, raw, read_ahead)
        delta = self._delta(stored, read_ahead, done=start + count == numel)
        # base + delta, elementwise in fp32, in place: any slice of it equals the same slice of PEFT's whole-weight
        # sum (`base_layer.weight.data += delta`), and no chunk-sized temporary is made.
        if raw is not out:
            out.copy_(raw)
        out.add_(delta[start : start + count])

    def _delta(self, stored: str, read_ahead: ReadAhead | None, *, done: bool) -> torch.Tensor:
        """``transpose(B @ A, fan_in_fan_out) * scaling``, flattened, in fp32: peft 0.21.2's exact expression
        (``Linear.get_delta_weight``; ``Conv1D`` layers set ``fan_in_fan_out``), so the merge is bit-identical.

        Kept while its weight is read chunk by chunk and dropped after the last chunk: memory holds the deltas
        of the weights in flight (one per IO thread), never the model's.
        """
        with self._lock:
            delta = self._deltas.pop(stored, None) if done else self._deltas.get(stored)
        if delta is None:
            pair, scale, transposed = self._merges[stored]
            lora_a = self._inner.read_tensor(pair.lora_a, None, read_ahead).float()
            lora_b = self._inner.read_tensor(pair.lora_b, None, read_ahead).float()
            product = lora_b @ lora_a
            delta = ((product.T if transposed else product) * scale).reshape(-1)
            if not done:
                with self._lock:
                    while len(self._deltas) >= _DELTAS_KEPT:  # a reader that never reads a weight to its end
                        self._deltas.pop(next(iter(self._deltas)))
                    self._deltas[stored] = delta
        return delta

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        return None if self._stored[name] in self._merges else super().byte_ranges(name)

    def byte_map(self, name: str) -> ByteMap | None:
        return None if self._stored[name] in self._merges else super().byte_map(name)


def peft_adapters(ckpt: Checkpoint) -> list[str]:
    """The LoRA adapters in ``ckpt`` (refused with a typed error when there is none)."""
    adapters = adapter_names(ckpt.infos)
    if not adapters:
        raise UnsupportedCheckpointError(
            f"'{ckpt.metadata.path}' holds no LoRA adapter (no '<module>.lora_A.<adapter>.weight' tensor): it was "
            "not saved from a PEFT model. Convert it without fmt='peft' / merge_lora.",
            path=ckpt.metadata.path,
        )
    return adapters


def adapter_configs(
    ckpt: Checkpoint, source: Path | RemotePath, adapters: list[str], given: AdapterConfigSource
) -> dict[str, AdapterConfig]:
    """Each adapter's config: ``given``, else ``adapter_config.json`` in the training output folder: the path
    given (``checkpoint-N/``), the folder read (the tag folder) or its parent."""
    read = ckpt.metadata.path
    folders: list[Path | RemotePath] = []
    for folder in (source, read, read.parent, source.parent if source.is_file() else source):
        if folder.is_dir() and folder not in folders:
            folders.append(folder)
    return read_adapter_configs(adapters, folders, given)


def adapter_view(ckpt: Checkpoint, adapter: str, config: AdapterConfig) -> RenamedView:
    """One adapter's tensors under the keys of PEFT's ``adapter_model.safetensors``; its ``config`` says which
    biases and embedding weights PEFT saves with them."""
    names = list(ckpt.infos)
    others = [a for a in adapter_names(names) if a != adapter]
    rules = config.file_rules(_module_names(names))
    return RenamedView(ckpt, adapter_keys(names, adapter, others=others, rules=rules, tied=ckpt.tied))


def _module_names(names: list[str]) -> set[str]:
    """The PEFT-wrapped base model's module names (``model.embed_tokens``), as ``named_modules`` lists them."""
    modules: set[str] = set()
    for name in names:
        parts = name.removeprefix(PEFT_PREFIX).split(".")[:-1]
        modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return modules


def _refuse_unmergeable(path: Path, names: list[str], adapter: str) -> None:
    """Tensors of ``adapter`` that ``W + scale * B @ A`` cannot place, refused by name: trained token rows,
    factors without a base weight (``target_parameters``), DoRA magnitude vectors."""
    unmergeable = unmergeable_tensors(names, adapter)
    if unmergeable:
        module, what = next(iter(unmergeable.items()))
        raise UnsupportedCheckpointError(
            f"'{path}': adapter '{adapter}' has {what} at '{module}', which merge_lora cannot merge as "
            "W + scale * B @ A. Write the adapter with fmt='peft' and merge it with PEFT's merge_and_unload().",
            path=path, name=module,
        )  # fmt: skip
    if any(".lora_magnitude_vector." in n for n in names):  # DoRA tensors, whatever the config says
        raise UnsupportedCheckpointError(
            f"'{path}': adapter '{adapter}' has DoRA magnitude vectors (lora_magnitude_vector), which merge_lora does "
            "not merge. Write the adapter with fmt='peft' and merge it with PEFT's merge_and_unload().",
            path=path, name=adapter,
        )  # fmt: skip


def merged_lora_view(ckpt: Checkpoint, source: Path | RemotePath, given: AdapterConfigSource) -> Checkpoint:
    """The plain base model with the checkpoint's LoRA adapter merged in, as ``merge_and_unload()`` leaves it.

    Raises:
        UnsupportedCheckpointError: no adapter, several (merge_and_unload merges the active ones, which the
            checkpoint does not record), LoRA on convolutions, trained token rows, factors without a base weight,
            or a variant such as DoRA, by name.
        CheckpointNotFoundError: no ``adapter_config.json`` (the scale ``lora_alpha / r`` is not in the checkpoint).
    """
    adapters = peft_adapters(ckpt)
    path = ckpt.metadata.path
    if len(adapters) > 1:
        raise UnsupportedCheckpointError(
            f"'{path}' holds {len(adapters)} LoRA adapters ({', '.join(adapters)}); merge_lora merges one. Write "
            "them with fmt='peft' (one folder each) and merge the one you want with PEFT.",
            path=path, found=adapters,
        )  # fmt: skip
    adapter = adapters[0]
    config = adapter_configs(ckpt, source, adapters, given)[adapter]
    config.merge_scale(1)  # refuses DoRA and the other variants by name before anything is planned
    names = list(ckpt.infos)
    _refuse_unmergeable(path, names, adapter)
    merges: dict[str, tuple[LoraPair, float, bool]] = {}
    for base, pair in lora_pairs(names, adapter).items():
        lora_a, lora_b = ckpt.info(pair.lora_a).shape, ckpt.info(pair.lora_b).shape
        if len(lora_a) != 2:
            raise UnsupportedCheckpointError(
                f"'{path}': LoRA adapter '{adapter}' targets a {len(lora_a)}-D (convolution) layer ('{pair.module}'), "
                "which merge_lora does not merge yet. Write the adapter with fmt='peft' and merge it with PEFT's "
                "merge_and_unload().",
                path=path, name=pair.module,
            )  # fmt: skip
        # peft 0.21.2 Embedding.get_delta_weight transposes always (lora_embedding_A is [r, num_embeddings]).
        transposed = pair.embedding or config.fan_in_fan_out
        delta = (lora_a[1], lora_b[0]) if transposed else (lora_b[0], lora_a[1])
        if len(lora_b) != 2 or lora_b[1] != lora_a[0] or ckpt.info(base).shape != delta:
            raise CheckpointFormatError(
                f"'{path}': '{pair.module}' has base weight {ckpt.info(base).shape}, lora_A {lora_a} and lora_B "
                f"{lora_b}, which do not make W + B @ A with fan_in_fan_out={transposed} ({config.where}). "
                "Check that the adapter_config.json is this run's.",
                path=path, name=pair.module,
            )  # fmt: skip
        merges[base] = (pair, config.merge_scale(lora_a[0]), transposed)
    return _MergedView(ckpt, base_names(names, adapter), merges)
