"""How the CLI reports exceptions: one line on stderr and an exit code, subclass-first."""

from __future__ import annotations

import re
from typing import Any, TextIO

from .. import errors
from ..errors import redact

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

# Checked in order: the first matching type decides the prefix and the exit code.
ERROR_TABLE: list[tuple[type[BaseException], str, int]] = [
    (errors.HubError, "Hub error", EXIT_FAILURE),
    (errors.StateDictMismatchError, "Mismatch", EXIT_FAILURE),
    (errors.OutputError, "Output error", EXIT_FAILURE),
    (errors.UnsafePickleError, "Unsafe pickle", EXIT_FAILURE),
    (errors.UnsupportedCheckpointError, "Unsupported checkpoint", EXIT_FAILURE),
    (errors.ZeroIOError, "Error", EXIT_FAILURE),
    # The library rejects bad argument values (e.g. --exclude-frozen with --format lightning) with ValueError:
    # for the CLI those are usage errors.
    (ValueError, "Invalid arguments", EXIT_USAGE),
]

# The library's messages name its Python arguments; the CLI user typed flags. Keyword arguments with a value
# (``fmt='lightning'``) become ``--format lightning``, ``flag=True`` becomes ``--flag``, and a bare argument name
# becomes its flag.
_VALUE_FLAGS = {
    "fmt": "--format",
    "dtype": "--dtype",
    "tag": "--tag",
    "output_tag": "--output-tag",
    "revision": "--revision",
    "max_shard_size": "--max-shard-size",
    "sub_group_size": "--sub-group-size",
    "adapter_config": "--adapter-config",
    "dcp_keys": "--dcp-keys",
    "true_vocab_size": "--true-vocab-size",
    "names": "--names",
}
_SWITCH_FLAGS = {
    "include_optimizer": "--include-optimizer",
    "merge_lora": "--merge-lora",
    "exclude_frozen": "--exclude-frozen",
    "distributed": "--distributed",
    "overwrite": "--overwrite",
    "create_pr": "--create-pr",
    "private": "--private",
}
_BARE_NAMES = (
    "max_shard_size", "exclude_frozen", "include_optimizer", "sub_group_size", "output_tag", "merge_lora",
    "true_vocab_size",
)  # fmt: skip

_SWITCH_WITH_FLAG = re.compile(r"\b(" + "|".join(_SWITCH_FLAGS) + r")=True \((--[a-z-]+)\)")
_SWITCH = re.compile(r"\b(" + "|".join(_SWITCH_FLAGS) + r")=True\b")
_VALUE = re.compile(r"\b(" + "|".join(_VALUE_FLAGS) + r")=(?:(['\"])(.*?)\2|([\w.]+))?")
_BARE = re.compile(r"(?<![-\w])(" + "|".join(_BARE_NAMES) + r")\b(?!=)")


def cli_spelling(message: str) -> str:
    """``message`` with the library's argument names (``include_optimizer=True``) written as CLI flags."""
    message = _SWITCH_WITH_FLAG.sub(lambda m: m.group(2), message)
    message = _SWITCH.sub(lambda m: _SWITCH_FLAGS[m.group(1)], message)

    def value_flag(m: re.Match[str]) -> str:
        value = m.group(3) if m.group(2) else m.group(4)
        flag = _VALUE_FLAGS[m.group(1)]
        return f"{flag} {value}" if value else flag

    message = _VALUE.sub(value_flag, message)
    return _BARE.sub(lambda m: _VALUE_FLAGS.get(m.group(1)) or _SWITCH_FLAGS[m.group(1)], message)


def format_error(exc: BaseException) -> tuple[str, int]:
    """The one line printed for ``exc`` and the exit code, or ``("", -1)`` when zeroio does not own it."""
    for exc_type, prefix, code in ERROR_TABLE:
        if isinstance(exc, exc_type):
            return f"{prefix}: {cli_spelling(redact(str(exc)))}", code
    return "", -1


class RedactingStream:
    """The CLI's stdout/stderr while a command runs: URL credentials in anything written are hidden (the last line
    of defence: zeroio's own messages are redacted where they are made)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
