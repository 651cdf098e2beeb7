"""``python -m zeroio``: the command-line interface."""

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C before the CLI is imported: exit like SIGINT, without a traceback
    import sys

    print("Interrupted.", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
