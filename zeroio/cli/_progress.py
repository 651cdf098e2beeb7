"""How the command shows progress: a bar on a terminal, plain lines in a log, or nothing (``--progress``).

Batch jobs write stderr to a file, where a bar is invisible (tqdm draws none) or garbage (carriage returns), so
off a terminal ``auto`` prints a line every 10 % or 10 s: percent, bytes, rate and time left. The library itself
never prints: the command hands it one of these as its ``progress=`` callback (STYLE.md B.6).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["MODES", "PROGRESS_ENV", "ProgressLines", "choose_mode", "progress_for"]

MODES = ("auto", "bar", "lines", "none")
PROGRESS_ENV = "ZEROIO_PROGRESS"
"""Environment variable with the default of ``--progress`` (the flag wins; ``--quiet`` means ``none``)."""

LINE_SECONDS = 10.0
"""A progress line at least this often (a slow conversion still shows it is alive) ..."""
LINE_PERCENT = 10
"""... and at every step of this many percent."""
AUTO_FIRST_LINE_SECONDS = 3.0
"""With ``auto``, no line before this: a conversion done sooner is told by its summary line alone."""


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.0f} B"  # pragma: no cover


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def choose_mode(flag: str | None, quiet: bool) -> str:
    """``auto``, ``bar``, ``lines`` or ``none``: ``--quiet`` wins, then ``--progress``, then ``ZEROIO_PROGRESS``."""
    if quiet:
        return "none"
    mode = flag or os.environ.get(PROGRESS_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{PROGRESS_ENV}={mode!r} is not a progress mode: use one of {', '.join(MODES)}.")
    return mode


class ProgressLines:
    """A ``callable(done, total)`` that prints ``label: 40% 1.20 GB of 3.00 GB, 310.00 MB/s, 5 s left`` lines to
    stderr every :data:`LINE_PERCENT` percent or :data:`LINE_SECONDS` seconds, and once at 100 %, the first after
    ``first_after`` seconds. Thread-safe."""

    def __init__(self, label: str, *, first_after: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._label = label
        self._first_after = first_after
        self._clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None
        self._last_time = 0.0
        self._last_step = -1
        self._finished = False

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            now = self._clock()
            if self._started is None:
                self._started, self._last_time = now, now
            if self._finished or total <= 0 or now - self._started < self._first_after:
                return
            step = min(100, done * 100 // total) // LINE_PERCENT
            final = done >= total
            due = step > self._last_step or now - self._last_time >= LINE_SECONDS or self._last_step < 0
            if not (final or due):
                return
            if done == 0:  # the start: nothing to say yet
                self._last_step = 0
                return
            self._last_step, self._last_time, self._finished = step, now, final
            print(self._line(done, total, now - self._started), file=sys.stderr, flush=True)

    def _line(self, done: int, total: int, elapsed: float) -> str:
        text = f"{self._label}: {done * 100 // total}% {_human(done)} of {_human(total)}"
        if elapsed <= 0:
            return text
        rate = done / elapsed
        text += f", {_human(rate)}/s"
        if done < total and rate > 0:
            text += f", {_duration((total - done) / rate)} left"
        else:
            text += f", done in {_duration(elapsed)}"
        return text


class _ForcedBar:
    """``--progress bar`` off a terminal: a tqdm bar drawn anyway (tqdm hides it there by default)."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._lock = threading.Lock()
        self._bar: Any = None
        self._done = 0

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            if self._bar is None:
                from tqdm import tqdm  # type: ignore[import-untyped]  # a huggingface_hub dependency

                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=self._label, disable=False, leave=True)
            self._bar.update(done - self._done)
            self._done = done
            if done >= total:
                self._bar.close()


def progress_for(mode: str, label: str) -> bool | Callable[[int, int], None]:
    """The library's ``progress=`` value for a mode from :func:`choose_mode`: ``True`` (its own bar, and the Hub
    client's, on a terminal), a line printer, a forced bar, or ``False``. ``auto`` is a bar on a terminal, else
    lines from :data:`AUTO_FIRST_LINE_SECONDS` on."""
    if mode == "none":
        return False
    if mode == "lines":
        return ProgressLines(label)
    if mode == "auto" and not stderr_is_terminal():
        return ProgressLines(label, first_after=AUTO_FIRST_LINE_SECONDS)
    return True if stderr_is_terminal() else _ForcedBar(label)
