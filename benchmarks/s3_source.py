"""A loopback S3 server to benchmark reading a checkpoint from an object store: moto's server mode behind a proxy.

moto (``ThreadedMotoServer``, as the tests use it) holds the objects and answers every request, except that the
proxy answers a plain ranged GET itself, by seeking into the object moto stores: moto 5.2.1 reads the whole object
for every ranged GET (0.43 s for 1 MiB of a 512 MiB object, docs/remote.md), so through moto alone a benchmark of
8 MiB parts of 170 MB rank files measures moto, not the reader. An object store serves a range in time proportional
to the range. The proxy keeps S3's answer: 206 with ``Content-Range``, moto's ``ETag`` and ``Last-Modified``, 412
for an ``If-Match`` that names another version (anything else, and every non-GET, is relayed to moto).

What it can emulate, per response (so per connection: a connection carries one request at a time):

* ``cap_bytes_per_s``: each response body is paced to at most this rate. Object stores limit one connection
  (S3 gives roughly 50-100 MB/s to one GET stream; AWS advises parallel ranged GETs of 8-16 MB to go faster), so a
  reader's throughput is its concurrent connections times that rate, until the host's network link;
* ``first_byte_s``: a delay before each ranged response (an object store's time to first byte, ~10-50 ms).

Everything runs in the calling process (threads): on a machine whose cores are all busy, the server competes with
the readers for CPU, which the benchmark records (load average, CPU seconds).
"""

from __future__ import annotations

import http.client
import logging
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, _free_port  # the tests' server: its credentials

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
_PACE_BYTES = 256 * 1024  # body written in pieces of this size, each no sooner than the cap allows


@dataclass
class Served:
    """What the proxy answered itself (ranged GETs) since the last :meth:`reset`."""

    gets: int = 0
    bytes: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    relayed: int = 0
    log: list[tuple[float, float, int, str, int, int]] = field(default_factory=list)
    """(start, end, client port, object key, first byte, bytes) of every ranged GET answered (epoch seconds)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.gets, self.bytes, self.max_in_flight, self.relayed, self.log = 0, 0, 0, 0, []

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {"gets": self.gets, "bytes": self.bytes, "max_concurrent_gets": self.max_in_flight,
                    "relayed_to_moto": self.relayed}  # fmt: skip


class S3Source:
    """moto + the ranged-GET proxy on 127.0.0.1; :meth:`env` points s3fs (boto) at the proxy."""

    def __init__(self, cap_bytes_per_s: float = 0.0, first_byte_s: float = 0.0) -> None:
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.cap = cap_bytes_per_s
        self.first_byte_s = first_byte_s
        self.served = Served()
        self.moto_port = _free_port()
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self._moto.start()
        self._backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]  # the store the server above answers from
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if not server._answer_range(self):
                    self._relay()

            def _relay(self) -> None:
                with server.served.lock:
                    server.served.relayed += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                upstream = http.client.HTTPConnection("127.0.0.1", server.moto_port, timeout=300)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                upstream.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length", "keep-alive"):
                        self.send_header(key, value)
                size = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", size or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        self._proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._proxy.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self._thread = threading.Thread(target=self._proxy.serve_forever, daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- ranged GETs, answered by seeking
    def _answer_range(self, handler: BaseHTTPRequestHandler) -> bool:
        """Answer a plain ranged GET of a stored object (True), or leave it to moto (False)."""
        match = _RANGE.match(handler.headers.get("Range") or "")
        if match is None or "?" in handler.path:
            return False
        bucket, _, name = handler.path.lstrip("/").partition("/")
        from urllib.parse import unquote

        try:
            key = self._backend.get_object(bucket, unquote(name))
        except Exception:  # noqa: BLE001 - no such bucket: moto answers as S3 does
            return False
        if key is None or key.size == 0:
            return False
        if_match = handler.headers.get("If-Match")
        start, last = int(match[1]), min(int(match[2]), key.size - 1)
        if (if_match and if_match != key.etag) or start > last:
            return False  # moto answers 412 / 416 as S3 does
        served = self.served
        with served.lock:
            served.in_flight += 1
            served.max_in_flight = max(served.max_in_flight, served.in_flight)
        t0 = time.time()
        try:
            if self.first_byte_s:
                time.sleep(self.first_byte_s)
            with key.lock:  # the lock moto's own reads of the buffer take
                key._value_buffer.seek(start)
                data = key._value_buffer.read(last + 1 - start)
            handler.send_response(206)
            for header, value in (("ETag", key.etag), ("Last-Modified", key.last_modified_RFC1123),
                                  ("Content-Type", key.metadata.get("Content-Type", "binary/octet-stream")),
                                  ("Accept-Ranges", "bytes"), ("Content-Range", f"bytes {start}-{last}/{key.size}"),
                                  ("Content-Length", str(len(data)))):  # fmt: skip
                handler.send_header(header, value)
            handler.end_headers()
            self._send_paced(handler, data)
            with served.lock:
                served.gets += 1
                served.bytes += len(data)
                served.log.append((t0, time.time(), handler.client_address[1], name, start, len(data)))
        finally:
            with served.lock:
                served.in_flight -= 1
        return True

    def _send_paced(self, handler: BaseHTTPRequestHandler, data: bytes) -> None:
        view = memoryview(data)
        t0 = time.perf_counter()
        for offset in range(0, len(view), _PACE_BYTES):
            if self.cap:
                wait = t0 + offset / self.cap - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            handler.wfile.write(view[offset : offset + _PACE_BYTES])
        if self.cap:  # the last piece, too, takes its share of the time
            wait = t0 + len(view) / self.cap - time.perf_counter()
            if wait > 0:
                time.sleep(wait)

    # ----------------------------------------------------------------- set-up
    env = S3Server.env  # the standard AWS variables that point s3fs at ``self.endpoint``, as for the tests' server

    def upload_tree(self, local: Path, bucket: str, prefix: str) -> str:
        """Every file under ``local`` to ``s3://bucket/prefix/...`` (straight to moto, multipart for large files)."""
        import boto3
        from boto3.s3.transfer import TransferConfig

        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.moto_port}", aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name=REGION)  # fmt: skip
        client.create_bucket(Bucket=bucket)
        config = TransferConfig(multipart_threshold=256 << 20, multipart_chunksize=256 << 20)
        for path in sorted(p for p in Path(local).rglob("*") if p.is_file()):
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}", Config=config)
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        self._proxy.shutdown()
        self._proxy.server_close()
        self._moto.stop()
