"""The ``zeroio`` command: run a subcommand, map zeroio errors to one line and an exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ._errors import EXIT_FAILURE, format_error

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zeroio`` and ``python -m zeroio``; returns the exit code."""
    from ._app import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    validate = getattr(args, "validate", None)
    if validate is not None:
        validate(parser, args)  # cross-flag checks: usage errors exit 2 like argparse's own
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    except Exception as exc:
        line, code = format_error(exc)
        if code < 0 or os.environ.get("ZEROIO_DEBUG") == "1":
            raise
        print(line, file=sys.stderr)
        print("(set ZEROIO_DEBUG=1 for the full traceback)", file=sys.stderr)
        return code if code >= 0 else EXIT_FAILURE
