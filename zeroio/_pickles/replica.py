"""Rank files that repeat another's pickle byte for byte, read without unpickling it again.

Every rank of a ZeRO-3 save writes the same model-states pickle: the module's parameter placeholders, the
``param_shapes``, the step counters, the config; only the records behind it differ (each rank's own frozen
fragments and buffers). A 1,024-rank checkpoint of 2,000 tensors holds 2 million placeholders, whose unpickling took
~50 ms a file. A :class:`Replica` is one such file parsed in full; a later file whose ``data.pkl`` has the same bytes
gets the same tree, with each reference to stored bytes bound to the later file and everything else (the placeholders
among it: storages of no bytes, never read) shared with the first. Its archive is still read and checked: every
storage the pickle names has its record, as :func:`~.read.load_pickle` checks.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .archive import Archive, RankFile, Storage, TensorRef
from .read import check_records, parse_archive_storages
from .standins import Inert

__all__ = ["Replica", "template_of"]

_Live = dict[int, tuple[Any, ...]]
"""``id(container)`` -> the keys (indices) of its children that hold references to stored bytes; ``id(ref)`` -> ()."""


@dataclass(frozen=True, eq=False)
class Replica:
    """A parsed rank file whose pickle later files may repeat: see the module doc."""

    pickle: bytes
    tree: Any
    storages: tuple[Storage, ...]
    live: _Live
    empty_keys: frozenset[str]

    def parse(self, archive: Archive) -> tuple[Any, RankFile] | None:
        """``archive``'s tree and file when its pickle is this one's byte for byte, else None."""
        if archive.pickle != self.pickle:
            return None
        # The placeholders' records (most of them) are checked as one set; their keys are kept once, here.
        empty_ok = self.empty_keys <= archive.empty_keys
        check_records(self.storages if not empty_ok else (s for s in self.storages if s.numel), archive)
        file = RankFile(
            archive.path, archive.records, size=archive.size, identity=archive.identity, root=archive.root,
            empty_keys=self.empty_keys,
        )  # fmt: skip
        return _rebind(self.tree, self.live, file, {}), file


def template_of(archive: Archive, trusted_globals: frozenset[str]) -> tuple[Any, RankFile, Replica | None]:
    """Parse ``archive`` in full; with it, the :class:`Replica` later files may match (None where its tree holds a
    container this module does not copy)."""
    tree, file, storages = parse_archive_storages(archive, trusted_globals)
    live: _Live = {}
    if not _find_live(tree, live, set()):
        return tree, file, None
    empty = frozenset(s.key for s in storages if s.numel == 0)
    return tree, file, Replica(archive.pickle, tree, tuple(storages), live, empty)


def _find_live(node: Any, live: _Live, seen: set[int]) -> bool:
    """Record in ``live`` the containers on the way to references with bytes; False on a container not copyable."""
    key = id(node)
    if key in seen:
        return True
    seen.add(key)
    if isinstance(node, TensorRef):
        if node.storage.numel:
            live[key] = ()
        return True
    if type(node) in (dict, OrderedDict) or isinstance(node, (list, tuple, Inert)):
        items = (
            node.__dict__.items()
            if isinstance(node, Inert)
            else node.items()
            if isinstance(node, dict)
            else enumerate(node)
        )
        children = []
        for k, child in items:
            if not _find_live(child, live, seen):
                return False
            if id(child) in live:
                children.append(k)
        if children:
            live[key] = tuple(children)
        return True
    if isinstance(node, dict):  # another dict type (an inert dict subclass): nothing to copy it by, unless bare
        return not any(isinstance(v, (TensorRef, dict, list, tuple, Inert)) for v in node.values())
    return True


def _rebind(node: Any, live: _Live, file: RankFile, done: dict[int, Any]) -> Any:
    """``node`` with every reference to stored bytes bound to ``file``: the containers on the way copied, the rest
    shared."""
    key = id(node)
    if key not in live:
        return node
    if key in done:
        return done[key]
    if isinstance(node, TensorRef):
        out: Any = TensorRef(file, node.storage, node.storage_offset, node.shape, node.stride)
    elif isinstance(node, dict):
        out = type(node)(node)
        for k in live[key]:
            out[k] = _rebind(node[k], live, file, done)
    elif isinstance(node, list):
        out = list(node)
        for k in live[key]:
            out[k] = _rebind(node[k], live, file, done)
    elif isinstance(node, tuple):
        items = list(node)
        for k in live[key]:
            items[k] = _rebind(node[k], live, file, done)
        out = type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    else:  # Inert: a fresh stand-in with the same attributes
        out = copy.copy(node)
        for k in live[key]:
            out.__dict__[k] = _rebind(node.__dict__[k], live, file, done)
    done[key] = out
    return out
