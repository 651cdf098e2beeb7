"""Progress reporting, with one meaning for every verb: ``progress=True`` draws a bar, a callable gets bytes."""

from __future__ import annotations

import sys
import threading
from typing import Any

from .._messages import redact
from .._types import ProgressCallback

__all__ = ["ByteProgress", "Progress", "check_progress"]

Progress = bool | ProgressCallback
"""``True``: a tqdm bar in bytes on a terminal (none when stderr is not one); ``False``: silent;
``callable(done, total)``: called with bytes done and total bytes, possibly from IO threads."""


def check_progress(progress: object) -> None:
    """Raise TypeError unless ``progress`` is a :data:`Progress` value."""
    if not (isinstance(progress, bool) or callable(progress)):
        raise TypeError(f"progress must be True, False or a callable(done, total), got {progress!r}.")


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream: let tqdm decide, as before
        return True


class ByteProgress:
    """Thread-safe byte counter feeding a tqdm bar (``progress=True``) or a ``callable(done, total)``."""

    def __init__(self, progress: Progress, total: int, desc: str) -> None:
        self._lock = threading.Lock()
        self._done = 0
        self._total = total
        self._callback: ProgressCallback | None = None
        self._bar: Any = None
        if callable(progress):
            self._callback = progress
        elif progress and _stderr_is_terminal():  # tqdm's disable=None would hide it anyway: do not import it
            from tqdm import tqdm  # type: ignore[import-untyped]  # a huggingface_hub dependency

            # disable=None: no bar when stderr is not a terminal (logs, CI, captured output).
            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=redact(desc), disable=None, leave=False)

    def update(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            if self._bar is not None:
                self._bar.update(nbytes)
            if self._callback is not None:
                self._callback(self._done, self._total)

    def start(self) -> None:
        if self._callback is not None:
            self._callback(0, self._total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
