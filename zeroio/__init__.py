"""zeroio: read, load, convert and publish DeepSpeed ZeRO checkpoints without DeepSpeed.

The public names are imported on first use (PEP 562), so ``import zeroio``, ``zeroio.errors`` and the
``zeroio --version`` / ``--help`` commands start without importing torch. The ``TYPE_CHECKING`` block below
gives type checkers and IDEs the real objects; ``_PUBLIC_HOMES`` must name the same homes at run time.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

from . import errors as errors  # light (no torch): `zeroio.errors` works right after `import zeroio`

if _typing.TYPE_CHECKING:
    from ._convert import ConvertResult, convert
    from ._formats import Checkpoint, CheckpointMetadata, TensorInfo, open
    from ._hub import PushResult, create_hub_repo, push_to_hub
    from ._load.model import LoadReport, load
    from ._reshard.reshard import ReshardResult, reshard
    from ._verify import Mismatch, VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointMetadata",
    "ConvertResult",
    "LoadReport",
    "Mismatch",
    "PushResult",
    "ReshardResult",
    "TensorInfo",
    "VerifyReport",
    "__version__",
    "convert",
    "create_hub_repo",
    "load",
    "open",
    "push_to_hub",
    "reshard",
    "verify",
]

# Public name -> the module (relative to this package) that defines it; imported when the name is first read.
_PUBLIC_HOMES: dict[str, str] = {
    "Checkpoint": "._formats",
    "CheckpointMetadata": "._formats",
    "ConvertResult": "._convert",
    "LoadReport": "._load.model",
    "Mismatch": "._verify",
    "PushResult": "._hub",
    "ReshardResult": "._reshard.reshard",
    "TensorInfo": "._formats",
    "VerifyReport": "._verify",
    "convert": "._convert",
    "create_hub_repo": "._hub",
    "load": "._load.model",
    "open": "._formats",
    "push_to_hub": "._hub",
    "reshard": "._reshard.reshard",
    "verify": "._verify",
}


def _import_public_name(name: str) -> _typing.Any:
    """Import a public name's module on first use and keep the object here, so later reads cost nothing."""
    home = _PUBLIC_HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """What ``dir(zeroio)`` showed when every public name was imported eagerly: loaded or not, all are listed."""
    return sorted(set(globals()) | set(__all__))


# Only at run time: a module ``__getattr__`` seen by type checkers would make any misspelt ``zeroio.name`` valid.
if not _typing.TYPE_CHECKING:
    __getattr__ = _import_public_name
