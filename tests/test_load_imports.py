"""A load imports no compiler stack: ``torch._dynamo`` (1.4 s with bytecode, 6.9 s without on the H200 host),
``sympy``, ``torch._inductor``, FSDP or DTensor support, unless the model holds DTensors (issue 34).

Run in a fresh interpreter, since other tests import these modules. The model is built on the CPU: building one on
``meta`` runs torch's Python meta kernels, which import ``torch._dynamo`` and ``sympy`` themselves, before zeroio
(benchmarks/load_imports.py measures both). ``zeroio.load`` imports its accelerator filler (pinned staging, reader
threads) on every load, so this also covers what the CUDA path's modules import.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp", "torch.distributed.tensor")

PROBE = """
import json, sys
import torch
from fixtures.models import TinyLM

model = TinyLM()
before = set(sys.modules)
import zeroio

report = zeroio.load("fixtures/z3_ws2_fp32", model, dtype="bf16")
new = sorted(set(sys.modules) - before)
print(json.dumps({"loaded": len(report.loaded_keys), "new": new}))
"""


def test_a_plain_load_imports_no_compiler_stack() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == 11
    heavy = [m for m in result["new"] if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == []
    assert len(result["new"]) < 150  # zeroio's own modules and a few of the standard library's (78 today)
