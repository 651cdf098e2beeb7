"""One ranged GET per backend, distrusting the server: bounded bodies, checked ranges, pinned object versions.

:class:`~zeroio._io.remote_file.RemoteFile` asks for bytes ``[start, end)`` through the function built here:

* ``http(s)://``: zeroio's own GET on fsspec's aiohttp session, asking for ``Accept-Encoding: identity`` and
  refusing a compressed body (a 1 MB gzip body inflated to 1 GiB in memory before); the body is streamed and
  never read past the bytes asked (or past the object's size when the server ignores ``Range``), whatever
  ``Content-Length`` says (a 1.5 GB body for a 1.7 KB file drove memory to 3.1 GB); ``Content-Range`` must name
  exactly the range asked and the size seen at open (a range starting 4 bytes early shifted every element); the
  ``ETag`` (or ``Last-Modified``) seen at open must be each response's: compared, not sent as ``If-Match``, since
  a Hub or CDN URL redirects and the first hop may judge ``If-Match`` against its own, different, ETag;
* ``s3://``: ``GetObject`` with ``Range`` and ``IfMatch`` set to the ETag of the listing (no extra request), the
  body length and ``ContentRange`` checked the same way;
* other backends (``gs://``, ``hf://``): the backend's ``cat_file`` (docs/security.md says what each pins).

An object that changed since it was listed fails with :class:`ObjectChanged` (never retried: each retry would
read the new version), a body that does not match the request with :class:`RangeError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TIMEOUT_OPTIONS",
    "WHOLE_OBJECT_BYTES",
    "ObjectChanged",
    "RangeError",
    "Timeouts",
    "backend_timeouts",
    "fetcher",
    "pinned_version",
]

WHOLE_OBJECT_BYTES = 64 * 2**20
"""Largest object read from a server that ignores HTTP ``Range`` (a plain web server answering every request with
the whole object): it is then kept in memory and every read served from it. A larger one is refused with the fix
(download it), since each read would download the whole object again."""
_CHUNK = 2**20
TIMEOUT_OPTIONS = ("connect_timeout", "read_timeout", "retry_timeout")
"""zeroio's own ``storage_options`` keys (seconds); taken out before the rest reach the backend."""


@dataclass(frozen=True)
class Timeouts:
    """How long zeroio waits on a remote store (``storage_options`` keys of the same names, in seconds)."""

    connect_timeout: float = 10.0
    """Opening a connection."""
    read_timeout: float = 60.0
    """Silence between two reads of a response (a server that sends headers and then stalls)."""
    retry_timeout: float = 120.0
    """One request with all its retries: no try outlasts it, and none starts after it (a stalled server was
    retried for ~30 min; botocore's own retries of a read timeout alone take 5 x ``read_timeout``)."""

    @classmethod
    def pop(cls, options: dict[str, Any]) -> Timeouts:
        """The timeouts in ``options`` (removed from it), defaults for the rest.

        Raises:
            ValueError: a timeout that is not a positive number.
        """
        given = {name: options.pop(name) for name in TIMEOUT_OPTIONS if name in options}
        for name, value in given.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"storage_options[{name!r}] must be a positive number of seconds, got {value!r}.")
        return cls(**{name: float(value) for name, value in given.items()})


def backend_timeouts(protocol: str, options: dict[str, Any], timeouts: Timeouts) -> None:
    """Put ``timeouts`` into the backend's own options (unless the caller set them there): aiohttp's session
    timeouts for ``http``, botocore's ``connect_timeout``/``read_timeout`` for ``s3``."""
    if protocol == "http":
        import aiohttp

        client = dict(options.get("client_kwargs") or {})
        client.setdefault(
            "timeout",
            aiohttp.ClientTimeout(
                total=None, connect=timeouts.connect_timeout, sock_connect=timeouts.connect_timeout,
                sock_read=timeouts.read_timeout,
            ),
        )  # fmt: skip
        options["client_kwargs"] = client
    elif protocol == "s3":
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeouts.connect_timeout)
        config.setdefault("read_timeout", timeouts.read_timeout)
        options["config_kwargs"] = config


class ObjectChanged(ValueError):
    """The object is not the one listed at open (another ETag, size or modification time): never retried."""


class RangeError(ValueError):
    """A response that is not the bytes asked for (wrong range, too long, compressed): the server's way, not a
    transient fault (a ValueError is not retried)."""


def pinned_version(protocol: str, info: Mapping[str, Any]) -> str | None:
    """What identifies the listed version of an object, from the listing's ``info`` (no extra request)."""
    if protocol == "s3":
        return _text(info.get("ETag"))
    if protocol == "http":
        return _text(info.get("ETag")) or _text(info.get("Last-Modified"))
    return None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def fetcher(
    fs: Any, protocol: str, key: str, size: int, version: str | None, timeouts: Timeouts
) -> Callable[[int, int], bytes]:
    """``fetch(start, end)`` for one object: one checked ranged request (retries are the caller's), cancelled
    after ``timeouts.retry_timeout`` whatever the backend's own retries would do."""
    if protocol == "http":
        return _http(fs, key, size, version, timeouts.retry_timeout)
    if protocol == "s3":
        return _s3(fs, key, size, version, timeouts.retry_timeout)
    exact = {"cache_type": "none"} if protocol == "hf" else {}  # HfFileSystem's cat_file reads 5 MB ahead otherwise
    return lambda start, end: bytes(fs.cat_file(key, start=start, end=end, **exact))


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


def check_content_range(header: str | None, start: int, end: int, size: int) -> None:
    """Raise unless ``header`` is ``bytes start-(end-1)/size`` (``*`` for an unknown size is accepted)."""
    if header is None:
        return  # S3 and most servers send it; its absence alone proves nothing (the length is checked)
    match = _CONTENT_RANGE.match(header)
    if match is None or (int(match[1]), int(match[2])) != (start, end - 1):
        raise RangeError(
            f"answers bytes {start}..{end} with Content-Range {header!r}, another range: the server mishandles HTTP ranges"
        )
    if match[3] != "*" and int(match[3]) != size:
        raise ObjectChanged(f"its Content-Range {header!r} gives a size of {match[3]} bytes, {size} at open")


def _http(fs: Any, url: str, size: int, version: str | None, limit_s: float) -> Callable[[int, int], bytes]:
    from fsspec.asyn import sync  # type: ignore[import-untyped]

    async def get(start: int, end: int) -> bytes:
        session = await fs.set_session()
        kwargs = dict(fs.kwargs)
        headers = dict(kwargs.pop("headers", None) or {})
        headers.update({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        async with session.get(fs.encode_url(url), headers=headers, auto_decompress=False, **kwargs) as response:
            if response.status == 412:  # a precondition the caller's own headers set
                raise ObjectChanged("the server answers 412 Precondition Failed: it holds another version")
            if response.status == 404:
                raise FileNotFoundError(url)
            response.raise_for_status()
            encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise RangeError(
                    f"sends a {encoding}-encoded body although zeroio asked for identity encoding (a compressed body "
                    "can inflate far beyond the bytes asked)"
                )
            _check_version(response.headers, version)
            if response.status == 206:
                check_content_range(response.headers.get("Content-Range"), start, end, size)
                limit = end - start
            elif size > WHOLE_OBJECT_BYTES:  # 200: the whole object, whatever was asked
                raise RangeError(
                    f"is served without HTTP range support (the server sent the whole {size}-byte object for bytes "
                    f"{start}..{end}); zeroio reads such objects only up to {WHOLE_OBJECT_BYTES} bytes"
                )
            else:
                limit = size
            length = response.headers.get("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > limit:
                raise RangeError(f"announces a {int(length)}-byte body for {limit} bytes asked (bytes {start}..{end})")
            body = bytearray()
            while len(body) <= limit:  # never more than one byte past what was asked: a longer body is refused
                chunk = await response.content.read(min(_CHUNK, limit + 1 - len(body)))
                if not chunk:
                    break
                body += chunk
            if len(body) > limit:
                raise RangeError(f"sends more than the {limit} bytes asked (bytes {start}..{end})")
            return bytes(body)

    return lambda start, end: bytes(sync(fs.loop, get, start, end, timeout=limit_s))


def _check_version(headers: Mapping[str, str], version: str | None) -> None:
    """The response's ETag (or, without one at open, Last-Modified) must be the one seen at open."""
    if version is None:
        return
    name = "ETag" if version.startswith(('"', "W/")) else "Last-Modified"
    seen = headers.get(name)
    if seen is not None and seen != version:
        raise ObjectChanged(f"its {name} is {seen!r}, {version!r} at open")


async def _bounded_read(body: Any, limit: int, start: int) -> bytes:
    """Up to ``limit`` bytes of an async stream (``read(n)``); :class:`RangeError` once it sends more."""
    data = bytearray()
    while len(data) <= limit:
        chunk = await body.read(min(_CHUNK, limit + 1 - len(data)))
        if not chunk:
            break
        data += chunk
    if len(data) > limit:
        raise RangeError(f"sends more than the {limit} bytes asked (bytes {start}..{start + limit})")
    return bytes(data)


def _s3(fs: Any, path: str, size: int, etag: str | None, limit_s: float) -> Callable[[int, int], bytes]:
    from fsspec.asyn import sync

    bucket, key, version_id = fs.split_path(path)
    pin: dict[str, str] = {"IfMatch": etag} if etag else {}
    if version_id:
        pin["VersionId"] = version_id

    def get(start: int, end: int) -> bytes:
        try:
            response = fs.call_s3(  # fsspec's sync wrapper: ``timeout`` cancels the call, botocore's retries too
                "get_object",
                Bucket=bucket,
                Key=key,
                Range=f"bytes={start}-{end - 1}",
                timeout=limit_s,
                **pin,
                **fs.req_kw,
            )
        except Exception as exc:
            if "PreconditionFailed" in f"{type(exc).__name__} {exc} {exc.__cause__!r}":
                raise ObjectChanged(
                    f"S3 answers If-Match {etag} with PreconditionFailed: it holds another version"
                ) from exc
            raise
        body = response["Body"]
        try:
            check_content_range(response.get("ContentRange"), start, end, size)
            if etag and response.get("ETag") not in (None, etag):
                raise ObjectChanged(f"its ETag is {response.get('ETag')}, {etag} at open")
            length = int(response.get("ContentLength") or 0)
            if length > end - start:
                raise RangeError(f"announces a {length}-byte body for {end - start} bytes asked")
            # aiohttp's stream, read on s3fs's loop, never more than one byte past the range: a chunked body with
            # no Content-Length was read whole (2.1 GB for a 184-byte object) before.
            return bytes(sync(fs.loop, _bounded_read, body, end - start, start, timeout=limit_s))
        finally:
            body.close()

    return get
