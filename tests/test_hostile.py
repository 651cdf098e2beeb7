"""Hostile input gets a typed error within seconds and bounded memory, and never changes what later reads return.

The crafted files (tests/hostile_files.py) are built byte by byte and are all small: what they claim is the attack.
Anything that could hang, exhaust memory or poison the interpreter runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from fixture_data import FIXTURES, ROOT
from hostile_files import (
    Ops,
    archive,
    broadcast_tensor,
    build_on_enum_member,
    build_on_global,
    bytearray_bomb,
    deep_nesting,
    exponential_dag,
    hashed_tuple_dag,
    many_dims,
    many_dims_size,
    rebuild_non_storage,
    self_reference,
    state_dict,
    zip_bomb,
)

import zeroio
from zeroio._pickles import load_pickle
from zeroio.errors import CheckpointFormatError, UnsafePickleError, UnsupportedCheckpointError, ZeroIOError

ZERO_FIXTURE = FIXTURES / "z2_ws2_fp32"
OPTIM_STATES = ZERO_FIXTURE / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _python(script: str, *args: str, timeout: float = 60) -> str:
    """Run ``script`` in a fresh interpreter (this checkout first on the path); its stdout, or a failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# --- item 1: a pickle cannot change what later files read ---------------------------------------------------------

_POISONERS = {
    "FloatStorage dtype (dict state)": lambda: build_on_global("torch.FloatStorage"),
    "FloatStorage dtype (slot state)": lambda: build_on_global("torch.FloatStorage", "slots"),
    "UntypedStorage dtype": lambda: build_on_global("torch.storage.UntypedStorage", "slots"),
    "ZeroStageEnum class": lambda: build_on_global("deepspeed.runtime.zero.config.ZeroStageEnum", "slots"),
    "ZeroStageEnum member": build_on_enum_member,
    "_codecs.encode defaults": lambda: build_on_global("_codecs.encode", "slots"),
    "_rebuild_tensor_v2 attributes": lambda: build_on_global("torch._utils._rebuild_tensor_v2"),
    "AttributeDict class": lambda: build_on_global("lightning.fabric.utilities.data.AttributeDict", "slots"),
    "Namespace class": lambda: build_on_global("argparse.Namespace", "slots"),
    "torch.Tensor class": lambda: build_on_global("torch.Tensor", "slots"),
}


def test_crafted_files_never_change_later_reads(tmp_path):
    """After each file that BUILDs on a shared global, a genuine checkpoint still reads bit-exactly as before."""
    crafted = []
    for i, make in enumerate(_POISONERS.values()):
        crafted.append(tmp_path / f"crafted{i}.pt")
        crafted[-1].write_bytes(make())
    genuine = tmp_path / "genuine.pt"
    torch.save({"w": torch.randn(3, 5), "h": torch.randn(4).half(), "b": b"\x00\xffbytes"}, genuine)
    script = """
        import json, sys, torch, zeroio
        from zeroio._pickles import load_pickle
        def fingerprint():
            with zeroio.open(sys.argv[1]) as ckpt:
                weights = {k: v.reshape(-1).view(torch.uint8).tolist() for k, v in ckpt.state_dict().items()}
            with zeroio.open(sys.argv[2]) as ckpt:
                plain = {k: v.reshape(-1).view(torch.uint8).tolist() for k, v in ckpt.state_dict().items()}
                described = json.dumps(ckpt.describe(), default=str)
            tree, file = load_pickle(sys.argv[3])
            stage = tree["optimizer_state_dict"]["zero_stage"]
            file.close()
            return [weights, plain, described, str(stage), stage.name, int(stage)]
        before = fingerprint()
        outcomes = []
        for path in sys.argv[4:]:
            try:
                zeroio.open(path).state_dict()
                outcomes.append("read")
            except zeroio.errors.ZeroIOError as exc:
                outcomes.append(type(exc).__name__)
            except Exception as exc:
                outcomes.append("raw " + type(exc).__name__)
            outcomes.append(fingerprint() == before)
        print(json.dumps(outcomes))
    """
    out = json.loads(_python(script, str(ZERO_FIXTURE), str(genuine), str(OPTIM_STATES), *map(str, crafted)))
    results = dict(zip(_POISONERS, zip(out[::2], out[1::2])))
    assert results == {name: (results[name][0], True) for name in _POISONERS}, "a later read changed"
    assert all(error in ("UnsafePickleError", "CheckpointFormatError") for error, _ in results.values()), results


def test_storage_type_build_is_refused_by_name(tmp_path):
    """The reported attack (torch.FloatStorage's dtype set to fp16) is refused, naming the file and the global."""
    path = tmp_path / "tampered.pt"
    path.write_bytes(build_on_global("torch.FloatStorage"))
    with pytest.raises(UnsafePickleError) as excinfo:
        load_pickle(path)
    assert str(excinfo.value) == (
        f"Refusing '{path}': the pickle tries to change the allowlisted global 'torch.FloatStorage', which every "
        "later read shares. The file is hostile or corrupted; do not use it."
    )
    assert excinfo.value.name == "torch.FloatStorage"


def _snapshot(obj: object) -> object:
    try:
        attrs = dict(vars(obj))
    except TypeError:
        attrs = None
    return attrs, getattr(obj, "__defaults__", None), getattr(obj, "dtype", None), repr(obj)


@pytest.mark.parametrize("state", ["dict", "slots"])
def test_every_allowlisted_global_is_sealed(tmp_path, state):
    """BUILD on any allowlisted global raises a zeroio error and leaves the global exactly as it was."""
    from zeroio._pickles.allowed import ALLOWED

    path = tmp_path / "x.pt"
    for name, obj in ALLOWED.items():
        before = _snapshot(obj)
        path.write_bytes(build_on_global(name, state))
        with pytest.raises(ZeroIOError):
            load_pickle(path)
        assert _snapshot(obj) == before, name


def test_tampered_file_does_not_verify_as_identical(tmp_path):
    """`zeroio verify tampered.pt trusted.pt` fails on the tampered file instead of reading both as fp16."""
    trusted = tmp_path / "trusted.pt"
    torch.save({"w": torch.arange(4.0)}, trusted)
    data = torch.arange(4.0).numpy().tobytes()
    ops = Ops().glob("torch.FloatStorage").dict().text("dtype").glob("torch.float16").setitem().build().pop()
    ops.raw(state_dict(lambda o: o.tensor((4,), (1,), numel=4)).out[2:])
    tampered = tmp_path / "tampered.pt"
    tampered.write_bytes(archive(ops.stop(), {"0": data}))
    done = subprocess.run(
        [sys.executable, "-m", "zeroio", "verify", str(tampered), str(trusted)],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "identical" not in done.stdout
    assert done.stderr.startswith(f"Unsafe pickle: Refusing '{tampered}': the pickle tries to change")


# --- item 11: bounded memory and time -----------------------------------------------------------------------------

_BOUNDED = {
    "bytearray(1 GiB) by REDUCE": (lambda: bytearray_bomb(1 << 30), CheckpointFormatError),
    "zip bomb: 600 KB pickle unpacking to 600 MiB": (lambda: zip_bomb(600 << 20), UnsupportedCheckpointError),
    "stride-0 tensor of 2**28 elements over 4 bytes": (lambda: broadcast_tensor(2**28), CheckpointFormatError),
    "stride-0 tensor of 2**40 elements over 4 bytes": (lambda: broadcast_tensor(2**40), CheckpointFormatError),
    "list DAG of 2**40 paths": (exponential_dag, None),
    "tuple DAG of 2**40 tuples as a dict key": (hashed_tuple_dag, CheckpointFormatError),
    "tuple DAG of 2**40 tuples in builtins.set": (lambda: hashed_tuple_dag("set"), CheckpointFormatError),
    "tuple DAG of 2**40 tuples in __builtin__.set": (
        lambda: hashed_tuple_dag("__builtin__.set"),
        CheckpointFormatError,
    ),
    "tuple DAG of 2**40 tuples in a frozenset": (lambda: hashed_tuple_dag("frozenset"), CheckpointFormatError),
    "20,000-dimension tensor": (many_dims, CheckpointFormatError),
    "20,000-dimension torch.Size": (many_dims_size, CheckpointFormatError),
}
_RSS_BUDGET_MB = 500


@pytest.mark.parametrize("attack", list(_BOUNDED))
def test_bounded_memory_and_time(tmp_path, attack):
    """Open, inspect and read every tensor: a typed error (or a result) in seconds, peak RSS < 500 MB over baseline."""
    make, expected = _BOUNDED[attack]
    path = tmp_path / "attack.pt"
    path.write_bytes(make())
    script = """
        import json, resource, sys, time
        import zeroio
        def rss_mb():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        base, start = rss_mb(), time.monotonic()
        try:
            with zeroio.open(sys.argv[1]) as ckpt:
                ckpt.describe()
                ckpt.state_dict()
            outcome = "read"
        except zeroio.errors.ZeroIOError as exc:
            outcome = type(exc).__name__
        except BaseException as exc:
            outcome = "raw " + type(exc).__name__ + ": " + str(exc)[:200]
        print(json.dumps([outcome, time.monotonic() - start, rss_mb() - base]))
    """
    outcome, seconds, rss_mb = json.loads(_python(script, str(path), timeout=60))
    assert outcome == ("read" if expected is None else expected.__name__)
    assert seconds < 10
    assert rss_mb < _RSS_BUDGET_MB


def test_shared_subtrees_are_walked_once_and_stay_shared(tmp_path):
    """The 2**40-path DAG reads in milliseconds; each shared list is one object in the result, as torch.load gives."""
    path = tmp_path / "dag.pt"
    path.write_bytes(exponential_dag())
    script = """
        import sys
        from zeroio._pickles import load_pickle, to_plain
        tree, file = load_pickle(sys.argv[1])
        node = to_plain(tree)["x"]
        file.close()
        for _ in range(40):
            assert node[0] is node[1]
            node = node[0]
        print(node)
    """
    assert _python(script, str(path), timeout=30) == "[]\n"


# --- item 12: typed errors, never raw ones ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: deep_nesting(20_000), ("nests containers more than 100 levels deep; zeroio reads checkpoints up to "
         "that depth. The file is corrupted or hostile.")),
        (self_reference, ("holds a list that contains itself; torch.save never writes one into a checkpoint. The file "
         "is corrupted or hostile.")),
        (rebuild_non_storage, ("a tensor is rebuilt from a value of type int where its storage belongs. The file is "
         "corrupted or was not written by torch.save.")),
    ],
    ids=["deep nesting", "self reference", "rebuild given a non-storage"],
)  # fmt: skip
def test_malformed_trees_raise_format_errors(tmp_path, make, message):
    """Deep nesting, self-reference and a non-storage in _rebuild_tensor_v2 are named, by every reader."""
    path = tmp_path / "bad.pt"
    path.write_bytes(make())
    with pytest.raises(CheckpointFormatError) as excinfo:
        load_pickle(path)  # what Lightning conversion and the ZeRO readers call directly
    assert str(excinfo.value).endswith(message)
    assert str(excinfo.value).startswith((f"'{path}' ", f"Refusing '{path}': "))
    with pytest.raises(CheckpointFormatError) as excinfo:
        zeroio.open(path)
    assert str(excinfo.value).endswith(message)


def test_quantized_storage_is_refused(tmp_path):
    """A tensor over torch.QInt8Storage (torch pickles quantized tensors otherwise) is refused, not read raw."""
    path = tmp_path / "q.pt"
    ops = Ops().dict().text("w").glob("torch._utils._rebuild_tensor_v2").mark()
    ops.mark().text("storage").glob("torch.QInt8Storage").text("0").text("cpu").int(4).raw(b"t")
    ops.raw(b"Q").int(0).ints((4,)).ints((1,)).false().glob("collections.OrderedDict").raw(b")").reduce()
    path.write_bytes(archive(ops.raw(b"t").reduce().setitem().stop(), {"0": bytes(4)}))
    with pytest.raises(UnsafePickleError) as excinfo:
        zeroio.open(path).state_dict()
    assert excinfo.value.name == "torch.QInt8Storage"


def test_special_files_are_refused_without_blocking(tmp_path):
    """A FIFO, /dev/zero or a link to it, as the path or as a rank file or shard inside, is a format error at once."""
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    link = tmp_path / "zero.pt"
    link.symlink_to("/dev/zero")
    ckpt = tmp_path / "ckpt"
    import shutil

    shutil.copytree(ZERO_FIXTURE, ckpt)
    rank = ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank.unlink()
    os.mkfifo(rank)
    shards = tmp_path / "shards"
    shards.mkdir()
    os.mkfifo(shards / "model-00001-of-00001.safetensors")
    weight_map = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    script = """
        import json, sys, zeroio
        from zeroio._pickles import load_pickle
        from pathlib import Path
        out = []
        for path in sys.argv[1:]:
            try:
                zeroio.open(path).state_dict()
                out.append("read")
            except zeroio.errors.ZeroIOError as exc:
                out.append(type(exc).__name__ + ": " + str(exc))
            except Exception as exc:
                out.append("raw " + type(exc).__name__)
        for read in (load_pickle, lambda p: zeroio.open(Path(p), verify_crc=True)):  # rank files and shards are read so
            try:
                read(sys.argv[1])
            except zeroio.errors.ZeroIOError as exc:
                out.append(type(exc).__name__ + ": " + str(exc))
        print(json.dumps(out))
    """
    paths = [fifo, "/dev/zero", link, ckpt, shards / "model.safetensors.index.json"]
    out = json.loads(_python(script, *map(str, paths), timeout=60))
    refused = (
        f"CheckpointFormatError: '{fifo}' is not a regular file (it is a FIFO). Point zeroio at a checkpoint file or "
    )
    rank_fifo = f"CheckpointFormatError: '{rank}' is not a regular file (it is a FIFO)."
    assert out[3].startswith(rank_fifo)  # a FIFO named like a rank file is named, not skipped
    assert out[4].startswith("CheckpointNotFoundError: Shard 'model-00001-of-00001.safetensors' listed in")
    assert out[:3] + out[5:] == [
        refused + "folder.",
        (
            "CheckpointFormatError: '/dev/zero' is not a regular file (it is a character device). Point zeroio at a "
            "checkpoint file or folder."
        ),
        (
            f"CheckpointFormatError: '{link}' is not a regular file (it is a character device). Point zeroio at a "
            "checkpoint file or folder."
        ),
        refused + "folder.",
        refused + "folder.",
    ]


def test_dtype_safetensors_cannot_store_names_the_tensor(tmp_path):
    """complex128 to safetensors is an unsupported-checkpoint error naming the tensor, not "Invalid arguments"."""
    src = tmp_path / "c.pt"
    torch.save({"b": torch.zeros(2), "w": torch.zeros(2, dtype=torch.complex128)}, src)
    with pytest.raises(UnsupportedCheckpointError) as excinfo:
        zeroio.convert(src, tmp_path / "out", progress=False)
    assert str(excinfo.value) == (
        f"'{src}': tensor 'w' is torch.complex128, which safetensors cannot store. Convert with fmt='torch'."
    )
    assert excinfo.value.name == "w"
    assert not (tmp_path / "out").exists()
    done = subprocess.run(
        [sys.executable, "-m", "zeroio", "convert", str(src), str(tmp_path / "out")],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("Unsupported checkpoint: ")


def test_torch_writer_on_a_full_disk_raises_output_error(tmp_path):
    """fmt="torch" past RLIMIT_FSIZE (no tmpfs without root): OutputError naming the file, partial output removed."""
    dst = tmp_path / "out"
    script = f"""
        import resource
        from zeroio import convert
        from zeroio.errors import OutputError
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        try:
            convert({str(ZERO_FIXTURE)!r}, {str(dst)!r}, fmt="torch", progress=False)
        except OutputError as exc:
            print(exc)
    """
    assert _python(script) == (
        f"Cannot write '{dst}': File too large ('{dst / 'pytorch_model.bin'}'). Removed the partial output. "
        "Raise the file size limit (ulimit -f) or use a smaller max_shard_size.\n"
    )
    assert list(tmp_path.iterdir()) == []
