"""verl's ``optim_world_size_W_rank_R.pt``: ``optimizer.state_dict()`` of each rank, keyed by parameter index.

The index is the parameter's position in ``model.parameters()``: the model's DTensor entries in state-dict order,
a tied name counted once (torch yields a shared parameter once), because verl 0.9.1 builds its optimizer from
``module.parameters()`` in one param group (``build_optimizer``). An optimizer built otherwise (several param
groups, or some parameters only) numbers them in an order the files do not record: its state is refused by name
(:class:`UnmappedOptimizer`) while the weights still read. Each moment is checked to have its parameter's global
shape, so a misnumbered mapping is refused rather than returned under the wrong name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..._pickles import RankFile, TensorRef, load_pickle, short_repr
from ...errors import CheckpointFormatError
from .dtensors import Assembled, assemble, is_dtensor

__all__ = ["OptimizerShards", "UnmappedOptimizer", "read_optimizer"]

OptimizerShards = tuple[dict[str, dict[str, Assembled]], dict[str, dict[str, Any]], dict[str, TensorRef]]
"""``({name: {moment: Assembled}}, {name: hyper-parameters}, {name: rank 0's step})``."""


class UnmappedOptimizer(Exception):
    """The optimizer was not built from ``model.parameters()`` in one group: which parameter an index stands for
    is not in the files. Its message says why (zeroio's readers turn it into a refusal of optimizer state)."""


def _bad(path: Path, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"'{path}' is not an optimizer state dict verl writes: {what}. Copy the checkpoint folder again, or open "
        "it without its optim_*.pt files to read the weights only.",
        path=path,
    )


def _tree(path: Path, trusted: frozenset[str], files: list[RankFile]) -> tuple[dict[Any, Any], list[Any]]:
    tree, file = load_pickle(path, trusted_globals=trusted)
    files.append(file)
    state = tree.get("state") if isinstance(tree, dict) else None
    groups = tree.get("param_groups") if isinstance(tree, dict) else None
    if not isinstance(state, dict) or not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise _bad(path, "it lacks 'state' (a mapping) or 'param_groups' (a list of mappings)")
    return state, groups


def _index_names(groups: list[Any], params: list[str], path: Path) -> dict[int, tuple[str, dict[str, Any]]]:
    """Parameter index -> (name, its group's hyper-parameters); every parameter named exactly once.

    Raises:
        UnmappedOptimizer: several param groups, or another number of parameters than the model's.
    """
    if len(groups) != 1:
        # torch numbers parameters group after group: unless the groups were cut from parameters() in order
        # (nothing records it), index i is not the i-th parameter, and equal shapes would hide the swap.
        raise UnmappedOptimizer(
            f"'{path}' holds {len(groups)} param groups; verl builds one from model.parameters(), and only then is "
            "optimizer index i the model's i-th parameter (the files do not record which parameter each index is)"
        )
    found: dict[int, tuple[str, dict[str, Any]]] = {}
    for group in groups:
        members = group.get("params")
        if not isinstance(members, list):
            raise _bad(path, "a param group has no 'params' list")
        hyper = {str(k): v for k, v in group.items() if k != "params"}
        for index in members:
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(params) or index in found:
                raise _bad(
                    path,
                    f"param group index {short_repr(index)!r} does not name one of the model's {len(params)} "
                    "parameters once",
                )
            found[index] = (params[index], hyper)
    if len(found) != len(params):
        raise UnmappedOptimizer(
            f"'{path}' optimizes {len(found)} parameters, the model files hold {len(params)}; verl builds its "
            "optimizer from all of model.parameters(), and only then is index i the model's i-th parameter"
        )
    return found


def read_optimizer(
    paths: tuple[Path, ...], params: list[str], shapes: dict[str, tuple[int, ...]], trusted: frozenset[str],
    files: list[RankFile],
) -> OptimizerShards:  # fmt: skip
    """Each parameter's moments assembled from every rank's file, its hyper-parameters and step."""
    trees = [_tree(p, trusted, files) for p in paths]
    names = _index_names(trees[0][1], params, paths[0])
    moments: dict[str, dict[str, Assembled]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    steps: dict[str, TensorRef] = {}
    for index, state in trees[0][0].items():
        if index not in names or not isinstance(state, dict):
            raise _bad(paths[0], f"state key {short_repr(index)!r} is not a parameter index of its param groups")
        name, group = names[index]
        hyper[name] = group
        per_rank = [tree[0].get(index) for tree in trees]
        if not all(isinstance(s, dict) and s.keys() == state.keys() for s in per_rank):
            raise _bad(paths[0], f"the ranks' files hold different state for parameter {index} ('{name}')")
        for key, value in state.items():
            if is_dtensor(value):
                piece = assemble(f"{name}.{key}", [s[key] for s in per_rank], paths)  # type: ignore[index]
                if piece.entry.shape != shapes[name]:
                    raise _bad(
                        paths[0],
                        f"'{key}' of parameter {index} has shape {piece.entry.shape}, yet parameter {index} is "
                        f"'{name}' of shape {shapes[name]}: the optimizer and model files disagree",
                    )
                moments.setdefault(name, {})[str(key)] = piece
            elif key == "step" and isinstance(value, TensorRef) and value.numel == 1:
                steps[name] = value
            elif key == "step" and isinstance(value, (int, float)):
                hyper[name] = {**group, "step": value}
    return moments, hyper, steps
