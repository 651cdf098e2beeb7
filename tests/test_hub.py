"""push_to_hub against the local Hub-protocol server, through the real huggingface_hub client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
import torch
import yaml
from fixture_data import FIXTURES
from hub_server import DEFAULT_TOKEN, READ_ONLY_TOKEN, HubServer
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError
from safetensors.torch import load_file, save_file

from zeroio import PushResult, convert, push_to_hub
from zeroio.errors import HubError

pytest_plugins = ["hub_fixtures"]

ZERO_FIXTURE = FIXTURES / "z3_ws2_fp32"  # a real DeepSpeed 0.19.8 ZeRO-3 checkpoint, world size 2, fp32
TOKENIZER_FILES = {
    "config.json": '{"model_type": "toy", "architectures": ["ToyModel"]}',
    "generation_config.json": '{"max_new_tokens": 8}',
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"model_max_length": 16}',
    "special_tokens_map.json": '{"eos_token": "</s>"}',
}


@pytest.fixture(params=["xet", "lfs"])
def xet_or_lfs(request: pytest.FixtureRequest, hub_server: HubServer) -> str:
    """Run a test on the client's default Xet upload path and on the LFS path (Xet disabled)."""
    if request.param == "lfs":
        request.getfixturevalue("xet_disabled")
    return str(request.param)


def _converted_folder(root: Path, *, sharded: bool = False, seed: int = 0) -> Path:
    """A folder as zeroio.convert writes it, made with safetensors itself."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"emb.weight": torch.randn(256, 128, generator=gen), "out.bias": torch.randn(256, generator=gen)}
    folder = root / f"converted-{seed}"
    folder.mkdir(parents=True)
    if not sharded:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file({"emb.weight": tensors["emb.weight"]}, folder / names[0], metadata={"format": "pt"})
    save_file({"out.bias": tensors["out.bias"]}, folder / names[1], metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {"emb.weight": names[0], "out.bias": names[1]}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def _snapshot(server: HubServer, repo_id: str, cache: Path, revision: str | None = None) -> Path:
    return Path(
        snapshot_download(repo_id, endpoint=server.endpoint, token=DEFAULT_TOKEN, cache_dir=cache, revision=revision)
    )


def _push(src: Path, repo_id: str, server: HubServer, **kwargs: object) -> PushResult:
    kwargs.setdefault("token", DEFAULT_TOKEN)
    return push_to_hub(src, repo_id, endpoint=server.endpoint, progress=False, **kwargs)  # type: ignore[arg-type]


def _titles(server: HubServer, repo_id: str, revision: str = "main") -> list[str]:
    return [c["title"] for c in server.commit_history(repo_id, revision)]


def _trainer_checkpoint(root: Path) -> Path:
    """An HF Trainer ``checkpoint-2/``: the DeepSpeed checkpoint plus config and tokenizer files beside it."""
    ckpt = root / "checkpoint-2"
    shutil.copytree(ZERO_FIXTURE, ckpt, ignore=shutil.ignore_patterns("expected", "manifest.json"))
    for name, text in TOKENIZER_FILES.items():
        (ckpt / name).write_text(text)
    return ckpt


# --------------------------------------------------------------------------- round trips


def test_push_converted_folder_round_trip(xet_or_lfs: str, hub_server: HubServer, tmp_path: Path) -> None:
    """A converted folder is uploaded as is, with a model card, and downloads byte-identical."""
    folder = _converted_folder(tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    result = _push(folder, "tester/converted", hub_server)

    head = hub_server.refs("tester/converted")["main"]
    assert result == PushResult(
        repo_id="tester/converted",
        revision="main",
        commit_url=f"{hub_server.endpoint}/tester/converted/commit/{head}",
        commit_oid=head,
        pr_url=None,
        files=("README.md", "model.safetensors"),
    )
    snapshot = _snapshot(hub_server, "tester/converted", tmp_path / "cache")
    assert (snapshot / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert (snapshot / "README.md").read_text().startswith("---\nlibrary_name: pytorch\n")
    assert sorted(p.name for p in folder.iterdir()) == before  # the user's folder is never written to
    uploaded = "/v1/xorbs/" if xet_or_lfs == "xet" else "/_lfs/upload/"
    assert any(uploaded in path for _, path, _ in hub_server.requests)


def test_push_sharded_folder(hub_server: HubServer, tmp_path: Path) -> None:
    """A sharded folder (index + shards) is recognised as converted and pushed whole."""
    folder = _converted_folder(tmp_path, sharded=True)
    result = _push(folder, "tester/sharded", hub_server)
    assert result.files == (
        "README.md",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    )
    snapshot = _snapshot(hub_server, "tester/sharded", tmp_path / "cache")
    for name in result.files[1:]:
        assert (snapshot / name).read_bytes() == (folder / name).read_bytes()


def test_push_raw_zero_checkpoint(xet_or_lfs: str, hub_server: HubServer, tmp_path: Path) -> None:
    """A DeepSpeed ZeRO checkpoint is converted on the fly; the Hub gets exactly what convert writes."""
    result = _push(ZERO_FIXTURE, "tester/from-zero", hub_server)
    local = convert(ZERO_FIXTURE, tmp_path / "local", progress=False)

    assert result.files == ("README.md", "model.safetensors")
    snapshot = _snapshot(hub_server, "tester/from-zero", tmp_path / "cache")
    assert (snapshot / "model.safetensors").read_bytes() == local.files[0].read_bytes()
    expected = torch.load(ZERO_FIXTURE / "expected" / "zero_to_fp32.pt", weights_only=True)
    for name, tensor in load_file(snapshot / "model.safetensors").items():
        assert torch.equal(tensor, expected[name]), name
    assert (
        _titles(hub_server, "tester/from-zero")[0]
        == "Upload DeepSpeed ZeRO checkpoint global_step2 converted with zeroio"
    )


def test_cli_push_of_a_zero_checkpoint_imports_no_torch(hub_server: HubServer, tmp_path: Path) -> None:
    """``zeroio push`` converts a ZeRO checkpoint without torch (issue 17: the conversion needs no arithmetic) and
    uploads what ``convert`` writes; ``python -X importtime`` lists every module the command imported."""
    env = {**os.environ, "HF_ENDPOINT": hub_server.endpoint, "HF_TOKEN": DEFAULT_TOKEN, "HF_HUB_DISABLE_XET": "1"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "zeroio", "push", str(ZERO_FIXTURE), "tester/no-torch", "--quiet"],
        capture_output=True, text=True, env=env, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "huggingface_hub" in imported  # the log covers the upload
    assert [m for m in imported if m.split(".")[0] == "torch"] == []
    local = convert(ZERO_FIXTURE, tmp_path / "local", progress=False)
    assert hub_server.read_file("tester/no-torch", "model.safetensors") == local.files[0].read_bytes()


@pytest.mark.parametrize("layout", ["root", "tag-folder"])
def test_push_trainer_checkpoint_takes_config_and_tokenizer(layout: str, hub_server: HubServer, tmp_path: Path) -> None:
    """config.json, generation_config.json and tokenizer files beside global_stepN/ are pushed too."""
    ckpt = _trainer_checkpoint(tmp_path)
    src = ckpt if layout == "root" else ckpt / "global_step2"
    result = _push(src, "tester/trainer", hub_server)

    assert result.files == tuple(sorted(["README.md", "model.safetensors", *TOKENIZER_FILES]))
    snapshot = _snapshot(hub_server, "tester/trainer", tmp_path / "cache")
    for name, text in TOKENIZER_FILES.items():
        assert (snapshot / name).read_text() == text
    card = (snapshot / "README.md").read_text()
    assert "library_name: transformers" in card and 'AutoModel.from_pretrained("tester/trainer")' in card


def test_push_same_content_twice_makes_one_commit(xet_or_lfs: str, hub_server: HubServer) -> None:
    """Pushing the same checkpoint again creates no commit and returns the current head."""
    first = _push(ZERO_FIXTURE, "tester/twice", hub_server)
    second = _push(ZERO_FIXTURE, "tester/twice", hub_server)
    assert second.commit_oid == first.commit_oid == hub_server.refs("tester/twice")["main"]
    assert len(_titles(hub_server, "tester/twice")) == 2  # "initial commit" + the push


def test_push_private_repo(hub_server: HubServer, tmp_path: Path) -> None:
    """private=True creates a private repo that anonymous clients cannot see."""
    _push(_converted_folder(tmp_path), "tester/secret", hub_server, private=True)
    assert HfApi(endpoint=hub_server.endpoint, token=DEFAULT_TOKEN).model_info("tester/secret").private is True
    with pytest.raises(HfHubHTTPError):
        HfApi(endpoint=hub_server.endpoint, token=False).model_info("tester/secret")


# --------------------------------------------------------------------------- authentication


@pytest.mark.parametrize("source", ["HF_TOKEN", "saved-login"])
def test_token_and_endpoint_come_from_the_environment(
    source: str, hub_server: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With token=None and endpoint=None, HF_TOKEN or the saved login and HF_ENDPOINT are used."""
    from huggingface_hub import constants

    if source == "HF_TOKEN":
        monkeypatch.setenv("HF_TOKEN", DEFAULT_TOKEN)
    else:
        token_path = tmp_path / "login" / "token"
        token_path.parent.mkdir()
        token_path.write_text(DEFAULT_TOKEN)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(token_path))
    # hub_server points HF_ENDPOINT (the constant read at import) at the local server.
    result = push_to_hub(_converted_folder(tmp_path), "tester/ambient", progress=False)
    assert result.commit_oid == hub_server.refs("tester/ambient")["main"]


@pytest.mark.parametrize("case", ["wrong", "missing", "read-only"])
def test_bad_token_raises_hub_error_and_stores_nothing(case: str, hub_server: HubServer, tmp_path: Path) -> None:
    """A wrong, missing or read-only token raises HubError saying what to do; nothing reaches the server."""
    folder = _converted_folder(tmp_path)
    token = {"wrong": "hf_wrong_token_1234", "missing": None, "read-only": READ_ONLY_TOKEN}[case]
    where = f"'tester/denied' at {hub_server.endpoint}"
    expected = {
        "wrong": (
            f"The Hub rejected the token while pushing to {where} (HTTP 401): it is invalid or expired. Create a "
            "token with write access at https://huggingface.co/settings/tokens and pass it as token=..., set "
            "HF_TOKEN, or run `hf auth login`."
        ),
        "missing": (
            f"Cannot push to {where} without a token (HTTP 401). No Hugging Face token was found. Pass "
            "token='hf_...' (a token with write access), set HF_TOKEN, or run `hf auth login`."
        ),
        "read-only": (
            f"The token cannot write to {where} (HTTP 403). Use a token with the 'write' role, or a fine-grained "
            "token allowed to write to the namespace 'tester'."
        ),
    }[case]
    with pytest.raises(HubError) as err:
        push_to_hub(folder, "tester/denied", token=token, endpoint=hub_server.endpoint, progress=False)

    assert str(err.value) == expected
    assert isinstance(err.value.__cause__, HfHubHTTPError)
    assert (err.value.name, err.value.path, err.value.found) == (
        "tester/denied",
        folder,
        403 if token == READ_ONLY_TOKEN else 401,
    )
    assert token is None or token not in str(err.value)
    assert not hub_server.repo_exists("tester/denied")


def test_cli_convert_push_to_hub_asks_the_hub_before_converting(hub_server: HubServer, tmp_path: Path) -> None:
    """``zeroio convert SRC DST --push-to-hub REPO`` with a wrong token fails on the Hub's answer before anything is
    converted (DST is never created); with a good token it converts, then pushes what it wrote."""
    env = {**os.environ, "HF_ENDPOINT": hub_server.endpoint, "HF_HUB_DISABLE_XET": "1"}
    cmd = [sys.executable, "-m", "zeroio", "convert", str(ZERO_FIXTURE), str(tmp_path / "out"), "--quiet",
           "--push-to-hub", "tester/early"]  # fmt: skip
    denied = subprocess.run(cmd, capture_output=True, text=True, env={**env, "HF_TOKEN": "hf_wrong_token_1234"},
                            check=False, timeout=120)  # fmt: skip
    assert denied.returncode == 1, denied.stderr
    assert "The Hub rejected the token while pushing to 'tester/early'" in denied.stderr
    assert "hf_wrong_token_1234" not in denied.stderr
    assert not (tmp_path / "out").exists() and not hub_server.repo_exists("tester/early")
    pushed = subprocess.run(cmd, capture_output=True, text=True, env={**env, "HF_TOKEN": DEFAULT_TOKEN}, check=False,
                            timeout=120)  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    written = tmp_path / "out" / "model.safetensors"
    assert hub_server.read_file("tester/early", "model.safetensors") == written.read_bytes()


def test_create_hub_repo_checks_the_token_and_makes_repo_and_branch(hub_server: HubServer) -> None:
    """zeroio.create_hub_repo: a wrong token raises HubError and creates nothing; a good one creates the repo and
    the branch (the first step of push_to_hub, for scripts that convert before pushing)."""
    from zeroio import create_hub_repo

    with pytest.raises(HubError, match="rejected the token") as err:
        create_hub_repo("tester/first", token="hf_wrong_token_1234", endpoint=hub_server.endpoint)
    assert err.value.name == "tester/first" and err.value.found == 401
    assert not hub_server.repo_exists("tester/first")
    create_hub_repo("tester/first", token=DEFAULT_TOKEN, endpoint=hub_server.endpoint, revision="bf16")
    assert hub_server.repo_exists("tester/first") and "bf16" in hub_server.refs("tester/first")


# --------------------------------------------------------------------------- network cuts


def test_network_cut_during_blob_upload_is_retried(xet_or_lfs: str, hub_server: HubServer, tmp_path: Path) -> None:
    """A connection reset mid-upload is retried; the commit push_to_hub reports is the one on the server."""
    folder = _converted_folder(tmp_path)
    fault = hub_server.drop_connection_on(
        lambda r: (r.method == "POST" and "/v1/xorbs/" in r.path) or (r.method == "PUT" and "/_lfs/" in r.path)
    )
    result = _push(folder, "tester/flaky", hub_server)
    assert fault.hits == 1
    assert result.commit_oid == hub_server.refs("tester/flaky")["main"]
    assert hub_server.read_file("tester/flaky", "model.safetensors") == (folder / "model.safetensors").read_bytes()


def test_network_cut_on_commit_raises_hub_error(xet_disabled: None, hub_server: HubServer, tmp_path: Path) -> None:
    """A connection reset while committing raises HubError (the client does not retry it); no commit exists."""
    hub_server.drop_connection_on(lambda r: "/commit/" in r.path)
    with pytest.raises(HubError, match=r"^Could not reach the Hub at .* Check the network connection") as err:
        _push(_converted_folder(tmp_path), "tester/cut", hub_server)
    assert isinstance(err.value.__cause__, httpx2.TransportError)
    assert _titles(hub_server, "tester/cut") == ["initial commit"]


def test_lost_commit_answer_never_claims_a_missing_commit(
    xet_or_lfs: str, hub_server: HubServer, tmp_path: Path
) -> None:
    """If the commit's answer is lost, push_to_hub raises (LFS) or reports the commit the server holds (Xet)."""
    fault = hub_server.drop_connection_on(lambda r: "/commit/" in r.path, after_response=True)
    if xet_or_lfs == "lfs":  # create_commit does not retry the commit POST: the error surfaces
        with pytest.raises(HubError) as err:
            _push(_converted_folder(tmp_path), "tester/lost-answer", hub_server)
        assert isinstance(err.value.__cause__, httpx2.TransportError)
    else:  # the Xet pipeline retries the commit POST, so the server may hold a duplicate commit
        result = _push(_converted_folder(tmp_path), "tester/lost-answer", hub_server)
        assert result.commit_oid == hub_server.refs("tester/lost-answer")["main"]
    assert fault.hits == 1


# --------------------------------------------------------------------------- branches and pull requests


def test_push_to_branch(xet_or_lfs: str, hub_server: HubServer, tmp_path: Path) -> None:
    """revision='dev' creates the branch from main on first push and commits to it; main is untouched."""
    first = _push(_converted_folder(tmp_path, seed=1), "tester/branchy", hub_server, revision="dev")
    main = hub_server.refs("tester/branchy")["main"]
    second = _push(_converted_folder(tmp_path, seed=2), "tester/branchy", hub_server, revision="dev")

    assert (first.revision, second.revision) == ("dev", "dev")
    assert hub_server.refs("tester/branchy") == {"main": main, "dev": second.commit_oid}
    assert [c["oid"] for c in hub_server.commit_history("tester/branchy", "dev")][:2] == [
        second.commit_oid,
        first.commit_oid,
    ]
    assert sorted(hub_server.list_files("tester/branchy")) == [".gitattributes"]


def test_push_create_pr_then_add_to_it(xet_or_lfs: str, hub_server: HubServer, tmp_path: Path) -> None:
    """create_pr=True opens refs/pr/1; revision='refs/pr/1' adds a commit to it; main is untouched."""
    opened = _push(_converted_folder(tmp_path, seed=1), "tester/reviewed", hub_server, create_pr=True)
    main = hub_server.refs("tester/reviewed")["main"]
    added = _push(_converted_folder(tmp_path, seed=2), "tester/reviewed", hub_server, revision="refs/pr/1")

    assert (opened.revision, opened.pr_url) == ("refs/pr/1", f"{hub_server.endpoint}/tester/reviewed/discussions/1")
    assert (added.revision, added.pr_url) == ("refs/pr/1", None)
    assert hub_server.refs("tester/reviewed") == {"main": main, "refs/pr/1": added.commit_oid}
    snapshot = _snapshot(hub_server, "tester/reviewed", tmp_path / "cache", revision="refs/pr/1")
    expected = (tmp_path / "converted-2" / "model.safetensors").read_bytes()
    assert (snapshot / "model.safetensors").read_bytes() == expected


def test_missing_pull_request_raises_hub_error(hub_server: HubServer, tmp_path: Path) -> None:
    """revision='refs/pr/7' on a repo without that pull request raises HubError naming the revision."""
    with pytest.raises(HubError) as err:
        _push(_converted_folder(tmp_path), "tester/no-pr", hub_server, revision="refs/pr/7")
    assert str(err.value) == (
        f"Revision 'refs/pr/7' does not exist in 'tester/no-pr' at {hub_server.endpoint}. Pass an existing branch "
        "(new branches are created from main), or 'refs/pr/N' of an open pull request."
    )
    assert isinstance(err.value.__cause__, RevisionNotFoundError)


def test_create_pr_with_revision_is_refused_before_any_request(hub_server: HubServer, tmp_path: Path) -> None:
    """create_pr=True with a branch revision raises ValueError without contacting the Hub."""
    with pytest.raises(ValueError) as err:
        _push(_converted_folder(tmp_path), "tester/x", hub_server, create_pr=True, revision="dev")
    assert str(err.value) == (
        "create_pr=True opens a pull request against 'main', so it cannot be combined with revision='dev'. Drop "
        "revision to open a pull request, or pass revision='refs/pr/N' without create_pr to add a commit to an "
        "open pull request."
    )
    assert hub_server.requests == []


# --------------------------------------------------------------------------- model card


def test_model_card_for_converted_folder_is_generic(hub_server: HubServer, tmp_path: Path) -> None:
    """Without conversion facts the card has the front matter, a generic line, the files and a usage snippet."""
    pushed = _push(_converted_folder(tmp_path), "tester/toy", hub_server)  # a converted folder: no facts
    assert sorted(pushed.files) == ["README.md", "model.safetensors"]
    card = hub_server.read_file("tester/toy", "README.md").decode()
    assert card == (
        "---\n"
        "library_name: pytorch\n"
        "tags:\n"
        "- deepspeed\n"
        "- zeroio\n"
        "- safetensors\n"
        "---\n"
        "\n"
        "# toy\n"
        "\n"
        "These weights were uploaded with [zeroio](https://pypi.org/project/zeroio/), a reader and converter for "
        "DeepSpeed ZeRO checkpoints.\n"
        "\n"
        "## Files\n"
        "\n"
        "- `model.safetensors`\n"
        "\n"
        "## Usage\n"
        "\n"
        "```python\n"
        "from huggingface_hub import snapshot_download\n"
        "from safetensors.torch import load_file\n"
        "\n"
        'folder = snapshot_download("tester/toy")\n'
        'state_dict = load_file(f"{folder}/model.safetensors")  # sharded: see model.safetensors.index.json\n'
        "```\n"
    )


def test_model_card_records_the_source_checkpoint(hub_server: HubServer, tmp_path: Path) -> None:
    """A pushed ZeRO checkpoint's card records DeepSpeed version, stage, world size, tag, step and dtypes."""
    _push(ZERO_FIXTURE, "tester/carded", hub_server)
    card = hub_server.read_file("tester/carded", "README.md").decode()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {"library_name": "pytorch", "tags": ["deepspeed", "zeroio", "safetensors"]}
    table = card[card.index("| Source checkpoint | |") : card.index("## Files")]
    assert table == (
        "| Source checkpoint | |\n"
        "|---|---|\n"
        "| ZeRO stage | 3 |\n"
        "| Data-parallel world size | 2 |\n"
        "| DeepSpeed version | `0.19.8` |\n"
        "| Tag | `global_step2` |\n"
        "| Global step | 2 |\n"
        "| Training dtype | fp32 |\n"
        "| Weights dtype | fp32 |\n"
        "| Parameters | 244 |\n"
        "\n"
    )


def test_existing_readme_is_kept_and_model_card_false_writes_none(hub_server: HubServer, tmp_path: Path) -> None:
    """A README.md already in the folder is pushed unchanged; model_card=False adds no README."""
    folder = _converted_folder(tmp_path)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# Mine\n")
    _push(folder, "tester/own-card", hub_server)
    assert hub_server.read_file("tester/own-card", "README.md") == b"---\nlicense: mit\n---\n# Mine\n"

    bare = _push(_converted_folder(tmp_path, seed=3), "tester/no-card", hub_server, model_card=False)
    assert bare.files == ("model.safetensors",)
    assert "README.md" not in hub_server.list_files("tester/no-card")
