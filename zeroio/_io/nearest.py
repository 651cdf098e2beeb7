"""The existing local path nearest to one that does not exist, for "did you mean" hints on a mistyped path."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

__all__ = ["did_you_mean"]

_MAX_ENTRIES = 10_000  # a huge folder is not worth listing for a hint


def _nearest(path: Path) -> Path | None:
    """Walk up to the first existing folder, then take the closest name at each missing level below it."""
    missing: list[str] = []
    folder = path
    while not os.path.isdir(folder):
        if folder == folder.parent:
            return None
        missing.append(folder.name)
        folder = folder.parent
    for name in reversed(missing):
        try:
            with os.scandir(folder) as entries:
                names = [e.name for _, e in zip(range(_MAX_ENTRIES), entries)]
        except OSError:
            return None
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if not close:
            return None
        folder = folder / close[0]
        if not folder.is_dir():
            return folder if name == missing[0] else None
    return folder


def did_you_mean(path: Path) -> str:
    """`` Did you mean 'fixtures/z3_ws2_fp32'?`` for a local ``path`` that does not exist, else ``""``."""
    if not isinstance(path, Path) or type(path).__name__ == "RemotePath":
        return ""
    near = _nearest(path)
    return f" Did you mean '{near}'?" if near is not None and near != path else ""
