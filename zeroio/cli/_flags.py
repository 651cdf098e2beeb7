"""The flags several subcommands share, each defined once: progress, tensor-parallel rules, quantized weights,
DCP keys, and ``--names hf`` with ``--true-vocab-size``; ``read_keywords`` turns the ones a subcommand defines back
into the reading keywords of the API, so each subcommand passes the same ones the same way."""

from __future__ import annotations

import argparse
from typing import Any, Literal

from . import _args
from ._progress import MODES, PROGRESS_ENV


def add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        choices=MODES,
        help=f"auto (default, or {PROGRESS_ENV}): a bar on a terminal, a line every 10%% or 10 s (percent, bytes, "
        "rate, time left) when stderr is a file; bar, lines or none to force one",
    )


def add_tp_rules(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp-rules",
        metavar="RULES",
        help="tensor-parallel checkpoints: how tensors the files do not describe are split, as a preset (megatron, "
        'neox) or JSON {"regex": dim or "replicated"}',
    )


def add_keep_quantized(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keep-quantized",
        action="store_true",
        help="read quantized weights as stored (float8 values and *_scale_inv scales) instead of dequantizing "
        "block-scaled FP8",
    )


def add_dcp_keys(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dcp-keys",
        choices=_args.DCP_KEYS_CHOICES,
        default="auto",
        help="PyTorch DCP checkpoints: which tensors are the model's. auto (default): 'model.' stripped when every "
        "other tensor is optimizer or training state, else every name as stored; model: only 'model.' tensors, "
        "prefix stripped; all: every tensor but optimizer state, as stored (docs/dcp.md)",
    )


def add_names(p: argparse.ArgumentParser, help: str) -> None:
    """``--names hf`` and ``--true-vocab-size N`` (which cuts what ``--names hf`` writes)."""
    p.add_argument("--names", choices=["hf"], help=help)
    p.add_argument(
        "--true-vocab-size",
        type=_args.vocab_size,
        metavar="N",
        help="with --names hf: keep the first N embedding and output rows (the tokenizer's vocabulary; the rest is "
        "Megatron's padding) and write vocab_size N in config.json (default: the size common.pt's args record "
        "for NullTokenizer/TikTokenizer runs, else every stored row)",
    )


def _quantized(args: argparse.Namespace) -> Literal["dequantize", "raw"]:
    return "raw" if args.keep_quantized else "dequantize"


def read_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The reading keywords for the flags this subcommand defined (``add_tp_rules``, ``add_names``,
    ``add_keep_quantized``, ``add_dcp_keys``), so each command passes every flag it has and no keyword it lacks."""
    given = vars(args)
    keywords: dict[str, Any] = {}
    if "tp_rules" in given:
        keywords["tp_rules"] = args.tp_rules
    if "names" in given:
        keywords["names"] = args.names
        keywords["true_vocab_size"] = args.true_vocab_size
    if "keep_quantized" in given:
        keywords["quantized"] = _quantized(args)
    if "dcp_keys" in given:
        keywords["dcp_keys"] = args.dcp_keys
    return keywords
