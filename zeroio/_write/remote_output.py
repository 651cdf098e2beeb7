"""Outputs at URLs (``s3://bucket/model``): built in a local staging folder, then uploaded, the markers last.

Object stores have no rename, so the local all-or-nothing engine cannot commit there. Instead the output is
written locally (the atomic engine, unchanged), then each file is uploaded with the backend's ``put_file``
(s3fs switches to a multipart upload for large files): side files, weights and rank files first, and last the
files that say an output is complete (``*.index.json``; ``latest`` for a resharded DeepSpeed checkpoint,
``latest_universal`` for a universal one, which is where DeepSpeed's loader starts): nothing at the destination
looks complete until everything it names is there. On any failure the files zeroio uploaded (and only those) are
removed. A destination prefix holding files is refused unless ``overwrite``, and then only zeroio's own output
names may be there and are replaced (as a local ``overwrite`` does, ``_write/own_files.py``).

A destination that is the source, inside it, or holding it is refused before anything is listed or written (an
``overwrite`` would delete the objects being read). An object that did not exist at the listing is put with a
conditional write (``If-None-Match: *`` on ``s3://``), so one created by someone else meanwhile is never replaced
without ``overwrite``; other backends check existence again just before each put (docs/security.md).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from .. import _constants as C
from .._io.remote_file import call_with_retries
from .._io.remote_path import as_path, filesystem
from .._messages import get_logger, redact_exception
from ..errors import CheckpointNotFoundError, OutputError
from .overlap import refuse_overlap
from .own_files import LATEST_UNIVERSAL, foreign_names

__all__ = ["write_file_to_url", "write_to_url"]

logger = get_logger(__name__)

T = TypeVar("T")


def _put(fs: Any, local: Path, key: str, *, exclusive: bool) -> None:
    """Upload ``local`` to ``key``; ``exclusive``: never replace an object created since the listing.

    s3fs sends ``If-None-Match: *`` (``mode="create"``, S3 and its emulators refuse the put with 412 when the key
    exists); other backends are checked just before the put (a window of one request remains there).
    """
    if exclusive and _protocol(fs) == "s3":
        fs.put_file(str(local), key, mode="create")
        return
    if exclusive and fs.exists(key):
        raise FileExistsError(key)
    fs.put_file(str(local), key)


def _protocol(fs: Any) -> str:
    protocol = fs.protocol
    return str(protocol if isinstance(protocol, str) else protocol[0])


def _appeared(url: str, name: str | None, *, overwrite: bool) -> OutputError:
    where = f"{url}/{name}" if name else url
    fix = (
        "Run again: overwrite=True replaces only objects found (and checked) at the listing."
        if overwrite
        else "Pass overwrite=True (--overwrite) to replace it, or choose another prefix."
    )
    return OutputError(
        f"Refusing to replace '{where}': the object was created after zeroio listed the destination (another "
        f"writer?); nothing of it was changed. {fix}",
        path=url,
    )


def _existing(fs: Any, key: str, url: str, fix_auth: str) -> list[str]:
    """Names (relative to ``key``) of every object under the destination prefix (credentials checked here)."""
    try:
        found = call_with_retries(url, "listing the destination", fix_auth, lambda: fs.find(key))
    except CheckpointNotFoundError:  # no bucket yet: the upload says so, naming the URL
        return []
    return sorted(str(k)[len(key) + 1 :] for k in found if str(k).startswith(key + "/"))


def _is_marker(name: str) -> bool:
    """A file that says its output is complete: it names (or leads a loader to) files that must already be there."""
    return name.endswith(".index.json") or name in (C.LATEST_FILE, LATEST_UNIVERSAL)


def _upload_order(staging: Path) -> list[Path]:
    """Side files, weights and rank files first, then the markers (indexes, ``latest``, ``latest_universal``)."""
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    return sorted(
        files, key=lambda p: (_is_marker(p.relative_to(staging).as_posix()), p.relative_to(staging).as_posix())
    )


def write_to_url(
    url: str,
    storage_options: Mapping[str, Any] | None,
    *,
    overwrite: bool,
    write: Callable[[Path], T],
    source: object = None,
) -> tuple[T, dict[Path, Path]]:
    """Run ``write(local_folder)``, then upload the folder to ``url``; returns its result and, for each local file
    it wrote (resolved path, as the result names it), the uploaded object's path.

    Raises:
        OutputError: the destination is, holds or is inside ``source``, holds files (without ``overwrite``), files
            zeroio does not write (with it), an object appeared there meanwhile, or an upload failed (what was
            uploaded is removed).
    """
    fs, key, fix_auth = filesystem(url, storage_options)
    url = url.rstrip("/")
    refuse_overlap(source, url)
    existing = _existing(fs, key, url, fix_auth)
    if existing and not overwrite:
        raise OutputError(
            f"Refusing to write '{url}': it already holds {len(existing)} file(s) ({', '.join(existing[:3])}). "
            "Pass overwrite=True (--overwrite) to replace zeroio's outputs there, or choose another prefix.",
            path=url,
        )
    foreign = foreign_names(existing)
    if foreign:
        raise OutputError(
            f"Refusing to overwrite '{url}': it holds files zeroio does not write ({', '.join(foreign[:5])}). "
            "Remove them or choose another prefix.",
            path=url,
        )
    with tempfile.TemporaryDirectory(prefix="zeroio-upload-") as tmp:
        staging = Path(tmp) / "out"
        result = write(staging)  # before anything at the destination changes
        files = _upload_order(staging)
        names = [p.relative_to(staging).as_posix() for p in files]
        uploaded: list[str] = []
        try:
            # Old outputs go first (an old index must not name a mix of old and new shards), markers first of all.
            stale = sorted(existing, key=lambda n: not _is_marker(n))
            for name in stale:
                fs.rm_file(f"{key}/{name}")
            for path, name in zip(files, names, strict=True):
                logger.debug("uploading %s to %s/%s", path, url, name)
                uploaded.append(name)
                try:
                    _put(fs, path, f"{key}/{name}", exclusive=name not in existing)
                except FileExistsError:
                    uploaded.pop()  # not zeroio's: never removed
                    raise _appeared(url, name, overwrite=overwrite) from None
        except BaseException as exc:
            _remove(fs, key, uploaded)
            if isinstance(exc, OutputError):
                raise
            if isinstance(exc, Exception):
                redact_exception(exc)
                raise OutputError(
                    f"Cannot write '{url}': uploading '{uploaded[-1] if uploaded else url}' failed ({exc}); the "
                    "files uploaded so far were removed. Check the credentials and the destination, then retry.",
                    path=url,
                ) from exc
            raise
    return result, {p.resolve(): as_path(f"{url}/{n}", storage_options) for p, n in zip(files, names, strict=True)}


def write_file_to_url(
    url: str,
    storage_options: Mapping[str, Any] | None,
    *,
    overwrite: bool,
    write: Callable[[Path], T],
    source: object = None,
) -> tuple[T, Path]:
    """Run ``write(local_file)``, then upload that one file as the object ``url`` (``fmt="lightning"``'s ``.ckpt``).

    One PUT makes an object visible whole or not at all, so there is no marker to order. An existing object is
    refused without ``overwrite``; a prefix holding objects (a folder) is refused either way, as a local folder is.

    Raises:
        OutputError: the destination is, holds or is inside ``source``, exists (without ``overwrite``), appeared
            meanwhile, is a folder, or the upload failed.
    """
    fs, key, fix_auth = filesystem(url, storage_options)
    url = url.rstrip("/")
    refuse_overlap(source, url)
    inside = _existing(fs, key, url, fix_auth)
    if inside:
        raise OutputError(
            f"Refusing to write '{url}': it is a folder holding {len(inside)} file(s) ({', '.join(inside[:3])}); "
            "a Lightning checkpoint is one file. Choose a file name such as '.../model.ckpt'.",
            path=url,
        )
    exists = call_with_retries(url, "checking the destination", fix_auth, lambda: fs.exists(key))
    if exists and not overwrite:
        raise OutputError(
            f"Refusing to write '{url}': the object exists. Pass overwrite=True (--overwrite) to replace it.",
            path=url,
        )
    with tempfile.TemporaryDirectory(prefix="zeroio-upload-") as tmp:
        local = Path(tmp) / (key.rsplit("/", 1)[-1] or "model.ckpt")
        result = write(local)  # before anything at the destination changes
        try:
            logger.debug("uploading %s to %s", local, url)
            _put(fs, local, key, exclusive=not exists)  # replaces an existing object in one step
        except FileExistsError:
            raise _appeared(url, None, overwrite=overwrite) from None
        except Exception as exc:
            redact_exception(exc)
            raise OutputError(
                f"Cannot write '{url}': the upload failed ({exc}). Check the credentials and the destination, "
                "then retry.",
                path=url,
            ) from exc
    return result, as_path(url, storage_options)


def _remove(fs: Any, key: str, names: list[str]) -> None:
    """Remove what this upload wrote, markers first; a failure to remove is logged (the upload error is raised)."""
    for name in sorted(names, key=lambda n: not _is_marker(n)):
        try:
            fs.rm_file(f"{key}/{name}")
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - the upload's error is the one to report
            logger.warning("could not remove '%s/%s' after a failed upload: %s", key, name, exc)
