"""``python -m zeroio``: the command-line interface."""

from .cli import main

raise SystemExit(main())
