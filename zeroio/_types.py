"""Type aliases shared by zeroio's modules."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

StrPath = str | os.PathLike[str]
StateDict = dict[str, torch.Tensor]
DTypeLike = str | torch.dtype
InitHook = Callable[[nn.Module], None]
ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(done, total)`` in bytes."""
