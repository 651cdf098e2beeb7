"""A real S3-protocol server for the remote-read tests: moto's server mode behind a counting, fault-injecting proxy.

``S3Server`` starts ``moto.server.ThreadedMotoServer`` on a free localhost port and a small threaded HTTP proxy in
front of it. zeroio (through s3fs, over HTTP) talks only to the proxy, which

* counts the body bytes and requests of every GET it relays (the server-side accounting the tests assert on);
* checks credentials as S3 does (moto's server accepts any): a request signed with another access key gets
  ``403 InvalidAccessKeyId``, an unsigned one ``403 AccessDenied``;
* injects faults on the next GETs when told: a connection reset, HTTP 500 or 503, a slow response, a body cut
  short of its Content-Length, or an endless chunked body (no Content-Length) after the true headers.

Uploads go straight to moto (boto3), never through the proxy.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ACCESS_KEY = "zeroio-test-key"
SECRET_KEY = "zeroio-test-secret"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Accounting:
    """What the proxy relayed: GET requests and body bytes, per object key; the paths PUT, in order."""

    gets: int = 0
    body_bytes: int = 0
    ranges: list[tuple[str, str]] = field(default_factory=list)
    puts: list[str] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    """Ranged GETs being answered at once, and the most seen since the last reset."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.gets, self.body_bytes, self.ranges, self.puts = 0, 0, [], []
            self.most_in_flight = self.in_flight


class S3Server:
    """moto + proxy; ``endpoint`` is the proxy's URL (what AWS_ENDPOINT_URL points at)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.moto_port = _free_port()
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self._moto.start()
        self.accounting = Accounting()
        self.faults: list[str] = []  # actions for the next GETs with a Range header, in order
        self.slow_s = 0.0
        self.put_faults: list[str] = []  # a PUT whose path contains one of these is refused (403), once
        self._faults_lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                auth = self.headers.get("Authorization") or ""
                if not auth:
                    return self._error(403, "AccessDenied", "Access Denied")
                if f"Credential={ACCESS_KEY}/" not in auth:
                    return self._error(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist")
                fault = None
                for marker in list(server.put_faults) if self.command == "PUT" else []:
                    if marker in self.path:
                        server.put_faults.remove(marker)
                        return self._error(403, "AccessDenied", "injected")
                if self.command == "GET" and "Range" in self.headers:
                    with server._faults_lock:
                        fault = server.faults.pop(0) if server.faults else None
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.close_connection = True
                    self.connection.close()
                    return None
                if fault in ("500", "503"):
                    return self._error(int(fault), "InternalError" if fault == "500" else "SlowDown", "injected")
                ranged = self.command == "GET" and "Range" in self.headers
                if ranged:
                    with server.accounting.lock:
                        server.accounting.in_flight += 1
                        server.accounting.most_in_flight = max(
                            server.accounting.most_in_flight, server.accounting.in_flight
                        )
                try:
                    return self._answer(body, fault)
                finally:
                    if ranged:
                        with server.accounting.lock:
                            server.accounting.in_flight -= 1

            def _answer(self, body: bytes | None, fault: str | None) -> None:
                if fault == "slow":
                    time.sleep(server.slow_s)
                upstream = http.client.HTTPConnection("127.0.0.1", server.moto_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                upstream.close()
                if fault == "endless":
                    return self._endless(response)
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length", "keep-alive"):
                        self.send_header(key, value)
                # A HEAD response has no body: its Content-Length is the object's size (what s3fs's info reads).
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command == "PUT" and response.status < 300:
                    with server.accounting.lock:
                        server.accounting.puts.append(self.path.split("?", 1)[0])
                if self.command == "HEAD":
                    return None
                if fault == "truncate":
                    data = data[: len(data) // 2]
                    self.close_connection = True
                if self.command == "GET":  # counted before the body goes out: once read, the client may reset
                    with server.accounting.lock:
                        server.accounting.gets += 1
                        server.accounting.body_bytes += len(data)
                        server.accounting.ranges.append((self.path, self.headers.get("Range") or ""))
                self.wfile.write(data)
                return None

            def _endless(self, response: http.client.HTTPResponse) -> None:
                """The true status and headers, then a chunked body of zeros that never ends (up to 8 GiB)."""
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length", "keep-alive"):
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.close_connection = True
                block = b"%x\r\n" % (1 << 20) + bytes(1 << 20) + b"\r\n"
                try:
                    for _ in range(8 << 10):
                        self.wfile.write(block)
                except OSError:  # the client stopped reading: what a bounded reader does
                    pass

            def _error(self, status: int, code: str, message: str) -> None:
                body = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
                    "<RequestId>0</RequestId></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        self._proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._proxy.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self._thread = threading.Thread(target=self._proxy.serve_forever, daemon=True)
        self._thread.start()
        self.client = self._boto_client()

    def _boto_client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.moto_port}",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point s3fs at the proxy with the right credentials."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        }

    def upload_tree(self, local: Path, bucket: str, prefix: str) -> str:
        """Upload every file under ``local`` to ``s3://bucket/prefix/...``; returns that URL."""
        try:
            self.client.create_bucket(Bucket=bucket)
        except self.client.exceptions.BucketAlreadyOwnedByYou:
            pass
        for path in sorted(p for p in Path(local).rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(local).as_posix()}" if prefix else path.relative_to(local).as_posix()
            self.client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def stop(self) -> None:
        self._proxy.shutdown()
        self._proxy.server_close()
        self._moto.stop()
