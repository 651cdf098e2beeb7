"""``python -m zeroio``: the command-line interface."""

import os
import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C before the CLI is imported: exit like SIGINT, without a traceback
    print("Interrupted.", file=sys.stderr)
    raise SystemExit(130) from None

code = main()
if os.environ.get("TORCHELASTIC_RUN_ID") and "torch.distributed" in sys.modules:
    # A torchrun worker that joined a process group (convert --distributed): its work is done and its outputs
    # closed and synced, the group destroyed. The interpreter's teardown of torch (0.4-0.7 s on the GPU host) would
    # only delay torchrun, which waits for its slowest worker to exit: flush what is buffered and leave now.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
