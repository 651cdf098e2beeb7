"""What a ``zeroio.load`` imports, and who imports the heavy modules (``torch._dynamo``, ``sympy``,
``torch.distributed``): the model is built first (on ``cpu`` or ``meta``), then only the load is watched.

    python benchmarks/load_imports.py --device cuda --build meta     # prints JSON: counts and import stacks
"""

from __future__ import annotations

import argparse
import builtins
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WATCH = ("torch._dynamo", "sympy", "torch.distributed", "torch._inductor", "torch.onnx")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--build", choices=["cpu", "meta"], default="cpu")
    parser.add_argument("--checkpoint", type=Path, default=REPO / "fixtures" / "z3_ws2_fp32")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from fixtures.models import TinyLM

    before_build = set(sys.modules)
    with torch.device(args.build):
        model = TinyLM()
    built = set(sys.modules)
    stacks: dict[str, list[str]] = {}
    original = builtins.__import__

    def watching(name: str, globals_: object = None, locals_: object = None, fromlist: object = (), level: int = 0):  # type: ignore[no-untyped-def]
        for watched in WATCH:
            if name.startswith(watched) and watched not in sys.modules and watched not in stacks:
                frames = traceback.extract_stack()[:-1]
                stacks[watched] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.line}" for f in frames][
                    -14:
                ]
        return original(name, globals_, locals_, fromlist, level)

    builtins.__import__ = watching
    t0 = time.perf_counter()
    import zeroio

    zeroio.load(args.checkpoint, model, device=args.device, dtype="bf16", strict=False)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    builtins.__import__ = original
    new = set(sys.modules) - built
    out = {
        "torch": torch.__version__,
        "device": args.device,
        "build": args.build,
        "build_imported": len(built - before_build),
        "build_imported_dynamo": "torch._dynamo" in built - before_build,
        "load_seconds": seconds,
        "load_imported": len(new),
        "load_imported_heavy": {w: sorted(m for m in new if m.startswith(w))[:3] for w in WATCH},
        "stacks": stacks,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
