"""How the CLI reports exceptions: one line on stderr and an exit code, subclass-first."""

from __future__ import annotations

from .. import errors

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


def format_error(exc: BaseException) -> tuple[str, int]:
    """The one line printed for ``exc`` and the exit code, or ``("", -1)`` when zeroio does not own it."""
    for exc_type, prefix, code in ERROR_TABLE:
        if isinstance(exc, exc_type):
            return f"{prefix}: {exc}", code
    return "", -1
