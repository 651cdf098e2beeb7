"""Argument types and checks of the ``zeroio`` command: turn what the user typed into library arguments."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence

# Decimal units are the Hugging Face ones (huggingface_hub's parse_size_to_int: KB/MB/GB/TB = 10**3..10**12, and
# huggingface_hub.utils.parse_size's one-letter K/M/G/T); the IEC binary units (KiB = 1024, ...) and a plain "B" are
# accepted too, because users type them (df -h, torch.cuda.mem_get_info) and huggingface_hub has none.
_SIZE_UNITS = {
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)

DTYPE_CHOICES = ("fp32", "fp16", "bf16")
DCP_KEYS_CHOICES = ("auto", "model", "all")
"""``--dcp-keys``: the library's ``dcp_keys`` values (zeroio.open checks them too)."""
# torch's spellings of the same dtypes (torch.bfloat16, ...), as users copy them from their training config.
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}

# Names a user gives a single file; --format safetensors/torch write a folder of files instead.
FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")

# The variables ``torchrun`` sets that torch.distributed's ``env://`` rendezvous reads.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def shard_size(text: str) -> int:
    """``--max-shard-size``: ``5GB``, ``500MB``, ``1.5GB``, ``2GiB``, ``200B`` or a byte count, to bytes."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS and unit != "":
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size: use a number with a unit, e.g. 5GB, 500MB (decimal), 2GiB (binary), "
            "200B, or a byte count"
        )
    size = int(float(match.group(1)) * _SIZE_UNITS.get(unit, 1))
    if size <= 0:
        raise argparse.ArgumentTypeError(f"the size must be at least one byte, got {text!r}")
    return size


def dtype(text: str) -> str:
    """``--dtype``: fp32/fp16/bf16, or torch's names for them (float32, float16, bfloat16, half)."""
    key = text.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from fp32, fp16, bf16, or float32, float16, bfloat16)"
        )
    return key


def vocab_size(text: str) -> int:
    """``--true-vocab-size``: a positive number of vocabulary rows."""
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected the tokenizer's vocabulary size (a positive integer), got {text!r}")
    return size


def running_under_torchrun() -> bool:
    """True when torchrun (or the user, by hand) set every variable the ``env://`` rendezvous needs."""
    return all(os.environ.get(name) for name in TORCHRUN_ENV)


def folder_destination_problem(dst: str, fmt: str) -> str | None:
    """Why ``dst`` cannot be the output folder of ``--format fmt``, or None when it can.

    ``--format safetensors/torch`` write a folder (``model.safetensors`` or shards and an index inside it); a
    destination named like a file would silently become a folder of that name.
    """
    if fmt == "lightning" or os.path.isdir(dst):
        return None
    name = os.path.basename(os.path.normpath(dst))
    if name.lower().endswith(FILE_SUFFIXES):
        stem = name.rsplit(".", 1)[0] or "model"
        return (
            f"DST '{dst}' is named like a file, but --format {fmt} writes a folder of files (e.g. "
            f"'{dst}/model.safetensors'): pass a folder name such as '{os.path.join(os.path.dirname(dst), stem)}'"
            + (" (or --format lightning for one .ckpt file)" if name.lower().endswith(".ckpt") else "")
        )
    return None


# Flags of DeepSpeed 0.19.8's zero_to_fp32.py and ds_to_universal.py -> what zeroio takes instead (docs/migrating.md).
FOREIGN_FLAGS = {
    "--max_shard_size": "use --max-shard-size",
    "--safe_serialization": "drop it: zeroio writes safetensors by default (--format torch for .bin files)",
    "-t": "use --tag",
    "--exclude_frozen_parameters": "use --exclude-frozen",
    "-d": "set ZEROIO_DEBUG=1 for tracebacks instead",
    "--debug": "set ZEROIO_DEBUG=1 for tracebacks instead",
    "--input_folder": "pass the checkpoint as SRC: zeroio convert SRC DST --format universal",
    "--output_folder": "pass the output folder as DST: zeroio convert SRC DST --format universal",
    "--num_extract_workers": "use --workers (IO threads)",
    "--num_merge_workers": "use --workers (IO threads)",
    "--keep_temp_folder": "drop it: zeroio writes no temporary slice files",
    "--no_strict": "drop it: zeroio always checks the checkpoint it reads",
    "--inject_missing_state": "drop it: zeroio converts checkpoints without universal_checkpoint_info as they are",
}


def foreign_flag_problem(argv: Sequence[str]) -> str | None:
    """The usage error for a zero_to_fp32.py / ds_to_universal.py flag in ``argv`` (None when there is none)."""
    for arg in argv:
        if arg == "--":
            break
        flag = arg.split("=", 1)[0]
        if flag in FOREIGN_FLAGS:
            return f"{flag} is a flag of DeepSpeed's zero_to_fp32.py/ds_to_universal.py: {FOREIGN_FLAGS[flag]} (docs/migrating.md)"
    return None
