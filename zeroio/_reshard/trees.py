"""The object tree of each target rank file, with every tensor a fill whose bytes are streamed when it is saved."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import _constants as C
from .._formats import moment_source, read_plan_into, zero3_partition_numel
from .._io.fileio import ChunkBuffers
from .._pickles import Chunks, RankFileBuilder, TensorRef, Where, writable
from .targets import RankRead, ReshardPlan, rank_reads

__all__ = ["RankTrees"]


class _Buffers:
    """Reused read and zero buffers, one per dtype: memory stays at a chunk or two."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._reads = ChunkBuffers()
        self._zeros: dict[torch.dtype, torch.Tensor] = {}

    def _elements(self, dtype: torch.dtype) -> int:
        return max(1, self.chunk_bytes // dtype.itemsize)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        n = self._elements(dtype)
        return self._reads.get(dtype, n)[:n]

    def zeros(self, dtype: torch.dtype) -> torch.Tensor:
        buf = self._zeros.get(dtype)
        if buf is None:
            buf = self._zeros[dtype] = torch.zeros(self._elements(dtype), dtype=dtype)
        return buf


def _ref_chunks(ref: TensorRef, buffers: _Buffers) -> Chunks:
    """A stored tensor, copied in bounded chunks."""

    def run() -> Iterator[torch.Tensor]:
        buf = buffers.read(ref.dtype)
        for start in range(0, ref.numel, buf.numel()):
            n = min(buf.numel(), ref.numel - start)
            ref.read(start, n, buf[:n])
            yield buf[:n]

    return run


def _slices_chunks(reads: list[RankRead], dtype: torch.dtype, buffers: _Buffers) -> Chunks:
    """``(source, start, count, padding)`` rows: ``count`` elements of a consolidated tensor, then zeros."""

    def run() -> Iterator[torch.Tensor]:
        buf = buffers.read(dtype)
        zeros = buffers.zeros(dtype)
        for source, start, count, padding in reads:
            for done in range(0, count, buf.numel()):
                n = min(buf.numel(), count - done)
                read_plan_into(source, start + done, buf[:n])
                yield buf[:n]
            for done in range(0, padding, zeros.numel()):
                yield zeros[: min(zeros.numel(), padding - done)]

    return run


class RankTrees:
    """Builds each target rank file's tree from rank 0's parsed source files (data-less tensors, fills recorded)."""

    def __init__(self, plan: ReshardPlan, chunk_bytes: int) -> None:
        self.plan = plan
        self._buffers = _Buffers(chunk_bytes)

    def _copy(self, value: Any, where: Where, builder: RankFileBuilder, source: Path) -> Any:
        """A parsed value, made picklable again; its stored tensors are copied whole."""

        def tensor(ref: TensorRef, path: Where) -> torch.Tensor:
            return builder.tensor(path, ref.shape, ref.dtype, _ref_chunks(ref, self._buffers))

        return writable(value, where, tensor=tensor, source=source)

    def model_file(self, rank: int) -> tuple[Any, RankFileBuilder]:
        """Rank ``rank``'s model states: module placeholders and buffers, param shapes, frozen fragments, ..."""
        plan, ckpt, buffers = self.plan, self.plan.ckpt, self._buffers
        model0, model0_path = plan.model0, plan.model0_path
        module = model0[C.MODULE]
        buffer_names = {str(b) for b in (model0.get(C.BUFFER_NAMES) or [])}
        frozen_shapes = model0.get(C.FROZEN_PARAM_SHAPES)
        has_fragments = model0.get(C.FROZEN_PARAM_FRAGMENTS) is not None
        builder = RankFileBuilder()
        tree: dict[Any, Any] = {}
        for key, value in model0.items():
            if key == C.MODULE:
                entries: collections.OrderedDict[str, Any] = collections.OrderedDict()
                for name, ref in module.items():
                    if name not in buffer_names and isinstance(ref, TensorRef) and ref.numel == 0:
                        entries[name] = torch.empty(ref.shape, dtype=ref.dtype)  # ZeRO-3 parameter placeholder
                    else:
                        entries[name] = self._copy(ref, (key, name), builder, model0_path)
                tree[key] = entries
            elif key == C.FROZEN_PARAM_FRAGMENTS and has_fragments:
                fragments: collections.OrderedDict[str, Any] = collections.OrderedDict()
                for name in frozen_shapes or {}:
                    info = ckpt.info(name)
                    reads = rank_reads([ckpt.read_plan(name)], [info.numel], plan.world_size, rank)
                    part = zero3_partition_numel(info.numel, plan.world_size)
                    fragments[name] = builder.tensor(
                        (key, name), (part,), info.dtype, _slices_chunks(reads, info.dtype, buffers)
                    )
                tree[key] = fragments
            elif key == C.PARAM_SHAPES:
                tree[key] = [
                    collections.OrderedDict((n, torch.Size(ckpt.info(n).shape)) for n in sub.names) for sub in plan.subs
                ]
            elif key == C.DP_WORLD_SIZE:
                tree[key] = plan.world_size
            elif key == C.SHARED_PARAMS and rank > 0 and isinstance(value, dict):
                tree[key] = type(value)()  # DeepSpeed 0.19.8 records the ties on rank 0 only
            else:
                tree[key] = self._copy(value, (key,), builder, model0_path)
        return tree, builder

    def optim_file(self, rank: int) -> tuple[Any, RankFileBuilder]:
        """Rank ``rank``'s optimizer states: fp32 partitions and moments per sub-group, param groups, the rest."""
        plan, ckpt, layout, buffers = self.plan, self.plan.ckpt, self.plan.layout, self._buffers
        optim0, optim0_path = plan.optim0, plan.optim0_path
        key_osd = C.OPTIMIZER_STATE_DICT
        osd0 = optim0[key_osd]
        base0 = osd0[key_osd]
        builder = RankFileBuilder()
        state: dict[int, dict[str, Any]] = {}
        flats = []
        pgroups: list[dict[str, Any]] = [{} for _ in layout.param_groups]
        members: list[list[int]] = [[] for _ in layout.param_groups]
        source_entries = base0.get("state") or {}
        for s, sub in enumerate(plan.subs):
            members[sub.param_group].append(s)
            sources: list[Any] = [ckpt.read_plan(n) for n in sub.names]  # trainable at ZeRO-3: FlatPlans
            reads = rank_reads(sources, sub.numels, plan.world_size, rank)
            size = sum(zero3_partition_numel(n, plan.world_size) for n in sub.numels)
            flats.append(
                builder.tensor(
                    (key_osd, C.FP32_FLAT_GROUPS, s),
                    (size,),
                    plan.flat_dtype,
                    _slices_chunks(reads, plan.flat_dtype, buffers),
                )
            )
            if not sub.names:
                continue  # an empty sub-group's flat tensor never steps: no state entry
            entry: dict[str, Any] = {}
            original = source_entries.get(layout.entries[sub.step_group], {})
            for k, v in original.items():
                where = (key_osd, key_osd, "state", s, k)
                if k in layout.moments:
                    dtype = v.dtype if isinstance(v, TensorRef) else torch.float32
                    moment_reads: list[RankRead] = [
                        (moment_source(layout, src, k), start, count, pad)
                        for src, (_, start, count, pad) in zip(sources, reads)
                    ]
                    entry[k] = builder.tensor(where, (size,), dtype, _slices_chunks(moment_reads, dtype, buffers))
                else:
                    entry[k] = self._copy(v, where, builder, optim0_path)
            state[s] = entry
        for g, group in enumerate(base0.get("param_groups") or []):
            for k, v in group.items():
                where = (key_osd, key_osd, "param_groups", g, k)
                pgroups[g][k] = members[g] if k == "params" else self._copy(v, where, builder, optim0_path)
        osd: dict[str, Any] = {}
        for k, v in osd0.items():
            if k == key_osd:
                osd[k] = {"state": state, "param_groups": pgroups}
            elif k == C.FP32_FLAT_GROUPS:
                osd[k] = flats
            elif k == C.PARTITION_COUNT:
                osd[k] = plan.world_size
            else:
                osd[k] = self._copy(v, (key_osd, k), builder, optim0_path)
        tree = {k: osd if k == key_osd else self._copy(v, (k,), builder, optim0_path) for k, v in optim0.items()}
        return tree, builder
