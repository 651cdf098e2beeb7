"""Message helpers shared by every module: one way to show a long list in one line."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["SHOWN", "listing"]

SHOWN = 5
"""Items a message lists before "... and N more" (huggingface_hub and torch keep messages to one screen too)."""


def listing(items: Sequence[str], *, limit: int = SHOWN, show: Callable[[str], str] = str) -> str:
    """``"a, b, c, d, e ... and 37 more"``: the first ``limit`` items, each rendered by ``show``."""
    shown = ", ".join(show(item) for item in items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")
