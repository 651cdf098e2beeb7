"""``ZEROIO_*`` byte counts from the environment, read one way at every layer: a whole number with an optional
unit, anything else a ValueError naming the variable."""

from __future__ import annotations

import os
import re

__all__ = ["env_byte_count", "env_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def env_byte_count(variable: str, text: str) -> int:
    """``"16777216"``, ``"16MiB"``, ``"16 MB"`` as bytes; anything else (``abc``, ``1e6``) a ValueError naming
    ``variable`` (it used to be a bare ``int()`` error)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if match and match[2].upper() in _UNITS:
        return int(match[1]) * _UNITS[match[2].upper()]
    raise ValueError(
        f"{variable}={text!r} is not a byte count: set it to a whole number of bytes, optionally with a unit "
        "(KB, MB, GB, KiB, MiB, GiB), e.g. 16MiB, or unset it."
    )


def env_bytes(variable: str, default: int) -> int:
    """``variable``'s byte count (:func:`env_byte_count`), or ``default`` where it is unset or empty."""
    text = os.environ.get(variable)
    return env_byte_count(variable, text) if text else default


def env_positive_int(variable: str, text: str) -> int:
    """``"8"`` as 8; anything else (``eight``, ``0``, ``1.5``) a ValueError naming ``variable``."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{variable}={text!r} is not a positive whole number: set it (e.g. 8), or unset it.")
    return int(text)
