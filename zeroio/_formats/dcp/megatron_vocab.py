"""How many embedding and output rows of a Megatron GPT are its tokenizer's vocabulary, for ``names="hf"``.

Megatron-LM pads the tokenizer's vocabulary to a multiple of ``make_vocab_size_divisible_by`` times the tensor
parallel size (``padded_vocab_size``), and the embedding and output layer hold that many rows; the rows past the
vocabulary are never a token's. transformers' model must have exactly the tokenizer's size, so ``names="hf"``
keeps the first ``true_vocab_size`` rows (as Megatron-LM's converters' ``--true-vocab-size`` does). Without it,
the size is taken from common.pt's args only where Megatron itself derives it from them: ``NullTokenizer`` (its
``--vocab-size`` plus the EOD token it appends) and ``TikTokenizer`` (``--vocab-size``). Every other tokenizer's
size lives in its files, which the checkpoint does not hold: the rows are then kept as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._messages import get_logger
from ...errors import CheckpointFormatError

__all__ = ["Vocab", "vocab_rows"]

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Vocab:
    """The rows kept and why."""

    size: int
    """Rows written (``config.json``'s ``vocab_size``)."""
    stored: int
    """Rows the checkpoint stores (Megatron's padded vocabulary)."""
    source: str
    """Where ``size`` comes from, in words."""

    def describe(self) -> str:
        """One line for ``inspect``."""
        if self.size == self.stored:
            return f"{self.stored} rows as stored ({self.source})"
        return f"{self.size} of {self.stored} stored rows ({self.source}); the rest is Megatron's padding"


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _recorded(args: dict[str, Any]) -> tuple[int, str] | None:
    """The vocabulary Megatron-LM's ``build_tokenizer`` derives from the args alone, or None."""
    kind, size = args.get("tokenizer_type"), _count(args.get("vocab_size"))
    if size is None:
        return None
    if kind == "NullTokenizer":
        return size + 1, f"NullTokenizer: vocab_size {size} in common.pt's args, plus its EOD token"
    if kind == "TikTokenizer":
        return size, f"TikTokenizer: vocab_size {size} in common.pt's args"
    return None


def _padded(size: int, args: dict[str, Any]) -> int | None:
    """Megatron-LM's ``vocab_size_with_padding`` of ``size`` under these args, or None if they do not say."""
    by, tp = _count(args.get("make_vocab_size_divisible_by")), _count(args.get("tensor_model_parallel_size"))
    if by is None or tp is None:
        return None
    multiple = by * tp
    return -(-size // multiple) * multiple


def vocab_rows(requested: int | None, args: dict[str, Any], stored: int, tensor: str, where: Any) -> Vocab:
    """The rows to keep of ``tensor`` (``stored`` rows): ``requested``, else what the args record, else all.

    A recorded size is used only when padding it as Megatron does gives the stored rows (or the args'
    ``padded_vocab_size`` is the stored rows): otherwise the args describe another vocabulary, and every row is kept.

    Raises:
        CheckpointFormatError: ``requested`` is more than the stored rows.
    """
    if requested is not None:
        if requested > stored:
            raise CheckpointFormatError(
                f"true_vocab_size={requested} is more than the {stored} rows of '{tensor}' in '{where}' (Megatron's "
                f"padded vocabulary); pass the tokenizer's vocabulary size, at most {stored}.",
                path=where,
                name=tensor,
                expected=requested,
                found=stored,
            )
        return Vocab(requested, stored, "true_vocab_size")
    found = _recorded(args)
    if found is None:
        return Vocab(
            stored, stored, "no vocabulary size in common.pt's args; true_vocab_size= / --true-vocab-size cuts padding"
        )
    size, how = found
    if size <= stored and stored in (_padded(size, args), args.get("padded_vocab_size")):
        return Vocab(size, stored, how)
    logger.warning("%s: %s, but '%s' stores %d rows: keeping them all", where, how, tensor, stored)
    return Vocab(stored, stored, f"{how}, which does not pad to the stored rows")
