"""Record or check the sha256 of every file zeroio writes for every fixture (issue 13's behaviour lock).

``python tests/golden_outputs.py --write`` records ``tests/golden/outputs.json``; ``tests/test_golden_outputs.py``
recomputes the hashes and compares. The hashes were recorded before the issue-13 restructuring, so a refactor
that changes a single output byte fails the test.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zeroio

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
GOLDEN = Path(__file__).resolve().parent / "golden" / "outputs.json"


def _sources() -> list[tuple[str, Path]]:
    found = [(p.parent.name, p.parent) for p in sorted(FIXTURES.glob("*/manifest.json"))]
    frameworks = FIXTURES / "frameworks"
    found += [("frameworks/hf_trainer", frameworks / "hf_trainer_gpt2_z3" / "checkpoint-3")]
    found += [(f"frameworks/{n}", frameworks / n / "model.ckpt") for n in ("lightning_z3_fp32", "lightning_z3_bf16")]
    return found


def _hash_tree(root: Path) -> dict[str, str]:
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _cases(name: str, src: Path) -> dict[str, Callable[[Path], Path]]:
    """Every output kind the fixture supports: ``{case: write(into) -> output path}``."""
    with zeroio.open(src) as ckpt:
        meta = ckpt.metadata
    cases: dict[str, Callable[[Path], Path]] = {}

    def conv(**kw: Any) -> Callable[[Path], Path]:
        def run(out: Path) -> Path:
            zeroio.convert(src, out / "o", progress=False, **kw)
            return out / "o"

        return run

    cases["safetensors"] = conv()
    cases["safetensors-bf16-sharded"] = conv(dtype="bf16", max_shard_size=300)
    cases["torch-fp16-sharded"] = conv(fmt="torch", dtype="fp16", max_shard_size=300)
    cases["safetensors-exclude-frozen"] = conv(exclude_frozen=True)
    if meta.format == "zero" and meta.zero_stage in (1, 2, 3):
        cases["safetensors-optimizer"] = conv(include_optimizer=True, max_shard_size=400)
    if name.startswith("frameworks/lightning"):

        def lightning(out: Path) -> Path:
            zeroio.convert(src, out / "single.ckpt", fmt="lightning")
            return out / "single.ckpt"

        cases["lightning"] = lightning
    if meta.format == "zero" and meta.zero_stage == 3:
        for ws in (1, 3):

            def resh(out: Path, ws: int = ws) -> Path:
                zeroio.reshard(src, out / "r", world_size=ws)
                return out / "r"

            cases[f"reshard-ws{ws}"] = resh
    return cases


def compute() -> dict[str, dict[str, Any]]:
    """``{fixture: {case: {file: sha256} | "error: <type>"}}`` for every fixture and case."""
    results: dict[str, dict[str, Any]] = {}
    warnings.simplefilter("ignore")
    for name, src in _sources():
        results[name] = {}
        for case, run in _cases(name, src).items():
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    out = run(Path(tmp))
                except zeroio.errors.ZeroIOError as exc:
                    results[name][case] = f"error: {type(exc).__name__}"
                    continue
                results[name][case] = _hash_tree(out)
    return results


if __name__ == "__main__":
    import zeroio.errors

    data = compute()
    if "--write" in sys.argv:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}: {sum(len(v) for v in data.values())} cases")
    else:
        print(json.dumps(data, indent=1, sort_keys=True))
