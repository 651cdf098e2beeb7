"""The one rule for every writer: an output never overlaps the source it reads (same path, inside, or holding it).

``convert SRC SRC --format universal --overwrite`` replaced the source's tag folders with its output (exit 0, the
checkpoint gone), while safetensors output refused. Every writer's destination setup calls :func:`refuse_overlap`
(``AtomicDir.check`` for local folders and files, the URL upload for object stores) before anything is created,
listed or deleted. Local paths are compared after resolving links (``realpath``: ``src`` given through a link
is the folder it names); URLs by :func:`~zeroio._io.remote_path.url_identity` (scheme aliases, credentials,
repeated and trailing slashes folded). A local path and a URL never overlap.
"""

from __future__ import annotations

import os

from .._io.remote_path import is_url, url_identity
from ..errors import OutputError

__all__ = ["refuse_overlap"]


def _local_parts(path: str) -> tuple[str, ...]:
    """The components of ``path`` with every link resolved (a missing tail is kept as written, normalised)."""
    return tuple(p for p in os.path.realpath(os.path.abspath(path)).split(os.sep) if p)


def _url_parts(url: str) -> tuple[str, ...]:
    scheme, rest = url_identity(url)
    return (scheme, *(p for p in rest.split("/") if p))


def _relation(src: tuple[str, ...], dst: tuple[str, ...]) -> str | None:
    if src == dst:
        return "it is the source"
    if dst[: len(src)] == src:
        return "it is inside the source"
    if src[: len(dst)] == dst:
        return "it holds the source"
    return None


def refuse_overlap(source: object, destination: object) -> None:
    """Refuse ``destination`` when it is ``source``, lies inside it, or holds it (links resolved, URLs folded).

    ``source`` is what the verb was given (a path, a URL, a ``RemotePath``; ``None``: nothing to compare).

    Raises:
        OutputError: naming both paths, before anything is created or deleted.
    """
    if source is None:
        return
    src_text, dst_text = os.fspath(str(source)), os.fspath(str(destination))
    src_url, dst_url = is_url(src_text) and not src_text.startswith("file://"), is_url(dst_text)
    if src_url != dst_url:
        return
    if src_url:
        src, dst = _url_parts(src_text), _url_parts(dst_text)
        if src[:1] != dst[:1]:
            return
        where = "prefix"
    else:
        src, dst = _local_parts(src_text.removeprefix("file://")), _local_parts(dst_text)
        where = "path"
    why = _relation(src, dst)
    if why is None:
        return
    raise OutputError(
        f"Refusing to write '{dst_text}': {why} '{src_text}', whose files would be replaced or deleted while they "
        f"are read. Write to another {where}.",
        path=dst_text,
    )
