"""Checkpoints at URLs (``s3://``, ``gs://``, ``hf://``, ``https://``): a path object the format readers use as a Path.

The readers find files with a small subset of :class:`pathlib.Path` (``/``, ``name``, ``parent``, ``exists``,
``is_file``, ``is_dir``, ``iterdir``, ``glob``, ``read_text``, ``stat``, ``open``) and open byte sources with
:func:`zeroio._io.sources.open_source`. :class:`RemotePath` implements exactly that subset over an fsspec filesystem
(s3fs, gcsfs, huggingface_hub's ``HfFileSystem``, fsspec's HTTP), answering every name question from one listing
made on first use (a recursive listing of the URL, and a one-level listing of any other folder asked about), so
detecting a layout costs one or two list requests, not one per file. :func:`as_path` is what readers call instead
of ``Path(...)``; it is typed as returning ``Path`` because a ``RemotePath`` stands in for one everywhere a
reader reads (docs/architecture.md, "storage backends").
"""

from __future__ import annotations

import fnmatch
import importlib.util
import io
import os
import posixpath
import re
import stat as stat_mod
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, cast
from urllib.parse import unquote

from .._messages import redact
from .._types import StrPath
from ..errors import RemoteStorageError
from .remote_fetch import Timeouts, backend_timeouts, fetcher, pinned_version
from .remote_file import RemoteFile, call_with_retries

__all__ = ["RemotePath", "as_path", "filesystem", "is_url", "url_identity", "with_storage_options"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

# protocol -> (module fsspec needs, what to install, how to fix refused access)
_S3_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), AWS_ENDPOINT_URL for an S3-compatible store, "
    "or pass storage_options (e.g. {'anon': True} for a public bucket)."
)
_GCS_FIX = (
    "set GOOGLE_APPLICATION_CREDENTIALS (or run `gcloud auth application-default login`), or pass storage_options "
    "(e.g. {'token': 'anon'} for a public bucket)."
)
_HF_FIX = "set HF_TOKEN (or run `hf auth login`) with read access to the repository; HF_ENDPOINT for another Hub."
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "s3": ("s3fs", "pip install s3fs (zeroio's [s3] extra)", _S3_FIX),
    "gs": ("gcsfs", "pip install gcsfs (zeroio's [gcs] extra)", _GCS_FIX),
    "hf": ("huggingface_hub", "pip install huggingface_hub", _HF_FIX),
    "http": (
        "aiohttp",
        "pip install aiohttp",
        "pass the headers the server needs in storage_options={'headers': ...}.",
    ),
}
_ALIASES = {"s3a": "s3", "gcs": "gs", "https": "http"}
_CREDENTIAL_VARIABLES = ("AWS_", "GOOGLE_", "GCE_", "HF_", "FSSPEC_", "STORAGE_EMULATOR_HOST", "GCSFS_")
_FILESYSTEMS: dict[tuple[str, str, tuple[tuple[str, str], ...]], Any] = {}
_FS_LOCK = threading.Lock()


S3_CONFIG_DEFAULTS: dict[str, Any] = {"retries": {"max_attempts": 1, "mode": "standard"}}
"""botocore settings for ``s3://`` unless ``storage_options`` gives ``config_kwargs``: fail fast without network
(zeroio retries transient errors itself; the connect and read timeouts come from ``remote_fetch.Timeouts``)."""


def is_url(path: object) -> bool:
    """True for ``scheme://...`` text (``file://`` included); a local path never matches."""
    return isinstance(path, str) and bool(_URL.match(path))


def url_identity(url: str) -> tuple[str, str]:
    """``(scheme, bucket/key)`` naming the same objects for equal results: scheme aliases (``s3a``, ``gcs``,
    ``https``) folded, credentials (``user:secret@``) dropped, repeated and trailing slashes removed."""
    scheme, _, rest = url.partition("://")
    scheme = _ALIASES.get(scheme.lower(), scheme.lower())
    host, slash, path = rest.partition("/")
    host = host.rsplit("@", 1)[-1]
    return scheme, "/".join(p for p in f"{host}{slash}{path}".split("/") if p not in ("", "."))


def as_path(path: StrPath | RemotePath, storage_options: Mapping[str, Any] | None = None) -> Path:
    """``Path(path)`` for local paths; a :class:`RemotePath` (typed as a Path: the readers' subset) for URLs."""
    if isinstance(path, RemotePath):
        return cast(Path, path)
    if is_url(path) and not str(path).startswith("file://"):
        return cast(Path, RemotePath.from_url(str(path), storage_options))
    if isinstance(path, str) and path.startswith("file://"):
        return Path(path[len("file://") :])
    if storage_options:
        raise ValueError(f"storage_options apply to URLs only, but '{path}' is a local path.")
    return Path(path)


def with_storage_options(path: StrPath, storage_options: Mapping[str, Any] | None) -> StrPath:
    """``path`` as given, or for a URL with ``storage_options`` its path carrying them (the verbs pass it on).

    Raises:
        ValueError: ``storage_options`` given for a local path (they configure a URL's filesystem only).
    """
    if not storage_options:
        return path
    return as_path(path, storage_options)


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str, str]:
    """``(fsspec filesystem, key, how to fix refused credentials)`` of ``url``: for writing outputs."""
    fs, key, protocol = _filesystem(url, storage_options)
    return fs, key, _backend(protocol)[2]


def _backend(protocol: str) -> tuple[str, str, str]:
    return _BACKENDS.get(_ALIASES.get(protocol, protocol), ("fsspec", "pip install fsspec", "check the credentials."))


def _filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str, str]:
    """``(fs, key, protocol)`` for ``url``; a one-line error naming the package to install when it is missing."""
    protocol = url.split("://", 1)[0].lower()
    module, install, _ = _backend(protocol)
    for needed in ("fsspec", module):
        if importlib.util.find_spec(needed) is None:
            raise RemoteStorageError(
                f"Reading '{url}' needs the '{needed}' package, which is not installed: {install}", path=url
            )
    import fsspec.core  # type: ignore[import-untyped]

    if protocol not in fsspec.available_protocols():  # a typo such as s4://: no package to install would help
        raise RemoteStorageError(
            f"Unknown URL scheme '{protocol}://' in '{url}'. zeroio reads s3://, gs://, hf://, https:// and http:// "
            "URLs (and any other scheme fsspec knows), or a local path.",
            path=url,
        )
    options = dict(storage_options or {})
    url = _credentials_to_options(url, protocol, options)
    scheme = _ALIASES.get(protocol, protocol)
    if scheme == "s3":
        # botocore retries under s3fs's and zeroio's own retries: with no network a read took 63 s to fail.
        # storage_options={'config_kwargs': ...} still overrides this; backend_timeouts adds the timeouts.
        options.setdefault("config_kwargs", S3_CONFIG_DEFAULTS)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in options:
            options["endpoint_url"] = endpoint
    backend_timeouts(scheme, options, Timeouts.pop(options))
    if protocol == "hf" and "endpoint" not in options and os.environ.get("HF_ENDPOINT"):
        options["endpoint"] = os.environ["HF_ENDPOINT"]  # huggingface_hub reads it once, at import
    # One filesystem per (URL scheme, options, credential variables): creating one (a botocore session) costs
    # more than reading a small checkpoint, and a change of credentials in the environment must not be missed.
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_CREDENTIAL_VARIABLES)))
    cache_key = (protocol, repr(sorted(options.items())), env)
    try:
        with _FS_LOCK:
            fs = _FILESYSTEMS.get(cache_key)
            if fs is None:
                fs, key = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
                _FILESYSTEMS[cache_key] = fs
            else:
                key = fsspec.core.strip_protocol(url)
    except (ImportError, ValueError) as exc:
        raise RemoteStorageError(f"Cannot open '{url}': {exc}. {install}", path=url) from exc
    fs.invalidate_cache()  # zeroio lists once per open (RemoteTree); a listing cached by an earlier open may be stale
    return fs, str(key).rstrip("/"), protocol


def _credentials_to_options(url: str, protocol: str, options: dict[str, Any]) -> str:
    """``s3://KEY:SECRET@bucket/key`` -> ``s3://bucket/key`` with ``key``/``secret`` in ``options`` (unless given).

    s3fs takes ``KEY:SECRET@bucket`` for a bucket name and quotes it in its errors; moved out of the URL, the
    secret reaches no object key, path or message. (HTTP keeps its ``user:password@``: aiohttp sends it as Basic
    auth, and messages hide it, ``zeroio._messages.redact``.)"""
    if _ALIASES.get(protocol, protocol) != "s3":
        return url
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if "@" not in host:
        return url
    userinfo, host = host.rsplit("@", 1)
    key_id, _, secret = userinfo.partition(":")
    options.setdefault("key", unquote(key_id))
    if secret:
        options.setdefault("secret", unquote(secret))
    return f"{scheme}://{host}{slash}{path}"


class RemoteTree:
    """What is at and under one URL, listed once and shared by every :class:`RemotePath` derived from it."""

    def __init__(self, fs: Any, protocol: str, root: str, timeouts: Timeouts | None = None) -> None:
        self.fs = fs
        self.protocol = protocol
        self.root = root
        self.fix_auth = _backend(protocol)[2]
        self.timeouts = timeouts or Timeouts()
        self._versions: dict[str, str | None] = {}  # key -> ETag (or Last-Modified) listed, pinned for its reads
        # An async backend's call (s3fs, gcsfs, HTTP) is cancelled after the retry budget, its own retries included.
        self._bounded: dict[str, float] = {"timeout": self.timeouts.retry_timeout} if fs.async_impl else {}
        self._lock = threading.RLock()
        self._sizes: dict[str, int | None] = {}  # key -> size, None for a folder
        self._children: dict[str, set[str]] = {}  # folder key -> child names, for listed folders
        self._deep: list[str] = []  # keys listed recursively
        self._sources: dict[str, RemoteFile] = {}
        # A web server has no listing (fsspec would download a page and parse its links): a URL is one file there.
        self._listable = _ALIASES.get(protocol, protocol) != "http"

    def url(self, key: str) -> str:
        return key if "://" in key else f"{self.protocol}://{key}"  # fsspec's HTTP keys keep their scheme

    def _call(self, key: str, what: str, fn: Any) -> Any:
        return call_with_retries(self.url(key), what, self.fix_auth, fn, retry_timeout=self.timeouts.retry_timeout)

    def _record(self, key: str, size: int | None, stop: str, info: Mapping[str, Any] | None = None) -> None:
        self._sizes[key] = size
        if info is not None and size is not None:
            self._versions[key] = pinned_version(_ALIASES.get(self.protocol, self.protocol), info)
        while key != stop and "/" in key:
            parent, name = key.rsplit("/", 1)
            self._children.setdefault(parent, set()).add(name)
            if self._sizes.get(parent, "absent") is None:
                break
            self._sizes[parent] = None
            key = parent

    def _covered(self, key: str) -> bool:
        return any(key == d or key.startswith(d + "/") for d in self._deep)

    def _list_root(self) -> None:
        """The one recursive listing of the URL the user gave (called on first use)."""
        if self._deep or self.root in self._sizes:
            return
        if not self._listable:  # plain HTTP: one object, its size (and ETag) from a HEAD request
            info = self._call(self.root, "object info", lambda: self.fs.info(self.root, **self._bounded))
            self._record(self.root, int(info["size"]), self.root, info)
            return
        found = self._call(
            self.root, "listing", lambda: self.fs.find(self.root, withdirs=True, detail=True, **self._bounded)
        )
        for key, info in found.items():
            key = key.rstrip("/")
            if key == self.root or key.startswith(self.root + "/"):
                size = None if info.get("type") == "directory" else int(info.get("size") or 0)
                self._record(key, size, self.root, info)
        if any(k.startswith(self.root + "/") for k in self._sizes):
            self._sizes[self.root] = None
            self._children.setdefault(self.root, set())
            self._deep.append(self.root)
        elif self.root not in self._sizes:  # a single object (or nothing) at the URL
            try:
                info = self._call(self.root, "object info", lambda: self.fs.info(self.root, **self._bounded))
            except FileNotFoundError:
                return
            if info.get("type") != "directory":
                self._record(self.root, int(info.get("size") or 0), self.root, info)

    def _list_folder(self, key: str) -> None:
        """One level of a folder outside the recursive listing (the parent of a tag folder or a file)."""
        if key in self._children or self._covered(key) or not self._listable:
            return
        try:
            infos = self._call(key, "listing", lambda: self.fs.ls(key, detail=True, **self._bounded))
        except FileNotFoundError:
            infos = []
        self._children.setdefault(key, set())
        for info in infos:
            child = str(info["name"]).rstrip("/")
            if child.startswith(key + "/") and "/" not in child[len(key) + 1 :]:
                size = None if info.get("type") == "directory" else int(info.get("size") or 0)
                self._record(child, size, key, info)
        if self._children[key]:
            self._sizes[key] = None

    def size_of(self, key: str) -> int | None | str:
        """The object's size, None for a folder, ``"absent"`` when nothing is there."""
        with self._lock:
            self._list_root()
            if key not in self._sizes and not self._covered(key) and "/" in key:
                self._list_folder(key.rsplit("/", 1)[0])
            return self._sizes.get(key, "absent")

    def source(self, key: str, size: int) -> RemoteFile:
        """The one :class:`RemoteFile` of ``key`` (shared: what one reader fetched, the next need not)."""
        with self._lock:
            found = self._sources.get(key)
            if found is None or found.size != size:
                protocol = _ALIASES.get(self.protocol, self.protocol)
                found = self._sources[key] = RemoteFile(
                    self.url(key),
                    fetcher(self.fs, protocol, key, size, self._versions.get(key), self.timeouts),
                    size,
                    self.fix_auth,
                    retry_timeout=self.timeouts.retry_timeout,
                )
            return found

    def children(self, key: str) -> list[str]:
        with self._lock:
            self._list_root()
            if self._sizes.get(key, "absent") is None:
                self._list_folder(key)
            return sorted(self._children.get(key, ()))


class RemotePath:
    """A file or folder at a URL, with the subset of :class:`pathlib.Path` the format readers use."""

    __slots__ = ("_key", "_tree")

    def __init__(self, tree: RemoteTree, key: str) -> None:
        self._tree = tree
        self._key = key

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> RemotePath:
        """The path of ``url``; nothing is requested until a question is asked about it."""
        fs, key, protocol = _filesystem(url, storage_options)
        return cls(RemoteTree(fs, protocol, key, Timeouts.pop(dict(storage_options or {}))), key)

    # ----------------------------------------------------------------- names
    def __str__(self) -> str:
        return self._tree.url(self._key)

    def __repr__(self) -> str:
        return f"RemotePath('{redact(str(self))}')"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: RemotePath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, name: str) -> RemotePath:
        parts = [p for p in str(name).replace("\\", "/").split("/") if p not in ("", ".")]
        return RemotePath(self._tree, "/".join([self._key, *parts]))

    @property
    def name(self) -> str:
        return posixpath.basename(self._key)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self._tree, posixpath.dirname(self._key) or self._key)

    def as_posix(self) -> str:
        return str(self)

    def is_absolute(self) -> bool:
        return True

    def resolve(self, strict: bool = False) -> RemotePath:
        return self  # object stores have no links

    def relative_to(self, other: object) -> PurePosixPath:
        if not self.is_relative_to(other):
            raise ValueError(f"'{self}' is not inside '{other}'")
        return PurePosixPath(str(self)[len(str(other).rstrip("/")) + 1 :])

    def is_relative_to(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (str(self) + "/").startswith(str(other).rstrip("/") + "/")

    # ----------------------------------------------------------------- questions, from the listing
    def exists(self) -> bool:
        return self._tree.size_of(self._key) != "absent"

    def is_file(self) -> bool:
        return isinstance(self._tree.size_of(self._key), int)

    def is_dir(self) -> bool:
        return self._tree.size_of(self._key) is None

    def iterdir(self) -> Iterator[RemotePath]:
        for name in self._tree.children(self._key):
            yield self / name

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """Names of this folder matching ``pattern`` (one level: the readers glob no deeper)."""
        for path in self.iterdir():
            if fnmatch.fnmatchcase(path.name, pattern):
                yield path

    def stat(self) -> os.stat_result:
        """Mode and size only: an object is a regular file, a prefix a folder."""
        size = self._tree.size_of(self._key)
        if isinstance(size, str):
            raise FileNotFoundError(2, "No such object", str(self))
        mode = stat_mod.S_IFDIR | 0o555 if size is None else stat_mod.S_IFREG | 0o444
        return os.stat_result((mode, 0, 0, 1, 0, 0, size or 0, 0, 0, 0))

    # ----------------------------------------------------------------- bytes
    def byte_source(self, size: int | None = None) -> RemoteFile:
        """A :class:`RemoteFile` reading this object with ranged requests."""
        return self._tree.source(self._key, size if size is not None else self.stat().st_size)

    def open(self, mode: str = "rb") -> io.BufferedIOBase:
        """A seekable binary reader (zipfile reads archive directories with it), each read one ranged request."""
        if mode != "rb":
            raise ValueError(f"'{self}' can only be opened for reading ('rb'), not {mode!r}.")
        return cast(io.BufferedIOBase, _Reader(self.byte_source()))

    def read_bytes(self) -> bytes:
        source = self.byte_source()
        return source.read_bytes(0, source.size)

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)


_ZIP_END_BYTES = 22  # the end-of-central-directory record (no comment: torch writes none)
_ZIP_TAIL_BYTES = 22 + 20 + 56  # ... plus the zip64 locator and end record, or the end of the central directory


class _Reader(io.RawIOBase):
    """A file object over a :class:`RemoteFile`: exact ranged reads, no read-ahead (pickles and zip headers)."""

    def __init__(self, source: RemoteFile) -> None:
        super().__init__()
        self._source = source
        self._pos = 0
        self._tail = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._source.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def prefetch(self, start: int, end: int) -> None:
        """Fetch ``[start, end)`` at once: the reads that follow (a zip entry's header, name, extra, data) hit it."""
        self._source.prefetch(start, end)

    def _at_tail(self) -> None:
        if self._pos >= self._source.size - _ZIP_END_BYTES and not self._tail:
            # zipfile reads the end record, the zip64 locator and the zip64 end record one by one: one request.
            self._tail = True
            self._source.prefetch(self._source.size - _ZIP_TAIL_BYTES, self._source.size)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        self._at_tail()
        data = self._source.read_bytes(self._pos, len(view))
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        self._at_tail()
        data = self._source.read_bytes(self._pos, max(0, self._source.size - self._pos))
        self._pos += len(data)
        return data
