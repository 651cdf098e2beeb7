"""Type aliases shared by zeroio's modules."""

from __future__ import annotations

import os
from typing import Callable, Union

import torch
from torch import nn

StrPath = Union[str, "os.PathLike[str]"]
StateDict = dict[str, torch.Tensor]
DTypeLike = Union[str, torch.dtype]
InitHook = Callable[[nn.Module], None]
ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(done, total)`` in bytes."""
