"""Inert stand-ins for the classes a checkpoint's pickle names: data without behaviour, DeepSpeed never imported."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from typing_extensions import Self

from ..errors import UnsafePickleError

__all__ = [
    "ZERO_STAGE_ENUM",
    "Device",
    "Inert",
    "InertDict",
    "InertParts",
    "Size",
    "ZeroStageEnum",
    "global_name",
    "inert_class",
    "inert_dict_class",
    "inert_parts",
    "is_inert",
    "refuse_build",
]

_ARGS, _KWARGS, _RAW_STATE = "_args", "_kwargs", "_state"


class ZeroStageEnum(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as ``ZeroStageEnum(n)``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3

    def __setstate__(self, state: Any) -> None:
        # Members are shared by every load in the process: a pickle's BUILD must not rename or renumber them.
        raise refuse_build(ZERO_STAGE_ENUM)


ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"


def refuse_build(name: str) -> UnsafePickleError:
    """The error for a pickle that BUILDs (sets the state of) an object every load shares, e.g. an allowed global.

    Raised without a path: ``load_pickle`` names the file.
    """
    return UnsafePickleError(
        f"the pickle tries to change the allowlisted global '{name}', which every later read shares. "
        "The file is hostile or corrupted; do not use it.",
        name=name,
    )


class Inert:
    """An object rebuilt from a pickle's state only; it has no behaviour. One subclass per global name."""

    _zeroio_global = "object"

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Reached when a pickle "calls" (REDUCE) or instantiates (NEWOBJ) an allowed global: record the
        # arguments, run nothing.
        self = object.__new__(cls)
        if args or kwargs:
            self.__dict__[_ARGS] = args
            self.__dict__[_KWARGS] = kwargs
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict_state, slots_state)
            merged: dict[str, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            state = merged
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__[_RAW_STATE] = state

    def __repr__(self) -> str:
        return f"<{type(self)._zeroio_global} {self.__dict__}>"


class InertDict(dict):  # type: ignore[type-arg]
    """Stand-in for dict subclasses that carry no behaviour we need (e.g. Lightning's AttributeDict)."""

    _zeroio_global = "builtins.dict"

    def __setstate__(self, state: Any) -> None:
        # BUILD on one instance (fresh per load) sets its attributes. Defined here also so that a BUILD aimed at
        # the shared class itself fails (pickle calls this unbound, without ``state``) instead of setting class
        # attributes.
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__[_RAW_STATE] = state


_INERT_CLASSES: dict[tuple[type, str], type] = {}


def _standin_class(base: type, qualified: str) -> type:
    cls = _INERT_CLASSES.get((base, qualified))
    if cls is None:
        cls = type(qualified.rsplit(".", 1)[-1], (base,), {"_zeroio_global": qualified})
        _INERT_CLASSES[(base, qualified)] = cls
    return cls


def inert_class(qualified: str) -> type[Inert]:
    """The :class:`Inert` subclass standing for global ``qualified`` (so the tree keeps its type name)."""
    return _standin_class(Inert, qualified)


def inert_dict_class(qualified: str) -> type[InertDict]:
    """The :class:`InertDict` subclass standing for the dict subclass ``qualified``."""
    return _standin_class(InertDict, qualified)


def is_inert(obj: object) -> bool:
    """True for an object rebuilt as inert data (an :class:`Inert`), whose class the pickle named."""
    return isinstance(obj, Inert)


def global_name(obj: object) -> str | None:
    """The pickle global a stand-in replaces (``"argparse.Namespace"``, DeepSpeed's ``ZeroStageEnum``, ...), or None."""
    if isinstance(obj, ZeroStageEnum):
        return ZERO_STAGE_ENUM
    if isinstance(obj, (Inert, InertDict)):
        return type(obj)._zeroio_global
    return None


@dataclass(frozen=True, slots=True)
class InertParts:
    """What a pickle recorded for one inert object: never run, only kept."""

    name: str
    """The global the pickle named (``"argparse.Namespace"``)."""
    args: tuple[Any, ...]
    """Arguments the pickle passed to the class (REDUCE/NEWOBJ)."""
    kwargs: dict[str, Any]
    """Keyword arguments the pickle passed to the class (NEWOBJ_EX)."""
    state: dict[str, Any]
    """Attributes the pickle set (BUILD); an opaque state sits under ``"_state"``."""
    opaque_state: bool
    """BUILD gave a state that is not a dict of attributes (or an attribute is literally named ``_state``)."""


def inert_parts(obj: Inert) -> InertParts:
    """The recorded arguments and state of an inert object."""
    state = dict(obj.__dict__)
    args, kwargs = state.pop(_ARGS, ()), state.pop(_KWARGS, {})
    return InertParts(type(obj)._zeroio_global, tuple(args), dict(kwargs), state, _RAW_STATE in state)


class Size(tuple):  # type: ignore[type-arg]
    """What ``torch.Size(...)`` in a pickle becomes: a tuple of ints (``to_plain`` gives back a ``torch.Size``)."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise refuse_build("torch.Size")

    def numel(self) -> int:
        """Number of elements of a tensor of this shape (as ``torch.Size.numel``)."""
        n = 1
        for d in self:
            n *= d
        return n


@dataclass(frozen=True)
class Device:
    """What ``torch.device(...)`` in a pickle becomes (``to_plain`` gives back the ``torch.device``)."""

    args: tuple[Any, ...]

    def __setstate__(self, state: Any) -> None:
        raise refuse_build("torch.device")

    def __str__(self) -> str:
        return ":".join(str(a) for a in self.args)
