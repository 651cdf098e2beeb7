"""``zeroio.open``: detect what a path holds and return the matching lazy checkpoint view."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from . import _constants as C
from ._checkpoint import Checkpoint
from ._layout import is_zero_checkpoint
from ._types import StrPath
from ._zero import open_zero
from .errors import CheckpointFormatError, CheckpointNotFoundError, ZeroIOError

__all__ = ["open"]

_open = open  # the builtin, before this module's `open` shadows it


def _is_consolidated(path: Path) -> bool:
    if path.is_file():
        return path.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt") and not path.name.endswith(
            C.STATES_SUFFIX
        ) or path.name.endswith(".index.json")
    return path.is_dir() and any(
        (path / name).is_file() for name in (C.SAFETENSORS_SINGLE, C.SAFETENSORS_INDEX, C.TORCH_SINGLE, C.TORCH_INDEX)
    )


def open(
    path: StrPath,
    tag: str | None = None,
    *,
    trusted_globals: Iterable[str] = (),
) -> Checkpoint:
    """Open a checkpoint lazily: read metadata now, tensor bytes only when asked.

    Args:
        path: a DeepSpeed checkpoint root (with ``latest``), a tag folder, a rank file, or a consolidated
            checkpoint (``model.safetensors``, a sharded safetensors folder, a torch ``.bin``/``.pt`` state dict).
        tag: the tag folder to read (default: the one named in ``latest``).
        trusted_globals: extra pickle globals to accept, rebuilt as inert data (never called).

    Returns:
        A read-only ``Mapping[str, torch.Tensor]`` with ``metadata``, ``info()``, ``tied`` and ``state_dict()``.

    Raises:
        CheckpointNotFoundError: the path, tag or a rank file is missing.
        CheckpointFormatError: a file is not what a checkpoint holds (subclasses say how).

    Example:
        >>> import zeroio
        >>> with zeroio.open("fixtures/z3_ws2_fp32") as ckpt:
        ...     print(ckpt.metadata.zero_stage, ckpt.metadata.world_size, ckpt["emb.weight"].shape)
        3 2 torch.Size([13, 7])
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"Checkpoint path '{p}' does not exist.", path=p)
    trusted = frozenset(trusted_globals)
    if _is_consolidated(p) and not is_zero_checkpoint(p):
        from ._files import open_consolidated

        return open_consolidated(p, trusted_globals=trusted)
    try:
        return open_zero(p, tag, trusted_globals=trusted)
    except ZeroIOError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError) as exc:
        # Last line of defence: metadata of an unexpected shape must never surface as a bare Python error.
        raise CheckpointFormatError(
            f"'{p}' holds metadata zeroio cannot interpret ({type(exc).__name__}: {exc}). The checkpoint is corrupted "
            "or was written by an unsupported DeepSpeed version; please report it with `zeroio inspect --json`.",
            path=p,
        ) from exc
