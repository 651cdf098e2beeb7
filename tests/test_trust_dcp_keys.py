"""A DCP whose keys include ``model.``-prefixed names beside others (issue 30, item 5): a Hugging Face-style
``dcp.save`` (``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``) converted without
``lm_head.weight``. Now no tensor is dropped silently, the split is said, and ``dcp_keys`` (``--dcp-keys`` on
``inspect``, ``convert``, ``verify`` and ``push``) chooses."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hub_server import DEFAULT_TOKEN, DEFAULT_USER, HubServer
from safetensors.torch import load, load_file
from torch import nn

import zeroio
from zeroio.cli import main

pytest_plugins = ["hub_fixtures"]


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)


class _HFStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = nn.Linear(4, 11, bias=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A DCP written by torch's own ``dcp.save`` (one process) from a Hugging Face-style state dict."""
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in _HFStyle().state_dict().items()}
    folder = tmp_path_factory.mktemp("hf_dcp") / "ckpt"
    with warnings.catch_warnings():  # torch warns that no process group is initialised: one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder, state


def test_hf_style_dcp_converts_every_tensor_under_its_own_name(saved, tmp_path):
    folder, state = saved
    zeroio.convert(folder, tmp_path / "out", progress=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(out) == sorted(state)  # lm_head.weight included
    assert all(torch.equal(out[k], state[k]) for k in state)
    with zeroio.open(folder) as ckpt:
        assert ckpt.metadata.extra["other_tensors"] == []
        assert ckpt.metadata.extra["dcp_keys"] == (
            "names kept as stored: 1 tensor(s) outside 'model.' (first: 'lm_head.weight') are model tensors too "
            "(dcp_keys='auto')."
        )


def test_dcp_keys_model_strips_and_says_what_it_left_out(saved):
    folder, state = saved
    with zeroio.open(folder, dcp_keys="model") as ckpt:
        assert sorted(ckpt.keys()) == sorted(k[len("model.") :] for k in state if k.startswith("model."))
        assert ckpt.metadata.extra["other_tensors"] == ["lm_head.weight"]
        assert "1 tensor(s) left out as non-model state (first: 'lm_head.weight')" in ckpt.metadata.extra["dcp_keys"]


def test_bad_dcp_keys_is_a_value_error(saved):
    with pytest.raises(ValueError, match="dcp_keys must be one of 'auto', 'model', 'all'"):
        zeroio.open(saved[0], dcp_keys="strip")


def test_cli_dcp_keys_on_inspect_convert_and_verify(saved, tmp_path, capsys):
    """``--dcp-keys`` on the three verbs that read a DCP source (the Python API's ``dcp_keys=``)."""
    folder, state = saved
    model = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    assert main(["inspect", str(folder), "--json", "--dcp-keys", "model"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert sorted(t["name"] for t in described["tensors"]) == sorted(model)
    assert "1 tensor(s) left out as non-model state (first: 'lm_head.weight')" in described["metadata"]["dcp_keys"]
    assert main(["inspect", str(folder)]) == 0  # the text says how keys were split, in the flag's spelling
    assert "(--dcp-keys auto)." in capsys.readouterr().out
    assert main(["convert", str(folder), str(tmp_path / "model"), "--dcp-keys", "model", "--quiet"]) == 0
    out = load_file(tmp_path / "model" / "model.safetensors")
    assert sorted(out) == sorted(model) and all(torch.equal(out[k], model[k]) for k in model)
    assert main(["verify", str(folder), str(tmp_path / "model"), "--dcp-keys", "model"]) == 0
    assert main(["verify", str(folder), str(tmp_path / "model")]) == 1  # auto: every name as stored, 3 vs 2
    assert "missing" in capsys.readouterr().out
    assert zeroio.verify(folder, tmp_path / "model", dcp_keys="model").ok


def test_cli_dcp_keys_all_keeps_every_name(saved, tmp_path, capsys):
    folder, state = saved
    assert main(["convert", str(folder), str(tmp_path / "all"), "--dcp-keys", "all", "--quiet"]) == 0
    assert sorted(load_file(tmp_path / "all" / "model.safetensors")) == sorted(state)
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(folder), "--dcp-keys", "strip"])
    assert exit_info.value.code == 2
    assert (
        "argument --dcp-keys: invalid choice: 'strip' (choose from 'auto', 'model', 'all')" in capsys.readouterr().err
    )


def test_push_dcp_keys(saved, hub_server: HubServer, tmp_path, monkeypatch, capsys):
    """``zeroio push --dcp-keys`` and ``push_to_hub(dcp_keys=)`` upload what ``convert`` writes with the same choice."""
    folder, state = saved
    model = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    monkeypatch.setenv("HF_TOKEN", DEFAULT_TOKEN)
    repo = f"{DEFAULT_USER}/dcp-keys"
    assert main(["push", str(folder), repo, "--endpoint", hub_server.endpoint, "--dcp-keys", "model", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    pushed = load(hub_server.read_file(repo, "model.safetensors"))
    assert sorted(pushed) == sorted(model) and all(torch.equal(pushed[k], model[k]) for k in model)
    zeroio.convert(folder, tmp_path / "model", dcp_keys="model", progress=False)
    assert hub_server.read_file(repo, "model.safetensors") == (tmp_path / "model" / "model.safetensors").read_bytes()

    zeroio.push_to_hub(folder, repo, endpoint=hub_server.endpoint, progress=False, dcp_keys="all")
    pushed = load(hub_server.read_file(repo, "model.safetensors"))
    assert sorted(pushed) == sorted(state) and all(torch.equal(pushed[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="dcp_keys must be one of 'auto', 'model', 'all'"):
        zeroio.push_to_hub(folder, repo, endpoint=hub_server.endpoint, progress=False, dcp_keys="strip")
