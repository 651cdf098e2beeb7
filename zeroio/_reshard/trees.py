"""The object tree of each target rank file, with every tensor a fill whose bytes are streamed when it is saved."""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import _constants as C
from .._formats import moment_source, read_plan_into, zero3_partition_numel
from .._io.fileio import ChunkBuffers, tensor_bytes
from .._pickles import Chunks, RankFileBuilder, TensorRef, Where, writable
from .targets import RankRead, ReshardPlan, rank_reads

__all__ = ["RankTrees"]


class _Buffers:
    """Reused read buffers, one per dtype, and the read-ahead windows: memory stays at a chunk or two."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._reads = ChunkBuffers()
        self._zeros: memoryview | None = None
        self.windows = _Windows()
        self.blocks = _Blocks()

    def _elements(self, dtype: torch.dtype) -> int:
        return max(1, self.chunk_bytes // dtype.itemsize)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        n = self._elements(dtype)
        return self._reads.get(dtype, n)[:n]

    def zero_bytes(self) -> memoryview:
        """A chunk of zero bytes (calloc'd: untouched pages cost no memory)."""
        if self._zeros is None:
            self._zeros = memoryview(bytes(self.chunk_bytes))
        return self._zeros


class _Windows:
    """Reads shared by consecutive target ranks, which the files are written in.

    Rank ``r + 1``'s part of a tensor starts where rank ``r``'s ends, so one read of the next :attr:`ranks` ranks'
    parts serves them from memory. Without it a reshard of 2,000 tensors to 1,024 ranks made 6 million reads of a
    few bytes each (a syscall and a CRC-32 fold apiece). ``ranks`` is set so that one window per tensor and state
    holds about one chunk in all; 1 (reads straight into the output chunk) when one rank's part is a chunk or more.
    The flat groups of the optimizer states go through :class:`_Blocks` where ``ranks`` > 1 (frozen fragments, of the
    model states, through these windows).
    """

    def __init__(self) -> None:
        self.ranks = 1
        self._held: dict[Hashable, tuple[int, int, memoryview, torch.Tensor]] = {}

    def copy(
        self, key: Hashable, source: Any, at: int, n: int, out: memoryview, pos: int, end: int, dtype: torch.dtype
    ) -> bool:
        """Elements ``[at, at + n)`` of ``source`` into the bytes ``out[pos:]`` from the window of ``key`` (read
        ``[at, end)`` ahead on a miss); False where a window would hold no more than that (the caller reads)."""
        held = self._held.get(key)
        if held is None or at < held[0] or at + n > held[1]:
            if self.ranks <= 1 or end <= at + n:
                return False
            self._held.pop(key, None)
            window = torch.empty(end - at, dtype=dtype)
            read_plan_into(source, at, window)
            held = self._held[key] = (at, end, tensor_bytes(window), window)
        each = held[3].element_size()
        lo = (at - held[0]) * each
        out[pos : pos + n * each] = held[2][lo : lo + n * each]
        return True


class _Blocks:
    """The flat partitions of several consecutive target ranks, made at once, one row a rank.

    A flat group of 2,000 parameters on 1,024 ranks is 2,000 slices a rank, 6 million in all with the two moments:
    copied one by one (even from :class:`_Windows`) they took most of a reshard's time. A block of the next
    ``ranks`` ranks is made with one read and one strided copy per parameter (each parameter's slices of those ranks
    are consecutive elements of it), and each rank's file takes its row. ``ranks`` is the windows' (about a chunk
    in all), so this serves only rank files of partitions under half a chunk; larger ones stream slice by slice.
    """

    def __init__(self) -> None:
        self._held: dict[Hashable, tuple[int, torch.Tensor]] = {}

    def row(self, key: Hashable, rank: int, ranks: int, sources: Sequence[Any], numels: Sequence[int],
            world_size: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """Rank ``rank``'s flat partition of ``sources`` (the group ``key``), from the block holding it."""
        first = rank - rank % ranks
        held = self._held.get(key)
        if held is None or held[0] != first:
            self._held.pop(key, None)  # the block of the ranks before: written
            block = _block(sources, numels, world_size, first, min(first + ranks, world_size), dtype)
            held = self._held[key] = (first, block)
        return held[1][rank - first]


def _block(
    sources: Sequence[Any], numels: Sequence[int], world_size: int, first: int, stop: int, dtype: torch.dtype
) -> torch.Tensor:
    """Ranks ``[first, stop)``'s flat partitions of the parameters ``sources``, one row a rank, padding zeros."""
    parts = [zero3_partition_numel(n, world_size) for n in numels]
    block = torch.zeros((stop - first, sum(parts)), dtype=dtype)
    column = 0
    for source, numel, part in zip(sources, numels, parts):
        lo, hi = first * part, min(stop * part, numel)
        if hi > lo:
            flat = torch.empty(hi - lo, dtype=dtype)
            read_plan_into(source, lo, flat)
            rows, rest = divmod(hi - lo, part)  # whole rows, then the last holder's elements (padding follows)
            if rows:
                block[:rows, column : column + part] = flat[: rows * part].view(rows, part)
            if rest:
                block[rows, column : column + rest] = flat[rows * part :]
        column += part
    return block


def _ref_chunks(ref: TensorRef, buffers: _Buffers) -> Chunks:
    """A stored tensor, copied in bounded chunks."""

    def run() -> Iterator[torch.Tensor]:
        buf = buffers.read(ref.dtype)
        for start in range(0, ref.numel, buf.numel()):
            n = min(buf.numel(), ref.numel - start)
            ref.read(start, n, buf[:n])
            yield buf[:n]

    return run


def _slices_chunks(
    reads: list[RankRead], tensors: Sequence[tuple[Hashable, int]], dtype: torch.dtype, buffers: _Buffers
) -> Chunks:
    """``(source, start, count, padding)`` rows: ``count`` elements of a consolidated tensor, then zeros, packed
    into chunks (a row is a few bytes at a thousand ranks: one write per row would be a syscall per few bytes).

    ``tensors`` gives each row's ``(key, numel)``: its tensor and state, for the read-ahead :class:`_Windows`."""

    def run() -> Iterator[torch.Tensor]:
        buf = buffers.read(dtype)
        raw, each, zeros = tensor_bytes(buf), buf.element_size(), buffers.zero_bytes()
        size, fill = buf.numel(), 0
        windows = buffers.windows
        for (source, start, count, padding), (key, numel) in zip(reads, tensors):
            end = min(start + windows.ranks * (count + padding), numel)
            for at, left, zero in ((start, count, False), (start + count, padding, True)):
                while left:
                    n = min(size - fill, left)
                    if zero:
                        raw[fill * each : (fill + n) * each] = zeros[: n * each]
                    elif not windows.copy(key, source, at, n, raw, fill * each, end, dtype):
                        read_plan_into(source, at, buf[fill : fill + n])
                    fill, at, left = fill + n, at + n, left - n
                    if fill == size:
                        yield buf
                        fill = 0
        if fill:
            yield buf[:fill]

    return run


class RankTrees:
    """Builds each target rank file's tree from rank 0's parsed source files (data-less tensors, fills recorded)."""

    def __init__(self, plan: ReshardPlan, chunk_bytes: int) -> None:
        self.plan = plan
        self._buffers = _Buffers(chunk_bytes)
        self._sources: dict[tuple[int, str | None], tuple[list[Any], list[tuple[Hashable, int]]]] = {}
        self._same: dict[Hashable, Any] = {}  # parts of the model states alike on every rank, made once

    def read_ahead(self, rank_bytes: int) -> None:
        """Size the read-ahead :class:`_Windows` for rank files of ``rank_bytes`` bytes of tensors each."""
        ranks = self._buffers.chunk_bytes // max(1, rank_bytes)
        self._buffers.windows.ranks = max(1, min(self.plan.world_size, ranks))

    def _sub_sources(self, s: int, state: str | None) -> tuple[list[Any], list[tuple[Hashable, int]]]:
        """Sub-group ``s``'s read plans (``state`` None: the fp32 masters, else that moment's) and each tensor's
        ``(key, numel)``, made once for all ranks."""
        found = self._sources.get((s, state))
        if found is None:
            sub, layout = self.plan.subs[s], self.plan.layout
            masters: list[Any] = [self.plan.ckpt.read_plan(n) for n in sub.names]  # trainable at ZeRO-3: FlatPlans
            plans = masters if state is None else [moment_source(layout, m, state) for m in masters]
            found = self._sources[(s, state)] = (plans, [((s, state, i), n) for i, n in enumerate(sub.numels)])
        return found

    def _copy(self, value: Any, where: Where, builder: RankFileBuilder, source: Path) -> Any:
        """A parsed value, made picklable again; its stored tensors are copied whole."""

        def tensor(ref: TensorRef, path: Where) -> torch.Tensor:
            return builder.tensor(path, ref.shape, ref.dtype, _ref_chunks(ref, self._buffers))

        return writable(value, where, tensor=tensor, source=source)

    def pickle_kind(self, kind: int, rank: int) -> Hashable:
        """Files of one kind pickle alike but for their tensors' bytes (``kind`` 0: model states, 1: optimizer
        states): what :meth:`model_file` and :meth:`optim_file` build depends on the rank only through the tensors'
        bytes, save rank 0's model states (the ``shared_params`` DeepSpeed records on rank 0 alone)."""
        return (kind, kind == 0 and rank == 0)

    def _placeholders(self, module: dict[str, Any], buffer_names: set[str]) -> dict[str, torch.Tensor]:
        """The module's ZeRO-3 parameter placeholders (empty tensors), made once and shared by every rank's tree:
        a pickle template (``zeroio._pickles.pickle_template``) knows the very tensors it recorded."""
        found = self._same.get(C.MODULE)
        if found is None:
            found = self._same[C.MODULE] = {
                name: torch.empty(ref.shape, dtype=ref.dtype)
                for name, ref in module.items()
                if name not in buffer_names and isinstance(ref, TensorRef) and ref.numel == 0
            }
        return found

    def _partition(self, rank: int, s: int, state: str | None, dtype: torch.dtype) -> Chunks:
        """Rank ``rank``'s flat partition of sub-group ``s`` (``state`` None: the fp32 masters, else that moment),
        from a :class:`_Blocks` row where consecutive ranks' partitions fit a chunk, else slice by slice."""
        sources, tensors = self._sub_sources(s, state)
        ranks, numels, world_size = self._buffers.windows.ranks, self.plan.subs[s].numels, self.plan.world_size
        if ranks > 1:
            blocks = self._buffers.blocks

            def row() -> Iterator[torch.Tensor]:
                yield blocks.row((s, state), rank, ranks, sources, numels, world_size, dtype)

            return row
        reads: list[RankRead] = rank_reads(sources, numels, world_size, rank)
        return _slices_chunks(reads, tensors, dtype, self._buffers)

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
                placeholders = self._placeholders(module, buffer_names)
                for name, ref in module.items():
                    found = placeholders.get(name)
                    entries[name] = self._copy(ref, (key, name), builder, model0_path) if found is None else found
                tree[key] = entries
            elif key == C.FROZEN_PARAM_FRAGMENTS and has_fragments:
                fragments: collections.OrderedDict[str, Any] = collections.OrderedDict()
                for name in frozen_shapes or {}:
                    info = ckpt.info(name)
                    reads = rank_reads([ckpt.read_plan(name)], [info.numel], plan.world_size, rank)
                    part = zero3_partition_numel(info.numel, plan.world_size)
                    fragments[name] = builder.tensor(
                        (key, name),
                        (part,),
                        info.dtype,
                        _slices_chunks(reads, [((key, name), info.numel)], info.dtype, buffers),
                    )
                tree[key] = fragments
            elif key == C.PARAM_SHAPES:
                if key not in self._same:
                    self._same[key] = [
                        collections.OrderedDict((n, torch.Size(ckpt.info(n).shape)) for n in sub.names)
                        for sub in plan.subs
                    ]
                tree[key] = self._same[key]
            elif key == C.DP_WORLD_SIZE:
                tree[key] = plan.world_size
            elif key == C.SHARED_PARAMS and rank > 0 and isinstance(value, dict):
                tree[key] = type(value)()  # DeepSpeed 0.19.8 records the ties on rank 0 only
            else:
                tree[key] = self._copy(value, (key,), builder, model0_path)
        return tree, builder

    def optim_file(self, rank: int) -> tuple[Any, RankFileBuilder]:
        """Rank ``rank``'s optimizer states: fp32 partitions and moments per sub-group, param groups, the rest."""
        plan, layout = self.plan, self.plan.layout
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
            size = sum(zero3_partition_numel(n, plan.world_size) for n in sub.numels)
            chunks = self._partition(rank, s, None, plan.flat_dtype)
            flats.append(builder.tensor((key_osd, C.FP32_FLAT_GROUPS, s), (size,), plan.flat_dtype, chunks))
            if not sub.names:
                continue  # an empty sub-group's flat tensor never steps: no state entry
            entry: dict[str, Any] = {}
            original = source_entries.get(layout.entries[sub.step_group], {})
            for k, v in original.items():
                where = (key_osd, key_osd, "state", s, k)
                if k in layout.moments:
                    dtype = v.dtype if isinstance(v, TensorRef) else torch.float32
                    entry[k] = builder.tensor(where, (size,), dtype, self._partition(rank, s, k, dtype))
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
