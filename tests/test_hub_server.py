"""The local Hub-protocol server against the real huggingface_hub client, with plain files."""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path

import httpx2
import pytest
from hub_server import DEFAULT_TOKEN, DEFAULT_USER, READ_ONLY_TOKEN, HubServer
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

pytest_plugins = ["hub_fixtures"]

BIG = 11 * 1000 * 1000  # over the 10 MB line where the Hub switches to LFS whatever the file type
CHUNK = 4 * 1024 * 1024  # multipart part size forced on the server: 3 parts for BIG


def _make_folder(root: Path, *, big: bytes) -> Path:
    folder = root / "upload"
    (folder / "nested").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(big)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8, "model_type": "toy"}))
    (folder / "nested" / "notes.json").write_text('{"note": "small regular file in a sub-folder"}')
    return folder


def _download(server: HubServer, repo_id: str, cache: Path, **kwargs: object) -> Path:
    return Path(snapshot_download(repo_id, endpoint=server.endpoint, token=DEFAULT_TOKEN, cache_dir=cache, **kwargs))


def _assert_same_tree(folder: Path, snapshot: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            assert (snapshot / path.relative_to(folder)).read_bytes() == path.read_bytes(), path


def _calls(server: HubServer, method: str, fragment: str) -> list[tuple[str, str, bool]]:
    return [r for r in server.requests if r[0] == method and fragment in r[1]]


@pytest.fixture(params=["xet", "lfs", "lfs-multipart"])
def transfer(request: pytest.FixtureRequest, hub_server: HubServer) -> str:
    """The upload transport under test: the default Xet path, or LFS with single PUT or multipart."""
    if request.param != "xet":
        request.getfixturevalue("xet_disabled")
    if request.param == "lfs-multipart":
        hub_server.lfs_multipart_threshold = 1
        hub_server.lfs_chunk_size = CHUNK
    return str(request.param)


@pytest.fixture(params=["xet", "lfs"])
def xet_or_lfs(request: pytest.FixtureRequest, hub_server: HubServer) -> str:
    """Run a test once on the default Xet path and once with Xet disabled."""
    if request.param == "lfs":
        request.getfixturevalue("xet_disabled")
    return str(request.param)


def test_upload_folder_round_trip(transfer: str, hub_server: HubServer, hub_api: HfApi, tmp_path: Path) -> None:
    """create_repo -> upload_folder -> snapshot_download gives identical bytes on every transfer path."""
    folder = _make_folder(tmp_path, big=os.urandom(BIG))
    hub_api.create_repo("tester/round-trip")
    info = hub_api.upload_folder(repo_id="tester/round-trip", folder_path=folder)

    assert hub_server.refs("tester/round-trip")["main"] == info.oid
    assert hub_server.read_file("tester/round-trip", "weights.bin") == (folder / "weights.bin").read_bytes()
    _assert_same_tree(folder, _download(hub_server, "tester/round-trip", tmp_path / "cache"))

    xorbs = _calls(hub_server, "POST", "/v1/xorbs/")
    puts = _calls(hub_server, "PUT", "/_lfs/upload/")
    parts = _calls(hub_server, "PUT", "/_lfs/part/")
    completions = _calls(hub_server, "POST", "/_lfs/complete/")
    if transfer == "xet":
        assert xorbs and not puts and not parts
        assert _calls(hub_server, "GET", "/fetch/")
    elif transfer == "lfs":
        assert len(puts) == 1 and not xorbs and not parts
    else:
        assert len(parts) == 3 and len(completions) == 1 and not puts and not xorbs
    # Presigned-style uploads and the foreign-origin CDN download carry no Authorization header.
    assert not any(auth for _, _, auth in puts + parts + completions + _calls(hub_server, "GET", "/_lfs/cdn/"))


def test_xet_upload_downloads_without_xet(
    hub_server: HubServer, hub_api: HfApi, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A file pushed through Xet downloads byte-identical over plain HTTP once Xet is disabled."""
    # Compressible content, so hf_xet stores LZ4 (text-like) and byte-grouped LZ4 (float-like) chunks that the
    # server has to decode: two zero bytes in every 4-byte word look like fp16 values widened to fp32.
    floats = bytearray(os.urandom(2_000_000))
    floats[0::4] = bytes(len(floats[0::4]))
    floats[1::4] = bytes(len(floats[1::4]))
    big = os.urandom(BIG // 2) + bytes(range(256)) * 4096 + bytes(floats) + b"\0" * 500_000
    folder = _make_folder(tmp_path, big=big)
    hub_api.create_repo("tester/xet-to-http")
    hub_api.upload_folder(repo_id="tester/xet-to-http", folder_path=folder)
    assert _calls(hub_server, "POST", "/v1/xorbs/")

    request.getfixturevalue("xet_disabled")
    path = hf_hub_download(
        "tester/xet-to-http",
        "weights.bin",
        endpoint=hub_server.endpoint,
        token=DEFAULT_TOKEN,
        cache_dir=tmp_path / "cache",
    )
    assert Path(path).read_bytes() == big
    assert _calls(hub_server, "GET", "/_lfs/cdn/")


def test_lfs_upload_downloads_with_xet(
    hub_server: HubServer,
    hub_api: HfApi,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """A file pushed over LFS downloads over plain HTTP even with Xet enabled (no X-Xet-Hash is sent)."""
    from huggingface_hub import constants

    folder = _make_folder(tmp_path, big=os.urandom(BIG))
    request.getfixturevalue("xet_disabled")
    hub_api.create_repo("tester/http-to-xet")
    hub_api.upload_folder(repo_id="tester/http-to-xet", folder_path=folder)

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    _assert_same_tree(folder, _download(hub_server, "tester/http-to-xet", tmp_path / "cache"))
    assert not _calls(hub_server, "GET", "xet-read-token")


@pytest.mark.parametrize("token", ["hf_not_a_valid_token", False], ids=["wrong", "missing"])
def test_bad_token_is_rejected(
    xet_or_lfs: str, token: str | bool, hub_server: HubServer, hub_api: HfApi, tmp_path: Path
) -> None:
    """A wrong or missing token gets 401 on writes, the client raises, and nothing is stored."""
    folder = _make_folder(tmp_path, big=os.urandom(1000))
    hub_api.create_repo("tester/guarded")
    intruder = HfApi(endpoint=hub_server.endpoint, token=token)

    with pytest.raises(HfHubHTTPError) as create_err:
        intruder.create_repo("tester/other")
    assert create_err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as upload_err:
        intruder.upload_folder(repo_id="tester/guarded", folder_path=folder)
    assert upload_err.value.response.status_code == 401

    assert not hub_server.repo_exists("tester/other")
    assert [c["title"] for c in hub_server.commit_history("tester/guarded")] == ["initial commit"]
    assert not _calls(hub_server, "POST", "/v1/xorbs/") and not _calls(hub_server, "PUT", "/_lfs/")


def test_read_only_token_can_read_but_not_write(hub_server: HubServer, hub_api: HfApi, tmp_path: Path) -> None:
    """A read-only token downloads a private repo but gets 403 on create_repo and commits."""
    hub_api.create_repo("tester/private", private=True)
    reader = HfApi(endpoint=hub_server.endpoint, token=READ_ONLY_TOKEN)
    assert reader.model_info("tester/private").private is True
    with pytest.raises(HfHubHTTPError) as err:
        reader.upload_folder(repo_id="tester/private", folder_path=_make_folder(tmp_path, big=b"x"))
    assert err.value.response.status_code == 403
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub_server.endpoint, token=False).model_info("tester/private")


def test_create_repo_exist_ok(hub_server: HubServer, hub_api: HfApi) -> None:
    """create_repo answers 409 with the url on an existing repo, which exist_ok=True turns into success."""
    url = hub_api.create_repo("tester/twice")
    assert hub_api.create_repo("tester/twice", exist_ok=True) == url == f"{hub_server.endpoint}/tester/twice"
    with pytest.raises(HfHubHTTPError) as err:
        hub_api.create_repo("tester/twice")
    assert err.value.response.status_code == 409
    assert (
        hub_api.create_repo("twice-no-namespace", exist_ok=True)
        == f"{hub_server.endpoint}/{DEFAULT_USER}/twice-no-namespace"
    )


def test_commit_to_branch(xet_or_lfs: str, hub_server: HubServer, hub_api: HfApi, tmp_path: Path) -> None:
    """Committing to a branch made with create_branch moves that branch only."""
    folder = _make_folder(tmp_path, big=os.urandom(BIG))
    hub_api.create_repo("tester/branched")
    main_before = hub_server.refs("tester/branched")["main"]
    hub_api.create_branch("tester/branched", branch="dev")
    info = hub_api.upload_folder(repo_id="tester/branched", folder_path=folder, revision="dev")

    refs = hub_server.refs("tester/branched")
    assert refs == {"main": main_before, "dev": info.oid}
    assert [b.name for b in hub_api.list_repo_refs("tester/branched").branches] == ["main", "dev"]
    _assert_same_tree(folder, _download(hub_server, "tester/branched", tmp_path / "cache", revision="dev"))
    assert sorted(hub_server.list_files("tester/branched")) == [".gitattributes"]


def test_create_pr(xet_or_lfs: str, hub_server: HubServer, hub_api: HfApi, tmp_path: Path) -> None:
    """create_pr=True commits to refs/pr/1 and returns its URL; main is untouched; the PR is downloadable."""
    folder = _make_folder(tmp_path, big=os.urandom(BIG))
    hub_api.create_repo("tester/with-pr")
    main_before = hub_server.refs("tester/with-pr")["main"]
    info = hub_api.upload_folder(
        repo_id="tester/with-pr", folder_path=folder, create_pr=True, commit_message="Add weights"
    )

    assert info.pr_url == f"{hub_server.endpoint}/tester/with-pr/discussions/1"
    assert hub_server.refs("tester/with-pr") == {"main": main_before, "refs/pr/1": info.oid}
    assert hub_server.commit_history("tester/with-pr", "refs/pr/1")[0]["title"] == "Add weights"
    _assert_same_tree(folder, _download(hub_server, "tester/with-pr", tmp_path / "cache", revision="refs/pr/1"))


def test_push_same_content_twice(xet_or_lfs: str, hub_server: HubServer, hub_api: HfApi, tmp_path: Path) -> None:
    """Pushing unchanged content again makes no new commit and sends no blob bytes."""
    folder = _make_folder(tmp_path, big=os.urandom(BIG))
    hub_api.create_repo("tester/idempotent")
    first = hub_api.upload_folder(repo_id="tester/idempotent", folder_path=folder)
    blob_calls = len(_calls(hub_server, "POST", "/v1/xorbs/") + _calls(hub_server, "PUT", "/_lfs/"))
    second = hub_api.upload_folder(repo_id="tester/idempotent", folder_path=folder)

    assert second.oid == first.oid
    assert len(hub_server.commit_history("tester/idempotent")) == 2
    assert len(_calls(hub_server, "POST", "/v1/xorbs/") + _calls(hub_server, "PUT", "/_lfs/")) == blob_calls


def test_network_cut_during_blob_upload_is_retried(
    xet_or_lfs: str, hub_server: HubServer, hub_api: HfApi, tmp_path: Path
) -> None:
    """A connection reset in the middle of a blob upload is retried by the client and the push lands."""
    folder = _make_folder(tmp_path, big=os.urandom(BIG))
    hub_api.create_repo("tester/flaky")
    fault = hub_server.drop_connection_on(
        lambda r: (r.method == "POST" and "/v1/xorbs/" in r.path) or (r.method == "PUT" and "/_lfs/" in r.path)
    )
    info = hub_api.upload_folder(repo_id="tester/flaky", folder_path=folder)

    assert fault.hits == 1
    assert hub_server.refs("tester/flaky")["main"] == info.oid
    assert hub_server.read_file("tester/flaky", "weights.bin") == (folder / "weights.bin").read_bytes()


def test_network_cut_on_commit_stores_nothing(
    xet_disabled: None, hub_server: HubServer, hub_api: HfApi, tmp_path: Path
) -> None:
    """A connection reset while the commit is sent makes the client raise; no commit is recorded."""
    hub_api.create_repo("tester/cut")
    fault = hub_server.drop_connection_on(lambda r: "/commit/" in r.path)
    with pytest.raises(httpx2.TransportError):  # create_commit does not retry the commit POST
        hub_api.upload_folder(repo_id="tester/cut", folder_path=_make_folder(tmp_path, big=os.urandom(BIG)))
    assert fault.hits == 1
    assert [c["title"] for c in hub_server.commit_history("tester/cut")] == ["initial commit"]


def test_unsupported_routes_answer_4xx_and_keep_the_connection(hub_server: HubServer, hub_api: HfApi) -> None:
    """Unknown routes get a 4xx (never a 5xx) and the request body is drained for keep-alive."""
    hub_api.create_repo("tester/routes")
    conn = http.client.HTTPConnection("127.0.0.1", hub_server.port, timeout=10)
    try:
        conn.request(
            "POST",
            "/api/models/tester/routes/not-a-route",
            body=b"x" * 100_000,
            headers={"Authorization": f"Bearer {DEFAULT_TOKEN}"},
        )
        first = conn.getresponse()
        first.read()
        conn.request("HEAD", "/tester/routes/resolve/main/missing.txt")
        second = conn.getresponse()
        second.read()
    finally:
        conn.close()
    assert first.status == 404
    assert second.status == 404 and second.getheader("X-Error-Code") == "EntryNotFound"
    assert second.getheader("X-Repo-Commit") == hub_server.refs("tester/routes")["main"]
