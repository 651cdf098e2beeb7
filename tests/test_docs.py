"""Every python and bash block of README.md and docs/*.md runs exactly as written (issue 23, item 10).

Each document's blocks run in order, in one fresh interpreter per document, from a folder of their own where
``fixtures`` is the repository's fixtures folder: what a reader gets after ``cd`` into a checkout. Python blocks
run each in a fresh namespace (a reader pastes one at a time), with the working folder importable as it is in
an interactive ``python``; bash blocks run under ``bash -euo pipefail``. Blocks that need a server get the local
ones (tests/s3_server.py, tests/hub_server.py, gcp-storage-emulator) through the variables a user would set
(``AWS_ENDPOINT_URL``, ``HF_ENDPOINT``, ``HF_TOKEN``, ``STORAGE_EMULATOR_HOST``); the text of a block is never
changed.

A block that cannot run here (GPUs, torchrun over nodes, a pip install, a long benchmark) says so in its info
string, with the reason: ```` ```bash no-run: needs 8 GPUs ````.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixture_data import FIXTURES, ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_LANGUAGES = {"python", "py", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^([ \t]*)```([^\n`]*)\n(.*?)^[ \t]*```[ \t]*$", flags=re.MULTILINE | re.DOTALL)
NO_RUN = re.compile(r"\bno-run\b:?\s*(.*)")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    language: str
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    found = []
    for match in FENCE.finditer(text):
        info = match.group(2).strip()
        language = info.split()[0] if info else ""
        if language in CODE_LANGUAGES:
            line = text.count("\n", 0, match.start()) + 1
            found.append(Block(doc, line, language, info, textwrap.dedent(match.group(3))))
    return found


def _runnable(doc: Path) -> list[Block]:
    return [b for b in _blocks(doc) if not NO_RUN.search(b.info)]


def test_every_code_block_runs_or_says_why():
    """A python/bash block is run by this file, or marked ``no-run: <reason>``; prompts ($) are not code."""
    problems = []
    for doc in DOCS:
        for block in _blocks(doc):
            marked = NO_RUN.search(block.info)
            if marked and not marked.group(1).strip():
                problems.append(f"{block.where}: 'no-run' without a reason")
            if block.language in {"console", "shell", "sh"}:
                problems.append(f"{block.where}: '{block.language}' block: write ```bash (commands only)")
            if any(line.startswith(("$ ", ">>> ")) for line in block.text.splitlines()):
                problems.append(f"{block.where}: prompt characters ($, >>>) in a code block")
    assert problems == []


_DRIVER = r"""
import json, os, subprocess, sys, traceback
sys.path.insert(0, os.getcwd())  # an interactive `python` started here imports from here
blocks = json.load(sys.stdin)
for block in blocks:
    print(f"--- {block['where']} ({block['language']})", flush=True)
    if block["language"] in ("python", "py"):
        code = compile(block["text"], block["where"], "exec")
        exec(code, {"__name__": "__main__"})
    else:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block["text"]])
        if done.returncode != 0:
            sys.exit(f"{block['where']}: bash block exited {done.returncode}")
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The local S3 and Hub servers, set up as the docs' examples expect, and the variables that reach them."""
    import gcsfs.core
    from gcp_storage_emulator.server import create_server
    from hub_server import DEFAULT_TOKEN, DEFAULT_USER, HubServer
    from huggingface_hub import HfApi
    from s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    s3 = S3Server()
    s3.upload_tree(FIXTURES / "z3_ws2_fp32", "my-bucket", "runs/llama/ckpt")
    gcs_port = _free_port()
    gcs = create_server("127.0.0.1", gcs_port, in_memory=True, default_bucket="bucket")
    gcs.start()
    gcs_env = {
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{gcs_port}",
        # gcsfs >= 2026 first asks a gRPC API the emulator lacks (tests/test_remote_gcs.py says more)
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    with pytest.MonkeyPatch.context() as mp:  # the uploading client, in this process, reaches the emulator too
        for key, value in gcs_env.items():
            mp.setenv(key, value)
        gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True).put(
            str(FIXTURES / "z3_ws2_fp32"), "bucket/run/ckpt", recursive=True
        )  # remote.md converts gs://bucket/run/ckpt
    hub = HubServer(orgs={DEFAULT_USER: ["my-org"]}).start()
    api = HfApi(endpoint=hub.endpoint, token=DEFAULT_TOKEN)
    api.create_repo("my-org/my-run")  # remote.md reads hf://my-org/my-run@main/global_step2
    api.upload_folder(repo_id="my-org/my-run", folder_path=FIXTURES / "z3_ws2_fp32")
    home = tmp_path_factory.mktemp("hf-home")
    env = {
        **s3.env(),
        **gcs_env,
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": DEFAULT_TOKEN,
        "HF_HOME": str(home),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    yield env
    hub.stop()
    s3.stop()
    gcs.stop()


_OUT_PATH = re.compile(r"(?<![\w/.-])out/[\w./-]*")


def test_each_page_writes_its_own_output_folders():
    """A reader runs the pages in order in one checkout: each page's examples write under ``out/<page>/`` (README
    under ``out/<name>`` of no page), so no page's output collides with an earlier page's (issue 32)."""
    pages = {doc.stem for doc in DOCS if doc.name != "README.md"}
    problems = []
    for doc in RUNNABLE_DOCS:
        for block in _runnable(doc):
            for path in {m.group(0).rstrip("/") for m in _OUT_PATH.finditer(block.text)}:
                parts = path.split("/")
                if doc.name == "README.md":
                    bad = len(parts) > 1 and parts[1] in pages
                else:
                    bad = len(parts) < 3 or parts[1] != doc.stem
                if bad:
                    problems.append(f"{block.where}: {path}")
    assert problems == []


# Documents whose examples reach s3:// or the Hub: they run with the local servers' variables set.
NEEDS_SERVERS = {"remote.md", "hub.md"}
RUNNABLE_DOCS = [d for d in DOCS if _runnable(d)]


def _run_doc(doc: Path, folder: Path, servers: dict[str, str]) -> subprocess.CompletedProcess[str]:
    folder.mkdir()
    (folder / "fixtures").symlink_to(FIXTURES, target_is_directory=True)
    (folder / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    blocks = [{"where": b.where, "language": b.language, "text": b.text} for b in _runnable(doc)]
    env = {
        **os.environ,
        **(servers if doc.name in NEEDS_SERVERS else {}),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONWARNINGS": "ignore",
    }
    # Each block starts interpreters; let them keep compiled bytecode as an installed package has (this machine
    # sets PYTHONDONTWRITEBYTECODE=1, which made every start compile zeroio again).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(blocks),
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def doc_runs(servers, tmp_path_factory):
    """Every document's blocks, started at once (one interpreter per document, two at a time): cheap on 2 cores."""
    root = tmp_path_factory.mktemp("docs")
    pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1))
    runs = {doc.name: pool.submit(_run_doc, doc, root / doc.stem, servers) for doc in RUNNABLE_DOCS}
    yield runs
    pool.shutdown(wait=True)


@pytest.mark.parametrize("doc", RUNNABLE_DOCS, ids=lambda d: d.name)
def test_doc_blocks_run_as_written(doc, doc_runs):
    """Every unmarked python/bash block of the document runs, in order, without error."""
    done = doc_runs[doc.name].result()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_readme_first_screen_commands_match_ci():
    """The README's test command is exactly what .ci/run runs."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = (
        "pip install torch==2.13.0 && pip install -e '.[test]' && ruff check zeroio tests && "
        "ruff format --check zeroio tests && mypy && python -m pytest -q -p no:cacheprovider"
    )
    assert command in readme.split("## What it does")[0]
    assert command in ci.splitlines()
