"""Reading ahead while a load to a GPU starts, so that the disk works while the CUDA context is made.

A load to CUDA copies nothing before the device's context exists and its first pinned buffer is made (0.2-0.5 s
on an H200 host, where the whole 2.6 GB read takes 1.2 s cold), and its reader threads wait until then. Once the
keys are matched, a thread here asks the kernel to read the planned tensors' bytes into the page cache, in the
order the filler reads them (``posix_fadvise(WILLNEED)``: queued, nothing copied); the filler's reads of them then
wait only for what is still on its way. It stops when the filler starts reading, or after
:data:`PREFETCH_BYTES`, so it never fills memory with bytes read long before they are needed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .._env import env_bytes
from .._formats import Checkpoint
from .._messages import get_logger

__all__ = ["PREFETCH_BYTES", "StartupPrefetch", "prefetch_bytes"]

logger = get_logger(__name__)

PREFETCH_BYTES = 1 << 30
"""Most bytes asked for ahead of the filler (``ZEROIO_PREFETCH_BYTES`` overrides it; 0: none): what a fast disk
reads in the filler's start-up time (2 GB/s x 0.5 s), far below any GPU host's memory."""

STEP = 8 << 20
"""Bytes per advice call: the thread notices :meth:`StartupPrefetch.stop` between calls."""

FORMATS = frozenset({"safetensors", "zero", "torch"})
"""Formats whose files are all opened by ``zeroio.open`` (others open some late, which this thread must not race)."""


def prefetch_bytes() -> int:
    """:data:`PREFETCH_BYTES`, or ``ZEROIO_PREFETCH_BYTES``."""
    return env_bytes("ZEROIO_PREFETCH_BYTES", PREFETCH_BYTES)


class StartupPrefetch:
    """Advises the kernel to read checkpoint tensors ``names`` (in this order) until :meth:`stop`, on a thread."""

    def __init__(self, ckpt: Checkpoint, names: Sequence[str], limit: int | None = None) -> None:
        self._stop = threading.Event()
        self.advised = 0
        """Bytes asked for so far."""
        self._thread: threading.Thread | None = None
        limit = prefetch_bytes() if limit is None else limit
        if limit > 0 and names and ckpt.metadata.format in FORMATS:
            args = (ckpt, list(names), limit)
            self._thread = threading.Thread(target=self._run, args=args, name="zeroio-prefetch", daemon=True)
            self._thread.start()

    def _run(self, ckpt: Checkpoint, names: list[str], limit: int) -> None:
        try:
            for name in names:
                source = ckpt.source_name(name)
                where = ckpt.byte_map(source)
                if where is None:
                    return
                for file, offset, nbytes in where.locate(0, ckpt.info(name).numel):
                    will_need = getattr(file, "will_need", None)
                    if will_need is None:  # a remote object: its reads fetch ahead their own way
                        return
                    for at in range(offset, offset + nbytes, STEP):
                        if self._stop.is_set() or self.advised >= limit:
                            return
                        n = min(STEP, offset + nbytes - at)
                        will_need(at, n)
                        self.advised += n
        except Exception as exc:  # noqa: BLE001 - advice only: the filler reads everything itself anyway
            logger.debug("read-ahead stopped: %s", exc)

    def stop(self) -> None:
        """Ask for nothing more; return once the thread has made its last call."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
