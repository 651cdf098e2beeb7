"""zeroio.load: every fixture into models built normally, on meta, or by an init hook; errors; keys; devices."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES, fixture_names, manifest, reference
from no_blocking import refused_without_blocking
from torch import nn

import zeroio
from zeroio import LoadReport, load
from zeroio.errors import InitHookError, StateDictMismatchError, ZeroIOError

MODES = ["normal", "meta", "hook"]


# --------------------------------------------------------------------------- the fixtures' models


@functools.cache
def _script(filename: str):
    """A fixture generator script (fixtures/generate*.py) as a module: the models are taken from it, not copied."""
    name = f"zeroio_fixtures_{Path(filename).stem}"
    spec = importlib.util.spec_from_file_location(name, FIXTURES / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build(name: str = "z3_ws2_fp32", **kwargs) -> nn.Module:
    """A TinyLM-family fixture's model with fresh random weights, from fixtures/generate.py's own builder.

    An expert-parallel MoE fixture is deployed as one process holding every expert, so it is built with ep_size=1.
    """
    gen = _script("generate.py")
    cfg = dict(gen.FIXTURES.get(name, {}))
    if cfg.get("model") == "moe":
        cfg["ep_size"] = 1
    model = gen._build_model(cfg)
    return type(model)(**kwargs) if kwargs else model


def _empty(cls: type) -> nn.Module:
    """An instance of ``cls`` with no layers, parameters or buffers: only nn.Module's own bookkeeping."""
    shell = cls.__new__(cls)
    nn.Module.__init__(shell)
    return shell


@dataclass
class Case:
    """How to build, load and run one fixture's model."""

    name: str
    path: Path
    """What zeroio.load is given: the DeepSpeed checkpoint root."""
    make: Callable[[str], tuple[nn.Module, Callable[[nn.Module], None] | None]]
    """mode -> (model, init_hook) for normal, meta and hook builds."""
    run: Callable[[nn.Module], torch.Tensor] | None
    """A deterministic forward pass, or None where the model cannot run outside DeepSpeed (MoE all-to-all)."""

    @property
    def expected(self) -> dict[str, torch.Tensor]:
        """The truth: the live engine's tensors, else DeepSpeed's consolidation."""
        return reference(self.name, "engine") or reference(self.name)


def _tinylm_case(name: str) -> Case:
    def make(mode: str):
        if mode == "normal":
            return build(name), None
        if mode == "meta":
            with torch.device("meta"):
                return build(name), None
        cls = type(build(name))
        calls: list[nn.Module] = []

        def hook(model: nn.Module) -> None:  # builds TinyLM's layers inside an empty instance
            calls.append(model)
            cls.__init__(model)

        hook.calls = calls  # type: ignore[attr-defined]
        return _empty(cls), hook

    ids = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(7))
    run = None if manifest(name).get("model") == "moe" else (lambda model: model(ids))
    return Case(name, FIXTURES / name, make, run)


def _lightning_case(name: str) -> Case:
    gen = _script("generate_frameworks.py")
    cls = gen.lightning_module_class()

    def make(mode: str):
        if mode == "hook":
            return cls(), None  # layers appear only in configure_model, which zeroio.load runs by default
        with torch.device("meta" if mode == "meta" else "cpu"):
            module = cls()
            module.configure_model()
        return module, None

    ids = gen.lightning_input_ids()
    return Case(name, FIXTURES / name / manifest(name)["checkpoint"], make, lambda model: model(ids))


def _transformers_case(name: str) -> Case:
    gen = _script("generate_frameworks.py")
    transformers = pytest.importorskip("transformers")
    config = gen.hf_config()
    cls = transformers.GPT2LMHeadModel

    def make(mode: str):
        if mode == "hook":
            return _empty(cls), lambda model: cls.__init__(model, config)
        with torch.device("meta" if mode == "meta" else "cpu"):
            return cls(config), None

    ids = gen.hf_input_ids()
    return Case(name, FIXTURES / name / manifest(name)["checkpoint"], make, lambda model: model.eval()(ids).logits)


def case(name: str) -> Case:
    """The Case of a fixture, by the generator that made it."""
    framework = manifest(name).get("framework", "")
    if framework.startswith("lightning"):
        return _lightning_case(name)
    if framework.startswith("transformers"):
        return _transformers_case(name)
    if name in _script("generate.py").FIXTURES:
        return _tinylm_case(name)
    raise AssertionError(f"fixture {name!r}: test_load.py does not know how to build its model")


def make(name: str, mode: str):
    """(model, init_hook) of a fixture's model for a build mode."""
    return case(name).make(mode)


# DeepSpeed fixtures (fixtures/<name>/) and framework fixtures (fixtures/frameworks/<name>/), by their manifests.
ALL = fixture_names() + [f"frameworks/{p.parent.name}" for p in sorted(FIXTURES.glob("frameworks/*/manifest.json"))]
DEEPSPEED_READS = [n for n in ALL if not manifest(n).get("zero_to_fp32_fails")]
LIGHTNING = [n for n in ALL if manifest(n).get("framework", "").startswith("lightning")]


def assert_equals_engine(model: nn.Module, name: str, dtype: torch.dtype | None = None) -> None:
    """The model's state dict equals the fixture's truth exactly, in the model's dtypes (or ``dtype``)."""
    expected = case(name).expected
    actual = model.state_dict()
    assert list(actual) == list(expected)
    for key, want in expected.items():
        got = actual[key]
        assert got.device.type == "cpu", key
        if dtype is not None and want.is_floating_point():
            assert got.dtype == dtype, key
        assert torch.equal(got, want.to(got.dtype)), key
        if dtype is None:
            assert torch.equal(got.to(want.dtype), want), key  # lossless both ways: exactly the reference


def non_persistent(model: nn.Module) -> tuple[str, ...]:
    """Buffers that no checkpoint holds (a meta-built model keeps them on meta)."""
    keys = model.state_dict()
    return tuple(n for n, _ in model.named_buffers() if n not in keys)


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every registered tensor object and a copy of its values (None on meta)."""
    out = {}
    for key, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        out[key] = (t, None if t.is_meta else t.detach().clone())
    return out


def assert_untouched(model: nn.Module, before) -> None:
    """Same tensor objects, same values, same devices as in the snapshot."""
    after = snapshot(model)
    assert list(after) == list(before)
    for key, (tensor, values) in before.items():
        assert after[key][0] is tensor, key
        if values is None:
            assert tensor.is_meta, key
        else:
            assert torch.equal(tensor, values), key


# --------------------------------------------------------------------------- every fixture, every build mode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALL)
def test_loads_engine_values(name, mode):
    """Every fixture loads into a normal, a meta-device or a hook-built model to exactly the engine's tensors."""
    c = case(name)
    model, hook = c.make(mode)
    report = load(c.path, model, init_hook=hook)
    assert_equals_engine(model, name)
    with zeroio.open(c.path) as ckpt:
        ties = ckpt.tied
    assert ties and report.tied == ties
    params = dict(model.named_parameters(remove_duplicate=False))
    for alias, source in ties.items():
        assert params[alias] is params[source]
    fresh, _ = c.make("normal")
    if hook is None and mode != "normal":
        fresh = model if mode == "hook" else fresh
    assert {n: p.requires_grad for n, p in params.items()} == {
        n: p.requires_grad for n, p in fresh.named_parameters(remove_duplicate=False)
    }
    assert all(not p.is_meta for p in model.parameters())
    assert report.missing_keys == report.unexpected_keys == report.mismatched_shapes == ()
    assert report.loaded_keys == tuple(model.state_dict())
    assert report.meta_keys == (non_persistent(model) if mode == "meta" else ())
    assert report.metadata.format == "zero" and report.metadata.zero_stage == manifest(name)["stage"]
    if hook is not None:
        assert getattr(hook, "calls", [model]) == [model]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", DEEPSPEED_READS)
def test_matches_deepspeed_loader(name, mode):
    """The loaded model equals DeepSpeed's load_state_dict_from_zero_checkpoint on every key that loader returns.

    Where it returns every key, the forward outputs are equal bit for bit. DeepSpeed 0.19.8 drops ZeRO-1 frozen
    parameters and loads with strict=False, so its ZeRO-1 model keeps random frozen weights: there only the
    returned keys are compared (the dropped ones are checked against the engine in test_loads_engine_values).
    """
    from deepspeed.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    c = case(name)
    ds_model, _ = c.make("normal")
    ds_model = load_state_dict_from_zero_checkpoint(ds_model, str(c.path))
    returned = get_fp32_state_dict_from_zero_checkpoint(str(c.path))
    model, hook = c.make(mode)
    load(c.path, model, init_hook=hook)
    ours, theirs = model.state_dict(), ds_model.state_dict()
    for key in returned:
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key
    if set(returned) == set(ours):
        assert torch.equal(c.run(model), c.run(ds_model))
    else:
        assert manifest(name)["stage"] == 1
        assert sorted(set(ours) - set(returned)) == ["frozen.bias", "frozen.weight"]


@pytest.mark.parametrize("name", LIGHTNING)
def test_lightning_fixture_matches_lightning_loader(name):
    """A Lightning ZeRO-3 checkpoint loads into a LightningModule whose layers configure_model builds.

    The forward output equals the same module restored by Lightning's own load_from_checkpoint from Lightning's
    own conversion (expected/lightning_fp32.ckpt) bit for bit, and the recorded outputs up to float rounding
    (they were computed on the GPU machine's CPU).
    """
    c = case(name)
    module, _ = c.make("hook")
    report = load(c.path, module)
    assert report.hooks_called == ("configure_model",)
    cls = type(module)
    reference_module = cls.load_from_checkpoint(
        FIXTURES / name / "expected" / "lightning_fp32.ckpt", map_location="cpu", weights_only=True
    )
    assert torch.equal(c.run(module), c.run(reference_module))
    recorded = torch.load(FIXTURES / name / "expected" / "outputs.pt", weights_only=True)
    torch.testing.assert_close(c.run(module), recorded["outputs"], rtol=1e-5, atol=1e-5)
    # Lightning's own single-file conversion loads the same way.
    again, _ = c.make("hook")
    load(FIXTURES / name / "expected" / "lightning_fp32.ckpt", again)
    assert torch.equal(c.run(again), c.run(module))


@pytest.mark.parametrize("mode", MODES)
def test_dtype_casts_floating_tensors(mode):
    """dtype= casts every floating parameter and buffer (as model.to(dtype) would); integer buffers keep theirs."""
    name = "z3_ws2_bf16"
    model, hook = make(name, mode)
    load(FIXTURES / name, model, init_hook=hook, dtype="bf16")
    assert_equals_engine(model, name, dtype=torch.bfloat16)
    assert model.head.weight is model.emb.weight
    assert model.scale.dtype == torch.bfloat16 and model.calls.dtype == torch.int64
    assert not model.frozen.weight.requires_grad


def test_in_place_load_keeps_parameter_objects():
    """A normally built model is filled in place: the same Parameter objects and storage (optimizers stay valid)."""
    model = build()
    before = {k: (p, p.data_ptr()) for k, p in model.named_parameters()}
    load(FIXTURES / "z3_ws2_fp32", model)
    for key, p in model.named_parameters():
        assert p is before[key][0] and p.data_ptr() == before[key][1], key


def test_floating_buffer_keeps_model_dtype():
    """DeepSpeed returns floating buffers as fp32; with dtype=None they take the model buffer's dtype."""
    model = build()
    model.scale = model.scale.half()
    load(FIXTURES / "z3_ws2_fp16", model)
    assert model.scale.dtype == torch.float16
    assert torch.equal(model.scale, reference("z3_ws2_fp16", "engine")["scale"].half())


def test_meta_model_leftovers_are_reported(caplog):
    """Non-persistent buffers are in no checkpoint: on a meta model they stay meta, reported and logged."""
    with torch.device("meta"):
        model = build()
    with caplog.at_level(logging.WARNING, logger="zeroio"):
        report = load(FIXTURES / "z3_ws2_fp32", model)
    assert report.meta_keys == ("scratch",)
    assert model.scratch.is_meta
    assert caplog.messages == [
        (
            f"1 tensor(s) still on the meta device after loading '{FIXTURES / 'z3_ws2_fp32' / 'global_step2'}' "
            "(first: scratch): the checkpoint does not hold them (non-persistent buffers are never saved); set them "
            "before using the model"
        )
    ]


def test_progress_and_open_checkpoint():
    """An open Checkpoint is accepted and left open; progress ends at the checkpoint's total bytes."""
    calls = []
    with zeroio.open(FIXTURES / "z3_ws3_bf16") as ckpt:
        load(ckpt, build(), progress=lambda done, total: calls.append((done, total)))
        assert not ckpt.closed
        total = ckpt.total_bytes
    assert len(calls) == 10  # distinct tensors; the tied head is loaded through emb.weight
    assert calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_tag_selects_an_older_checkpoint():
    """tag= loads the named tag folder instead of the one in `latest`."""
    model = build()
    report = load(FIXTURES / "z3_ws2_fp32", model, tag="global_step1")
    assert report.metadata.tag == "global_step1"
    with zeroio.open(FIXTURES / "z3_ws2_fp32", tag="global_step1") as ckpt:
        assert torch.equal(model.mlp_in.weight, ckpt["mlp_in.weight"])


# --------------------------------------------------------------------------- consolidated inputs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["safetensors", "safetensors-hub", "torch"])
def test_loads_consolidated_files(tmp_path, fmt, mode):
    """safetensors (tie dropped, or recorded as huggingface_hub does) and torch.save files load through zeroio.load."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    name = "z2_ws2_bf16"
    ref = reference(name, "engine")
    if fmt == "safetensors":
        path = tmp_path / "model.safetensors"
        save_file({k: v for k, v in ref.items() if k != "head.weight"}, path)
    elif fmt == "safetensors-hub":
        save_torch_state_dict(ref, tmp_path)
        path = tmp_path
    else:
        path = tmp_path / "pytorch_model.bin"
        torch.save(ref, path)
    model, hook = make(name, mode)
    report = load(path, model, init_hook=hook)
    assert_equals_engine(model, name)
    assert model.head.weight is model.emb.weight
    assert report.missing_keys == ()
    assert report.loaded_keys[-1] == "head.weight" or "head.weight" in report.loaded_keys
    with zeroio.open(path) as ckpt:
        assert ckpt.metadata.format == ("torch" if fmt == "torch" else "safetensors")
        assert ckpt.tied == ({} if fmt == "safetensors" else {"head.weight": "emb.weight"})


def test_untied_model_from_tied_checkpoint():
    """A model whose head is not tied gets two tensors with equal values, not one shared storage."""
    model = build()
    model.head.weight = nn.Parameter(torch.zeros(13, 7))
    report = load(FIXTURES / "z3_ws2_fp32", model)
    assert model.head.weight is not model.emb.weight
    assert model.head.weight.data_ptr() != model.emb.weight.data_ptr()
    assert torch.equal(model.head.weight, model.emb.weight)
    assert report.tied == {}


# --------------------------------------------------------------------------- key normalisation


def _prefixed(tmp_path, prefix: str):
    from huggingface_hub import save_torch_state_dict

    ref = reference("z3_ws2_fp32", "engine")
    save_torch_state_dict({prefix + k: v for k, v in ref.items()}, tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "prefix", ["module.", "_forward_module.", "model.", "_forward_module.model.", "module.module."]
)
def test_wrapper_prefixes_are_stripped(tmp_path, prefix):
    """DeepSpeed's module., Lightning's _forward_module. and model. prefixes are stripped when that matches."""
    model = build()
    report = load(_prefixed(tmp_path, prefix), model)
    assert_equals_engine(model, "z3_ws2_fp32")
    assert report.renamed_keys == {prefix + k: k for k in reference("z3_ws2_fp32", "engine")}


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.model = inner


def test_prefix_added_for_a_wrapping_module():
    """A module holding the network as self.model loads a checkpoint of the bare network (model. added)."""
    wrapper = _Wrapper(build())
    report = load(FIXTURES / "z3_ws2_fp32", wrapper)
    assert_equals_engine(wrapper.model, "z3_ws2_fp32")
    assert report.renamed_keys["emb.weight"] == "model.emb.weight"


def test_prefix_kept_when_it_matches(tmp_path):
    """Keys that already match the model are never renamed, even if they start with a known prefix."""
    wrapper = _Wrapper(build())
    report = load(_prefixed(tmp_path, "model."), wrapper)
    assert_equals_engine(wrapper.model, "z3_ws2_fp32")
    assert report.renamed_keys == {}


def test_key_map_dict_and_callable_and_drop():
    """key_map renames keys (dict or callable); None drops a key, which is then neither loaded nor unexpected."""
    model = build()
    model.proj = model._modules.pop("mlp_in")
    report = load(
        FIXTURES / "z3_ws2_fp32",
        model,
        key_map={"mlp_in.weight": "proj.weight", "mlp_in.bias": "proj.bias"},
    )
    assert report.renamed_keys == {"mlp_in.weight": "proj.weight", "mlp_in.bias": "proj.bias"}
    assert torch.equal(model.proj.weight, reference("z3_ws2_fp32", "engine")["mlp_in.weight"])

    model = build()
    original = model.calls.clone()
    report = load(FIXTURES / "z3_ws2_fp32", model, key_map=lambda k: None if k == "calls" else k, strict=False)
    assert report.dropped_keys == ("calls",)
    assert report.missing_keys == ("calls",)
    assert report.unexpected_keys == ()
    assert torch.equal(model.calls, original)


def test_two_keys_for_one_model_key():
    """A key_map sending two checkpoint tensors to one model key is refused before loading anything."""
    model = build()
    before = snapshot(model)
    with pytest.raises(StateDictMismatchError) as exc:
        load(FIXTURES / "z3_ws2_fp32", model, key_map={"frozen.bias": "mlp_in.bias"})
    assert str(exc.value) == (
        f"Checkpoint keys 'frozen.bias' and 'mlp_in.bias' both map to model key 'mlp_in.bias' in "
        f"'{FIXTURES / 'z3_ws2_fp32' / 'global_step2'}'. Fix key_map so that each model key receives one tensor."
    )
    assert_untouched(model, before)


# --------------------------------------------------------------------------- strict errors leave the model untouched


@pytest.mark.parametrize("mode", ["normal", "meta"])
def test_strict_mismatch_lists_everything(mode):
    """strict=True reports missing, unexpected and size-mismatched keys at once, in torch's wording; nothing changes."""
    ctx = torch.device("meta") if mode == "meta" else torch.device("cpu")
    with ctx:
        model = build(vocab=14)
        model.proj = model._modules.pop("mlp_in")
        model.extra = nn.Linear(2, 2)
    before = snapshot(model)
    where = FIXTURES / "z3_ws2_fp32" / "global_step2"
    with pytest.raises(StateDictMismatchError) as exc:
        load(FIXTURES / "z3_ws2_fp32", model)
    assert str(exc.value) == (
        "Error(s) in loading state_dict for TinyLM:\n"
        '\tMissing key(s) in state_dict: "proj.weight", "proj.bias", "extra.weight", "extra.bias".\n'
        '\tUnexpected key(s) in state_dict: "mlp_in.weight", "mlp_in.bias".\n'
        "\tsize mismatch for emb.weight: copying a param with shape torch.Size([13, 7]) from checkpoint, the shape "
        "in current model is torch.Size([14, 7]).\n"
        "\tsize mismatch for head.weight: copying a param with shape torch.Size([13, 7]) from checkpoint, the shape "
        "in current model is torch.Size([14, 7]).\n"
        f"\tCheckpoint: '{where}'. No parameter was modified; pass strict=False to load the 7 matching tensors "
        "(the LoadReport lists the rest), or key_map= to rename keys."
    )
    err = exc.value
    assert err.missing_keys == ["proj.weight", "proj.bias", "extra.weight", "extra.bias"]
    assert err.unexpected_keys == ["mlp_in.weight", "mlp_in.bias"]
    assert err.mismatched_shapes == [("emb.weight", (13, 7), (14, 7)), ("head.weight", (13, 7), (14, 7))]
    assert err.path == where
    assert_untouched(model, before)


def test_strict_false_loads_what_matches():
    """strict=False loads the matching tensors and returns the same lists in the LoadReport."""
    model = build(vocab=14)
    model.proj = model._modules.pop("mlp_in")
    emb_before = model.emb.weight.detach().clone()
    report = load(FIXTURES / "z3_ws2_fp32", model, strict=False)
    assert report.missing_keys == ("proj.weight", "proj.bias")
    assert report.unexpected_keys == ("mlp_in.weight", "mlp_in.bias")
    assert report.mismatched_shapes == (("emb.weight", (13, 7), (14, 7)), ("head.weight", (13, 7), (14, 7)))
    assert torch.equal(model.emb.weight, emb_before)
    ref = reference("z3_ws2_fp32", "engine")
    for key in ("frozen.weight", "mlp_out.weight", "norm.bias", "calls"):
        assert torch.equal(model.state_dict()[key], ref[key]), key
    assert set(report.loaded_keys) == {
        "scale",
        "calls",
        "frozen.weight",
        "frozen.bias",
        "mlp_out.weight",
        "norm.weight",
        "norm.bias",
    }


def test_long_lists_are_truncated_with_suggestions():
    """Lists show five items then '... and N more'; a close name is suggested for a missing key."""
    model = nn.Sequential()
    for i in range(6):
        model.add_module(f"layer{i}", nn.Linear(2, 2))
    model.add_module("emb", nn.Embedding(13, 7))
    model.add_module("norm", nn.LayerNorm(7))
    model.norm.register_buffer("scales", torch.ones(7))
    with pytest.raises(StateDictMismatchError) as exc:
        load(FIXTURES / "z3_ws2_fp32", model)
    lines = str(exc.value).split("\n\t")
    assert lines[0] == "Error(s) in loading state_dict for Sequential:"
    assert lines[1] == (
        'Missing key(s) in state_dict: "layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias", '
        '"layer2.weight" ... and 8 more.'
    )
    assert lines[2] == (
        'Unexpected key(s) in state_dict: "scale", "calls", "frozen.weight", "frozen.bias", "mlp_in.weight" '
        "... and 3 more."
    )
    assert len(exc.value.missing_keys) == 13

    model = build()
    model.mlp_output = model._modules.pop("mlp_out")
    with pytest.raises(StateDictMismatchError) as exc:
        load(FIXTURES / "z3_ws2_fp32", model)
    assert str(exc.value).split("\n\t")[1] == (
        'Missing key(s) in state_dict: "mlp_output.weight" (did you mean "mlp_out.weight"?).'
    )


def test_many_size_mismatches_are_truncated():
    """More than five size mismatches show five, then a count."""
    with torch.device("meta"):
        model = build(dim=8)
    with pytest.raises(StateDictMismatchError) as exc:
        load(FIXTURES / "z3_ws2_fp32", model)
    lines = str(exc.value).split("\n\t")
    assert [line.split(":")[0] for line in lines[1:6]] == [
        "size mismatch for scale",
        "size mismatch for emb.weight",
        "size mismatch for frozen.weight",
        "size mismatch for frozen.bias",
        "size mismatch for mlp_in.weight",
    ]
    assert lines[6] == "... and 4 more size mismatches."
    assert len(exc.value.mismatched_shapes) == 9


# --------------------------------------------------------------------------- init hooks


def test_raising_hook_is_a_zeroio_error():
    """A hook that raises becomes an InitHookError naming it, with the original as __cause__; nothing is loaded."""
    model = build()
    before = snapshot(model)

    def broken(m):
        raise RuntimeError("layer sizes unknown")

    with pytest.raises(InitHookError) as exc:
        load(FIXTURES / "z3_ws2_fp32", model, init_hook=broken)
    assert str(exc.value) == (
        "The init hook test_raising_hook_is_a_zeroio_error.<locals>.broken raised RuntimeError: layer sizes unknown. "
        f"Nothing was loaded from '{FIXTURES / 'z3_ws2_fp32' / 'global_step2'}'; fix the hook so that it builds "
        "the model's layers, then call zeroio.load again."
    )
    assert isinstance(exc.value.__cause__, RuntimeError)
    assert exc.value.name == "test_raising_hook_is_a_zeroio_error.<locals>.broken"
    assert_untouched(model, before)


def test_missing_checkpoint_fails_before_the_hook():
    """A path that does not exist fails before the hook runs."""
    calls = []
    with pytest.raises(zeroio.errors.CheckpointNotFoundError):
        load(FIXTURES / "nope", build(), init_hook=calls.append)
    assert calls == []


def test_hook_that_builds_nothing():
    """A hook that leaves the model empty surfaces as missing layers: all checkpoint keys unexpected."""
    shell = nn.Module()
    with pytest.raises(StateDictMismatchError) as exc:
        load(FIXTURES / "z3_ws2_fp32", shell, init_hook=lambda m: None)
    assert exc.value.missing_keys == []
    assert len(exc.value.unexpected_keys) == 11


class _PlainLit(nn.Module):
    """A plain module using Lightning's hook name, for the default-hook rule."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None
        self.configured = 0

    def configure_model(self) -> None:
        self.configured += 1
        if self.model is None:
            self.model = build()


@functools.cache
def _lit_with_hook() -> type[nn.Module]:
    """_PlainLit as a LightningModule: implicit hooks run only for LightningModules (issue 15, as Lightning does)."""
    pl = pytest.importorskip("lightning.pytorch")

    class LitHook(_PlainLit, pl.LightningModule):
        pass

    return LitHook


def test_configure_model_runs_by_default():
    """With init_hook=None, a LightningModule's own configure_model runs exactly once before loading."""
    module = _lit_with_hook()()
    report = load(FIXTURES / "z3_ws4_fp32", module)
    assert module.configured == 1
    assert report.hooks_called == ("configure_model",)
    assert_equals_engine(module.model, "z3_ws4_fp32")


def test_explicit_hook_replaces_configure_model():
    """An explicit init_hook runs instead of configure_model."""
    module = _PlainLit()
    report = load(FIXTURES / "z3_ws4_fp32", module, init_hook=lambda m: setattr(m, "model", build()))
    assert module.configured == 0
    assert report.hooks_called == ("test_explicit_hook_replaces_configure_model.<locals>.<lambda>",)
    assert_equals_engine(module.model, "z3_ws4_fp32")


def test_raising_configure_model():
    """A raising configure_model is reported with the class and hook name."""

    class Broken(_lit_with_hook()):  # type: ignore[misc]
        def configure_model(self) -> None:
            raise ValueError("no config")

    with pytest.raises(ZeroIOError) as exc:
        load(FIXTURES / "z3_ws2_fp32", Broken())
    assert str(exc.value).startswith("The init hook Broken.configure_model raised ValueError: no config. Nothing")


@functools.cache
def _lightning_module_class():
    pl = pytest.importorskip("lightning.pytorch")

    class LitTiny(_PlainLit, pl.LightningModule):
        """A LightningModule whose layers exist only after configure_model (Lightning's sharded-init hook)."""

        def forward(self, ids):
            return self.model(ids)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch[0]).reshape(-1, 13), batch[0].roll(1, 1).reshape(-1))

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)

    return LitTiny


@pytest.mark.parametrize("name", fixture_names(stage=3))
def test_lightning_module_from_zero3(name):
    """A real LightningModule with layers built in configure_model loads a ZeRO-3 checkpoint with one call."""
    module = _lightning_module_class()()
    assert list(module.parameters()) == []
    report = load(FIXTURES / name, module)
    assert module.configured == 1
    assert report.hooks_called == ("configure_model",)
    assert_equals_engine(module.model, name)
    assert module.model.head.weight is module.model.emb.weight
    assert set(report.renamed_keys.values()) == {"model." + k for k in reference(name, "engine")}


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
# Lightning's PossibleUserWarnings depend on the machine ("GPU available but not used", "does not have many
# workers" on a 16-core GPU host); they are about training throughput, not about the checkpoint under test.
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_ckpt_written_by_trainer(tmp_path):
    """A .ckpt saved by Lightning's Trainer loads into a fresh LightningModule and into the bare network."""
    pl = pytest.importorskip("lightning.pytorch")
    cls = _lightning_module_class()
    torch.manual_seed(0)
    trained = cls()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    data = torch.utils.data.TensorDataset(torch.randint(0, 13, (4, 6), generator=torch.Generator().manual_seed(1)))
    trainer.fit(trained, torch.utils.data.DataLoader(data, batch_size=2))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    expected = trained.model.state_dict()

    fresh = cls()
    report = load(tmp_path / "last.ckpt", fresh)
    assert report.metadata.format == "torch" and report.metadata.global_step == 2
    assert report.renamed_keys == {}
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert fresh.model.head.weight is fresh.model.emb.weight

    with torch.device("meta"):
        bare = build()
    report = load(tmp_path / "last.ckpt", bare)
    assert report.renamed_keys["model.emb.weight"] == "emb.weight"
    for key, value in bare.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_huggingface_transformers_meta_model(tmp_path):
    """A transformers model built on meta loads its save_pretrained weights; the tied lm_head is re-tied."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    source = transformers.GPT2LMHeadModel(config).eval()
    source.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    report = load(tmp_path, model)
    model.eval()
    assert report.missing_keys == report.unexpected_keys == report.meta_keys == ()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.arange(10).reshape(2, 5)
    assert torch.equal(model(ids).logits, source(ids).logits)


# --------------------------------------------------------------------------- devices


def test_device_cpu_from_meta():
    """device='cpu' places every loaded tensor on the CPU."""
    with torch.device("meta"):
        model = build()
    load(FIXTURES / "z2_ws3_fp16", model, device="cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_reads_are_not_redirected_by_a_default_device():
    """Loading inside a `with torch.device("meta")` block still materialises real tensors."""
    model = build()
    with torch.device("meta"):
        load(FIXTURES / "z3_ws2_fp32", model)
    assert_equals_engine(model, "z3_ws2_fp32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_load_to_cuda(mode):
    """device='cuda' streams every tensor to the GPU; values equal the engine's and ties hold there."""
    name = "z3_ws2_bf16"
    model, hook = make(name, mode)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    report = load(FIXTURES / name, model, init_hook=hook, device="cuda", dtype="bf16")
    assert report.missing_keys == ()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert model.head.weight is model.emb.weight
    expected = reference(name, "engine")
    for key, value in model.state_dict().items():
        want = expected[key].to(torch.bfloat16) if expected[key].is_floating_point() else expected[key]
        assert torch.equal(value.cpu(), want), key
    ids = torch.randint(0, 13, (3, 6), device="cuda")
    assert model(ids).shape == (3, 6, 13)


def _plain_module(state: dict[str, torch.Tensor]) -> nn.Module:
    """A module holding a zero tensor (as a buffer) at every name of ``state``: a target for any checkpoint."""
    root = nn.Module()
    for key, value in state.items():
        *path, leaf = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_buffer(leaf, torch.zeros_like(value))
    return root


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
@pytest.mark.parametrize("name", fixture_names())
def test_load_to_cuda_through_pinned_chunks_equals_cpu(name, dtype, monkeypatch):
    """Pinned staging with tiny chunks (many per tensor, casts on the GPU), each read in parts of 8 bytes for the
    bf16 loads, gives exactly what a CPU load gives."""
    expected = reference(name, "engine")
    torch_dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cpu = {k: (v.to(torch_dtype) if torch_dtype and v.is_floating_point() else v) for k, v in expected.items()}
    model = _plain_module(expected)
    monkeypatch.setenv("ZEROIO_STAGING_BYTES", "24")  # 24 bytes: 3-12 elements a chunk, odd offsets
    if dtype == "bf16":
        monkeypatch.setenv("ZEROIO_READ_BLOCK", "8")  # 3 reads a chunk, landing in any order
    report = load(FIXTURES / name, model, device="cuda", dtype=dtype, strict=False)
    assert report.missing_keys == () and report.unexpected_keys == ()
    for key, value in model.state_dict().items():
        assert value.device.type == "cuda", key
        assert value.dtype == cpu[key].dtype and torch.equal(value.cpu(), cpu[key]), key


def _evict(path: Path) -> None:
    """Make ``path`` cold: its next reads go to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("read_ahead", ["0", "1GiB"])
@pytest.mark.parametrize(
    ("chunk", "block"), [("24", ""), ("5000", ""), ("5000", "4KiB"), ("16MiB", ""), ("1MiB", "4KiB")]
)
def test_load_to_cuda_from_files_not_in_the_page_cache(tmp_path, monkeypatch, chunk, block, read_ahead):
    """Bytes the page cache does not hold are read as the aligned blocks around them (O_DIRECT on a local disk),
    and the tensor taken from inside them: exactly what safetensors saved, for any chunk size and offset, read
    whole or in parts (``ZEROIO_READ_BLOCK``)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(3, 1001, generator=g).to(torch.bfloat16),  # odd sizes: every entry at an unaligned offset
        "b": torch.randn(7, generator=g),
        "c": torch.randint(-(2**31), 2**31 - 1, (4099,), generator=g, dtype=torch.int32),
        "d": torch.randn(2048, 9, generator=g).to(torch.float16),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    _evict(path)
    monkeypatch.setenv("ZEROIO_DIRECT_READS", "1")
    monkeypatch.setenv("ZEROIO_STAGING_BYTES", chunk)
    monkeypatch.setenv("ZEROIO_PREFETCH_BYTES", read_ahead)
    if block:
        monkeypatch.setenv("ZEROIO_READ_BLOCK", block)
    model = _plain_module(tensors)
    report = load(path, model, device="cuda", strict=False)
    assert report.missing_keys == () and report.unexpected_keys == ()
    for key, value in model.state_dict().items():
        assert value.device.type == "cuda" and torch.equal(value.cpu(), tensors[key]), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_load_to_cuda_refuses_a_file_swapped_before_its_direct_read(tmp_path, monkeypatch, kind):
    """The O_DIRECT descriptor is opened at the first read the page cache cannot serve, after the descriptor pool
    recorded the file: one swapped since for a link (to a copy of its bytes) or a FIFO is refused, never blocking,
    as the pool refuses a reopened file that changed (tests/test_trust_low.py)."""
    from safetensors.torch import save_file

    if os.major(os.stat(tmp_path).st_dev) == 0:  # tmpfs, overlay: no block device, so no direct reads
        pytest.skip("the temporary folder is not on a block device")
    tensors = {"w": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(5))}  # 4 MiB
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    shutil.copy(path, tmp_path / "copy.safetensors")
    monkeypatch.setenv("ZEROIO_DIRECT_READS", "1")
    monkeypatch.setenv("ZEROIO_PREFETCH_BYTES", "0")  # nothing read ahead: the tensor's bytes stay cold
    monkeypatch.setenv("ZEROIO_STAGING_BYTES", "1MiB")
    model = _plain_module(tensors)
    with zeroio.open(path) as ckpt:
        load(ckpt, _plain_module(tensors), device="cuda")  # warm: the page cache serves it, the pool records the file
        _evict(path)  # cold again: the next load opens its O_DIRECT descriptor
        path.unlink()
        if kind == "link":
            path.symlink_to(tmp_path / "copy.safetensors")
        else:
            os.mkfifo(path)
        exc = refused_without_blocking(lambda: load(ckpt, model, device="cuda"), seconds=30)
    assert str(exc).startswith(f"'{path}' changed while zeroio was reading it"), exc


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_to_cuda_refuses_a_misspelled_direct_reads_switch(tmp_path, monkeypatch):
    """``ZEROIO_DIRECT_READS`` is 0 or 1: anything else is refused naming the variable, before anything is read."""
    monkeypatch.setenv("ZEROIO_DIRECT_READS", "yes")
    model = build()
    with pytest.raises(ValueError, match=r"^ZEROIO_DIRECT_READS='yes' is not 0 or 1"):
        load(FIXTURES / "z3_ws2_fp32", model, device="cuda")


def test_load_report_is_frozen():
    """LoadReport is an immutable value object."""
    report = load(FIXTURES / "z3_ws2_fp32", build())
    assert isinstance(report, LoadReport)
    with pytest.raises(AttributeError):
        report.missing_keys = ("x",)  # type: ignore[misc]


def test_argument_errors():
    """Wrong argument types raise TypeError/ValueError naming what was expected."""
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        load(FIXTURES / "z3_ws2_fp32", {})
    with pytest.raises(TypeError, match="init_hook must be a callable taking the model, got str"):
        load(FIXTURES / "z3_ws2_fp32", build(), init_hook="configure_model")
    with pytest.raises(ValueError, match="Unknown dtype 'fp8'"):
        load(FIXTURES / "z3_ws2_fp32", build(), dtype="fp8")


_PEAK_SCRIPT = """
import sys, torch
from zeroio import load

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4096, 4096, bias=False) for _ in range(4))

with torch.device("meta"):
    model = Stack()
open("/proc/self/clear_refs", "w").write("5")  # restart VmHWM from the current RSS
before = status("VmRSS")
load(sys.argv[1], model)
print(status("VmHWM") - before - sum(p.numel() * p.element_size() for p in model.parameters()))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_host_memory_is_one_chunk_not_the_model(tmp_path):
    """Loading 256 MiB of weights into a meta model adds about one 64 MiB chunk of host memory beyond the model."""
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({f"layers.{i}.weight": torch.full((4096, 4096), float(i)) for i in range(4)}, path)
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(zeroio.__file__).parent.parent)},
    )
    extra = int(out.stdout.strip())
    assert extra < 96 * 2**20, f"{extra / 2**20:.0f} MiB beyond the model's 256 MiB"
