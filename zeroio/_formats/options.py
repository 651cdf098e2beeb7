"""How to read a checkpoint, as one value: built once by the public verb from its keywords, then passed down."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .tp_rules import Rule, TPRules, parse_tp_rules

__all__ = ["DCP_KEYS", "DcpKeys", "NamesMode", "ReadOptions", "read_options", "trusted_names"]

DcpKeys = Literal["auto", "model", "all"]
"""``dcp_keys=``: which tensors of a DCP checkpoint are the model's (``_formats/dcp/keys.py``). ``model``: only
``model.``-prefixed tensors, prefix stripped; ``all``: every tensor that is not optimizer state, named as stored;
``auto``: ``model`` where every non-optimizer tensor is ``model.``-prefixed, else names as stored."""
DCP_KEYS: tuple[str, ...] = get_args(DcpKeys)

NamesMode = Literal["hf"]
"""``names=``: ``"hf"`` reads a Megatron GPT under transformers' names (None: the framework's own)."""


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """The reading keywords of ``open``, ``load``, ``convert``, ``reshard``, ``verify`` and ``push_to_hub``,
    validated (see :func:`read_options`): readers and the write engine take this one value, never the keywords."""

    tag: str | None = None
    """The tag folder to read (None: the one named in ``latest``)."""
    verify_crc: bool = True
    """Check every zip record read against its stored CRC-32 (``Checkpoint.verify_crc``)."""
    trusted_globals: frozenset[str] = frozenset()
    """Extra pickle globals to accept, rebuilt as inert data (never called)."""
    tp_rules: dict[str, Rule] | None = None
    """A tensor-parallel source's split rules, parsed (``{regex: dim or "replicated"}``), or None."""
    ignore_recorded_tp: bool = False
    """Set the tensor-parallel partitions recorded in the files aside, so ``tp_rules`` alone decide."""
    storage_options: Mapping[str, Any] | None = None
    """Options of a URL source's fsspec filesystem (credentials, endpoint), or None for the defaults."""
    merge_lora: bool = False
    """Present a PEFT checkpoint as its base model with the LoRA adapter merged in (``_formats/lora_views.py``)."""
    adapter_config: str | os.PathLike[str] | Mapping[str, Any] | None = None
    """A LoRA adapter's ``adapter_config.json`` (file, folder or dict) where none lies beside the checkpoint."""
    names: NamesMode | None = None
    """``"hf"``: a Megatron GPT under transformers' names (docs/formats.md); None: the framework's own."""
    true_vocab_size: int | None = None
    """With ``names="hf"``: the tokenizer's vocabulary, the embedding and output rows kept (the rest is Megatron's
    padding); None: the size common.pt's args give where Megatron derives it from them, else every stored row."""
    dcp_keys: DcpKeys = "auto"
    """Which tensors of a DCP checkpoint are the model's, under which names (``_formats/dcp/keys.py``)."""
    quantized: Literal["dequantize", "raw"] = "dequantize"
    """Block-scaled FP8 weights: ``dequantize`` them (DeepSeek's algorithm) or read them ``raw``, as stored."""


def trusted_names(trusted_globals: Iterable[str]) -> frozenset[str]:
    """``trusted_globals=`` as a set of names; one string is refused (its letters would each become a name)."""
    if isinstance(trusted_globals, str):
        raise TypeError(f"trusted_globals must be an iterable of names, not a string: [{trusted_globals!r}].")
    return frozenset(trusted_globals)


def read_options(
    *,
    tag: str | None = None,
    verify_crc: bool = True,
    trusted_globals: Iterable[str] = (),
    tp_rules: TPRules | None = None,
    ignore_recorded_tp: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    merge_lora: bool = False,
    adapter_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    names: NamesMode | None = None,
    dcp_keys: DcpKeys = "auto",
    quantized: Literal["dequantize", "raw"] = "dequantize",
    true_vocab_size: int | None = None,
) -> ReadOptions:
    """Validate the reading keywords a public verb was given, once, into a :class:`ReadOptions`.

    Raises:
        TypeError, ValueError: ``trusted_globals`` is one string, or ``tp_rules`` is not a mapping, a preset or
            JSON of one (a bad rule is the caller's error, not a checkpoint's format error), or ``quantized``
            is neither ``"dequantize"`` nor ``"raw"``, or ``true_vocab_size`` is not a positive int given with
            ``names="hf"``.
    """
    if names not in (None, "hf"):
        raise ValueError(f"names must be None (the checkpoint's own) or 'hf', not {names!r}.")
    _vocab(true_vocab_size, names)
    if dcp_keys not in DCP_KEYS:
        raise ValueError(f"dcp_keys must be one of 'auto', 'model', 'all', got {dcp_keys!r}.")

    if quantized not in ("dequantize", "raw"):
        raise ValueError(f"quantized must be 'dequantize' or 'raw', not {quantized!r}.")
    return ReadOptions(
        tag=tag,
        verify_crc=verify_crc,
        trusted_globals=trusted_names(trusted_globals),
        tp_rules=parse_tp_rules(tp_rules),
        ignore_recorded_tp=ignore_recorded_tp,
        storage_options=storage_options,
        merge_lora=_flag("merge_lora", merge_lora),
        adapter_config=_adapter_config(adapter_config),
        names=names,
        dcp_keys=dcp_keys,
        quantized=quantized,
        true_vocab_size=true_vocab_size,
    )


def _vocab(size: object, names: str | None) -> None:
    """``true_vocab_size``: a positive int, and only where it cuts something (``names="hf"``)."""
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"true_vocab_size must be an int (the tokenizer's vocabulary size), not {size!r}.")
    if size < 1:
        raise ValueError(f"true_vocab_size must be at least 1, not {size}.")
    if names != "hf":
        raise ValueError(
            "true_vocab_size cuts the padded vocabulary of a Megatron GPT written under transformers' names: "
            "pass names='hf' with it."
        )


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r}.")
    return value


def _adapter_config(
    value: str | os.PathLike[str] | Mapping[str, Any] | None,
) -> str | os.PathLike[str] | Mapping[str, Any] | None:
    if value is None or isinstance(value, (str, os.PathLike, Mapping)):
        return value
    raise TypeError(f"adapter_config must be a path or a dict, not {type(value).__name__}.")
