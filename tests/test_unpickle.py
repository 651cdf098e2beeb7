"""The restricted unpickler: never executes pickle code, needs no DeepSpeed, reads tensors lazily."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from fixture_data import FIXTURES, ROOT

import zeroio
from zeroio._pickles import load_pickle
from zeroio.errors import UnsafePickleError, UnsupportedCheckpointError


class _RunsShell:
    def __init__(self, marker: str, use_subprocess: bool = False) -> None:
        self.marker = marker
        self.use_subprocess = use_subprocess

    def __reduce__(self):
        if self.use_subprocess:
            return (subprocess.call, (["touch", self.marker],))
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("use_subprocess", [False, True], ids=["os.system", "subprocess.call"])
def test_malicious_model_states_never_run(tmp_path, use_subprocess):
    """A model_states file whose pickle calls os.system/subprocess raises UnsafePickleError; no marker appears."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z3_ws2_fp32", root)
    marker = tmp_path / "pwned"
    victim = root / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    payload = {"module": {}, "evil": _RunsShell(str(marker), use_subprocess)}
    torch.save(payload, victim)
    with pytest.raises(UnsafePickleError) as excinfo:
        zeroio.open(root)
    qualified = excinfo.value.name  # pickle records where it found the callable (e.g. 'posix.system')
    assert qualified.endswith(".call" if use_subprocess else ".system")
    assert str(excinfo.value) == (
        f"Refusing to unpickle global '{qualified}' from '{victim}': it is not on zeroio's allowlist. If you trust "
        f"this file, pass trusted_globals=['{qualified}'] (it is rebuilt as inert data, never called)."
    )
    assert not marker.exists()


def test_trusted_globals_are_rebuilt_inert(tmp_path):
    """Even a trusted global is never called: it becomes inert data and the marker still does not appear."""
    marker = tmp_path / "pwned"
    path = tmp_path / "x.pt"
    torch.save({"evil": _RunsShell(str(marker))}, path)
    qualified = f"{os.system.__module__}.system"
    tree, _ = load_pickle(path, trusted_globals=frozenset([qualified]))
    assert not marker.exists()
    assert type(tree["evil"]).__name__ == "system"


def test_deepspeed_classes_become_inert_stand_ins():
    """ZeroStageEnum, LossScaler and fragment_address unpickle without DeepSpeed's code."""
    tree, _ = load_pickle(FIXTURES / "z2_ws2_fp32" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    osd = tree["optimizer_state_dict"]
    assert int(osd["zero_stage"]) == 2 and type(osd["zero_stage"]).__name__ == "ZeroStageEnum"
    assert osd["loss_scaler"].cur_scale == 1.0
    mapping = osd["param_slice_mappings"][0]["emb.weight"]
    assert (mapping.numel, mapping.start) == (82, 0)


def test_matches_torch_load_bit_for_bit():
    """Every tensor in every fixture file equals what torch.load (with DeepSpeed installed) returns."""
    for path in sorted(FIXTURES.glob("*/global_step*/*.pt")):
        tree, file = load_pickle(path)
        reference = torch.load(path, weights_only=False, map_location="cpu")

        def walk(ours, theirs, where):
            if isinstance(theirs, torch.Tensor):
                got = ours.materialize()
                # Compare bytes: ZeRO padding past the last parameter may hold uninitialised NaNs.
                assert got.dtype == theirs.dtype and got.shape == theirs.shape, where
                assert torch.equal(got.reshape(-1).view(torch.uint8), theirs.detach().reshape(-1).view(torch.uint8)), (
                    where
                )
            elif isinstance(theirs, dict):
                assert list(ours) == list(theirs), where
                for k in theirs:
                    walk(ours[k], theirs[k], f"{where}.{k}")
            elif isinstance(theirs, (list, tuple)) and not isinstance(theirs, torch.Size):
                assert len(ours) == len(theirs), where
                for i, (a, b) in enumerate(zip(ours, theirs)):
                    walk(a, b, f"{where}[{i}]")

        walk(tree, reference, path.name)
        file.close()


def test_legacy_torch_format_is_refused(tmp_path):
    """Files saved with the pre-1.6 serialization are refused with a fix, not misread."""
    path = tmp_path / "old.pt"
    torch.save({"a": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedCheckpointError) as excinfo:
        load_pickle(path)
    assert str(excinfo.value) == (
        f"'{path}' uses torch's legacy (pre-1.6) serialization, which zeroio does not read. "
        "Re-save it with torch.save (zip format)."
    )


def test_works_without_deepspeed_installed():
    """Reading a checkpoint never imports DeepSpeed: with it made unimportable the result is unchanged."""
    script = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import torch, zeroio\n"
        "sd = zeroio.open(sys.argv[1]).state_dict()\n"
        "ref = torch.load(sys.argv[2], weights_only=True)\n"
        "assert all(torch.equal(sd[k], ref[k]) for k in ref), 'mismatch'\n"
        "assert 'deepspeed' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok', len(sd))\n"
    )
    name = "z2_ws3_fp16"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(FIXTURES / name), str(FIXTURES / name / "expected" / "zero_to_fp32.pt")],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok 11"


def test_plain_data_client_state_is_readable(tmp_path):
    """argparse.Namespace / Path hyper-parameters in client state are rebuilt inert instead of refused."""
    import argparse
    import pathlib

    path = tmp_path / "client.pt"
    torch.save({"args": argparse.Namespace(lr=0.1, out=pathlib.Path("/x")), "w": torch.arange(3)}, path)
    tree, file = load_pickle(path)
    assert tree["args"].lr == 0.1 and type(tree["args"]).__name__ == "Namespace"
    assert torch.equal(tree["w"].materialize(), torch.arange(3))
    file.close()
