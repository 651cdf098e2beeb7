"""Crafted legacy (non-zip) torch streams, built byte by byte: the attacks tests/test_legacy.py defends against.

A legacy stream is five pickles then the storages' records (``int64`` element count + raw bytes) in key-list order;
each builder writes exactly what its name says, so a lie in a length or a key is the only thing wrong with it.
"""

from __future__ import annotations

import pickle
import struct

from hostile_files import Ops

MAGIC = 0x1950A86A20F9469CFC6C
SYS_INFO = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}


def legacy_tensor(ops: Ops, shape: tuple[int, ...], stride: tuple[int, ...], *, numel: int, key: str,
                  offset: int = 0, view: object = None) -> Ops:  # fmt: skip
    """``_rebuild_tensor_v2`` over the legacy persistent id ``('storage', FloatStorage, key, 'cpu', numel, view)``."""
    ops.glob("torch._utils._rebuild_tensor_v2").mark()
    ops.mark().text("storage").glob("torch.FloatStorage").text(key).text("cpu").int(numel)
    ops.none() if view is None else ops.text(str(view))
    ops.raw(b"t").raw(b"Q").int(offset).ints(shape).ints(stride).false()
    ops.glob("collections.OrderedDict").raw(b")").reduce()
    return ops.raw(b"t").reduce()


def stream(tree: bytes, keys: list[str], records: list[tuple[int, bytes]], *, magic: int = MAGIC,
           sys_info: object = SYS_INFO, header: bytes | None = None) -> bytes:  # fmt: skip
    """A legacy stream: header pickles, the object tree ``tree``, the key list, then ``(count, data)`` records."""
    head = header if header is not None else b"".join(pickle.dumps(v, protocol=2) for v in (magic, 1001, sys_info))
    body = b"".join(struct.pack("<q", count) + data for count, data in records)
    return head + tree + pickle.dumps(keys, protocol=2) + body


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def one_tensor(numel: int = 3, *, count: int | None = None, data: bytes | None = None, key: str = "0",
               keys: list[str] | None = None, view: object = None) -> bytes:  # fmt: skip
    """``{"w": <numel floats>}`` whose record says ``count`` elements and holds ``data`` (honest by default)."""
    tree = legacy_tensor(Ops().dict().text("w"), (numel,), (1,), numel=numel, key=key, view=view).setitem().stop()
    data = floats(*range(numel)) if data is None else data
    return stream(tree, [key] if keys is None else keys, [(numel if count is None else count, data)])


def two_tensors_sharing_a_key_twice() -> bytes:
    """Two storages, the key list naming the first twice (its bytes read as two records overlapping nothing)."""
    tree = Ops().dict().text("a")
    legacy_tensor(tree, (2,), (1,), numel=2, key="0").setitem().text("b")
    legacy_tensor(tree, (2,), (1,), numel=2, key="1").setitem()
    return stream(tree.stop(), ["0", "0", "1"], [(2, floats(1, 2)), (2, floats(3, 4)), (2, floats(5, 6))])
