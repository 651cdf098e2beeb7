"""A local Hugging Face Hub-protocol server for tests, built on the standard library only.

It speaks what the real ``huggingface_hub`` 2.4 client sends (see ``shared/notes/hub-protocol.md``):

* the Hub API: repo creation, preupload, validate-yaml, commits (NDJSON), branches, pull requests,
  repo info, refs, tree listing, paths-info, whoami;
* the Git LFS path (used when Xet is disabled): batch, basic PUT, multipart PUT + completion, verify;
* the Xet path (the client's default): xet-write/read tokens and the CAS v1 routes (xorbs, shards,
  reconstructions, ranged fetches);
* downloads: HEAD/GET ``/resolve`` with ``X-Repo-Commit``/``ETag``/sizes, LFS files redirected to
  the *other* loopback origin (``localhost`` vs ``127.0.0.1``, same port) the way the Hub redirects
  to its CDN, so the client's "drop auth on a foreign origin" logic is exercised.

Everything is stored under a temporary directory. Unknown routes are answered with a 4xx, never a
5xx (the client retries 5xx with a multi-second backoff), and every request body is read in full
before answering (leftover bytes would desync keep-alive connections; hf_xet then retries for
minutes). Unexpected server exceptions are answered with 400 and recorded in
``HubServer.internal_errors`` so a test can fail loudly instead of passing on a server bug.

Fault injection: ``server.drop_connection_on(predicate, times=1)`` resets the TCP connection in the
middle of matching requests (after reading part of the body), which the client sees as a network cut.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import itertools
import json
import re
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TOKEN", "DEFAULT_USER", "Fault", "HubServer", "RequestInfo"]

DEFAULT_USER = "tester"
DEFAULT_TOKEN = "hf_zeroio_test_write_token"
READ_ONLY_TOKEN = "hf_zeroio_test_read_token"

_REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
_PR_REF_RE = re.compile(r"^refs/pr/(\d+)$")

# The Hub's default .gitattributes marks these as LFS; the real preupload endpoint answers "lfs" for them.
_LFS_SUFFIXES = (
    ".7z",
    ".arrow",
    ".bin",
    ".bz2",
    ".ckpt",
    ".ftz",
    ".gz",
    ".h5",
    ".joblib",
    ".mlmodel",
    ".model",
    ".msgpack",
    ".npy",
    ".npz",
    ".onnx",
    ".ot",
    ".parquet",
    ".pb",
    ".pickle",
    ".pkl",
    ".pt",
    ".pth",
    ".rar",
    ".safetensors",
    ".tar",
    ".tflite",
    ".tgz",
    ".wasm",
    ".xz",
    ".zip",
    ".zst",
)
_GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in _LFS_SUFFIXES).encode()

# Xet shard layout (xet-core spec/shard.md): 48-byte header, then 48-byte file-info records ending in a bookend.
_SHARD_HEADER_SIZE = 48
_SHARD_RECORD = 48
_BOOKEND = b"\xff" * 32
_FLAG_VERIFICATION = 1 << 31
_FLAG_METADATA_EXT = 1 << 30

# Access tokens handed out by xet-write/read-token, shared by every server of this process: hf_xet and
# huggingface_hub cache connection info per URL, and an ephemeral port may be reused by a later server.
_XET_TOKENS: dict[str, float] = {}
_XET_TOKENS_LOCK = threading.Lock()


class _HttpError(Exception):
    """An HTTP error answer, raised from route handlers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})
        self.body = dict(body or {})


@dataclass(frozen=True)
class RequestInfo:
    """What a fault predicate sees of a request (the body has not been read yet)."""

    method: str
    path: str
    """The URL path, percent-decoded, without the query string."""
    query: dict[str, str]
    headers: dict[str, str]
    """Request headers with lower-case names."""


@dataclass
class Fault:
    """A registered fault; ``hits`` counts how many requests it has hit so far."""

    predicate: Callable[[RequestInfo], bool]
    times: int
    after_response: bool
    hits: int = 0


@dataclass
class _Entry:
    size: int
    oid: str  # git blob sha1 (of the content for regular files, of the LFS pointer for LFS files)
    sha256: str | None = None  # set for LFS files
    xet_hash: str | None = None  # set for files whose bytes live in Xet storage


@dataclass
class _Commit:
    oid: str
    parent: str | None
    title: str
    description: str
    files: dict[str, _Entry]
    date: str


@dataclass
class _PullRequest:
    num: int
    title: str
    description: str
    author: str
    base: str
    created_at: str
    status: str = "draft"


@dataclass
class _Repo:
    repo_type: str
    repo_id: str
    private: bool
    refs: dict[str, str]  # "main" / branch names / "refs/pr/N" -> commit oid
    commits: dict[str, _Commit]
    created_at: str
    prs: dict[int, _PullRequest] = field(default_factory=dict)


@dataclass
class _XetFile:
    size: int
    sha256: str | None
    terms: list[tuple[str, int, int, int]]  # (xorb hash, chunk start, chunk end exclusive, unpacked bytes)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _xet_hex(raw: bytes) -> str:
    """Xet's string form of a 32-byte hash: four little-endian u64 values, each as %016x."""
    return "".join(f"{v:016x}" for v in struct.unpack("<4Q", raw))


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Parse a single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range into [start, end] inclusive."""
    if not header:
        return None
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if m is None or (m.group(1) == "" and m.group(2) == ""):
        raise _HttpError(416, f"Unsupported Range header {header!r}.")
    if m.group(1) == "":
        start, end = max(0, size - int(m.group(2))), size - 1
    else:
        start = int(m.group(1))
        end = int(m.group(2)) if m.group(2) else size - 1
    end = min(end, size - 1)
    if start >= size or start > end:
        raise _HttpError(
            416, f"Range {header!r} is outside 0-{size - 1}.", headers={"Content-Range": f"bytes */{size}"}
        )
    return start, end


# --------------------------------------------------------------------------------------------------
# LZ4 block decoding, only used to serve Xet-uploaded files to a client that downloads without Xet.


def _lz4_block_decode(src: bytes) -> bytes:
    """Decode one raw LZ4 block (sequences of literals + back-references)."""
    out = bytearray()
    i, n = 0, len(src)
    while i < n:
        token = src[i]
        i += 1
        lit = token >> 4
        if lit == 15:
            while True:
                b = src[i]
                i += 1
                lit += b
                if b != 255:
                    break
        out += src[i : i + lit]
        i += lit
        if i >= n:
            break  # the last sequence has literals only
        offset = src[i] | (src[i + 1] << 8)
        i += 2
        mlen = token & 15
        if mlen == 15:
            while True:
                b = src[i]
                i += 1
                mlen += b
                if b != 255:
                    break
        mlen += 4
        start = len(out) - offset
        if offset >= mlen:
            out += out[start : start + mlen]
        else:  # overlapping copy repeats the last `offset` bytes
            for k in range(mlen):
                out.append(out[start + k])
    return bytes(out)


def _lz4_decode(src: bytes, raw_size: int) -> bytes:
    """Decode an LZ4 frame (magic 0x184D2204) or a raw LZ4 block."""
    if src[:4] != b"\x04\x22\x4d\x18":
        out = _lz4_block_decode(src)
    else:
        flg = src[4]
        pos = 6 + (8 if flg & 0x08 else 0) + (4 if flg & 0x01 else 0) + 1  # FLG, BD, [size], [dict id], HC
        buf = bytearray()
        while True:
            (bsize,) = struct.unpack_from("<I", src, pos)
            pos += 4
            if bsize == 0:
                break
            stored = bool(bsize & 0x80000000)
            bsize &= 0x7FFFFFFF
            block = src[pos : pos + bsize]
            pos += bsize + (4 if flg & 0x10 else 0)
            buf += block if stored else _lz4_block_decode(block)
        out = bytes(buf)
    if len(out) != raw_size:
        raise ValueError(f"LZ4 data decoded to {len(out)} bytes, expected {raw_size}.")
    return out


def _bg4_ungroup(data: bytes) -> bytes:
    n = len(data)
    sizes = [n // 4 + (1 if k < n % 4 else 0) for k in range(4)]
    out = bytearray(n)
    pos = 0
    for k in range(4):
        out[k::4] = data[pos : pos + sizes[k]]
        pos += sizes[k]
    return bytes(out)


def _decode_chunk(scheme: int, payload: bytes, raw_size: int) -> bytes:
    if scheme == 0:
        return payload
    if scheme == 1:
        return _lz4_decode(payload, raw_size)
    if scheme == 2:
        return _bg4_ungroup(_lz4_decode(payload, raw_size))
    raise ValueError(f"Unknown Xet chunk compression scheme {scheme}.")


# --------------------------------------------------------------------------------------------------


class HubServer:
    """A Hub-protocol server on ``127.0.0.1`` at an ephemeral port; use as a context manager.

    Args:
        tokens: valid write tokens, mapped to their user name.
        read_only_tokens: valid tokens that may read but get 403 on writes.
        orgs: user name -> namespaces (besides their own) the user may write to.
        root: storage directory; a fresh temporary directory when omitted (removed on ``stop``).
        lfs_threshold: files at least this large are uploaded as LFS/Xet (besides LFS suffixes and binary samples).
        lfs_multipart_threshold: LFS objects at least this large get a multipart upload (None: never).
        lfs_chunk_size: multipart part size.
    """

    def __init__(
        self,
        *,
        tokens: Mapping[str, str] | None = None,
        read_only_tokens: Mapping[str, str] | None = None,
        orgs: Mapping[str, Iterable[str]] | None = None,
        root: str | Path | None = None,
        lfs_threshold: int = 10 * 1024 * 1024,
        lfs_multipart_threshold: int | None = None,
        lfs_chunk_size: int = 5 * 1024 * 1024,
    ) -> None:
        self.tokens = dict(tokens if tokens is not None else {DEFAULT_TOKEN: DEFAULT_USER})
        self.read_only_tokens = dict(
            read_only_tokens if read_only_tokens is not None else {READ_ONLY_TOKEN: DEFAULT_USER}
        )
        self.orgs = {user: set(names) for user, names in (orgs or {}).items()}
        self.lfs_threshold = lfs_threshold
        self.lfs_multipart_threshold = lfs_multipart_threshold
        self.lfs_chunk_size = lfs_chunk_size
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="hub-server-")) if root is None else Path(root)
        for sub in ("blobs", "lfs", "xorbs", "shards", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.requests: list[tuple[str, str, bool]] = []
        """(method, path with query, whether an Authorization header was sent) for every request."""
        self.internal_errors: list[str] = []
        self.body_bytes_sent = 0
        """Response body bytes sent (every request but HEAD): what remote-read tests assert on."""
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._xet_files: dict[str, _XetFile] = {}
        self._sha_to_xet: dict[str, str] = {}
        self._xorb_offsets: dict[str, list[int]] = {}
        self._faults: list[Fault] = []
        self._counter = itertools.count()
        self._nonce = secrets.token_hex(4)
        self._httpd: _ThreadingServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -------------------------------------------------------------------------------- lifecycle

    def start(self) -> HubServer:
        if self._httpd is not None:
            raise RuntimeError("The server is already running.")
        self._httpd = _ThreadingServer(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> HubServer:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """The Hub endpoint to give the client (``HfApi(endpoint=...)`` / ``HF_ENDPOINT``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_origin(self) -> str:
        """The other loopback origin, where LFS downloads are redirected (like the Hub's CDN)."""
        return f"http://localhost:{self.port}"

    @property
    def cas_url(self) -> str:
        # A per-server path keeps hf_xet's on-disk caches (keyed by CAS endpoint) apart between servers.
        return f"{self.endpoint}/xet-cas/{self._nonce}"

    # -------------------------------------------------------------------------------- faults

    def drop_connection_on(
        self, predicate: Callable[[RequestInfo], bool], *, times: int = 1, after_response: bool = False
    ) -> Fault:
        """Reset the connection of the next ``times`` requests matching ``predicate``.

        By default the request is cut while its body is being read, so the server does not act on it.
        With ``after_response=True`` the request is fully handled first and only the answer is lost.
        """
        fault = Fault(predicate=predicate, times=times, after_response=after_response)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, info: RequestInfo) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.hits < fault.times and fault.predicate(info):
                    fault.hits += 1
                    return fault
        return None

    # -------------------------------------------------------------------------------- inspection helpers

    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        with self._lock:
            return (repo_type, repo_id) in self._repos

    def refs(self, repo_id: str, repo_type: str = "model") -> dict[str, str]:
        """Branch and PR refs of a repo -> commit oid."""
        with self._lock:
            return dict(self._repo(repo_type, repo_id).refs)

    def commit_history(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[dict[str, Any]]:
        """Commits reachable from ``revision``, newest first: oid, title, description, files."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            oid: str | None = self._resolve(repo, revision)
            out = []
            while oid is not None:
                c = repo.commits[oid]
                out.append({"oid": c.oid, "title": c.title, "description": c.description, "files": sorted(c.files)})
                oid = c.parent
            return out

    def list_files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, dict[str, Any]]:
        """path -> {size, oid, sha256, xet_hash} at ``revision``."""
        with self._lock:
            commit = self._commit_at(self._repo(repo_type, repo_id), revision)
            return {p: vars(e).copy() for p, e in commit.files.items()}

    def read_file(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        """The bytes of a file as stored (LFS and Xet files included)."""
        with self._lock:
            entry = self._commit_at(self._repo(repo_type, repo_id), revision).files[path]
        return self._entry_bytes(entry)

    # -------------------------------------------------------------------------------- state helpers (lock held)

    def _repo(self, repo_type: str, repo_id: str) -> _Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None:
            raise _HttpError(404, f"Repository {repo_id} not found.", code="RepoNotFound")
        return repo

    @staticmethod
    def _resolve(repo: _Repo, revision: str) -> str | None:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision.startswith("refs/heads/") and revision[len("refs/heads/") :] in repo.refs:
            return repo.refs[revision[len("refs/heads/") :]]
        if _COMMIT_RE.match(revision) and revision in repo.commits:
            return revision
        return None

    def _commit_at(self, repo: _Repo, revision: str) -> _Commit:
        oid = self._resolve(repo, revision)
        if oid is None:
            raise _HttpError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return repo.commits[oid]

    def _new_commit(
        self, repo: _Repo, parent: str | None, title: str, description: str, files: dict[str, _Entry]
    ) -> _Commit:
        seed = f"{repo.repo_id}\0{parent}\0{title}\0{time.time_ns()}\0{next(self._counter)}"
        commit = _Commit(
            oid=hashlib.sha1(seed.encode()).hexdigest(),
            parent=parent,
            title=title,
            description=description,
            files=files,
            date=_now(),
        )
        repo.commits[commit.oid] = commit
        return commit

    def _repo_url(self, repo: _Repo) -> str:
        return f"{self.endpoint}/{_URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    def _lfs_path(self, sha256: str) -> Path:
        return self.root / "lfs" / sha256

    def _has_object(self, sha256: str) -> bool:
        return self._lfs_path(sha256).is_file() or sha256 in self._sha_to_xet

    def _object_size(self, sha256: str) -> int:
        path = self._lfs_path(sha256)
        if path.is_file():
            return path.stat().st_size
        return self._xet_files[self._sha_to_xet[sha256]].size

    def _entry_bytes(self, entry: _Entry) -> bytes:
        if entry.sha256 is None:
            return (self.root / "blobs" / entry.oid).read_bytes()
        path = self._lfs_path(entry.sha256)
        if path.is_file():
            return path.read_bytes()
        if entry.xet_hash is None:
            raise KeyError(entry.sha256)
        data = self._reconstruct_xet(entry.xet_hash)
        tmp = self.root / "tmp" / f"{entry.sha256}.{secrets.token_hex(4)}"
        tmp.write_bytes(data)
        tmp.replace(path)  # cache, so the next download is a plain file read
        return data

    # -------------------------------------------------------------------------------- Xet storage

    def _xorb_path(self, xorb: str) -> Path:
        return self.root / "xorbs" / xorb

    def _chunk_offsets(self, xorb: str, upto: int) -> list[int]:
        """Byte offsets of chunk headers 0..upto in a stored xorb (the last one is the end of chunk upto-1)."""
        with self._lock:
            cached = self._xorb_offsets.get(xorb)
            if cached is not None and len(cached) > upto:
                return cached
        data = self._xorb_path(xorb).read_bytes()
        offsets, pos = [0], 0
        # Chunk header: version (1 byte, 0), compressed length (3 bytes LE), scheme (1 byte), raw length (3 bytes LE).
        while pos + 8 <= len(data) and data[pos] == 0:
            clen = int.from_bytes(data[pos + 1 : pos + 4], "little")
            if pos + 8 + clen > len(data):
                break
            pos += 8 + clen
            offsets.append(pos)
        with self._lock:
            self._xorb_offsets[xorb] = offsets
        if len(offsets) <= upto:
            raise _HttpError(400, f"Xorb {xorb} has {len(offsets) - 1} chunks, a term needs {upto}.")
        return offsets

    def _reconstruct_xet(self, file_hash: str) -> bytes:
        xfile = self._xet_files[file_hash]
        out = bytearray()
        for xorb, start, end, _ in xfile.terms:
            offsets = self._chunk_offsets(xorb, end)
            data = self._xorb_path(xorb).read_bytes()
            for i in range(start, end):
                pos = offsets[i]
                clen = int.from_bytes(data[pos + 1 : pos + 4], "little")
                scheme = data[pos + 4]
                raw = int.from_bytes(data[pos + 5 : pos + 8], "little")
                out += _decode_chunk(scheme, data[pos + 8 : pos + 8 + clen], raw)
        if len(out) != xfile.size:
            raise ValueError(f"Xet file {file_hash} reconstructed to {len(out)} bytes, expected {xfile.size}.")
        return bytes(out)

    def _register_shard(self, data: bytes) -> int:
        if len(data) < _SHARD_HEADER_SIZE + _SHARD_RECORD:
            raise _HttpError(400, "Shard is too short.")
        (version,) = struct.unpack_from("<Q", data, 32)
        if version != 2:
            raise _HttpError(400, f"Unsupported shard header version {version}.")
        pos = _SHARD_HEADER_SIZE
        files: list[tuple[str, _XetFile]] = []
        while True:
            if pos + _SHARD_RECORD > len(data):
                raise _HttpError(400, "Shard file-info section has no bookend.")
            raw_hash = data[pos : pos + 32]
            if raw_hash == _BOOKEND:
                break
            flags, num = struct.unpack_from("<II", data, pos + 32)
            pos += _SHARD_RECORD
            terms = []
            for _ in range(num):
                xorb = _xet_hex(data[pos : pos + 32])
                _, unpacked, start, end = struct.unpack_from("<IIII", data, pos + 32)
                terms.append((xorb, start, end, unpacked))
                pos += _SHARD_RECORD
            if flags & _FLAG_VERIFICATION:
                pos += _SHARD_RECORD * num
            sha256 = None
            if flags & _FLAG_METADATA_EXT:
                sha256 = _xet_hex(data[pos : pos + 32])
                pos += _SHARD_RECORD
            files.append((_xet_hex(raw_hash), _XetFile(size=sum(t[3] for t in terms), sha256=sha256, terms=terms)))
        for _, xfile in files:
            for xorb, *_ in xfile.terms:
                if not self._xorb_path(xorb).is_file():
                    raise _HttpError(400, f"Shard references xorb {xorb}, which was never uploaded.")
        with self._lock:
            for file_hash, xfile in files:
                self._xet_files[file_hash] = xfile
                if xfile.sha256 is not None:
                    self._sha_to_xet[xfile.sha256] = file_hash
        return len(files)


# ======================================================================================================


class _ThreadingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64
    hub: HubServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Client disconnects (and our own injected resets) are expected; anything else is a server bug.
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
            return
        self.hub.internal_errors.append(traceback.format_exc())


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ThreadingServer
    server_version = "zeroio-test-hub/1.0"

    # ---------------------------------------------------------------- plumbing

    def log_message(self, format: str, *args: Any) -> None:
        return  # keep test output clean; requests are recorded in HubServer.requests

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def do_PATCH(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        self.raw_segments = split.path.split("/")[1:]
        self.segments = [urllib.parse.unquote(s) for s in self.raw_segments]
        self.query = {k: v[-1] for k, v in urllib.parse.parse_qs(split.query, keep_blank_values=True).items()}
        self.hdrs = {k.lower(): v for k, v in self.headers.items()}
        self._body: bytes | None = None
        self._sent = False
        self._suppress = False
        self.hub.requests.append((self.command, self.path, "authorization" in self.hdrs))
        info = RequestInfo(self.command, urllib.parse.unquote(split.path), dict(self.query), dict(self.hdrs))
        fault = self.hub._take_fault(info)
        try:
            if fault is not None and not fault.after_response:
                self._drop(partial=True)
                return
            # A "lost answer" fault: handle the request, but never write the answer.
            self._suppress = fault is not None
            try:
                self._route()
            except _HttpError as e:
                self._error(e)
            except Exception:  # noqa: BLE001 - a server bug: record it, answer 4xx (a 5xx is retried for seconds)
                tb = traceback.format_exc()
                self.hub.internal_errors.append(tb)
                self._error(_HttpError(400, "Test server error: " + tb.strip().splitlines()[-1]))
            if fault is not None and fault.after_response:
                self._drop(partial=False)
        finally:
            if not self._sent and fault is None:
                self._error(_HttpError(400, "No response"))

    def _drop(self, *, partial: bool) -> None:
        """Reset the TCP connection; with ``partial`` read about half of the body first."""
        if partial:
            length = int(self.hdrs.get("content-length", "0") or 0)
            try:
                if length:
                    self.rfile.read(min(length // 2, 1 << 20))
            except OSError:
                pass
        self.close_connection = True
        self._sent = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def body(self) -> bytes:
        if self._body is None:
            self._body = self._read_body()
        return self._body

    def _read_body(self) -> bytes:
        if self.hdrs.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(parts)
        length = int(self.hdrs.get("content-length", "0") or 0)
        return self.rfile.read(length) if length else b""

    def _stream_body_to(self, path: Path) -> tuple[str, int]:
        """Stream the request body into ``path``; return (sha256, size)."""
        h = hashlib.sha256()
        size = 0
        with open(path, "wb") as f:
            if self.hdrs.get("transfer-encoding", "").lower() == "chunked":
                data = self._read_body()
                f.write(data)
                h.update(data)
                size = len(data)
            else:
                remaining = int(self.hdrs.get("content-length", "0") or 0)
                while remaining:
                    piece = self.rfile.read(min(remaining, 1 << 20))
                    if not piece:
                        raise ConnectionError("Client closed the connection mid-body.")
                    f.write(piece)
                    h.update(piece)
                    size += len(piece)
                    remaining -= len(piece)
        self._body = b""
        return h.hexdigest(), size

    def json_body(self) -> Any:
        data = self.body()
        try:
            return json.loads(data or b"{}")
        except ValueError:
            raise _HttpError(400, "Request body is not valid JSON.") from None

    def _send(
        self,
        status: int,
        body: bytes = b"",
        *,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        content_length: int | None = None,
    ) -> None:
        if self._body is None:
            self.body()  # always drain the request body, even on errors
        if self._suppress:
            self._sent = True
            return
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            with self.hub._lock:
                self.hub.body_bytes_sent += len(body)
            try:
                self.wfile.write(body)
            except OSError:
                self.close_connection = True
        self._sent = True

    def _json(self, status: int, obj: Any, *, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _error(self, e: _HttpError) -> None:
        if self._sent:
            return
        headers = {"X-Error-Message": e.message, **e.headers}
        if e.code:
            headers["X-Error-Code"] = e.code
        try:
            self._json(e.status, {"error": e.message, **e.body}, headers=headers)
        except OSError:
            self.close_connection = True
            self._sent = True

    # ---------------------------------------------------------------- auth

    def _token(self) -> str | None:
        auth = self.hdrs.get("authorization")
        if auth is None:
            return None
        scheme, _, value = auth.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise _HttpError(401, "Invalid credentials in Authorization header")
        return value.strip()

    def _user(self) -> str | None:
        """The authenticated user, None when anonymous; 401 on a token the server does not know."""
        token = self._token()
        if token is None:
            return None
        hub = self.hub
        if token in hub.tokens:
            return hub.tokens[token]
        if token in hub.read_only_tokens:
            return hub.read_only_tokens[token]
        raise _HttpError(401, "Invalid credentials in Authorization header")

    def _require_write(self, namespace: str) -> str:
        user = self._user()
        if user is None:
            raise _HttpError(401, "You must be authenticated to write to the Hub (no Authorization header).")
        token = self._token()
        if token in self.hub.read_only_tokens:
            raise _HttpError(403, "This token has the 'read' role and cannot write. Use a token with write access.")
        if namespace != user and namespace not in self.hub.orgs.get(user, set()):
            raise _HttpError(403, f"You don't have the rights to write to the namespace {namespace!r}.")
        return user

    def _require_read(self, repo: _Repo) -> None:
        user = self._user()
        if repo.private:
            ns = repo.repo_id.split("/")[0]
            if user is None or (ns != user and ns not in self.hub.orgs.get(user, set())):
                raise _HttpError(401, f"Repository {repo.repo_id} not found.", code="RepoNotFound")

    def _xet_token_ok(self, *, write: bool) -> None:
        token = self._token()
        with _XET_TOKENS_LOCK:
            exp = _XET_TOKENS.get(token or "")
        if exp is None or exp < time.time():
            raise _HttpError(401, "Missing or expired Xet access token.")
        if write and not (token or "").startswith("xetw-"):
            raise _HttpError(403, "Xet read token used for a write.")

    # ---------------------------------------------------------------- routing

    def _route(self) -> None:
        seg, method = self.segments, self.command
        if not seg or seg == [""]:
            raise _HttpError(404, "Not found.")
        head = seg[0]
        if head == "api":
            self._route_api(seg[1:], method)
            return
        if head == "_lfs":
            self._route_lfs(seg[1:], method)
            return
        if head == "xet-cas":
            self._route_cas(seg[2:], method)  # seg[1] is the per-server nonce
            return
        if seg[:2] == ["v1", "telemetry"]:
            self._json(200, {})
            return
        # /{[datasets/|spaces/]}{ns}/{name}.git/info/lfs/objects/batch and /{prefix}{ns}/{name}/resolve/{rev}/{path}
        repo_type = "model"
        rest = seg
        if head in ("datasets", "spaces"):
            repo_type, rest = _REPO_TYPES[head], seg[1:]
        if len(rest) >= 6 and rest[1].endswith(".git") and rest[2:6] == ["info", "lfs", "objects", "batch"]:
            if method != "POST":
                raise _HttpError(405, "Method not allowed.")
            self._lfs_batch(repo_type, f"{rest[0]}/{rest[1][:-4]}")
            return
        if len(rest) >= 5 and rest[2] == "resolve" and method in ("GET", "HEAD"):
            self._resolve(repo_type, f"{rest[0]}/{rest[1]}", rest[3], "/".join(rest[4:]))
            return
        raise _HttpError(404, f"Unknown route {method} {self.path}.")

    def _route_api(self, seg: list[str], method: str) -> None:
        if seg == ["repos", "create"] and method == "POST":
            self._create_repo()
            return
        if seg == ["validate-yaml"] and method == "POST":
            self._validate_yaml()
            return
        if seg == ["whoami-v2"] and method == "GET":
            user = self._user()
            if user is None:
                raise _HttpError(401, "Invalid credentials in Authorization header")
            self._json(
                200,
                {
                    "type": "user",
                    "name": user,
                    "orgs": [{"name": o} for o in self.hub.orgs.get(user, ())],
                    "auth": {"type": "access_token"},
                },
            )
            return
        if len(seg) < 3 or seg[0] not in _REPO_TYPES:
            raise _HttpError(404, f"Unknown API route {method} {self.path}.")
        repo_type, repo_id, rest = _REPO_TYPES[seg[0]], f"{seg[1]}/{seg[2]}", seg[3:]
        if method == "GET" and not rest:
            self._repo_info(repo_type, repo_id, "main")
        elif method == "GET" and len(rest) >= 2 and rest[0] == "revision":
            self._repo_info(repo_type, repo_id, "/".join(rest[1:]))
        elif method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            self._tree(repo_type, repo_id, rest[1], "/".join(rest[2:]))
        elif method == "POST" and len(rest) == 2 and rest[0] == "paths-info":
            self._paths_info(repo_type, repo_id, rest[1])
        elif method == "GET" and rest == ["refs"]:
            self._list_refs(repo_type, repo_id)
        elif method == "POST" and len(rest) == 2 and rest[0] == "preupload":
            self._preupload(repo_type, repo_id, rest[1])
        elif method == "POST" and len(rest) == 2 and rest[0] == "commit":
            self._commit(repo_type, repo_id, rest[1])
        elif method == "POST" and len(rest) == 2 and rest[0] == "branch":
            self._create_branch(repo_type, repo_id, rest[1])
        elif method == "POST" and rest == ["discussions"]:
            self._create_discussion(repo_type, repo_id)
        elif method == "GET" and len(rest) == 2 and rest[0] == "discussions" and rest[1].isdigit():
            self._discussion_details(repo_type, repo_id, int(rest[1]))
        elif method == "GET" and len(rest) == 2 and rest[0] in ("xet-write-token", "xet-read-token"):
            self._xet_token(repo_type, repo_id, rest[1], write=rest[0] == "xet-write-token")
        else:
            raise _HttpError(404, f"Unknown API route {method} {self.path}.")

    # ---------------------------------------------------------------- API: repos

    def _create_repo(self) -> None:
        payload = self.json_body()
        user = self._user()
        if user is None:
            raise _HttpError(401, "You must be authenticated to create a repo (no Authorization header).")
        name = payload.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise _HttpError(400, f"Invalid repo name {name!r}.")
        ns = payload.get("organization") or user
        repo_type = payload.get("type") or "model"
        if repo_type not in _URL_PREFIX:
            raise _HttpError(400, f"Invalid repo type {repo_type!r}.")
        self._require_write(ns)
        repo_id = f"{ns}/{name}"
        private = payload.get("visibility") == "private" or payload.get("private") is True
        hub = self.hub
        with hub._lock:
            existing = hub._repos.get((repo_type, repo_id))
            if existing is not None:
                raise _HttpError(409, "You already created this model repo", body={"url": hub._repo_url(existing)})
            repo = _Repo(repo_type=repo_type, repo_id=repo_id, private=private, refs={}, commits={}, created_at=_now())
            blob = _git_blob_oid(_GITATTRIBUTES)
            (hub.root / "blobs" / blob).write_bytes(_GITATTRIBUTES)
            first = hub._new_commit(
                repo, None, "initial commit", "", {".gitattributes": _Entry(size=len(_GITATTRIBUTES), oid=blob)}
            )
            repo.refs["main"] = first.oid
            hub._repos[(repo_type, repo_id)] = repo
            self._json(200, {"url": hub._repo_url(repo), "name": repo_id, "id": repo_id})

    def _validate_yaml(self) -> None:
        payload = self.json_body()
        content = payload.get("content", "")
        errors = []
        if isinstance(content, str) and content.startswith("---") and "\n---" not in content[3:]:
            errors.append({"message": "YAML front matter is not closed by '---'."})
        self._json(400 if errors else 200, {"errors": errors, "warnings": []})

    def _readable_repo(self, repo_type: str, repo_id: str) -> _Repo:
        self._user()  # 401 on an invalid token, even for public repos
        with self.hub._lock:
            repo = self.hub._repo(repo_type, repo_id)
        self._require_read(repo)
        return repo

    def _repo_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        blobs = self.query.get("blobs", "").lower() in ("1", "true")
        with self.hub._lock:
            commit = self.hub._commit_at(repo, revision)
            siblings = []
            for path, entry in sorted(commit.files.items()):
                sib: dict[str, Any] = {"rfilename": path}
                if blobs:
                    sib.update({"size": entry.size, "blobId": entry.oid})
                    if entry.sha256:
                        sib["lfs"] = {
                            "sha256": entry.sha256,
                            "size": entry.size,
                            "pointerSize": len(_lfs_pointer(entry.sha256, entry.size)),
                        }
                siblings.append(sib)
            info = {
                "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit.oid,
                "lastModified": commit.date,
                "createdAt": repo.created_at,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "tags": [],
                "siblings": siblings,
            }
            if repo_type == "model":
                info["modelId"] = repo_id
        self._json(200, info)

    def _tree_entry(self, path: str, entry: _Entry) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "file", "path": path, "size": entry.size, "oid": entry.oid}
        if entry.sha256 is not None:
            out["lfs"] = {
                "oid": entry.sha256,
                "size": entry.size,
                "pointerSize": len(_lfs_pointer(entry.sha256, entry.size)),
            }
        if entry.xet_hash is not None:
            out["xetHash"] = entry.xet_hash
        return out

    def _tree(self, repo_type: str, repo_id: str, revision: str, prefix: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        with self.hub._lock:
            commit = self.hub._commit_at(repo, revision)
            files = dict(commit.files)
        base = prefix.strip("/")
        start = f"{base}/" if base else ""
        if base and base not in {d for p in files for d in _parents(p)}:
            raise _HttpError(
                404, f"Entry {base} not found.", code="EntryNotFound", headers={"X-Repo-Commit": commit.oid}
            )
        out: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for path in sorted(files):
            if not path.startswith(start):
                continue
            rel = path[len(start) :]
            if "/" in rel and not recursive:
                dirs.add(start + rel.split("/")[0])
                continue
            if recursive:
                dirs.update(d for d in _parents(path) if d.startswith(start) and d != base)
            out.append(self._tree_entry(path, files[path]))
        out = [
            {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()} for d in sorted(dirs)
        ] + out
        self._json(200, out)

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        raw = self.body()
        if self.hdrs.get("content-type", "").startswith("application/json"):
            paths = json.loads(raw or b"{}").get("paths", [])
        else:
            paths = urllib.parse.parse_qs(raw.decode()).get("paths", [])
        with self.hub._lock:
            files = dict(self.hub._commit_at(repo, revision).files)
        dirs = {d for p in files for d in _parents(p)}
        out = []
        for p in paths:
            if p in files:
                out.append(self._tree_entry(p, files[p]))
            elif p in dirs:
                out.append({"type": "directory", "path": p, "oid": hashlib.sha1(p.encode()).hexdigest()})
        self._json(200, out)

    def _list_refs(self, repo_type: str, repo_id: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        include_prs = self.query.get("include_prs", "") in ("1", "true", "True")
        with self.hub._lock:
            refs = dict(repo.refs)
        branches = [
            {"name": n, "ref": f"refs/heads/{n}", "targetCommit": c}
            for n, c in refs.items()
            if not n.startswith("refs/")
        ]
        prs = [{"name": n, "ref": n, "targetCommit": c} for n, c in refs.items() if n.startswith("refs/pr/")]
        body: dict[str, Any] = {"branches": branches, "converts": [], "tags": []}
        if include_prs:
            body["pullRequests"] = prs
        self._json(200, body)

    def _create_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        payload = self.json_body()
        self._require_write(repo_id.split("/")[0])
        if not branch or branch.startswith("refs/") or not re.fullmatch(r"[A-Za-z0-9._/-]+", branch):
            raise _HttpError(400, f"Invalid reference for a branch: {branch!r}.")
        hub = self.hub
        with hub._lock:
            repo = hub._repo(repo_type, repo_id)
            if branch in repo.refs:
                raise _HttpError(409, f"Reference already exists: refs/heads/{branch}")
            start = payload.get("startingPoint") or "main"
            oid = hub._resolve(repo, start)
            if oid is None:
                raise _HttpError(404, f"Invalid rev id: {start}", code="RevisionNotFound")
            repo.refs[branch] = oid
        self._json(200, {})

    def _new_pr(self, repo: _Repo, title: str, description: str, author: str, base: str) -> _PullRequest:
        hub = self.hub
        num = max([0, *repo.prs]) + 1
        pr = _PullRequest(num=num, title=title, description=description, author=author, base=base, created_at=_now())
        repo.prs[num] = pr
        head = hub._resolve(repo, base)
        if head is None:
            raise _HttpError(404, f"Invalid rev id: {base}", code="RevisionNotFound")
        repo.refs[f"refs/pr/{num}"] = head
        return pr

    def _create_discussion(self, repo_type: str, repo_id: str) -> None:
        payload = self.json_body()
        user = self._require_write(repo_id.split("/")[0])
        if not payload.get("pullRequest"):
            raise _HttpError(400, "This test server only supports pull requests, not plain discussions.")
        with self.hub._lock:
            repo = self.hub._repo(repo_type, repo_id)
            pr = self._new_pr(
                repo, payload.get("title") or "Pull request", payload.get("description") or "", user, "main"
            )
        self._json(200, {"num": pr.num, "url": f"{self.hub._repo_url(repo)}/discussions/{pr.num}"})

    def _discussion_details(self, repo_type: str, repo_id: str, num: int) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        with self.hub._lock:
            pr = repo.prs.get(num)
            if pr is None:
                raise _HttpError(404, f"Discussion {num} not found.")
            body = {
                "num": pr.num,
                "title": pr.title,
                "status": pr.status,
                "author": {"name": pr.author},
                "createdAt": pr.created_at,
                "repo": {"name": repo_id, "type": repo_type},
                "isPullRequest": True,
                "events": [],
                "changes": {"base": f"refs/heads/{pr.base}"},
                "filesWithConflicts": [],
                "diff": "",
            }
        self._json(200, body)

    # ---------------------------------------------------------------- API: uploads

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        payload = self.json_body()
        self._require_write(repo_id.split("/")[0])
        hub = self.hub
        with hub._lock:
            repo = hub._repo(repo_type, repo_id)
            files = hub._commit_at(repo, revision).files
            out = []
            for f in payload.get("files", []):
                path, size = f["path"], int(f["size"])
                sample = base64.b64decode(f.get("sample", ""))
                lfs = path.endswith(_LFS_SUFFIXES) or size >= hub.lfs_threshold or b"\0" in sample
                remote = files.get(path)
                oid = None
                if remote is not None:
                    oid = remote.sha256 if lfs else (remote.oid if remote.sha256 is None else None)
                out.append(
                    {
                        "path": path,
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": path.startswith(".git/"),
                        "oid": oid,
                    }
                )
        self._json(200, {"files": out, "commitOid": hub._resolve(repo, revision)})

    def _commit(self, repo_type: str, repo_id: str, revision: str) -> None:
        raw = self.body()
        user = self._require_write(repo_id.split("/")[0])
        try:
            lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        except ValueError:
            raise _HttpError(400, "Commit payload is not valid NDJSON.") from None
        if not lines or lines[0].get("key") != "header":
            raise _HttpError(400, "The first NDJSON line must be the commit header.")
        header = lines[0]["value"]
        hub = self.hub
        with hub._lock:
            repo = hub._repo(repo_type, repo_id)
            ref = revision.removeprefix("refs/heads/")
            if ref not in repo.refs:  # only branches and PR refs take commits, not commit hashes
                raise _HttpError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
            pr = None
            if self.query.get("create_pr") in ("1", "true", "True"):
                pr = self._new_pr(
                    repo, header.get("summary") or "Pull request", header.get("description") or "", user, ref
                )
                ref = f"refs/pr/{pr.num}"
            head = repo.refs[ref]
            parent_commit = header.get("parentCommit")
            if parent_commit and pr is None and not head.startswith(parent_commit):
                raise _HttpError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(repo.commits[head].files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                path = value.get("path", "")
                if key == "file":
                    if value.get("encoding", "base64") != "base64":
                        raise _HttpError(400, f"Unsupported encoding {value.get('encoding')!r}.")
                    data = base64.b64decode(value["content"])
                    oid = _git_blob_oid(data)
                    (hub.root / "blobs" / oid).write_bytes(data)
                    files[path] = _Entry(size=len(data), oid=oid)
                elif key == "lfsFile":
                    sha = value.get("oid", "")
                    if value.get("algo", "sha256") != "sha256" or not _HEX64_RE.match(sha):
                        raise _HttpError(400, f"Invalid LFS oid {sha!r} for {path!r}.")
                    if not hub._has_object(sha):
                        raise _HttpError(422, f"LFS object {sha} for {path!r} was never uploaded.")
                    size = hub._object_size(sha)
                    if "size" in value and int(value["size"]) != size:
                        raise _HttpError(422, f"LFS object {sha} has size {size}, commit says {value['size']}.")
                    files[path] = _Entry(
                        size=size,
                        oid=_git_blob_oid(_lfs_pointer(sha, size)),
                        sha256=sha,
                        xet_hash=hub._sha_to_xet.get(sha),
                    )
                elif key == "deletedFile":
                    if path not in files:
                        raise _HttpError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
                    del files[path]
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    gone = [p for p in files if p.startswith(prefix)]
                    if not gone:
                        raise _HttpError(404, f"A folder with this name doesn't exist: {path}", code="EntryNotFound")
                    for p in gone:
                        del files[p]
                else:
                    raise _HttpError(400, f"Unsupported commit operation {key!r}.")
            commit = hub._new_commit(repo, head, header.get("summary", ""), header.get("description", ""), files)
            repo.refs[ref] = commit.oid
            pr_match = _PR_REF_RE.match(ref)
            if pr_match and int(pr_match.group(1)) in repo.prs:
                repo.prs[int(pr_match.group(1))].status = "open"
            body: dict[str, Any] = {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": f"{hub._repo_url(repo)}/commit/{commit.oid}",
            }
            if pr is not None:
                body["pullRequestUrl"] = f"{hub._repo_url(repo)}/discussions/{pr.num}"
        self._json(200, body)

    # ---------------------------------------------------------------- LFS

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        payload = self.json_body()
        self._require_write(repo_id.split("/")[0])
        hub = self.hub
        with hub._lock:
            hub._repo(repo_type, repo_id)
        if payload.get("operation") != "upload":
            raise _HttpError(400, "This test server only supports the LFS 'upload' operation.")
        objects = []
        multipart_used = False
        for obj in payload.get("objects", []):
            oid, size = obj.get("oid", ""), int(obj.get("size", -1))
            if not _HEX64_RE.match(oid) or size < 0:
                objects.append(
                    {"oid": str(oid), "size": max(size, 0), "error": {"code": 422, "message": "Invalid oid or size."}}
                )
                continue
            if hub._has_object(oid):
                objects.append({"oid": oid, "size": size})  # no actions: already stored
                continue
            verify = {"href": f"{hub.endpoint}/_lfs/verify/{oid}"}
            threshold = hub.lfs_multipart_threshold
            if threshold is not None and size >= threshold and "multipart" in payload.get("transfers", ["basic"]):
                multipart_used = True
                chunk = hub.lfs_chunk_size
                nparts = max(1, -(-size // chunk))
                header = {"chunk_size": str(chunk)}
                header.update({f"{i:05d}": f"{hub.endpoint}/_lfs/part/{oid}/{i}" for i in range(1, nparts + 1)})
                upload = {"href": f"{hub.endpoint}/_lfs/complete/{oid}?size={size}", "header": header}
            else:
                upload = {"href": f"{hub.endpoint}/_lfs/upload/{oid}?size={size}"}
            objects.append({"oid": oid, "size": size, "actions": {"upload": upload, "verify": verify}})
        self._send(
            200,
            json.dumps({"transfer": "multipart" if multipart_used else "basic", "objects": objects}).encode(),
            content_type="application/vnd.git-lfs+json",
        )

    def _store_lfs(self, tmp: Path, oid: str, sha: str, size: int, expected_size: int | None) -> None:
        if sha != oid:
            tmp.unlink(missing_ok=True)
            raise _HttpError(400, f"Uploaded content has sha256 {sha}, expected {oid}.")
        if expected_size is not None and size != expected_size:
            tmp.unlink(missing_ok=True)
            raise _HttpError(400, f"Uploaded content has {size} bytes, expected {expected_size}.")
        tmp.replace(self.hub._lfs_path(oid))

    def _route_lfs(self, seg: list[str], method: str) -> None:
        hub = self.hub
        # Presigned-style URLs: the client sends no Authorization header here, so none is checked.
        if method == "PUT" and len(seg) == 2 and seg[0] == "upload" and _HEX64_RE.match(seg[1]):
            oid = seg[1]
            tmp = hub.root / "tmp" / f"{oid}.{secrets.token_hex(4)}"
            sha, size = self._stream_body_to(tmp)
            expected = int(self.query["size"]) if self.query.get("size", "").isdigit() else None
            self._store_lfs(tmp, oid, sha, size, expected)
            self._send(200, b"", headers={"ETag": f'"{sha}"'})
            return
        if method == "PUT" and len(seg) == 3 and seg[0] == "part" and _HEX64_RE.match(seg[1]) and seg[2].isdigit():
            part = hub.root / "tmp" / f"{seg[1]}.part{int(seg[2]):05d}"
            tmp = part.with_name(part.name + f".{secrets.token_hex(4)}")
            self._stream_body_to(tmp)
            tmp.replace(part)
            etag = hashlib.md5(part.read_bytes()).hexdigest()
            self._send(200, b"", headers={"ETag": f'"{etag}"'})
            return
        if method == "POST" and len(seg) == 2 and seg[0] == "complete" and _HEX64_RE.match(seg[1]):
            oid = seg[1]
            payload = self.json_body()
            parts = sorted(payload.get("parts", []), key=lambda p: int(p["partNumber"]))
            tmp = hub.root / "tmp" / f"{oid}.{secrets.token_hex(4)}"
            h = hashlib.sha256()
            size = 0
            with open(tmp, "wb") as out:
                for expected_number, p in enumerate(parts, start=1):
                    part = hub.root / "tmp" / f"{oid}.part{int(p['partNumber']):05d}"
                    if int(p["partNumber"]) != expected_number or not part.is_file():
                        tmp.unlink(missing_ok=True)
                        raise _HttpError(400, f"Part {p['partNumber']} of {oid} was never uploaded.")
                    data = part.read_bytes()
                    if f'"{hashlib.md5(data).hexdigest()}"' != p.get("etag"):
                        tmp.unlink(missing_ok=True)
                        raise _HttpError(400, f"ETag mismatch for part {p['partNumber']} of {oid}.")
                    out.write(data)
                    h.update(data)
                    size += len(data)
            expected = int(self.query["size"]) if self.query.get("size", "").isdigit() else None
            self._store_lfs(tmp, oid, h.hexdigest(), size, expected)
            for p in parts:
                (hub.root / "tmp" / f"{oid}.part{int(p['partNumber']):05d}").unlink(missing_ok=True)
            self._json(200, {})
            return
        if method == "POST" and len(seg) == 2 and seg[0] == "verify":
            payload = self.json_body()
            if self._user() is None:
                raise _HttpError(401, "You must be authenticated to verify an LFS upload.")
            oid = seg[1]
            if not hub._lfs_path(oid).is_file() or hub._lfs_path(oid).stat().st_size != int(payload.get("size", -1)):
                raise _HttpError(404, f"LFS object {oid} is not stored (or has another size).")
            self._json(200, {})
            return
        if method in ("GET", "HEAD") and len(seg) == 2 and seg[0] == "cdn" and _HEX64_RE.match(seg[1]):
            self._serve_object(seg[1])
            return
        raise _HttpError(404, f"Unknown LFS route {method} {self.path}.")

    # ---------------------------------------------------------------- downloads

    def _serve_bytes(self, data: bytes, headers: dict[str, str]) -> None:
        rng = _parse_range(self.hdrs.get("range"), len(data)) if data else None
        headers = {"Accept-Ranges": "bytes", **headers}
        if rng is None:
            self._send(200, data, headers=headers, content_type="application/octet-stream")
        else:
            start, end = rng
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            self._send(206, data[start : end + 1], headers=headers, content_type="application/octet-stream")

    def _serve_object(self, sha256: str) -> None:
        hub = self.hub
        with hub._lock:
            if not hub._has_object(sha256):
                raise _HttpError(404, f"Object {sha256} not found.")
            entry = _Entry(size=hub._object_size(sha256), oid="", sha256=sha256, xet_hash=hub._sha_to_xet.get(sha256))
        data = hub._entry_bytes(entry)
        self._serve_bytes(data, {"ETag": f'"{sha256}"'})

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        hub = self.hub
        with hub._lock:
            commit = hub._commit_at(repo, revision)
            entry = commit.files.get(path)
        base = {"X-Repo-Commit": commit.oid}
        if entry is None:
            raise _HttpError(404, f"Entry not found: {path}", code="EntryNotFound", headers=base)
        if entry.sha256 is None:
            data = (hub.root / "blobs" / entry.oid).read_bytes()
            self._serve_bytes(data, {**base, "ETag": f'"{entry.oid}"'})
            return
        headers = {
            **base,
            "ETag": f'"{entry.oid}"',
            "X-Linked-Etag": f'"{entry.sha256}"',
            "X-Linked-Size": str(entry.size),
            "Location": f"{hub.cdn_origin}/_lfs/cdn/{entry.sha256}?expires={int(time.time()) + 3600}",
        }
        if entry.xet_hash is not None:
            refresh = f"{hub.endpoint}/api/{repo_type}s/{repo_id}/xet-read-token/{commit.oid}"
            headers["X-Xet-Hash"] = entry.xet_hash
            headers["Link"] = f'<{refresh}>; rel="xet-auth"'
        self._send(302, b"", headers=headers)

    # ---------------------------------------------------------------- Xet

    def _xet_token(self, repo_type: str, repo_id: str, revision: str, *, write: bool) -> None:
        hub = self.hub
        if write:
            self._require_write(repo_id.split("/")[0])
            with hub._lock:
                repo = hub._repo(repo_type, repo_id)
                if revision != "None" and hub._resolve(repo, revision) is None:
                    raise _HttpError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        else:
            self._readable_repo(repo_type, repo_id)
        token = ("xetw-" if write else "xetr-") + secrets.token_hex(16)
        exp = int(time.time()) + 3600
        with _XET_TOKENS_LOCK:
            _XET_TOKENS[token] = exp
        # hf_xet reads the JSON body (write tokens); huggingface_hub reads the X-Xet-* headers (read tokens).
        headers = {"X-Xet-Cas-Url": hub.cas_url, "X-Xet-Access-Token": token, "X-Xet-Token-Expiration": str(exp)}
        self._json(200, {"casUrl": hub.cas_url, "accessToken": token, "exp": exp}, headers=headers)

    def _route_cas(self, seg: list[str], method: str) -> None:
        hub = self.hub
        if seg == ["v1", "telemetry"]:
            self._json(200, {})
            return
        if method == "GET" and len(seg) == 2 and seg[0] == "fetch" and _HEX64_RE.match(seg[1]):
            # Presigned-style URL: no auth. Serves raw xorb bytes for the requested Range.
            path = hub._xorb_path(seg[1])
            if not path.is_file():
                raise _HttpError(404, f"Xorb {seg[1]} not found.")
            self._serve_bytes(path.read_bytes(), {})
            return
        if method == "GET" and len(seg) == 4 and seg[:2] == ["v1", "chunks"]:
            self._xet_token_ok(write=False)
            raise _HttpError(404, "Global deduplication is not supported by this test server.")
        if method == "POST" and len(seg) >= 2 and seg[:2] == ["v1", "xorb-grants"]:
            self._xet_token_ok(write=True)
            raise _HttpError(404, "Upload grants are not supported; use the xorb upload route.")
        if method == "POST" and len(seg) == 4 and seg[:2] == ["v1", "xorbs"] and _HEX64_RE.match(seg[3]):
            data = self.body()
            self._xet_token_ok(write=True)
            path = hub._xorb_path(seg[3])
            inserted = not path.is_file()
            if inserted:
                tmp = path.with_name(path.name + f".{secrets.token_hex(4)}")
                tmp.write_bytes(data)
                tmp.replace(path)
            self._json(200, {"was_inserted": inserted})
            return
        if method == "POST" and seg == ["v2", "shards"]:
            self._xet_token_ok(write=True)
            raise _HttpError(404, "Shard API v2 is not supported; use v1.")
        if method == "POST" and seg == ["v1", "shards"]:
            data = self.body()
            self._xet_token_ok(write=True)
            (hub.root / "shards" / hashlib.sha256(data).hexdigest()).write_bytes(data)
            hub._register_shard(data)
            self._json(200, {"result": 1})
            return
        if method == "GET" and len(seg) == 3 and seg[0] == "v2" and seg[1] == "reconstructions":
            self._xet_token_ok(write=False)
            raise _HttpError(404, "Reconstruction API v2 is not supported; use v1.")
        if method == "GET" and len(seg) == 3 and seg[:2] == ["v1", "reconstructions"]:
            self._xet_token_ok(write=False)
            self._reconstruction(seg[2])
            return
        raise _HttpError(404, f"Unknown CAS route {method} {self.path}.")

    def _reconstruction(self, file_hash: str) -> None:
        hub = self.hub
        with hub._lock:
            xfile = hub._xet_files.get(file_hash)
        if xfile is None:
            raise _HttpError(404, f"Xet file {file_hash} not found.")
        rng = _parse_range(self.hdrs.get("range"), xfile.size) if xfile.size else None
        first, last = (0, xfile.size - 1) if rng is None else rng
        terms, fetch_info = [], {}
        offset_into_first = 0
        pos = 0
        for xorb, start, end, unpacked in xfile.terms:
            term_start, term_end = pos, pos + unpacked  # [term_start, term_end) in file bytes
            pos = term_end
            if term_end <= first or term_start > last:
                continue
            if not terms:
                offset_into_first = first - term_start
            offsets = hub._chunk_offsets(xorb, end)
            terms.append({"hash": xorb, "unpacked_length": unpacked, "range": {"start": start, "end": end}})
            fetch_info.setdefault(xorb, []).append(
                {
                    "range": {"start": start, "end": end},
                    "url": f"{hub.cas_url}/fetch/{xorb}",
                    "url_range": {"start": offsets[start], "end": offsets[end] - 1},
                }
            )
        self._json(200, {"offset_into_first_range": offset_into_first, "terms": terms, "fetch_info": fetch_info})


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
