"""How much work a checkpoint's pickle may ask for: bounds that no genuine file comes near, so hostile ones stop early.

A pickle is a program for a stack machine; zeroio's unpickler runs no code, but a few hundred bytes can still ask
for gigabytes (a huge ``bytearray``, a tensor view repeating one element 2**40 times) or for hours of work (one
list referenced twice per level, 40 levels deep, is 2**40 paths for a naive walker). Every bound below is checked
before the work it guards, and exceeding one raises a :mod:`zeroio.errors` exception naming the file.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_DEPTH", "MAX_DIMS", "MAX_NUMEL", "MAX_PICKLE_BYTES", "short_repr", "too_large"]

MAX_PICKLE_BYTES = 1 << 30
"""Largest ``data.pkl`` record read (1 GiB). It holds only the object tree (tensor bytes live in their own records):
a DeepSpeed rank file for a 100B-parameter model has a pickle of a few MB."""

MAX_DIMS = 64
"""Most dimensions a tensor shape may have. Real checkpoints use a handful, and torch's CUDA kernels index at most
25 (``MAX_DIMS`` of their offset calculator); 64 leaves ample room, while a 20,000-dimension shape only turns every
per-dimension loop (strides, views, printing) into seconds of work per tensor."""

MAX_NUMEL = (1 << 63) - 1
"""Largest dimension, and largest product of a shape's non-zero dimensions: torch sizes are int64, and safetensors
multiplies a shape's dimensions in u64. An empty tensor of shape ``(0, 2**64)`` named nothing to read, yet torch
refused it and a safetensors file written with it did not load."""


def too_large(shape: tuple[int, ...]) -> bool:
    """True when a shape of non-negative ints passes :data:`MAX_NUMEL` (a dimension, or the product of the non-zero
    ones): no tensor can have it, though an empty one names no bytes to back it."""
    nonzero = 1
    for d in shape:
        nonzero *= d or 1
        if nonzero > MAX_NUMEL:
            return True
    return False


MAX_DEPTH = 100
"""Deepest nesting of containers walked in a pickled tree. A Lightning checkpoint's hyper-parameters nest under
ten levels; the bound keeps every recursive walk far below Python's recursion limit (a deeper tree would raise a
bare RecursionError)."""


def short_repr(value: Any) -> str:
    """A repr of bounded length and cost, for messages about values a hostile pickle chose.

    ``str()`` of a 7 KB pickle's list of lists (each holding the one below twice) builds gigabytes; here at most 3
    levels of 4 items are shown, an int of more than 200 bits by its size, None, bools and floats as themselves, any
    other object by its type's name (an inert record's ``repr`` would walk its state).
    """
    import reprlib

    class _Bounded(reprlib.Repr):
        def repr_int(self, x: int, level: int) -> str:
            return repr(x) if x.bit_length() <= 200 else f"<int of {x.bit_length()} bits>"

        def repr_instance(self, x: Any, level: int) -> str:
            if x is None or isinstance(x, (bool, float, complex)):
                return repr(x)  # bounded: a float's repr is at most a few dozen characters
            return f"<{type(x).__name__}>"

    shown = _Bounded()
    shown.maxlevel, shown.maxlist, shown.maxtuple, shown.maxdict, shown.maxset = 3, 4, 4, 4, 4
    shown.maxstring = shown.maxother = shown.maxlong = 80
    return shown.repr(value)
