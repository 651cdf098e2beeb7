"""Tensor-parallel DeepSpeed checkpoints (AutoTP, Megatron-style): one ZeRO checkpoint per tp rank, merged lazily.

Each tp rank ``t`` writes ``mp_rank_{t:02d}_model_states.pt`` (the full module, its split tensors as shards) and
its own ZeRO optimizer files ``*zero_pp_rank_{dp}_mp_rank_{t:02d}_optim_states.pt`` (fp32 masters of the shards,
ZeRO-partitioned over the data-parallel ranks of that tp rank). zeroio opens each tp rank as a ZeRO checkpoint
and serves every tensor from its shards: concatenated along its partition dimension, or rank 0's copy of a
replicated one. The partition comes from the files' ``universal_checkpoint_info`` or the user's ``tp_rules``
(:mod:`.tensor_parallel_rules`); a tensor neither describes is refused by name, never guessed.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._dtypes import DType
from ..._io.integrity import CheckedFile
from ..._io.sources import ByteRange
from ..._messages import get_logger, listing
from ..._pickles import short_repr
from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError
from ..checkpoint import Checkpoint
from ..metadata import CheckpointMetadata, TensorInfo
from ..name_patterns import MAX_NAME_CHARS
from ..optimizer.state import optimizer_state
from ..optimizer.views import merge_tp_states
from ..options import ReadOptions
from ..read_plans import sample_ranges
from ..tp_rules import (
    REPLICATED,
    UNSUPPORTED,
    PatternError,
    Rule,
    describe_rule,
    parse_tp_rules,
    recorded_rule,
    user_rule,
)
from ..zero.file_layout import find_tag_dir, model_parallel_ranks, scan_tag_dir
from ..zero.reader import ZeroCheckpoint, open_zero

if TYPE_CHECKING:
    import torch

    from ..._io.read_ahead import ReadAhead

__all__ = [
    "Merge",
    "MergePlan",
    "TensorParallelCheckpoint",
    "is_tensor_parallel",
    "open_tensor_parallel",
    "plan_tp_merges",
]

logger = get_logger(__name__)

UC_INFO = "universal_checkpoint_info"


@dataclass(frozen=True, slots=True)
class Merge:
    """How one stored tensor is rebuilt from the tp ranks' shards."""

    rule: Rule
    shard_shapes: tuple[tuple[int, ...], ...]

    def runs(self) -> tuple[int, list[int]]:
        """``(block, widths)``: the full tensor is ``outer`` blocks, each rank ``r``'s run of ``widths[r]`` in turn."""
        dim = int(self.rule)
        inner = math.prod(self.shard_shapes[0][dim + 1 :])
        widths = [shape[dim] * inner for shape in self.shard_shapes]
        return sum(widths), widths


class TensorParallelCheckpoint(Checkpoint):
    """A tensor-parallel checkpoint, merged lazily from its tp ranks; build it with :func:`zeroio.open`."""

    def __init__(
        self,
        metadata: CheckpointMetadata,
        infos: dict[str, TensorInfo],
        tied: dict[str, str],
        ranks: Sequence[Checkpoint],
        merges: dict[str, Merge],
    ) -> None:
        super().__init__(metadata, infos, tied)
        self._ranks = tuple(ranks)
        self._merges = merges

    def partition(self, name: str) -> str:
        """How tensor ``name`` is split over the tp ranks: ``"dim D"`` or ``"replicated"``."""
        return describe_rule(self._merges[self.source_name(self.info(name).name)].rule)

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        self.read_ahead_into(name, start, out, None)

    def read_ahead_into(self, name: str, start: int, out: torch.Tensor, read_ahead: ReadAhead | None) -> None:
        """Each tp rank's runs read through that rank, handing on ``read_ahead``: the windows of this checkpoint's
        pass (over every rank's files) or of a conversion."""
        merge = self._merges[name]
        if merge.rule == REPLICATED:
            self._ranks[0].read_ahead_into(name, start, out, read_ahead)
            return
        # Row-major order: for each index before the split dim, rank 0's run, rank 1's run, ... Read run by run
        # into slices of ``out``: memory stays the caller's chunk, whatever the tensor size.
        block, widths = merge.runs()
        offsets = [0]
        for width in widths[:-1]:
            offsets.append(offsets[-1] + width)
        pos, end = start, start + out.numel()
        while pos < end:
            outer, within = divmod(pos, block)
            rank = bisect.bisect_right(offsets, within) - 1
            into = within - offsets[rank]
            take = min(widths[rank] - into, end - pos)
            self._ranks[rank].read_ahead_into(
                name, outer * widths[rank] + into, out[pos - start : pos - start + take], read_ahead
            )
            pos += take

    def byte_ranges(self, name: str) -> list[ByteRange] | None:
        if self._merges[name].rule == REPLICATED:
            return self._ranks[0].byte_ranges(name)
        return None  # interleaved runs of several files: the writer streams them through read_into

    def _checked_files(self) -> list[CheckedFile]:
        return [file for rank in self._ranks for file in rank._checked_files()]

    def _release(self) -> None:
        for rank in self._ranks:
            rank.close()

    # ---- optimizer state (zeroio/_formats/optimizer/views.py): each tp rank's shard state, merged like the weight.

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """The Adam moments, step and hyper-parameters of a trainable parameter, merged over the tp ranks."""
        return self._merged_optimizer_state(name, meta=False)

    def optimizer_state_spec(self, name: str) -> dict[str, Any]:
        """As :meth:`optimizer_state` with meta tensors (keys, dtypes, merged shapes): nothing read."""
        return self._merged_optimizer_state(name, meta=True)

    def _merged_optimizer_state(self, name: str, *, meta: bool) -> dict[str, Any]:
        source = self.source_name(self.info(name).name)
        rule = self._merges[source].rule
        states = [optimizer_state(rank, source, meta=meta) for rank in self._ranks]
        return merge_tp_states(source, states, None if rule == REPLICATED else int(rule), self.metadata.path)


# --------------------------------------------------------------------------- detection


def _tag_dirs(path: Path) -> list[Path]:
    """Folders ``path`` may name as a checkpoint's tag folder (names only; never raises)."""
    try:
        if path.is_file():
            return [path.parent]
        if not path.is_dir():
            return []
        folders = [path] + [p for p in path.iterdir() if p.is_dir()]
        return folders
    except OSError:
        return []


def is_tensor_parallel(path: Path) -> bool:
    """True when ``path`` (a root, tag folder or rank file) holds rank files of several model-parallel ranks."""
    for folder in _tag_dirs(path):
        try:
            if len(model_parallel_ranks(folder)) > 1:
                return True
        except OSError:
            continue
    return False


# --------------------------------------------------------------------------- opening


def open_tensor_parallel(path: Path, options: ReadOptions) -> Checkpoint:
    """Open every tp rank of a tensor-parallel checkpoint and plan each tensor's merge (no tensor bytes read).

    ``ignore_recorded_tp`` sets the files' ``universal_checkpoint_info`` aside, so ``tp_rules`` alone decide.
    """
    tag, trusted_globals, ignore_recorded_tp = options.tag, options.trusted_globals, options.ignore_recorded_tp
    rules = parse_tp_rules(options.tp_rules)
    tag_dir, tag_name = find_tag_dir(path, tag)
    mp_ranks = model_parallel_ranks(tag_dir)
    if len(mp_ranks) < 2:  # a root whose other tag is tensor parallel: this one is plain ZeRO
        return open_zero(path, tag, trusted_globals=trusted_globals)
    if mp_ranks != list(range(len(mp_ranks))):
        missing = sorted(set(range(max(mp_ranks) + 1)) - set(mp_ranks))
        raise CheckpointNotFoundError(
            f"'{tag_dir}' lacks the files of model-parallel rank(s) {listing([str(r) for r in missing])} "
            f"(found mp_rank {listing([f'{r:02d}' for r in mp_ranks])}). Copy the whole tag folder again.",
            path=tag_dir,
            found=mp_ranks,
        )
    counts = [len(scan_tag_dir(tag_dir, rank).optim_files) for rank in mp_ranks]
    if len(set(counts)) > 1:
        short = counts.index(min(counts))
        raise CheckpointNotFoundError(
            f"'{tag_dir}' holds {max(counts)} optimizer file(s) for some model-parallel ranks but {min(counts)} for "
            f"mp_rank_{short:02d}: each tp rank saves one per data-parallel rank. Copy the whole tag folder again.",
            path=tag_dir,
            rank=short,
            expected=max(counts),
            found=min(counts),
        )
    ranks: list[ZeroCheckpoint] = []
    try:
        for rank in mp_ranks:
            ranks.append(open_zero(tag_dir, None, trusted_globals=trusted_globals, mp_rank=rank))
        return _merge_ranks(tag_dir, tag_name, ranks, rules, ignore_recorded_tp)
    except BaseException:
        for opened in ranks:
            with contextlib.suppress(Exception):
                opened.close()
        raise


def _model_tree(rank: ZeroCheckpoint) -> tuple[Path, Any]:
    first = rank.parsed_files[0]  # the rank's model states, parsed first
    return first, rank.file_tree(first)


def _check_ranks(tag_dir: Path, ranks: Sequence[ZeroCheckpoint]) -> tuple[Path, dict[str, Any]]:
    """Every tp rank from one training run; returns rank 0's model file and its ``universal_checkpoint_info``."""
    path0, tree0 = _model_tree(ranks[0])
    tp = len(ranks)
    recorded = tree0.get("mp_world_size")
    dims = tree0.get("checkpoint_parallel_dimensions")
    degree = dims.get("tp_degree") if isinstance(dims, dict) else None
    for what, value in (("mp_world_size", recorded), ("checkpoint_parallel_dimensions.tp_degree", degree)):
        if value is not None and value != tp:
            raise CheckpointFormatError(
                f"'{path0}' records {what}={short_repr(value)} but '{tag_dir}' holds {tp} model-parallel ranks: the folder "
                "mixes files of different runs or is incomplete. Copy the whole tag folder again.",
                path=path0,
                expected=value,
                found=tp,
            )
    if isinstance(dims, dict) and isinstance(dims.get("pp_degree"), int) and dims["pp_degree"] > 1:
        raise UnsupportedCheckpointError(
            f"'{path0}' records pipeline parallelism (pp_degree={dims['pp_degree']}) with tensor parallelism; "
            "zeroio does not merge pipeline stages. Use DeepSpeed's ds_to_universal.py for this one.",
            path=path0,
        )
    for rank in ranks[1:]:
        meta0, meta = ranks[0].metadata, rank.metadata
        if (meta.zero_stage, meta.world_size, meta.global_step) != (
            meta0.zero_stage,
            meta0.world_size,
            meta0.global_step,
        ):
            path, _ = _model_tree(rank)
            raise CheckpointFormatError(
                f"'{path}' was saved at ZeRO stage {meta.zero_stage}, dp {meta.world_size}, step {meta.global_step}; "
                f"tp rank 0 at stage {meta0.zero_stage}, dp {meta0.world_size}, step {meta0.global_step}: the folder "
                "mixes different saves. Copy the whole tag folder again.",
                path=path,
            )
        if list(rank.infos) != list(ranks[0].infos):
            path, _ = _model_tree(rank)
            differ = sorted(set(rank.infos) ^ set(ranks[0].infos))
            raise CheckpointFormatError(
                f"'{path}' holds other tensors than tp rank 0 ({listing(differ) or 'another order'}): the folder "
                "mixes different models. Copy the whole tag folder again.",
                path=path,
                found=differ,
            )
    info = tree0.get(UC_INFO)
    return path0, info if isinstance(info, dict) else {}


def _choose(
    name: str, infos: Sequence[TensorInfo], uc_info: Mapping[str, Any], rules: Mapping[str, Rule] | None
) -> tuple[Rule | None, str, str | None]:
    """``(rule, where it came from, problem)`` for stored tensor ``name`` (problem: why it cannot be decided)."""
    tp = len(infos)
    if infos[0].kind == "buffer":
        return REPLICATED, "buffer", None  # buffers are not split by tensor parallelism: every rank holds its copy
    recorded = recorded_rule(uc_info, name, tp) if uc_info else None
    chosen, matched = user_rule(rules, name) if rules is not None else (None, [])
    if recorded == UNSUPPORTED:
        return None, "recorded", "recorded with a split zeroio does not merge (fused sub-parameters or scaled pieces)"
    if rules is not None and len(matched) > 1 and chosen is None:
        return None, "tp_rules", f"tp_rules patterns disagree ({', '.join(repr(p) for p in matched)})"
    if recorded is not None and chosen is not None and recorded != chosen:
        return None, "recorded", f"recorded as {describe_rule(recorded)}, tp_rules say {describe_rule(chosen)}"
    if recorded is not None:
        return recorded, "recorded", None
    if chosen is not None:
        return chosen, "tp_rules", None
    return None, "", "no recorded partition and no tp_rules pattern matches"


def _merged_shape(rule: Rule, infos: Sequence[TensorInfo]) -> tuple[int, ...] | None:
    """The full shape the shards make under ``rule``, or None when their shapes do not fit it."""
    shapes = [info.shape for info in infos]
    if rule == REPLICATED:
        return shapes[0] if all(s == shapes[0] for s in shapes) else None
    dim = int(rule)
    if any(len(s) != len(shapes[0]) or len(s) <= dim for s in shapes):
        return None
    if any(s[:dim] + s[dim + 1 :] != shapes[0][:dim] + shapes[0][dim + 1 :] for s in shapes):
        return None
    return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1 :]


def _stored_spec(rank: Checkpoint, name: str) -> DType:
    info = rank.info(name)
    return info.stored_spec or info.dtype_spec


def _raw_bytes(rank: Checkpoint, name: str, lo: int, hi: int) -> bytes | None:
    """Stored bytes ``[lo, hi)`` of ``name`` read through its byte ranges (no torch), or None without ranges."""
    ranges = rank.byte_ranges(rank.source_name(name))
    if ranges is None:
        return None
    out = bytearray()
    at = 0
    for source, offset, nbytes in ranges:
        a, b = max(lo, at), min(hi, at + nbytes)
        if a < b:
            out += source.read_bytes(offset + a - at, b - a)
        at += nbytes
    return bytes(out) if len(out) == hi - lo else None


def _replicas_agree(name: str, ranks: Sequence[Checkpoint], info: TensorInfo) -> bool:
    """True when every tp rank holds the same bits for a replicated tensor (compared at both ends).

    Compares raw stored bytes (opening a checkpoint needs no torch); a reader without byte ranges is read as
    tensors instead.
    """
    itemsize = _stored_spec(ranks[0], name).itemsize
    for start, count in sample_ranges(info.numel):
        lo, hi = start * itemsize, (start + count) * itemsize
        raw = [_raw_bytes(rank, name, lo, hi) for rank in ranks]
        if all(r is not None for r in raw):
            if any(r != raw[0] for r in raw[1:]):
                return False
            continue
        import torch

        dtype = ranks[0].stored_dtype(name)
        first = torch.empty(count, dtype=dtype)
        ranks[0].read_into(name, start, first)
        for rank in ranks[1:]:
            other = torch.empty(count, dtype=dtype)
            rank.read_into(name, start, other)
            if not torch.equal(first.view(torch.uint8), other.view(torch.uint8)):
                return False
    return True


@dataclass(frozen=True, slots=True)
class MergePlan:
    """Every tensor of a tp-sharded checkpoint planned from its ranks: full infos (in rank 0's order), ties, merges."""

    infos: dict[str, TensorInfo]
    tied: dict[str, str]
    merges: dict[str, Merge]
    sources: dict[str, str]
    """Where each tensor's rule came from: ``recorded``, ``tp_rules`` or ``buffer``."""


def plan_tp_merges(
    path0: Path,
    ranks: Sequence[Checkpoint],
    rules: Mapping[str, Rule] | None,
    uc_info: Mapping[str, Any],
    kind: str | None = None,
) -> MergePlan:
    """Decide how each tensor is rebuilt from ``ranks`` (one reader per tp rank, same names); refuse the undecided.

    ``uc_info`` is what the files record (AutoTP's ``universal_checkpoint_info``; empty when nothing is), ``rules``
    the user's; a tensor neither decides, or whose shards do not fit its rule, is refused by name (``path0`` is
    the file the message names, ``kind`` what the checkpoint is, default ``N-way tensor-parallel``).
    """
    tied = ranks[0].tied
    merges: dict[str, Merge] = {}
    merged: dict[str, TensorInfo] = {}
    sources: dict[str, str] = {}
    problems: dict[str, str] = {}
    for name, info0 in ranks[0].infos.items():
        if name in tied:
            continue
        infos = [rank.info(name) for rank in ranks]
        if len(name) > MAX_NAME_CHARS and (uc_info or rules):  # matching a pattern on it could take minutes
            raise CheckpointFormatError(
                f"'{path0}' records a parameter name of {len(name)} characters ({name[:40]!r}...); zeroio matches "
                f"names of up to {MAX_NAME_CHARS}. The checkpoint is corrupted or hostile.",
                path=path0,
                name=name[:MAX_NAME_CHARS],
            )
        try:
            rule, source, problem = _choose(name, infos, uc_info, rules)
        except PatternError as exc:
            raise CheckpointFormatError(f"'{path0}': {exc}", path=path0, name=name) from None
        shape = None if rule is None else _merged_shape(rule, infos)
        if rule is not None and shape is None:
            problem = f"{describe_rule(rule)} does not fit the shard shapes {[i.shape for i in infos]}"
        elif rule == REPLICATED and not _replicas_agree(name, ranks, info0):
            problem = "said to be replicated, but the tp ranks hold different values"
        if any(_stored_spec(ranks[0], name) != _stored_spec(rank, name) for rank in ranks):
            problem = f"stored as {[str(_stored_spec(rank, name)) for rank in ranks]} by the tp ranks"
        if problem is not None or rule is None or shape is None:
            problems[name] = problem or "undecided"
            continue
        files = info0.files if rule == REPLICATED else tuple(f for i in infos for f in i.files)
        merged[name] = TensorInfo(name, shape, info0.dtype_spec, info0.kind, files, info0.stored_spec)
        merges[name] = Merge(rule, tuple(i.shape for i in infos))
        sources[name] = source
    if problems:
        names = list(problems)
        detail = "; ".join(f"{n}: {problems[n]}" for n in names[:5]) + (" ..." if len(names) > 5 else "")
        raise UnsupportedCheckpointError(
            f"'{path0}': cannot tell how {len(names)} tensor(s) of this "
            f"{kind or f'{len(ranks)}-way tensor-parallel'} checkpoint are split ({detail}). Pass tp_rules={{regex: dim or 'replicated'}} (or a preset: megatron, neox) "
            "covering them.",
            path=path0,
            found=names,
        )
    ordered: dict[str, TensorInfo] = {}
    for name in ranks[0].infos:
        if name in tied:
            base = merged[tied[name]]
            ordered[name] = TensorInfo(
                name, base.shape, base.dtype_spec, base.kind, base.files, base.stored_spec, tied[name]
            )
        else:
            ordered[name] = merged[name]
    return MergePlan(ordered, dict(tied), merges, sources)


def _merge_ranks(
    tag_dir: Path,
    tag_name: str | None,
    ranks: Sequence[ZeroCheckpoint],
    rules: Mapping[str, Rule] | None,
    ignore_recorded: bool,
) -> TensorParallelCheckpoint:
    path0, uc_info = _check_ranks(tag_dir, ranks)
    plan = plan_tp_merges(path0, ranks, rules, {} if ignore_recorded else uc_info)
    metadata = _metadata(tag_dir, tag_name, ranks, plan.merges, plan.sources)
    logger.debug(
        "opened %s: tensor parallel tp=%d, dp=%s, %d tensors", tag_dir, len(ranks), metadata.world_size, len(plan.infos)
    )
    return TensorParallelCheckpoint(metadata, plan.infos, plan.tied, ranks, plan.merges)


def _metadata(
    tag_dir: Path,
    tag_name: str | None,
    ranks: Sequence[ZeroCheckpoint],
    merges: dict[str, Merge],
    sources: dict[str, str],
) -> CheckpointMetadata:
    meta0 = ranks[0].metadata
    extra = dict(meta0.extra)
    extra["model_files"] = [name for rank in ranks for name in rank.metadata.extra.get("model_files", [])]
    extra["optim_files"] = [name for rank in ranks for name in rank.metadata.extra.get("optim_files", [])]
    extra["tp_partition"] = {name: describe_rule(merge.rule) for name, merge in merges.items()}
    extra["tp_rule_source"] = dict(sources)
    return CheckpointMetadata(
        format="zero",
        path=tag_dir,
        tag=tag_name,
        zero_stage=meta0.zero_stage,
        world_size=meta0.world_size,
        train_dtype=meta0.train_spec,
        ds_version=meta0.ds_version,
        global_step=meta0.global_step,
        has_fp32_master=meta0.has_fp32_master,
        layout="tensor-parallel",
        parallel={"dp": meta0.world_size or 1, "tp": len(ranks)},
        offload=meta0.offload,
        serialization=meta0.serialization,
        optimizer=meta0.optimizer,
        extra=extra,
    )
