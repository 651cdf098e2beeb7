"""What a failed push says: huggingface_hub's and hf_xet's exceptions, as one :class:`~zeroio.errors.HubError`
with what to do (a token, a permission, a revision, the network), never the token itself."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ._messages import redact_exception
from .errors import HubError

__all__ = ["as_hub_error"]


def _hub_failures() -> tuple[type[BaseException], ...]:
    """What huggingface_hub and hf_xet raise for a failed push (HTTP errors, network errors, bad answers)."""
    types: list[type[BaseException]] = [OSError, RuntimeError, ValueError]  # HfHubHTTPError is an OSError
    try:
        import httpx2  # huggingface_hub >= 2 (its HTTP errors are not OSErrors)

        types.append(httpx2.HTTPError)
    except ImportError:  # pragma: no cover - older huggingface_hub uses requests, whose errors are OSErrors
        pass
    return tuple(types)


@contextmanager
def as_hub_error(
    *, repo_id: str, endpoint: str, src: Path | None, revision: str | None, token_given: bool
) -> Iterator[None]:
    """Re-raise what huggingface_hub / hf_xet raise as a HubError with a what-to-do message."""
    try:
        yield
    except _hub_failures() as e:
        redact_exception(e)  # its message quotes URLs, HF_ENDPOINT's user:password@ included
        had_token = token_given or _token_found()
        raise _to_hub_error(
            e, repo_id=repo_id, endpoint=endpoint, src=src, revision=revision, had_token=had_token
        ) from e


def _token_found() -> bool:
    """Whether huggingface_hub finds a token (HF_TOKEN, saved login...); only asked once a push failed."""
    try:
        from huggingface_hub import get_token

        return get_token() is not None
    except Exception:  # noqa: BLE001 - e.g. a failed OIDC exchange: then there is no usable token either
        return False


def _to_hub_error(
    e: BaseException, *, repo_id: str, endpoint: str, src: Path | None, revision: str | None, had_token: bool
) -> HubError:
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, HFValidationError):  # checked by the client before any request: retrying cannot help
        return HubError(
            f"'{repo_id}' is not a valid Hub repo id: use 'namespace/name' (or 'name' in your own namespace) of "
            "letters, digits, '-', '_' and '.', not starting or ending with '-' or '.', without '--' or '..', "
            "at most 96 characters.",
            path=src,
            name=repo_id,
        )
    where = f"'{repo_id}' at {endpoint}"
    no_token = (
        "No Hugging Face token was found. Pass token='hf_...' (a token with write access), set HF_TOKEN, "
        "or run `hf auth login`."
    )
    status = e.response.status_code if isinstance(e, HfHubHTTPError) and e.response is not None else None
    not_found = isinstance(e, RepositoryNotFoundError)
    if isinstance(e, RevisionNotFoundError):
        message = (
            f"Revision {revision!r} does not exist in {where}. Pass an existing branch (new branches are created "
            "from main), or 'refs/pr/N' of an open pull request."
        )
    elif not had_token and (status in (401, 403) or not_found):
        message = f"Cannot push to {where} without a token (HTTP {status}). {no_token}"
    elif status == 401 and not not_found:
        # huggingface_hub reports a 401 on a repo URL as RepositoryNotFoundError unless the token itself was refused.
        message = (
            f"The Hub rejected the token while pushing to {where} (HTTP 401): it is invalid or expired. Create a "
            "token with write access at https://huggingface.co/settings/tokens and pass it as token=..., set "
            "HF_TOKEN, or run `hf auth login`."
        )
    elif status == 403:
        message = (
            f"The token cannot write to {where} (HTTP 403). Use a token with the 'write' role, or a fine-grained "
            f"token allowed to write to the namespace '{repo_id.split('/')[0]}'."
        )
    elif not_found or status in (401, 404):
        message = (
            f"Repository {where} was not found, or the token cannot see it (HTTP {status}). Check the repo id and "
            "the endpoint (HF_ENDPOINT), and that the token's account may write to that namespace."
        )
    elif status in (409, 412):
        message = (
            f"{where} changed while pushing (HTTP {status}). Run the same push again; files already on the Hub "
            "are not sent twice."
        )
    elif isinstance(e, HfHubHTTPError):
        detail = (e.server_message or "").strip() or type(e).__name__
        message = (
            f"The Hub answered HTTP {status} while pushing to {where}: {_short(detail)}. Run the push again later."
        )
    elif _is_network_error(e):
        message = (
            f"Could not reach the Hub at {endpoint} while pushing to '{repo_id}' ({type(e).__name__}: "
            f"{_short(str(e))}). The commit may not have been made. Check the network connection and HF_ENDPOINT, "
            "then run the same push again: files already stored are not sent twice."
        )
    else:
        message = (
            f"Uploading to {where} failed ({type(e).__name__}: {_short(str(e))}). Run the same push again; if it "
            "keeps failing, set ZEROIO_DEBUG=1 for the full traceback."
        )
    return HubError(message, path=src, name=repo_id, found=status)


def _is_network_error(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    try:
        import httpx2

        if isinstance(e, httpx2.TransportError):
            return True
    except ImportError:  # pragma: no cover
        pass
    cause = e.__cause__ or e.__context__
    return cause is not None and cause is not e and _is_network_error(cause)


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
