"""How much hashing a pickle asks for, counted before it is unpickled.

Python hashes a tuple by hashing each of its items, every time, with no cache and no check for shared items: a
pickle can build ``t0 = ()``, ``t1 = (t0, t0)``, ... ``t40 = (t39, t39)`` from its memo in about 300 bytes, and
using ``t40`` as a dict key (or a set item, or an argument of ``set``/``frozenset``/``OrderedDict``) makes the
unpickler hash 2**40 tuples inside C code that nothing interrupts: ``zeroio.open`` of a 1 KB file never returned
(``torch.load(weights_only=True)`` does the same).

:func:`check_hash_work` walks the opcodes once, building no object, with the weight of each stack item: a tuple
weighs one more than its items (memo references included), a container one more than what was put in it,
anything else one. Each hash the unpickler does (dict keys, set items, the arguments of a hashing call, an object
state's keys) adds the weight hashed; past :func:`limit` (twice the pickle's bytes plus a million: a pickle that
shares no tuple hashes at most its own size) the file is refused before any object is built. The same walk counts
the distinct keys of one hash put in each dict or set (:mod:`.key_hashes`: hash-collision floods). It costs about
0.12 s of CPU per megabyte of pickle; a pickle already checked (a rank file repeating another's) is not walked
again.
"""

from __future__ import annotations

import hashlib
import pickletools
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol, cast

from ..errors import CheckpointFormatError
from .global_names import python2_name
from .key_hashes import MAX_SHARED, Flood, call_keys, carried, count_keys, frozen_hash

__all__ = ["check_hash_work", "check_stream", "limit"]

_HASHING = frozenset({"builtins.set", "builtins.frozenset", "collections.OrderedDict", "builtins.dict"})
"""Allowlisted callables that hash what they are given."""
_CARRYING = frozenset({"torch.Size", "builtins.slice", "builtins.tuple"})
"""Allowlisted callables whose result hashes as its arguments do."""

# What the walk does for an opcode, beyond reading its argument.
(_GENERIC, _TUPLE, _GET, _PUT, _MEMOIZE, _MARK, _TEXT, _GLOBAL, _STACK_GLOBAL, _STOP, _GROW, _BUILT, _CALL,
 _DUP, _NUMBER) = range(15)  # fmt: skip
_KINDS = {
    "TUPLE1": _TUPLE, "TUPLE2": _TUPLE, "TUPLE3": _TUPLE, "GET": _GET, "BINGET": _GET, "LONG_BINGET": _GET,
    "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "MEMOIZE": _MEMOIZE, "MARK": _MARK, "UNICODE": _TEXT,
    "SHORT_BINUNICODE": _TEXT, "BINUNICODE": _TEXT, "BINUNICODE8": _TEXT, "GLOBAL": _GLOBAL,
    "STACK_GLOBAL": _STACK_GLOBAL, "STOP": _STOP, "APPEND": _GROW, "APPENDS": _GROW, "SETITEM": _GROW,
    "SETITEMS": _GROW, "ADDITEMS": _GROW, "BUILD": _GROW, "DICT": _BUILT, "FROZENSET": _BUILT, "REDUCE": _CALL,
    "NEWOBJ": _CALL, "NEWOBJ_EX": _CALL, "OBJ": _CALL, "INST": _CALL, "DUP": _DUP, "LONG1": _NUMBER,
    "LONG4": _NUMBER, "INT": _NUMBER, "LONG": _NUMBER, "BINFLOAT": _NUMBER, "FLOAT": _NUMBER,
}  # fmt: skip
_Spec = tuple[str, int, int, bool, int, int, int]


def _table() -> list[_Spec | None]:
    """By opcode byte: (name, kind, argument size or reader, pops to a mark, items popped, items pushed, lines)."""
    table: list[_Spec | None] = [None] * 256
    for op in pickletools.opcodes:
        before, after = op.stack_before, op.stack_after
        marked = pickletools.markobject in before
        popped = before.index(pickletools.markobject) if marked else len(before)
        size = op.arg.n if op.arg is not None else 0
        lines = 2 if op.arg is not None and op.arg.name == "stringnl_noescape_pair" else 1
        table[ord(op.code)] = (op.name, _KINDS.get(op.name, _GENERIC), size, marked, popped, len(after), lines)
    return table


_TABLE = _table()
_LENGTHS: dict[int, tuple[int, Callable[[bytes, int], tuple[int, ...]]]] = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, lambda data, at: (data[at],)),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, struct.Struct("<i").unpack_from),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, struct.Struct("<I").unpack_from),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, struct.Struct("<Q").unpack_from),
}
_CHECKED: set[bytes] = set()  # digests of the pickles walked already (rank files repeat each other's)
_CHECKED_LOCK = threading.Lock()
_MAX_CHECKED = 4096


def limit(nbytes: int) -> int:
    """Tuple hashes allowed for a pickle of ``nbytes`` bytes."""
    return 2 * nbytes + 1_000_000


def check_hash_work(data: bytes, path: Path) -> None:
    """Raise CheckpointFormatError when unpickling ``data`` would hash more than :func:`limit` tuples; a malformed
    pickle is left to the unpickler, which names what is wrong."""
    digest = hashlib.blake2b(data, digest_size=16).digest()  # a gigabyte a second: far cheaper than the walk
    with _CHECKED_LOCK:
        if digest in _CHECKED:
            return
    try:
        work, most = _walk(data), limit(len(data))
    except Flood:
        raise CheckpointFormatError(
            f"'{path}': its pickle puts more than {MAX_SHARED} distinct keys of one hash in a dict or set "
            f"({len(data)} bytes; ints that differ by multiples of 2**61 - 1, or tuples built to collide): torch.save "
            "never writes one. The file is corrupted or hostile; do not use it.",
            path=path,
        ) from None
    if work > most:
        raise CheckpointFormatError(
            f"'{path}': its pickle asks for more than {most} tuple hashes ({len(data)} bytes; a tuple holding the "
            "same tuple over and over, used as a dict key or set item): torch.save never writes one. The file is "
            "corrupted or hostile; do not use it.",
            path=path,
        )
    with _CHECKED_LOCK:
        if len(_CHECKED) >= _MAX_CHECKED:
            _CHECKED.clear()
        _CHECKED.add(digest)


class Stream(Protocol):
    """A pickle read in place (:class:`~zeroio._pickles.legacy.PickleWindow`): where it stands, and its bytes."""

    position: int

    def read(self, n: int = -1) -> bytes: ...

    def readline(self, n: int = -1) -> bytes: ...

    def pread(self, at: int, n: int) -> bytes: ...


def check_stream(stream: Stream, path: Path) -> None:
    """:func:`check_hash_work` of the pickle starting at ``stream``'s position (a legacy file's), which is kept."""
    start = stream.position
    try:
        for op, _, _ in pickletools.genops(cast("IO[bytes]", stream)):
            if op.name == "STOP":
                break
    except Exception:  # noqa: BLE001 - malformed: the unpickler refuses it, naming what is wrong
        return
    finally:
        stop, stream.position = stream.position, start
    check_hash_work(stream.pread(start, stop - start), path)


_Cell = list[Any]
"""``[weight, weight of its keys, value or global name, hash, parts]`` (:mod:`.key_hashes`): one per object, shared
by its memo references."""


_FAST = {b"h"[0]: 1, b"q"[0]: 2, b"K"[0]: 3, b"\x94"[0]: 4, b"j"[0]: 5, b"("[0]: 6, b"r"[0]: 7, b"M"[0]: 8,
         b"J"[0]: 8, b")"[0]: 3, b"\x89"[0]: 3, b"\x88"[0]: 3, b"N"[0]: 3, b"}"[0]: 9, b"]"[0]: 9, b"\x85"[0]: 10,
         b"\x86"[0]: 10, b"R"[0]: 11, b"\x81"[0]: 11, b"X"[0]: 12, b"\x8c"[0]: 12, b"Q"[0]: 13, b"t"[0]: 14,
         b"u"[0]: 15, b"b"[0]: 16}  # fmt: skip
"""The commonest opcodes of torch pickles (memo references, small ints, constants, empty containers, small tuples,
calls, strings, persistent ids), handled before the general path: the walk costs under a microsecond an opcode."""
_FAST_CODES = [_FAST.get(i, 0) for i in range(256)]
_FAST_CODES[b"K"[0]] = 17  # BININT1
_INT2, _INT4 = struct.Struct("<H").unpack_from, struct.Struct("<i").unpack_from


def _walk(data: bytes) -> int:
    """The tuple hashes unpickling ``data`` does (an upper bound), stopping once past the limit."""
    most, end, at, work = limit(len(data)), len(data), 0, 0
    cap = most + 1  # weights stop growing here: one past the limit is refused all the same
    leaf: _Cell = [1, 0, None, None, None]  # bytes, storages...: never grows (an append to one is malformed)
    none: _Cell = [1, 0, None, hash(None), None]
    empty: _Cell = [1, 0, None, None, ()]
    stack: list[_Cell] = []
    marks: list[int] = []
    memo: dict[int, _Cell] = {}
    fast, table = _FAST_CODES, _TABLE
    try:
        while at < end:
            byte = data[at]
            code = fast[byte]
            if code:
                if code == 1:  # BINGET
                    stack.append(memo[data[at + 1]])
                    at += 2
                elif code == 2:  # BINPUT
                    memo[data[at + 1]] = stack[-1]
                    at += 2
                elif code == 17:  # BININT1
                    stack.append([1, 0, data[at + 1], None, None])
                    at += 2
                elif code == 3:  # a one-byte constant
                    stack.append(none if byte == 0x4E else empty if byte == 0x29 else [1, 0, byte == 0x88, None, None])
                    at += 1
                elif code == 4:  # MEMOIZE
                    memo[len(memo)] = stack[-1]
                    at += 1
                elif code == 5:  # LONG_BINGET
                    stack.append(memo[int.from_bytes(data[at + 1 : at + 5], "little")])
                    at += 5
                elif code == 6:  # MARK
                    marks.append(len(stack))
                    at += 1
                elif code == 7:  # LONG_BINPUT
                    memo[int.from_bytes(data[at + 1 : at + 5], "little")] = stack[-1]
                    at += 5
                elif code == 8 or code == 12:  # BININT2, BININT, BINUNICODE, SHORT_BINUNICODE
                    at = _value(data, at, byte, stack)
                elif code == 9:  # EMPTY_DICT, EMPTY_LIST: filled later
                    stack.append([1, 0, None, None, None if byte == 0x7D else []])
                    at += 1
                elif code == 10:  # TUPLE1, TUPLE2
                    if byte == 0x85:
                        one = stack[-1]
                        stack[-1] = [1 + one[0], 0, None, None, (one,)]
                    else:
                        one, two = stack[-2], stack[-1]
                        stack[-2:] = [[min(cap, 1 + one[0] + two[0]), 0, None, None, (one, two)]]
                    at += 1
                elif code == 14:  # TUPLE
                    start = marks.pop()
                    weight = 1
                    items = tuple(stack[start:])
                    for item in items:
                        weight += item[0]
                    stack[start:] = [[min(cap, weight), 0, None, None, items]]
                    at += 1
                elif code == 15:  # SETITEMS: each key hashed
                    start = marks.pop()
                    target, added, keys = stack[start - 1], 0, 0
                    for i, item in enumerate(stack[start:]):
                        added += item[0]
                        keys += item[0] if not i % 2 else 0
                    count_keys(target, stack[start::2])
                    del stack[start:]
                    target[0], target[1] = min(cap, target[0] + added), min(cap, target[1] + keys)
                    work += keys
                    at += 1
                elif code == 16:  # BUILD: a dict state's keys hashed again (a stand-in may copy them once more)
                    state = stack.pop()
                    target = stack[-1]
                    target[0] = min(cap, target[0] + state[0])
                    work += 2 * state[1]
                    at += 1
                elif code == 11:  # REDUCE, NEWOBJ
                    called, args = stack[-2], stack[-1]
                    name = called[2]
                    hashing = name is None or name in _HASHING  # a callable not named: it may hash
                    weight = args[0] if hashing or name in _CARRYING else 0
                    stack[-2:] = [_called([min(cap, 1 + weight), 0, None, None, None], name, args[4])]
                    work += weight if hashing else 0
                    at += 1
                else:  # BINPERSID: a storage
                    stack[-1] = leaf
                    at += 1
                if work > most:
                    return work
                continue
            at, added = _other(data, at, table[byte], stack, marks, memo, leaf, cap)
            if added < 0:  # STOP, or a malformed opcode the unpickler refuses
                return work
            work += added
            if work > most:
                return work
    except (ValueError, KeyError, IndexError, TypeError, struct.error):  # malformed: the unpickler refuses it
        return work
    return work


def _value(data: bytes, at: int, byte: int, stack: list[_Cell]) -> int:
    """Push the int of a BININT2/BININT or the text of a (SHORT_)BINUNICODE at ``at`` (a long text's hash only:
    it is never a name); return where the next opcode starts."""
    if byte == 0x4D:
        stack.append([1, 0, _INT2(data, at + 1)[0], None, None])
        return at + 3
    if byte == 0x4A:
        stack.append([1, 0, _INT4(data, at + 1)[0], None, None])
        return at + 5
    width = 4 if byte == 0x58 else 1
    length = int.from_bytes(data[at + 1 : at + 1 + width], "little")
    start = at + 1 + width
    raw = data[start : start + length]
    text = raw.decode("utf-8", "replace") if length <= 200 else None
    stack.append([1, 0, text, None if text is not None else hash(raw), None])
    return start + length


def _called(cell: _Cell, name: object, args: object) -> _Cell:
    """``cell``, the result of calling the global ``name`` with the argument cells ``args``: the keys of a
    hashing call counted, what a tuple-like call returns given its items."""
    if type(args) is tuple and type(name) is str:
        if name in _HASHING:
            count_keys(cell, call_keys(name, args))
            if name == "builtins.frozenset":
                cell[3] = frozen_hash(call_keys(name, args))
        elif name in _CARRYING:
            cell[4] = carried(name, args)
    return cell


_CONTAINERS = frozenset({"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"})
"""Opcodes pushing an object that later opcodes fill: each its own cell."""


def _other(
    data: bytes, at: int, spec: _Spec | None, stack: list[_Cell], marks: list[int], memo: dict[int, _Cell],
    leaf: _Cell, cap: int,
) -> tuple[int, int]:  # fmt: skip
    """The opcode at ``at`` that :func:`_walk` does not handle itself: (where the next one starts, the hashing it
    does), the hashing -1 at STOP or where the unpickler will refuse the opcode."""
    if spec is None:
        return at, -1
    name, kind, size, marked, popped, pushed, lines = spec
    at += 1
    arg: bytes | int | None = None
    if size >= 0:
        if kind in (_GET, _PUT):
            arg = data[at] if size == 1 else int.from_bytes(data[at : at + 4], "little")
        elif kind == _NUMBER:
            arg = data[at : at + size]
        at += size
    elif size == pickletools.UP_TO_NEWLINE:
        stop = data.index(b"\n", at)
        if lines == 2:
            stop = data.index(b"\n", stop + 1)
        arg = int(data[at:stop]) if kind in (_GET, _PUT) else data[at:stop]
        at = stop + 1
    else:
        width, read = _LENGTHS[size]
        length = read(data, at)[0]
        if length < 0:
            return at, -1
        arg = data[at + width : at + width + length] if kind in (_TEXT, _NUMBER) else None
        at += width + length
    if kind == _TUPLE:
        items = tuple(stack[len(stack) - popped :])
        stack[len(stack) - popped :] = [[min(cap, 1 + sum(i[0] for i in items)), 0, None, None, items]]
    elif kind == _GET:
        stack.append(memo[arg])  # type: ignore[index]
    elif kind == _PUT:
        memo[arg] = stack[-1]  # type: ignore[index]
    elif kind == _MEMOIZE:
        memo[len(memo)] = stack[-1]
    elif kind == _MARK:
        marks.append(len(stack))
    elif kind == _DUP:
        stack.append(stack[-1])
    elif kind == _TEXT:
        raw = arg if isinstance(arg, bytes) else b""
        text = raw.decode("utf-8", "replace") if len(raw) <= 200 else None
        stack.append([1, 0, text, None if text is not None else hash(raw), None])
    elif kind == _NUMBER:
        stack.append([1, 0, _number(name, arg), None, None])
    elif kind == _GLOBAL:
        stack.append([1, 0, _dotted(arg), None, None])
    elif kind == _STACK_GLOBAL:  # named only when both parts are known text
        module, qualname = stack[-2][2], stack[-1][2]
        known = type(module) is str and type(qualname) is str and module and qualname
        stack[-2:] = [[1, 0, _qualified(module, qualname) if known else None, None, None]]
    elif kind == _STOP:
        return at, -1
    elif kind == _GENERIC and not popped and not marked and pushed == 1 and name not in _CONTAINERS:
        stack.append(leaf)
    elif kind != _GENERIC or popped or marked or pushed:
        return at, _apply(kind, name, stack, marks, marked, popped, pushed, _dotted(arg), cap)
    return at, 0


def _number(name: str, arg: object) -> int | float:
    """The int or float a LONG1/LONG4/INT/LONG/BINFLOAT/FLOAT opcode pushes, as the unpickler reads it."""
    assert isinstance(arg, bytes)
    if name in ("LONG1", "LONG4"):
        return int.from_bytes(arg, "little", signed=True)
    if name == "BINFLOAT":
        return cast("float", struct.unpack(">d", arg)[0])
    if name == "FLOAT":
        return float(arg)
    if name == "INT" and arg in (b"00", b"01"):
        return arg == b"01"
    return int(arg[:-1] if name == "LONG" and arg.endswith(b"L") else arg, 0)


def _dotted(arg: object) -> str | None:
    """``module.name`` of a GLOBAL or INST argument (``module\\nname``), as the unpickler resolves it."""
    if not isinstance(arg, bytes):
        return None
    module, _, name = arg.decode("utf-8", "replace").partition("\n")
    return _qualified(module, name)


def _qualified(module: str, name: str) -> str:
    """``module.name`` as the unpickler resolves it (:func:`~.global_names.python2_name`: ``__builtin__.set`` is
    ``builtins.set``, a hashing call under either name)."""
    module, name = python2_name(module, name)
    return f"{module}.{name}"


def _apply(
    kind: int, name: str, stack: list[_Cell], marks: list[int], marked: bool, popped: int, pushed: int,
    text: str | None, cap: int,
) -> int:  # fmt: skip
    """Apply an opcode's stack effect; return the hashing it does (dict keys, set items, the arguments of a hashing
    call, an object state's keys)."""
    if marked:
        start = marks.pop()
        below, sliced = stack[start - popped : start], stack[start:]
        del stack[start - popped :]
    else:
        below, sliced = (stack[len(stack) - popped :] if popped else []), []
        del stack[len(stack) - popped :]
    if kind == _GROW and below:
        target = below[0]  # the container (or the object given a state) stays, holding more
        keys = below[1:2] if name == "SETITEM" else sliced[0::2] if name == "SETITEMS" else []
        if keys or name == "ADDITEMS":
            count_keys(target, keys or sliced)
        elif name in ("APPEND", "APPENDS") and type(target[4]) is list:
            target[4].extend(below[1:] + sliced)
        hashed: int = sum(k[0] for k in keys) + (sum(i[0] for i in sliced) if name == "ADDITEMS" else 0)
        hashed += 2 * below[1][1] if name == "BUILD" and len(below) > 1 else 0  # a dict state's keys, again
        target[0] = min(cap, target[0] + sum(i[0] for i in below[1:]) + sum(i[0] for i in sliced))
        target[1] = min(cap, target[1] + sum(k[0] for k in keys))
        stack.append(target)
        return hashed
    added: int = min(cap, sum(i[0] for i in below) + sum(i[0] for i in sliced))
    if kind == _BUILT:
        keys = sliced[0::2] if name == "DICT" else sliced
        keys_weight: int = min(cap, sum(k[0] for k in keys))
        built = [1 + added, keys_weight, None, None, None]
        count_keys(built, keys)
        if name == "FROZENSET":
            built[3] = frozen_hash(keys)
        stack.append(built)
        return keys_weight
    if kind == _CALL:
        holder = sliced[0] if name == "OBJ" and sliced else below[0] if below else None
        called = text if name == "INST" else holder[2] if holder is not None else None
        hashing = called is None or called in _HASHING  # a callable not named: it may hash
        weight = 1 + added if hashing or called in _CARRYING else 1
        # INST: MARK args; OBJ: MARK cls args; NEWOBJ_EX: cls, an args tuple, kwargs
        args = tuple(sliced) if name == "INST" else tuple(sliced[1:]) if name == "OBJ" else below[1][4]
        stack.extend(_called([weight, 0, None, None, None], called, args) for _ in range(pushed))
        return added if hashing else 0
    stack.extend([1 + added, 0, None, None, list(sliced) if name == "LIST" else None] for _ in range(pushed))
    return 0
