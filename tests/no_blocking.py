"""A read that must fail, not hang: run it in a thread, give it a deadline, and return what it raised.

A FIFO swapped in for a checkpoint file would block an ``open`` or a ``read`` forever; these tests must fail with a
message instead of hanging the suite, so the read runs in a daemon thread the test abandons if it blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from zeroio.errors import CheckpointFormatError


def refused_without_blocking(read: Callable[[], object], seconds: float = 10) -> CheckpointFormatError:
    """``read()`` raises a CheckpointFormatError within ``seconds`` (a FIFO must never block it); returns it."""
    found: list[BaseException] = []

    def run() -> None:
        try:
            read()
        except BaseException as exc:  # noqa: BLE001 - any exception is checked below, in the test's thread
            found.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read blocked"
    assert found and isinstance(found[0], CheckpointFormatError), found
    return found[0]
