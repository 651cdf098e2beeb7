"""Type aliases shared by zeroio's modules (torch types named as strings: importing this module imports no torch)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import torch
    from torch import nn

StrPath = str | os.PathLike[str]
StateDict: TypeAlias = "dict[str, torch.Tensor]"
DTypeLike: TypeAlias = "str | torch.dtype"
InitHook: TypeAlias = "Callable[[nn.Module], None]"
ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(done, total)`` in bytes."""
