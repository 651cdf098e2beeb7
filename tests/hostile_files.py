"""Crafted hostile torch files, built byte by byte (all tiny): the attacks tests/test_hostile.py defends against.

Each builder returns the bytes of a ``.pt`` zip archive whose ``data.pkl`` is hand-written pickle opcodes, so the
attack is exactly what the name says and nothing torch.save would add.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable


def archive(pkl: bytes, records: dict[str, bytes] | None = None, *, compress_pickle: bool = False) -> bytes:
    """A torch zip archive: ``archive/data.pkl`` plus one stored record per storage."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        method = zipfile.ZIP_DEFLATED if compress_pickle else zipfile.ZIP_STORED
        zf.writestr(zipfile.ZipInfo("archive/data.pkl"), pkl, compress_type=method)
        for key, data in (records or {}).items():
            zf.writestr(zipfile.ZipInfo(f"archive/data/{key}"), data, compress_type=zipfile.ZIP_STORED)
        zf.writestr(zipfile.ZipInfo("archive/version"), b"3\n")
    return buf.getvalue()


class Ops:
    """Pickle protocol-2 opcodes, appended in order (``Ops().dict().text("a").int(1).setitem().stop()``)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")

    def raw(self, data: bytes) -> Ops:
        self.out += data
        return self

    def glob(self, qualified: str) -> Ops:
        module, _, name = qualified.rpartition(".")
        return self.raw(b"c" + module.encode() + b"\n" + name.encode() + b"\n")

    def text(self, s: str) -> Ops:
        data = s.encode()
        return self.raw(b"X" + struct.pack("<I", len(data)) + data)

    def int(self, n: int) -> Ops:
        if 0 <= n < 2**31:
            return self.raw(b"J" + struct.pack("<i", n))
        data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
        return self.raw(b"\x8a" + bytes([len(data)]) + data)

    def ints(self, values: tuple[int, ...]) -> Ops:
        self.mark()
        for v in values:
            self.int(v)
        return self.raw(b"t")

    def mark(self) -> Ops:
        return self.raw(b"(")

    def dict(self) -> Ops:
        return self.raw(b"}")

    def list(self) -> Ops:
        return self.raw(b"]")

    def none(self) -> Ops:
        return self.raw(b"N")

    def false(self) -> Ops:
        return self.raw(b"\x89")

    def setitem(self) -> Ops:
        return self.raw(b"s")

    def append(self) -> Ops:
        return self.raw(b"a")

    def tuple(self, n: int) -> Ops:
        return self.raw({1: b"\x85", 2: b"\x86", 3: b"\x87"}[n])

    def reduce(self) -> Ops:
        return self.raw(b"R")

    def build(self) -> Ops:
        return self.raw(b"b")

    def pop(self) -> Ops:
        return self.raw(b"0")

    def put(self, i: int) -> Ops:
        return self.raw(b"r" + struct.pack("<I", i))

    def get(self, i: int) -> Ops:
        return self.raw(b"j" + struct.pack("<I", i))

    def tensor(
        self, shape: tuple[int, ...], stride: tuple[int, ...], *, numel: int, key: str = "0", offset: int = 0
    ) -> Ops:
        """``_rebuild_tensor_v2(<float storage key, numel elements>, offset, shape, stride, False, OrderedDict())``."""
        self.glob("torch._utils._rebuild_tensor_v2").mark()
        self.mark().text("storage").glob("torch.FloatStorage").text(key).text("cpu").int(numel).raw(b"t")
        self.raw(b"Q").int(offset).ints(shape).ints(stride).false()
        self.glob("collections.OrderedDict").raw(b")").reduce()
        return self.raw(b"t").reduce()

    def stop(self) -> bytes:
        return bytes(self.out + b".")


def state_dict(tensor_ops: Callable[[Ops], Ops], *, name: str = "w") -> Ops:
    """``{name: <tensor>}`` with the tensor written by ``tensor_ops``."""
    return tensor_ops(Ops().dict().text(name)).setitem()


# --- item 1: a pickle changing what later reads return ----------------------------------------------------------


def build_on_global(qualified: str, state: str = "dict") -> bytes:
    """GLOBAL ``qualified``, then BUILD with an attribute state (``dict``: ``{"dtype": torch.float16}``;
    ``slots``: ``(None, {"dtype": torch.float16})``, which pickle applies with setattr); the tree is ``{}``."""
    ops = Ops().glob(qualified)
    if state == "slots":
        ops.none()
    ops.dict().text("dtype").glob("torch.float16").setitem()
    for attr in ("_value2member_map_", "__defaults__", "_zeroio_global"):
        ops.text(attr).dict().setitem()
    if state == "slots":
        ops.tuple(2)
    return archive(ops.build().pop().dict().stop())


def build_on_enum_member() -> bytes:
    """``ZeroStageEnum(2)`` (a member shared by every load), then BUILD renaming it."""
    ops = Ops().glob("deepspeed.runtime.zero.config.ZeroStageEnum").int(2).tuple(1).reduce()
    ops.dict().text("_name_").text("weights").setitem().text("_value_").int(3).setitem().build()
    return archive(Ops().dict().text("stage").raw(ops.out[2:]).setitem().stop())


# --- item 11: bounded work --------------------------------------------------------------------------------------


def bytearray_bomb(size: int = 3 << 30) -> bytes:
    """``bytearray(3 GiB)`` by REDUCE on an allowed callable: a few hundred bytes asking for gigabytes."""
    return archive(Ops().dict().text("x").glob("builtins.bytearray").int(size).tuple(1).reduce().setitem().stop())


def zip_bomb(unpacked: int = 64 << 20) -> bytes:
    """A DEFLATE-compressed ``data.pkl`` that unpacks to ``unpacked`` bytes (a BINBYTES8 of zeros)."""
    pkl = b"\x80\x04\x8e" + struct.pack("<Q", unpacked) + bytes(unpacked) + b"."
    return archive(pkl, compress_pickle=True)


def broadcast_tensor(numel: int = 2**40) -> bytes:
    """A stride-0 tensor claiming ``numel`` elements backed by a 1-element storage (4 bytes)."""
    pkl = state_dict(lambda o: o.tensor((numel,), (0,), numel=1)).stop()
    return archive(pkl, {"0": bytes(4)})


def exponential_dag(depth: int = 40) -> bytes:
    """A tensor, plus lists where each level holds the level below twice (by memo reference): 2**depth paths in
    about 1 KB."""
    ops = Ops().list().put(0).pop()
    for level in range(1, depth + 1):
        ops.list().get(level - 1).append().get(level - 1).append().put(level).pop()
    tree = state_dict(lambda o: o.tensor((1,), (1,), numel=1)).text("x").raw(ops.out[2:]).get(depth).setitem()
    return archive(tree.stop(), {"0": bytes(4)})


def tuple_dag(ops: Ops, depth: int = 40, first: int = 1000) -> Ops:
    """Memo ``first + depth`` := a tuple holding the level below twice, ``depth`` levels deep (2**depth tuples to
    hash, about 20 bytes a level); the stack is left as it was."""
    ops.raw(b")").put(first).pop()
    for level in range(first + 1, first + depth + 1):
        ops.get(level - 1).get(level - 1).tuple(2).put(level).pop()
    return ops


def hashed_tuple_dag(how: str = "key", depth: int = 40) -> bytes:
    """A tensor, plus a :func:`tuple_dag` hashed by the unpickler: as a dict key (``key``), an item of
    ``builtins.set([...])`` (``set``, or ``__builtin__.set``: the same), or of a ``frozenset`` opcode (``frozenset``, protocol 4). Hashing it walks
    2**depth tuples inside C code: ``zeroio.open`` never returned."""
    tree = state_dict(lambda o: o.tensor((1,), (1,), numel=1))
    tuple_dag(tree, depth).text("x")
    top = 1000 + depth
    if how == "key":
        tree.dict().get(top).int(1).setitem()
    elif how in ("set", "__builtin__.set"):  # the second as torch.save's protocol 2 spells it
        tree.glob("builtins.set" if how == "set" else how).list().get(top).append().tuple(1).reduce()
    else:
        tree.mark().get(top).raw(b"\x91")  # FROZENSET
    data = tree.setitem().stop()
    return archive(data.replace(b"\x80\x02", b"\x80\x04", 1) if how == "frozenset" else data, {"0": bytes(4)})


def many_dims(ndim: int = 20_000) -> bytes:
    """A 1-element tensor with ``ndim`` dimensions of size 1."""
    pkl = state_dict(lambda o: o.tensor((1,) * ndim, (1,) * ndim, numel=1)).stop()
    return archive(pkl, {"0": bytes(4)})


def many_dims_size(ndim: int = 20_000) -> bytes:
    """A tensor, plus a ``torch.Size`` of ``ndim`` dimensions (how ZeRO model states record parameter shapes)."""
    ops = state_dict(lambda o: o.tensor((1,), (1,), numel=1)).text("shape").glob("torch.Size").mark()
    for _ in range(ndim):
        ops.int(1)
    return archive(ops.raw(b"l").tuple(1).reduce().setitem().stop(), {"0": bytes(4)})


# --- item 12: raw exceptions ------------------------------------------------------------------------------------


def deep_nesting(depth: int = 100_000) -> bytes:
    """A tensor plus a list nested ``depth`` levels deep."""
    ops = state_dict(lambda o: o.tensor((1,), (1,), numel=1)).text("deep")
    ops.raw(b"]" * depth + b"a" * (depth - 1)).setitem()
    return archive(ops.stop(), {"0": bytes(4)})


def self_reference() -> bytes:
    """A tensor plus a list that contains itself."""
    ops = state_dict(lambda o: o.tensor((1,), (1,), numel=1)).text("loop")
    ops.list().put(0).get(0).append().setitem()
    return archive(ops.stop(), {"0": bytes(4)})


def rebuild_non_storage() -> bytes:
    """``_rebuild_tensor_v2`` given an int where a storage belongs."""
    ops = Ops().dict().text("w").glob("torch._utils._rebuild_tensor_v2").mark().int(7).int(0)
    ops.ints((1,)).ints((1,)).false().glob("collections.OrderedDict").raw(b")").reduce().raw(b"t").reduce()
    return archive(ops.setitem().stop())


ATTACKS: dict[str, Callable[[], bytes]] = {
    "storage_type_build": lambda: build_on_global("torch.FloatStorage"),
    "storage_type_build_slots": lambda: build_on_global("torch.FloatStorage", "slots"),
    "enum_class_build_slots": lambda: build_on_global("deepspeed.runtime.zero.config.ZeroStageEnum", "slots"),
    "enum_member_build": build_on_enum_member,
    "codecs_defaults_build": lambda: build_on_global("_codecs.encode", "slots"),
    "inert_dict_class_build": lambda: build_on_global("lightning.fabric.utilities.data.AttributeDict", "slots"),
    "bytearray_bomb": bytearray_bomb,
    "zip_bomb": lambda: zip_bomb(1 << 20),
    "broadcast_tensor": broadcast_tensor,
    "exponential_dag": exponential_dag,
    "hashed_tuple_dag": hashed_tuple_dag,
    "hashed_tuple_dag_set": lambda: hashed_tuple_dag("set"),
    "many_dims": many_dims,
    "many_dims_size": many_dims_size,
    "deep_nesting": lambda: deep_nesting(20_000),
    "self_reference": self_reference,
    "rebuild_non_storage": rebuild_non_storage,
}
"""Every crafted attack, by name (the fuzz corpus in tests/test_errors.py uses them too)."""

__all__ = ["ATTACKS", "Ops", "archive"]
