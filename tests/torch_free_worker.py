"""Run many ``zeroio convert`` commands in one interpreter whose import system refuses some packages.

``python tests/torch_free_worker.py REFUSED OUT CASES_JSON``: REFUSED is a comma-separated list of top-level
packages (``torch,safetensors,huggingface_hub,tqdm``, or ``numpy``) whose import raises ImportError; CASES_JSON
maps a case id to the command's arguments (``["convert", SRC, "--dtype", "bf16", ...]``, without the
destination, which is ``OUT/<n>``). Prints one JSON object: per case its exit code, stderr and the sha256 of every
file written; plus every refused import asked for and the refused packages loaded at the end. One interpreter
for every case keeps the test cheap (a start-up each would cost ~0.3 s, ~3 s with torch).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from pathlib import Path

REFUSED = tuple(p for p in sys.argv[1].split(",") if p)
asked: list[str] = []


class Refuse:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] in REFUSED:
            asked.append(name)
            raise ModuleNotFoundError(f"torch_free_worker: {name} refused")  # as if not installed


sys.meta_path.insert(0, Refuse())

from zeroio.cli import main  # after the guard: zeroio must be imported under it


def _hashes(root: Path) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {
        str(p.relative_to(root)) if p != root else p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }


def run(out: Path, cases: dict[str, list[str]]) -> dict[str, object]:
    results: dict[str, object] = {}
    for n, (key, argv) in enumerate(cases.items()):
        dst = out / str(n)
        before = len(asked)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main([*argv[:2], str(dst), *argv[2:]])
            except SystemExit as exc:  # argparse
                code = int(exc.code or 0)
        results[key] = {
            "code": code,
            "stderr": err.getvalue(),
            "asked": asked[before:],
            "files": _hashes(dst) if code == 0 else {},
        }
    return results


if __name__ == "__main__":
    report = run(Path(sys.argv[2]), json.loads(sys.argv[3]))
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in REFUSED)
    print(json.dumps({"cases": report, "asked": asked, "loaded": loaded}))
