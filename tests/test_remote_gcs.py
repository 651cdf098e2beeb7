"""Checkpoints read straight from gs:// URLs, against a real GCS JSON-API server (gcp-storage-emulator) on localhost.

The emulator runs in this process (its own thread) on a free port; fixtures are uploaded with the real gcsfs
client, and zeroio reaches the server through gcsfs over HTTP with ``STORAGE_EMULATOR_HOST`` (gcsfs's standard
variable) and ``storage_options={"token": "anon"}``. The emulator honours ``Range`` headers (206 with exactly the
bytes asked), so these are the same ranged reads a real bucket serves.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES

import zeroio

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

NAMES = ["z2_ws2_fp32", "z3_ws2_bf16"]
OPTIONS = {"token": "anon"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def gcs():
    """The emulator with the fixtures uploaded to gs://fixtures/<name>, and STORAGE_EMULATOR_HOST pointing at it."""
    import gcsfs
    import gcsfs.core
    from gcp_storage_emulator.server import create_server

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="fixtures")
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        # gcsfs >= 2026.x asks the gRPC storage-control API for each bucket's layout first; an emulator has no
        # gRPC endpoint (each call waits 60 s, then falls back): the plain JSON-API filesystem is what it serves.
        mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        mp.setattr(gcsfs, "GCSFileSystem", gcsfs.core.GCSFileSystem)
        fs = gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True)
        for name in NAMES:
            fs.put(str(FIXTURES / name), f"fixtures/{name}", recursive=True)
        yield fs
    server.stop()


def _sha256_tree(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("name", NAMES)
def test_gs_url_equals_local(gcs, tmp_path, name):
    """open, convert, verify and load from gs:// give exactly the local result."""
    url = f"gs://fixtures/{name}"
    assert gcs.cat_file(f"fixtures/{name}/latest", start=2, end=6) == (FIXTURES / name / "latest").read_bytes()[2:6]
    with zeroio.open(FIXTURES / name) as local, zeroio.open(url, storage_options=OPTIONS) as remote:
        assert list(remote.keys()) == list(local.keys())
        assert str(remote.metadata.path).startswith(url + "/global_step")
        for key in local:
            a, b = local[key], remote[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key
        expected = local.state_dict()
    zeroio.convert(FIXTURES / name, tmp_path / "local", progress=False)
    zeroio.convert(url, tmp_path / "remote", progress=False, storage_options=OPTIONS)
    assert _sha256_tree(tmp_path / "remote") == _sha256_tree(tmp_path / "local")
    assert zeroio.verify(url, tmp_path / "local", storage_options=OPTIONS).ok

    model = torch.nn.Module()
    for key, value in expected.items():
        module = model
        *parents, leaf = key.split(".")
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_buffer(leaf, torch.zeros_like(value))
    report = zeroio.load(url, model, storage_options=OPTIONS)
    assert not report.missing_keys and not report.unexpected_keys
    assert all(torch.equal(model.get_buffer(k), v) for k, v in expected.items())
