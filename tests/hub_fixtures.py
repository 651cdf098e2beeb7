"""Pytest fixtures that run the local Hub-protocol server for the real huggingface_hub client.

Use from a test module with ``pytest_plugins = ["hub_fixtures"]``. The fixtures never patch client
functions, only module-level *constants* that huggingface_hub reads at import time (HF_HOME paths,
the endpoint, progress bars, HF_HUB_DISABLE_XET), so nothing can reach huggingface.co or a real token.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_server import DEFAULT_TOKEN, DEFAULT_USER, READ_ONLY_TOKEN, HubServer

__all__ = ["DEFAULT_TOKEN", "DEFAULT_USER", "READ_ONLY_TOKEN", "hf_home", "hub_api", "hub_server", "xet_disabled"]

_SCRUBBED_ENV = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_HUB_DISABLE_XET",
    "HF_OIDC_RESOURCE",
    "HF_OIDC_ID_TOKEN",
    "HF_HUB_CACHE",
    "HF_XET_CACHE",
)


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private HF_HOME for the whole session: no real token, cache or login can leak in.

    Session-scoped on purpose: hf_xet creates one process-wide session that reads HF_HOME once, so
    the directory must outlive every test that uploads or downloads through Xet.
    """
    from huggingface_hub import constants

    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as mp:
        for name in _SCRUBBED_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        mp.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        # Constants computed from the environment when huggingface_hub was first imported.
        mp.setattr(constants, "HF_HOME", str(home))
        mp.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        mp.setattr(constants, "HF_XET_CACHE", str(home / "xet"))
        mp.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
        mp.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
        mp.setattr(constants, "HF_HUB_OFFLINE", False)
        mp.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
        mp.setattr(constants, "HF_HUB_DISABLE_XET", False)
        # utils/tqdm.py copied the progress-bar constant into its own namespace at import.
        mp.setattr(importlib.import_module("huggingface_hub.utils.tqdm"), "HF_HUB_DISABLE_PROGRESS_BARS", True)
        yield home


@pytest.fixture
def hub_server(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A fresh Hub-protocol server; the client's default endpoint points at it for the test.

    Valid tokens: ``DEFAULT_TOKEN`` (write, user ``DEFAULT_USER``) and ``READ_ONLY_TOKEN``.
    The test fails if the server hit an internal error, even when the client swallowed the answer.
    """
    from huggingface_hub import constants

    with HubServer() as server:
        # Both are derived from HF_ENDPOINT at import; hf_hub_url() only swaps the endpoint when they agree.
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server
        errors = list(server.internal_errors)
    if errors:
        pytest.fail("The test Hub server hit internal errors:\n" + "\n".join(errors), pytrace=False)


@pytest.fixture
def hub_api(hub_server: HubServer):  # type: ignore[no-untyped-def]
    """An ``HfApi`` bound to the test server with the write token."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub_server.endpoint, token=DEFAULT_TOKEN)


@pytest.fixture
def xet_disabled(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the legacy LFS upload path, as ``HF_HUB_DISABLE_XET=1`` would at import time.

    ``is_xet_available()`` reads ``constants.HF_HUB_DISABLE_XET`` on every call, so patching the
    constant is enough; no client function is touched.
    """
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
