"""zeroio.load's implicit init hooks (issue 15): only a LightningModule's, and never random weights on a meta model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from zeroio import load
from zeroio.errors import StateDictMismatchError

pl = pytest.importorskip("lightning.pytorch")


def _net() -> nn.Module:
    return nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 4))


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A consolidated safetensors checkpoint of ``_net()`` held as ``self.net``."""
    torch.manual_seed(0)
    tensors = {f"net.{k}": v.clone() for k, v in _net().state_dict().items()}
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors", tensors


class PlainRebuilds(nn.Module):
    """A plain module with a ``configure_model`` that (re)builds its layers every time it is called."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.configured = 0

    def configure_model(self) -> None:
        self.configured += 1
        self.net = _net()


class PlainShell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.configured = 0

    def configure_model(self) -> None:
        self.configured += 1
        self.net = _net()


class LitHalfMeta(pl.LightningModule):
    """``emb`` built in ``__init__`` (on meta when constructed under meta), ``net`` built by ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.seen_devices: list[str] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = _net()
            self.seen_devices = sorted({p.device.type for p in self.net.parameters()})


class LitWithMetaPart(LitHalfMeta):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))


def _equal(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    for key, want in tensors.items():
        assert state[key].device.type == "cpu" and torch.equal(state[key], want), key


def test_plain_module_configure_model_is_not_called_implicitly(ckpt) -> None:  # type: ignore[no-untyped-def]
    """A plain nn.Module is never mutated by an implicit hook: its built layers stay the same objects."""
    path, tensors = ckpt
    model = PlainRebuilds()
    layers = list(model.net)
    report = load(path, model)
    assert model.configured == 0 and report.hooks_called == ()
    assert list(model.net) == layers
    _equal(model, tensors)


def test_plain_shell_needs_an_explicit_hook(ckpt) -> None:  # type: ignore[no-untyped-def]
    path, tensors = ckpt
    with pytest.raises(StateDictMismatchError):
        load(path, PlainShell())
    model = PlainShell()
    report = load(path, model, init_hook=lambda m: m.configure_model())
    assert model.configured == 1 and len(report.hooks_called) == 1
    _equal(model, tensors)


def test_lightning_module_hook_runs_on_meta_when_the_model_is_on_meta(ckpt) -> None:  # type: ignore[no-untyped-def]
    """A LightningModule built on meta gets its configure_model layers on meta too: no random CPU weights first."""
    path, tensors = ckpt
    with torch.device("meta"):
        model = LitWithMetaPart()
    assert model.scale.is_meta
    report = load(path, model, strict=False)
    assert report.hooks_called == ("configure_model",)
    assert model.seen_devices == ["meta"]
    _equal(model, tensors)


def test_explicit_hook_on_a_meta_model_builds_on_meta(ckpt) -> None:  # type: ignore[no-untyped-def]
    path, tensors = ckpt
    with torch.device("meta"):
        model = PlainShell()
        model.scale = nn.Parameter(torch.ones(()))
    devices: list[str] = []

    def build(m: nn.Module) -> None:
        m.net = _net()
        devices.extend(sorted({p.device.type for p in m.net.parameters()}))

    load(path, model, init_hook=build, strict=False)
    assert devices == ["meta"]
    _equal(model, tensors)


def test_lightning_module_on_cpu_builds_on_cpu(ckpt) -> None:  # type: ignore[no-untyped-def]
    path, tensors = ckpt
    model = LitWithMetaPart()
    load(path, model, strict=False)
    assert model.seen_devices == ["cpu"]
    _equal(model, tensors)
