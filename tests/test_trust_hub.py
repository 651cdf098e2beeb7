"""push_to_hub trust defects (issue 15): stale weights on re-push, arguments checked before any Hub call,
``--token`` on the command line, symlinks leaving a converted folder. Local Hub server, real client."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES
from hub_server import DEFAULT_TOKEN, HubServer
from huggingface_hub import snapshot_download
from safetensors.torch import save_file

from zeroio import push_to_hub
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError, CheckpointNotFoundError

pytest_plugins = ["hub_fixtures"]

ZERO_FIXTURE = FIXTURES / "z3_ws2_fp32"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture(params=["xet", "lfs"])
def xet_or_lfs(request: pytest.FixtureRequest, hub_server: HubServer) -> str:
    if request.param == "lfs":
        request.getfixturevalue("xet_disabled")
    return str(request.param)


def _push(src: Path, repo_id: str, server: HubServer, **kwargs: object):  # type: ignore[no-untyped-def]
    kwargs.setdefault("token", DEFAULT_TOKEN)
    return push_to_hub(src, repo_id, endpoint=server.endpoint, progress=False, **kwargs)  # type: ignore[arg-type]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"emb.weight": torch.randn(64, 32, generator=gen), "out.bias": torch.randn(64, generator=gen)}


def _single(root: Path, seed: int) -> Path:
    folder = root / f"single-{seed}"
    folder.mkdir()
    save_file(_tensors(seed), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _sharded(root: Path, seed: int) -> Path:
    folder = root / f"sharded-{seed}"
    folder.mkdir()
    tensors = _tensors(seed)
    save_file({"emb.weight": tensors["emb.weight"]}, folder / SHARDS[0], metadata={"format": "pt"})
    save_file({"out.bias": tensors["out.bias"]}, folder / SHARDS[1], metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {"emb.weight": SHARDS[0], "out.bias": SHARDS[1]}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _card_weights(card: str) -> list[str]:
    return [line[3:-1] for line in card.splitlines() if line.startswith("- `")]


# --------------------------------------------------------------------------- item 8: stale files on re-push


def test_sharded_over_single_file_deletes_the_old_weights(
    xet_or_lfs: str, hub_server: HubServer, tmp_path: Path
) -> None:
    """Sharded over single-file: model.safetensors is gone, the card lists exactly the shards on the Hub."""
    _push(_single(tmp_path, 1), "tester/relayout", hub_server)
    sharded = _sharded(tmp_path, 2)
    _push(sharded, "tester/relayout", hub_server)

    files = sorted(hub_server.list_files("tester/relayout"))
    assert files == [".gitattributes", "README.md", *SHARDS, "model.safetensors.index.json"]
    snapshot = Path(
        snapshot_download(
            "tester/relayout", endpoint=hub_server.endpoint, token=DEFAULT_TOKEN, cache_dir=tmp_path / "c"
        )
    )
    assert not (snapshot / "model.safetensors").exists()
    for name in SHARDS:
        assert (snapshot / name).read_bytes() == (sharded / name).read_bytes()
    card = hub_server.read_file("tester/relayout", "README.md").decode()
    assert _card_weights(card) == [f for f in files if f.endswith(".safetensors")]


def test_single_file_over_sharded_and_optimizer_deletes_shards_index_and_optimizer(
    hub_server: HubServer, tmp_path: Path
) -> None:
    """Single-file over sharded + zeroio optimizer files + torch .bin: only the new layout and other files stay."""
    old = _sharded(tmp_path, 1)
    for name in ("optimizer.safetensors", "optimizer.json", "pytorch_model.bin", "pytorch_model.bin.index.json"):
        (old / name).write_bytes(b"{}")
    (old / "notes.txt").write_text("kept: not a weight file")
    (old / "config.json").write_text('{"model_type": "toy"}')
    _push(old, "tester/shrink", hub_server)
    _push(_single(tmp_path, 2), "tester/shrink", hub_server)

    assert sorted(hub_server.list_files("tester/shrink")) == [
        ".gitattributes",
        "README.md",
        "config.json",
        "model.safetensors",
        "notes.txt",
    ]


def test_repush_of_the_same_content_still_makes_no_commit(hub_server: HubServer, tmp_path: Path) -> None:
    """Deleting the old layout must not turn an unchanged re-push into a commit."""
    folder = _sharded(tmp_path, 1)
    first = _push(folder, "tester/same", hub_server)
    second = _push(folder, "tester/same", hub_server)
    assert second.commit_oid == first.commit_oid == hub_server.refs("tester/same")["main"]


# --------------------------------------------------------------------------- item 9: validate before any Hub call


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_shard_size": "5XB"}, ValueError),
        ({"max_shard_size": 0}, ValueError),
        ({"dtype": "fp12"}, ValueError),
        ({"tag": "global_step999"}, CheckpointNotFoundError),
    ],
)
def test_bad_arguments_fail_before_any_hub_request(
    kwargs: dict[str, object], error: type[Exception], hub_server: HubServer
) -> None:
    with pytest.raises(error):
        _push(ZERO_FIXTURE, "tester/never", hub_server, **kwargs)
    assert hub_server.requests == []
    assert not hub_server.repo_exists("tester/never")


def test_unreadable_source_fails_before_any_hub_request(hub_server: HubServer, tmp_path: Path) -> None:
    """A folder that exists but is no checkpoint, and a converted folder with a broken file, never reach the Hub."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        _push(tmp_path / "empty", "tester/never", hub_server)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointFormatError):
        _push(broken, "tester/never", hub_server)
    assert hub_server.requests == []


def test_cli_bad_shard_size_exits_without_creating_the_repo(hub_server: HubServer, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_info:  # a usage error: argparse exits with 2
        main(
            [
                "push",
                str(ZERO_FIXTURE),
                "tester/cli-never",
                "--max-shard-size",
                "5XB",
                "--endpoint",
                hub_server.endpoint,
            ]
        )
    assert exit_info.value.code == 2
    assert "5XB" in capsys.readouterr().err
    assert hub_server.requests == []


# --------------------------------------------------------------------------- item 17: --token on the command line


def test_cli_token_flag_still_works_and_warns(hub_server: HubServer, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(
        ["push", str(_single(tmp_path, 1)), "tester/cli-token", "--token", DEFAULT_TOKEN,
         "--endpoint", hub_server.endpoint, "--quiet"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0 and hub_server.repo_exists("tester/cli-token")
    assert len(err.splitlines()) == 1 and err.startswith("warning: --token is visible to other users")
    assert DEFAULT_TOKEN not in err
    assert "HF_TOKEN" in err


def test_cli_token_from_environment_does_not_warn(
    hub_server: HubServer, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HF_TOKEN", DEFAULT_TOKEN)
    code = main(["push", str(_single(tmp_path, 1)), "tester/cli-env", "--endpoint", hub_server.endpoint, "--quiet"])
    assert code == 0
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- item 7: links leaving the folder


def test_links_leaving_a_converted_folder_are_not_uploaded(
    hub_server: HubServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config.json linking outside the folder (a secret) is skipped with a warning; links inside are followed."""
    secret = tmp_path / "secret-token"
    secret.write_text("hf_SECRET")
    folder = _single(tmp_path, 1)
    os.symlink(secret, folder / "config.json")
    (folder / "real_tokenizer.json").write_text('{"version": "1.0"}')
    os.symlink(folder / "real_tokenizer.json", folder / "tokenizer.json")

    with caplog.at_level(logging.WARNING, logger="zeroio"):
        result = _push(folder, "tester/linked", hub_server)

    assert "config.json" not in result.files
    assert sorted(hub_server.list_files("tester/linked")) == [
        ".gitattributes",
        "README.md",
        "model.safetensors",
        "real_tokenizer.json",
        "tokenizer.json",
    ]
    assert hub_server.read_file("tester/linked", "tokenizer.json") == b'{"version": "1.0"}'
    assert any("config.json" in r.getMessage() and "outside" in r.getMessage() for r in caplog.records)
    assert all(b"hf_SECRET" not in hub_server.read_file("tester/linked", f) for f in result.files)
