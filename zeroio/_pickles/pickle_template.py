"""Rank files of one shape pickled once: each later one replays the first one's pickle (issue 34, goal 5).

A reshard to 1,024 ranks writes 2,048 files, and the files of one kind differ only in their tensors' bytes (the
model states of ranks 1 and up, every rank's optimizer states: DeepSpeed's own saves repeat such a pickle byte for
byte, see ``replica.py``). ``torch.save`` pickles each tree afresh and calls its ``persistent_id`` on every one of
its objects (25,000 in a model-states file of 2,000 parameters): most of the reshard's 80 s of CPU at 1,024 ranks.

A :class:`PickleTemplate` lets ``torch.save`` pickle the first tree it is given, recording the tensors in the order
the pickle meets them, where each sits in the tree and the persistent id its storage got, and keeps the archive
``torch.save`` wrote around that pickle (``archive_layout.ArchiveLayout``). A later tree is neither pickled nor
given to ``torch.save``: where the tensors at the recorded places match the recorded ones (type, dtype, shape,
stride, offset, storage size, and storages shared as the recorded ones were, so torch would number them alike), its
archive is the kept one, only its records' bytes differ; else the tree is pickled and saved as usual. That the rest
of the tree is the same is the caller's promise: ``zeroio._reshard.trees.RankTrees.pickle_kind`` gives one template
per kind of file whose trees differ only in tensor bytes, and tests/test_reshard.py checks the files equal, byte
for byte, those ``torch.save`` wrote for each tree.
"""

from __future__ import annotations

import pickle
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .archive_layout import ArchiveLayout
from .plain_tree import Where
from .write import DeepSpeedPickler, walk_path

if TYPE_CHECKING:
    import torch

__all__ = ["PickleTemplate"]


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of the template tree, in pickle order: where it is, what its storage's persistent id was, and
    what must match in a later tree for the recorded bytes to be that tree's pickle."""

    path: Where
    pid: tuple[Any, ...]
    form: tuple[Any, ...]
    tensor: torch.Tensor
    """The tensor itself: a later tree holding the very tensor (an empty placeholder shared by every rank's
    tree) needs no check, and its storage registers as before."""
    key: int
    """Its storage's key (``pid[2]``): storages are numbered as the pickle first meets them."""
    storage_id: int
    """``id`` of the tensor's untyped storage (held by the tensor)."""


def _form(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a tensor's pickle says besides its storage's key (and what decides its storage's persistent id)."""
    storage = tensor.untyped_storage()
    return (type(tensor), tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(),
            tensor.requires_grad, storage.nbytes(), str(storage.device))  # fmt: skip


def _tensor_paths(tree: Any) -> dict[int, Where]:
    """``{id(tensor): its path}`` of every tensor of a writable tree (dicts, lists, tuples, objects' attributes)."""
    import torch

    found: dict[int, Where] = {}
    stack: list[tuple[Any, Where]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, torch.Tensor):
            found.setdefault(id(node), path)
            continue
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, (list, tuple)):
            items = enumerate(node)
        elif hasattr(node, "__dict__") and not isinstance(node, (type, types.ModuleType, types.FunctionType)):
            items = vars(node).items()
        else:
            continue
        stack.extend((value, (*path, key)) for key, value in items)
    return found


class PickleTemplate:
    """The pickle of the first tree saved through :meth:`pickle_module`, replayed for the later ones."""

    def __init__(self) -> None:
        self._data: bytes | None = None
        self._entries: list[_Entry] = []
        self._layout: ArchiveLayout | None = None
        self._last_from_template = False  # the last tree saved: recorded or replayed (its keys known here)
        self.replayed = 0
        """Trees written from the template (not pickled)."""

    def pickle_module(self) -> types.ModuleType:
        """The ``pickle_module`` to give ``torch.save`` for the next tree: the first one is recorded, a later one
        that :meth:`layout_for` did not take is pickled afresh."""
        module = types.ModuleType("zeroio._template_pickle")
        base = _Recording if self._data is None else _Afresh
        module.Pickler = type("Pickler", (base,), {"template": self})  # type: ignore[attr-defined]
        return module

    def layout_for(self, tree: Any) -> ArchiveLayout | None:
        """The archive to write for ``tree``, the recorded one's (None: save it with ``torch.save``)."""
        self._last_from_template = self._layout is not None and self._matches(tree)
        if not self._last_from_template:
            return None
        self.replayed += 1
        return self._layout

    def keep_layout(self, layout: ArchiveLayout) -> None:
        """Keep ``layout``, the archive just written, where its tree was the one recorded."""
        if self._layout is None and self._data is not None and self._last_from_template:
            self._layout = layout

    def storage_keys(self, paths: list[Where]) -> dict[Where, tuple[str, int]] | None:
        """``{path: (storage key, storage elements)}`` of the tensors at ``paths`` in the last tree saved, or None
        when that tree was pickled afresh (not recorded: its keys are not known here)."""
        if not self._last_from_template:
            return None
        by_path = {entry.path: (str(entry.pid[2]), int(entry.pid[4])) for entry in self._entries}
        return {path: by_path[path] for path in paths if path in by_path}

    def record(self, tree: Any, data: bytes, tensors: list[torch.Tensor], pids: list[tuple[Any, Any]]) -> None:
        """Keep ``data`` (``tree``'s pickle) with its tensors, met in this order, and their storages' persistent
        ids (each with the storage it was given for)."""
        paths = _tensor_paths(tree)
        if len(tensors) != len(pids) or any(id(t) not in paths for t in tensors):
            return  # a storage met outside a tensor, or a tensor outside the tree's containers: never replayed
        self._entries = [
            _Entry(paths[id(t)], pid, _form(t), t, int(pid[2]), id(t.untyped_storage()))
            for t, (pid, _) in zip(tensors, pids)
        ]
        self._data = data
        self._last_from_template = True

    def _matches(self, tree: Any) -> bool:
        """Whether ``tree``'s tensors at the recorded places are the recorded ones' likes, their storages shared
        as the recorded ones were (``torch.save`` numbers storages as the pickle first meets them: it would give
        them the recorded keys)."""
        import torch

        held = []  # the storages whose ids are keys below, alive until the end
        keys: dict[int, int] = {}  # id(storage) -> the key torch gives it
        for entry in self._entries:
            try:
                tensor = walk_path(tree, entry.path)
            except (KeyError, IndexError, TypeError):
                return False
            if tensor is entry.tensor:  # the very tensor recorded (a placeholder every rank's tree shares)
                if keys.setdefault(entry.storage_id, len(keys)) != entry.key:
                    return False
                continue
            if not isinstance(tensor, torch.Tensor) or _form(tensor) != entry.form:
                return False
            storage = tensor.untyped_storage()
            held.append(storage)
            if keys.setdefault(id(storage), len(keys)) != entry.key:
                return False
        return True


class _Recording(DeepSpeedPickler):
    """Pickles the tree, noting each tensor as the pickle meets it and each storage's persistent id."""

    template: PickleTemplate

    def pickled(self, obj: Any) -> bytes:
        torch_id = self.persistent_id  # torch.save's own (its subclass's method)
        self.template._last_from_template = False
        self._tensors: list[torch.Tensor] = []
        pids: list[tuple[Any, Any]] = []

        def recording(value: Any) -> Any:
            pid = torch_id(value)
            if pid is not None:
                pids.append((pid, value))
            return pid

        pickle.Pickler.persistent_id.__set__(self, recording)  # type: ignore[attr-defined]
        data = super().pickled(obj)
        self.template.record(obj, data, self._tensors, pids)
        return data

    def reducer_override(self, obj: Any) -> Any:
        """Called for every object but the plain ones (dicts, lists, strings, numbers): notes the tensors."""
        import torch

        if isinstance(obj, torch.Tensor):
            self._tensors.append(obj)
        return NotImplemented


class _Afresh(DeepSpeedPickler):
    """Pickles a later tree that does not match the recorded one, as ``torch.save`` would (its keys read back)."""

    template: PickleTemplate

    def pickled(self, obj: Any) -> bytes:
        self.template._last_from_template = False
        return super().pickled(obj)
