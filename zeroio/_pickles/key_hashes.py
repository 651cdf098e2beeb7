"""Distinct keys of one dict or set that share a hash, counted during :mod:`.hash_work`'s walk.

CPython does not randomize the hashes of ints, floats and tuples: ``hash(n)`` is ``n mod (2**61 - 1)`` and a tuple's
hash is a fixed function of its items' hashes (solvable for its last item). A pickle can fill a dict or set with
distinct keys of one hash, and each insertion then compares with every key before it, inside C code that nothing
interrupts: 20,000 such int keys (a 279 KB pickle) took 3.7 s to unpickle, 100,000 about 95 s. Distinct keys of a
real dict share a full hash only by accident (``1`` and ``2**61``), so more than :data:`MAX_SHARED` in one container
is refused. Strings and bytes hash with a per-process secret: they cannot be made to collide, but a tuple holding
one still collides when its other items do, so the walk gives every object a hash.

A walk cell is ``[weight, weight of its keys, value or name, hash, parts]``: the value of an int, float, bool or
string (or a global's name), its hash once computed, and the item cells of a tuple (a ``tuple``) or list (a
``list``), or the keys seen by hash of a dict or set (a ``dict``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_SHARED", "Flood", "call_keys", "carried", "count_keys", "frozen_hash", "key_hash"]

MAX_SHARED = 32
"""Distinct keys of one container allowed one hash."""
_DEPTH = 64
"""Tuple nesting followed for a hash; deeper, a tuple counts as an object of its own (no real pickle nests so)."""

_Cell = list[Any]


class Flood(Exception):
    """More than :data:`MAX_SHARED` distinct keys of one container share a hash."""


def key_hash(cell: _Cell, depth: int = 0) -> int:
    """The hash the unpickled object will have: exact for ints, floats, strings and tuples of them; for any other
    object one the same wherever that object (memo references included) is, so a tuple holding it still shows the
    collisions of its other items. Kept in the cell."""
    h: int | None = cell[3]
    if h is None:
        parts = cell[4]
        if type(parts) is tuple and depth < _DEPTH:
            h = hash(tuple([key_hash(part, depth + 1) for part in parts]))  # hash(h) == h for every hash h
        elif cell[2] is not None:
            h = hash(cell[2])
        else:
            h = id(cell)
        cell[3] = h
    return h


def count_keys(container: _Cell, keys: list[_Cell]) -> None:
    """Record ``keys`` as put in ``container``; raise :class:`Flood` past :data:`MAX_SHARED` distinct ones of one
    hash. Equal values (``1`` twice, ``1`` and ``1.0``) or one object twice are one key: each costs one compare."""
    if not keys:
        return
    seen = container[4]
    if type(seen) is not dict:
        seen = container[4] = {}
    for key in keys:
        h = key_hash(key)
        value = key[2] if key[2] is not None else id(key)
        first = seen.get(h, seen)
        if first is seen:
            seen[h] = value
        elif type(first) is set:
            first.add(value)
            if len(first) > MAX_SHARED:
                raise Flood
        elif first != value:
            seen[h] = {first, value}


def frozen_hash(keys: list[_Cell]) -> int:
    """A frozenset's hash from its items' (exact where no two items share one)."""
    return hash(frozenset([key_hash(key) for key in keys]))


def call_keys(called: str, args: tuple[_Cell, ...] | list[_Cell]) -> list[_Cell]:
    """The keys ``set``/``frozenset`` (items) or ``dict``/``OrderedDict`` (first items of pairs) hash when called
    with the argument cells ``args``: those of a list or tuple the walk holds, else none."""
    items = args[0][4] if args else None
    if type(items) is not list and type(items) is not tuple:
        return []
    if called in ("builtins.dict", "collections.OrderedDict"):
        return [pair[4][0] for pair in items if type(pair[4]) is tuple and pair[4]]
    return list(items)


def carried(called: str, args: tuple[_Cell, ...] | list[_Cell]) -> tuple[_Cell, ...] | None:
    """The items of what ``torch.Size``/``tuple`` (the first argument's) or ``slice`` (the arguments) return: it
    hashes as a tuple of them."""
    if called == "builtins.slice":
        return tuple(args)
    items = args[0][4] if args else None
    return tuple(items) if type(items) is list or type(items) is tuple else None
