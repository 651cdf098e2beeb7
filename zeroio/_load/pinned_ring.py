"""Page-locked staging buffers made on a background thread while the checkpoint opens.

Creating the CUDA context (~0.1-0.3 s) and pinning a few hundred MiB of host memory (``cudaHostAlloc`` pins page
by page) are fixed costs of every load to a GPU, paid before the first byte can be copied. Started as soon as
``zeroio.load`` knows its target device, they overlap opening the checkpoint and matching keys; the filler takes
each buffer when it first needs it (waiting only if it is not made yet).
"""

from __future__ import annotations

import queue
import threading

import torch

__all__ = ["PinnedRing"]


class PinnedRing:
    """``count`` pinned host buffers of ``nbytes`` each for copies to ``device``, made one by one on a thread
    (after the device's CUDA context); :meth:`take` hands them out in order."""

    def __init__(self, device: torch.device, count: int, nbytes: int) -> None:
        self.device = device
        self.count = count
        self.nbytes = nbytes
        self._made: queue.SimpleQueue[torch.Tensor | BaseException] = queue.SimpleQueue()
        self._taken = 0
        self._wanted = count
        self._thread = threading.Thread(target=self._make, name="zeroio-pin", daemon=True)
        self._thread.start()

    def _make(self) -> None:
        try:
            torch.empty(1, device=self.device)  # the CUDA context, on this thread's time
            made = 0
            while made < min(self.count, self._wanted):  # trim() may lower the count while this runs
                made += 1
                self._made.put(torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True))
        except BaseException as exc:  # noqa: BLE001 - raised in the loading thread by take()
            self._made.put(exc)

    def trim(self, wanted: int) -> None:
        """Make no more than ``wanted`` buffers in all (a small model needs fewer than the whole ring)."""
        self._wanted = max(1, wanted)

    def take(self) -> torch.Tensor:
        """The next buffer (raises what making it raised)."""
        if self._taken >= min(self.count, self._wanted):
            raise IndexError(f"all {self._taken} pinned buffers were taken")
        item = self._made.get()
        if isinstance(item, BaseException):
            self._made.put(item)  # every later take raises it too
            raise item
        self._taken += 1
        return item

    def close(self) -> None:
        """Make no more buffers; wait for the thread (buffers go back to torch's pinned-memory cache when freed)."""
        self.trim(self._taken)
        self._thread.join()
