"""Work and memory at open bounded by the bytes of the files, not by the references they contain (issue 30, item 4):
each hostile folder of tests/hostile_dcp.py, at the size that cost gigabytes or minutes, and an S3 object served with
an endless chunked body, give a typed error in seconds with bounded memory. Measured in a child process (peak RSS),
whose data segment is capped so that the old code fails there instead of exhausting the machine."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from fixture_data import FIXTURES
from hostile_dcp import (
    chunk_references,
    one_archive_many_chunks,
    shared_chunk_lists,
    shared_list_offsets,
    values_on_one_range,
)

_CHILD = """
import json, resource, sys, time
import zeroio

def peak():
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))

data = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmData'))
resource.setrlimit(resource.RLIMIT_DATA, (data + (3 << 30), resource.RLIM_INFINITY))
results = {}
for name, root in json.loads(sys.argv[1]).items():
    base, start, outcome = peak(), time.monotonic(), 'read'
    try:
        with zeroio.open(root) as ckpt:
            for key in ckpt.keys():
                ckpt[key]
    except Exception as exc:
        outcome = f'{type(exc).__module__}.{type(exc).__name__}: {exc}'
    results[name] = {'outcome': outcome, 'grew': peak() - base, 'seconds': time.monotonic() - start}
print(json.dumps(results))
"""


def _open_in_child(roots: dict[str, str], env: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(roots)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


BUILDERS = {
    "shared_list_offsets": (shared_list_offsets, "a chunk offset of 'model.scale' is [[[[...], [...]]"),
    "values_on_one_range": (values_on_one_range, "'value0' and 'value1' share the bytes of '__9_0.distcp'"),
    "chunk_references": (chunk_references, "'model.scale' lists the same chunk twice"),
    "shared_chunk_lists": (shared_chunk_lists, "share"),
    "one_archive_many_chunks": (one_archive_many_chunks, "'model.big' and 'model.big' share the bytes"),
}


@pytest.fixture(scope="module")
def dcp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Every DCP attack at full size (a 2**40-leaf list, 150 x 16 MiB, a million references, 200k zip entries)."""
    roots = {}
    for name, (build, _) in BUILDERS.items():
        root, edited = build(tmp_path_factory.mktemp(name))
        assert edited.stat().st_size < 2_100_000  # the attack is the references, not the bytes
        roots[name] = str(root)
    return _open_in_child(roots)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_hostile_dcp_metadata_is_refused_quickly_in_bounded_memory(dcp_results, name):
    result = dcp_results[name]
    assert str(result["outcome"]).startswith("zeroio.errors.CheckpointFormatError"), result
    assert BUILDERS[name][1] in str(result["outcome"]), result
    assert int(str(result["grew"])) < 64 << 20, result
    assert float(str(result["seconds"])) < 5, result


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    pytest.importorskip("s3fs")
    from s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server()
    server.upload_tree(FIXTURES / "z3_ws2_fp32", "bombs", "ckpt")
    yield server
    server.stop()


def test_endless_chunked_s3_body_is_refused_with_bounded_memory(s3):
    """A ranged GET answered with the true headers and then a chunked body that never ends: read whole before
    (2.1 GB for a 184-byte object)."""
    s3.faults = ["endless"] * 10  # type: ignore[attr-defined]
    try:
        result = _open_in_child({"s3": "s3://bombs/ckpt"}, env=s3.env())["s3"]  # type: ignore[attr-defined]
    finally:
        s3.faults = []  # type: ignore[attr-defined]
    assert str(result["outcome"]).startswith("zeroio.errors.RemoteStorageError"), result
    assert "sends more than the" in str(result["outcome"]), result
    assert int(str(result["grew"])) < 64 << 20, result
    assert float(str(result["seconds"])) < 10, result
