"""Message helpers shared by every module: one way to show a long list in one line, one way to hide secrets."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence

__all__ = ["SHOWN", "get_logger", "listing", "redact", "redact_exception"]

HIDDEN = "***"
"""What a credential in a URL is replaced with."""

# ``scheme://user:password@host``: everything between '//' and the first '@' before any '/' is credentials
# (``hf://user/repo@rev`` has a '/' first, so a revision is kept).
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"<>]*@")
# Query parameters that carry secrets in presigned or token URLs (S3 ``X-Amz-Signature``/``-Credential``/
# ``-Security-Token``, GCS ``X-Goog-Signature``, Azure SAS ``sig``, ``token``, ``access_token``, ``api_key``...).
_SECRET_QUERY = re.compile(
    r"([?&;](?:[\w.-]*(?:token|sig|signature|secret|password|passwd|credential|key|auth)[\w.-]*)=)[^&;#\s'\"<>]*",
    re.IGNORECASE,
)

SHOWN = 5
"""Items a message lists before "... and N more" (huggingface_hub and torch keep messages to one screen too)."""


def listing(items: Sequence[str], *, limit: int = SHOWN, show: Callable[[str], str] = str) -> str:
    """``"a, b, c, d, e ... and 37 more"``: the first ``limit`` items, each rendered by ``show``."""
    shown = ", ".join(show(item) for item in items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it hidden: ``user:password@`` and secret query values.

    Every message that can hold a URL the user gave goes through this (errors, log records, progress lines, the
    CLI's output): ``http://user:PASS@host/m`` becomes ``http://***@host/m``, ``?X-Amz-Signature=ab`` becomes
    ``?X-Amz-Signature=***``.
    """
    if "://" not in text and "=" not in text:
        return text  # the common case, a local path: no regex work
    return _SECRET_QUERY.sub(lambda m: m.group(1) + HIDDEN, _USERINFO.sub(lambda m: m.group(1) + HIDDEN + "@", text))


def redact_exception(exc: BaseException) -> None:
    """Hide URL credentials in the messages of ``exc`` and its causes (in place): a backend's error quotes the URL
    whole (huggingface_hub: ``Cannot access content at: https://user:pass@...``), and a traceback prints it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        try:
            current.args = tuple(redact(a) if isinstance(a, str) else a for a in current.args)
            if isinstance(getattr(current, "message", None), str):
                current.message = redact(current.message)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):  # an exception type with read-only attributes: leave it
            pass
        current = current.__cause__ or current.__context__


class _Redacting(logging.Filter):
    """Hides URL credentials in a zeroio log record (its message formatted once, here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = redact(message)
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


_FILTER = _Redacting()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` whose records never show URL credentials (a filter per logger: a parent
    logger's filters do not see its children's records)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
