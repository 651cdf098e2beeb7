"""The ``zeroio`` command: run a subcommand, map zeroio errors to one line and an exit code."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zeroio`` and ``python -m zeroio``; returns the exit code."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while starting (imports, parsing): one line, not a traceback
        print("Interrupted.", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    from ._app import build_parser
    from ._args import foreign_flag_problem
    from ._errors import RedactingStream

    parser = build_parser()
    problem = foreign_flag_problem(sys.argv[1:] if argv is None else argv)
    if problem is not None:
        parser.error(problem)  # zero_to_fp32.py / ds_to_universal.py flags: name zeroio's own
    args = parser.parse_args(argv)
    validate = getattr(args, "validate", None)
    if validate is not None:
        validate(parser, args)  # cross-flag checks: usage errors exit 2 like argparse's own
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(stdout), RedactingStream(stderr)  # no URL credentials on screen
    try:
        return _run(args)
    finally:
        sys.stdout, sys.stderr = stdout, stderr


def _run(args: argparse.Namespace) -> int:
    from ..errors import redact_exception
    from ._errors import EXIT_FAILURE, format_error

    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()
    except Exception as exc:
        line, code = format_error(exc)
        if code < 0 or os.environ.get("ZEROIO_DEBUG") == "1":
            redact_exception(exc)
            raise
        print(line, file=sys.stderr)
        print("(set ZEROIO_DEBUG=1 for the full traceback)", file=sys.stderr)
        return code if code >= 0 else EXIT_FAILURE


def _stdout_closed() -> int:
    """``zeroio inspect ... | head``: the reader left; stop quietly, like Unix tools killed by SIGPIPE.

    Python ignores SIGPIPE, so the write raises instead; restoring SIGPIPE's default would also kill a push whose
    socket breaks. Point stdout at /dev/null so the interpreter's final flush does not complain either.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a real file (e.g. captured by a test harness)
        pass
    return 128 + signal.SIGPIPE
