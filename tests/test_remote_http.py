"""``http(s)://`` sources (single files) against web servers started here on localhost: one that serves HTTP
ranges, and Python's plain ``http.server``, which ignores them and sends the whole file to every request."""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from fixture_data import FIXTURES

import zeroio
from zeroio.errors import RemoteStorageError

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")  # fsspec's HTTP filesystem


class _Counted(SimpleHTTPRequestHandler):
    """Python's static file handler (no ``Range`` support), counting GETs per path."""

    gets: ClassVar[dict[str, int]] = {}

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        type(self).gets[self.path] = type(self).gets.get(self.path, 0) + 1
        super().do_GET()


class _Ranged(_Counted):
    """The same, answering ``Range: bytes=A-B`` with 206 and exactly those bytes, as object stores and CDNs do."""

    gets: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        path = Path(self.translate_path(self.path))
        if match is None or not path.is_file():
            return super().do_GET()
        type(self).gets[self.path] = type(self).gets.get(self.path, 0) + 1
        data = path.read_bytes()
        start, end = int(match[1]), min(int(match[2]), len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self.wfile.write(data[start : end + 1])
        return None


class _Sloppy(_Ranged):
    """Answers a range with one byte too many (a broken proxy or server)."""

    gets: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        if match is not None:
            self.headers.replace_header("Range", f"bytes={match[1]}-{int(match[2]) + 1}")
        super().do_GET()


def _serve(handler: type[_Counted], root: Path) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A consolidated torch file and a safetensors file converted from a DeepSpeed fixture."""
    root = tmp_path_factory.mktemp("web")
    zeroio.convert(FIXTURES / "z3_ws2_fp32", root / "st", progress=False)
    with zeroio.open(FIXTURES / "z3_ws2_fp32") as ckpt:
        torch.save(ckpt.state_dict(), root / "model.pt")
    return root


@pytest.fixture(scope="module")
def ranged(files: Path) -> Iterator[str]:
    yield from _serve(_Ranged, files)


@pytest.fixture(scope="module")
def plain(files: Path) -> Iterator[str]:
    yield from _serve(_Counted, files)


def _bits(path: object) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, raw bytes) of every tensor."""
    with zeroio.open(path) as ckpt:
        tensors = {k: ckpt[k] for k in ckpt}
    return {
        k: (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()) for k, t in tensors.items()
    }


@pytest.mark.parametrize("name", ["model.pt", "st/model.safetensors"])
def test_single_file_over_http_equals_local(files, ranged, tmp_path, name):
    """open and convert of an http:// file give the local result byte for byte."""
    assert _bits(f"{ranged}/{name}") == _bits(files / name)
    zeroio.convert(files / name, tmp_path / "local", progress=False)
    zeroio.convert(f"{ranged}/{name}", tmp_path / "remote", progress=False)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "local").iterdir()}
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "remote").iterdir()} == digest


def test_server_without_ranges_small_file_is_fetched_once(files, plain):
    """A server that answers every range with the whole file: a small file is read whole, once, and equals local."""
    _Counted.gets.clear()
    assert _bits(f"{plain}/model.pt") == _bits(files / "model.pt")
    assert _Counted.gets == {"/model.pt": 1}


def test_server_without_ranges_large_file_is_refused_naming_the_fix(files, plain):
    """Above 64 MiB each read would download the whole object again: a typed error naming the URL and the fix."""
    big = files / "big.pt"
    torch.save({"w": torch.zeros(17 * 2**20)}, big)  # 68 MiB
    try:
        with pytest.raises(RemoteStorageError, match=r"served without HTTP range support.*Download the file"):
            zeroio.open(f"{plain}/big.pt")
    finally:
        big.unlink()


def test_server_sending_more_than_the_range_is_a_typed_error_at_once(files):
    """A body longer than the range (and not the whole object) is the server's bug, not a transient fault: one
    request, then a RemoteStorageError naming the URL and the fix."""
    _Sloppy.gets.clear()
    for url in _serve(_Sloppy, files):
        with pytest.raises(RemoteStorageError, match=r"mishandles HTTP ranges\. Download the file"):
            zeroio.open(f"{url}/model.pt")
    assert sum(_Sloppy.gets.values()) == 1
