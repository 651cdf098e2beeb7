"""Checkpoints read straight from S3 URLs, against a real S3-protocol server (moto's server mode) on localhost.

tests/s3_server.py puts a counting, fault-injecting proxy in front of moto; zeroio reaches it through s3fs over HTTP
with the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from fixture_data import FIXTURES
from hub_server import DEFAULT_TOKEN, DEFAULT_USER
from s3_server import S3Server

import zeroio
from zeroio.cli import main
from zeroio.errors import CheckpointFormatError, CheckpointNotFoundError, OutputError, RemoteStorageError

pytest.importorskip("s3fs")
pytest_plugins = ["hub_fixtures"]

FIXTURE_NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/manifest.json"))
WORKER = Path(__file__).with_name("remote_ckpt_worker.py")


@pytest.fixture(scope="module")
def s3():
    """The server, with every fixture uploaded to s3://fixtures/<name> and the AWS variables pointing at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env().items():
            mp.setenv(key, value)
        for name in FIXTURE_NAMES:
            server.upload_tree(FIXTURES / name, "fixtures", name)
        yield server
    server.stop()


@pytest.fixture(scope="module")
def big(s3, tmp_path_factory):
    """A ~38 MB ZeRO-3 fp32 checkpoint written by DeepSpeed on CPU (Adam moments: two thirds of it), uploaded."""
    out = tmp_path_factory.mktemp("big")
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    subprocess.run([sys.executable, str(WORKER), str(out)], env=env, check=True, capture_output=True, timeout=300)
    return out, s3.upload_tree(out, "big", "run")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _sha256_tree(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _record_extents(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """(pickle bytes, [(start, end) of every tensor record's data]) of a torch zip file."""
    pickle_bytes, extents = 0, []
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as archive:
        for info in archive.infolist():
            fh.seek(info.header_offset)
            header = struct.unpack("<IHHHHHIIIHH", fh.read(30))
            start = info.header_offset + 30 + header[9] + header[10]
            if info.filename.endswith("data.pkl"):
                pickle_bytes += info.file_size
            elif "/data/" in info.filename:
                extents.append((start, start + info.file_size))
    return pickle_bytes, extents


# --------------------------------------------------------------------------- every fixture, byte for byte


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_from_url_equals_local(s3, tmp_path, name):
    """open, convert and verify from s3:// give exactly the local result (tensors and every output byte)."""
    url = f"s3://fixtures/{name}"
    with zeroio.open(FIXTURES / name) as local, zeroio.open(url) as remote:
        assert str(remote.metadata.path) == url + str(local.metadata.path)[len(str(FIXTURES / name)) :]
        assert list(remote.keys()) == list(local.keys())
        assert remote.tied == local.tied
        for key in local:
            a, b = local[key], remote[key]
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a, b.view(torch.uint8) if
                               b.is_floating_point() else b), key  # fmt: skip
    zeroio.convert(FIXTURES / name, tmp_path / "local", progress=False)
    zeroio.convert(url, tmp_path / "remote", progress=False)
    assert _sha256_tree(tmp_path / "remote") == _sha256_tree(tmp_path / "local")
    assert zeroio.verify(url, tmp_path / "local").ok


@pytest.mark.parametrize("name", ["legacy_z2_ws2_fp32", "legacy_z3_ws2_bf16"])
def test_legacy_stream_from_url_equals_local(s3, tmp_path, name):
    """Rank files saved with torch's legacy (non-zip) serialization read from s3:// exactly as from disk."""
    local = FIXTURES / "layouts" / name
    url = s3.upload_tree(local, "layouts", name)
    with zeroio.open(local) as expected, zeroio.open(url) as remote:
        assert remote.metadata.serialization == "legacy" and list(remote.keys()) == list(expected.keys())
        for key in expected:
            a, b = expected[key], remote[key]
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key
    zeroio.convert(local, tmp_path / "local", progress=False)
    zeroio.convert(url, tmp_path / "remote", progress=False)
    assert _sha256_tree(tmp_path / "remote") == _sha256_tree(tmp_path / "local")


def test_load_from_url_equals_local(s3):
    """zeroio.load from a URL fills a model exactly as from the local folder."""
    name = "z3_ws2_fp32"
    engine = torch.load(FIXTURES / name / "expected" / "engine.pt", weights_only=True)
    reference = engine.get("params", engine)
    with zeroio.open(FIXTURES / name) as ckpt:
        shapes = {k: v.shape for k, v in ckpt.items()}

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for key, shape in shapes.items():
                self.register_parameter(key.replace(".", "__"), torch.nn.Parameter(torch.zeros(shape)))

    def load_into(path: object) -> dict[str, torch.Tensor]:
        model = Flat()
        state = zeroio.open(path).state_dict()
        model.load_state_dict({k.replace(".", "__"): v for k, v in state.items()})
        return {k.replace("__", "."): v.detach() for k, v in model.state_dict().items()}

    local, remote = load_into(FIXTURES / name), load_into(f"s3://fixtures/{name}")
    assert local.keys() == remote.keys()
    for key in local:
        assert torch.equal(local[key], remote[key])
    for key, value in reference.items():
        if key in remote:
            assert torch.equal(remote[key], value)


# --------------------------------------------------------------------------- bytes fetched


def test_convert_fetches_only_the_weights(s3, big, tmp_path):
    """Bytes the server sends for a conversion <= 1.05 x (tensor bytes written + pickles): no Adam moments."""
    local, url = big
    pickles, tensor_records = 0, 0
    for path in sorted((local / "step1").iterdir()):
        p, extents = _record_extents(path)
        pickles += p
        tensor_records += sum(e - s for s, e in extents)
    s3.accounting.reset()
    result = zeroio.convert(url, tmp_path / "out", progress=False)
    fetched = s3.accounting.body_bytes
    assert fetched <= 1.05 * (result.total_size + pickles), (fetched, result.total_size, pickles)
    assert result.total_size < 0.4 * tensor_records  # the moments are most of the data, and were not fetched
    zeroio.convert(local, tmp_path / "ref", progress=False)
    assert _sha256_tree(tmp_path / "out") == _sha256_tree(tmp_path / "ref")


def test_one_reader_keeps_several_gets_in_flight(s3, big, tmp_path):
    """One IO thread converting from s3:// (each GET answered after 50 ms) keeps several ranged GETs in flight: a
    read continuing an earlier one fetches the next windows ahead (before, one window at a time, one GET in flight).
    Still nothing fetched twice and no Adam moment fetched; the output is the local one's bytes."""
    local, url = big
    pickles = sum(_record_extents(path)[0] for path in sorted((local / "step1").iterdir()))
    s3.slow_s = 0.05
    s3.faults = ["slow"] * 500
    s3.accounting.reset()
    try:
        result = zeroio.convert(url, tmp_path / "out", workers=1, progress=False)
    finally:
        s3.faults = []
    assert s3.accounting.most_in_flight >= 3, s3.accounting.ranges
    assert s3.accounting.body_bytes <= 1.05 * (result.total_size + pickles), (s3.accounting.body_bytes, pickles)
    zeroio.convert(local, tmp_path / "ref", workers=1, progress=False)
    assert _sha256_tree(tmp_path / "out") == _sha256_tree(tmp_path / "ref")


def test_distributed_convert_fetches_each_weight_once(s3, big, tmp_path):
    """`torchrun --nproc-per-node 2 -m zeroio convert s3://... --distributed`: both processes read (the default for a
    URL), each its own shards' bytes: the server sends <= 1.05 x (weights written + each process's pickles), plus
    the 4 MiB that each process fetches with the header of the rank file's one record (read-ahead up to the next
    fence). Each process's read-ahead stops at the end of its own bytes: before, a bias read fetched 4 MiB of the
    next weight, which the other process writes. The output is the single-process bytes."""
    local, url = big
    pickles = sum(_record_extents(path)[0] for path in sorted((local / "step1").iterdir()))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parent.parent), OMP_NUM_THREADS="1")
    env.pop("ZEROIO_READERS_PER_HOST", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "zeroio", "convert", url, str(tmp_path / "out"), "--max-shard-size", "5MB", "--distributed",
    ]  # fmt: skip
    s3.accounting.reset()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    fetched = s3.accounting.body_bytes
    result = zeroio.convert(local, tmp_path / "ref", max_shard_size="5MB", progress=False)
    assert len(result.files) == 3  # a weight and its bias per shard: one process writes two, the other one
    header_read_ahead = 4 << 20  # zeroio._io.remote_file.COALESCE_BYTES, once more: both read the record's header
    assert fetched <= 1.05 * (result.total_size + 2 * pickles) + header_read_ahead, (fetched, result.total_size)
    assert _sha256_tree(tmp_path / "out") == _sha256_tree(tmp_path / "ref")


def test_inspect_reads_only_pickles(s3, big, capsys):
    """``zeroio inspect URL`` fetches pickles and zip directories, never a byte of a tensor record."""
    local, url = big
    extents = {p.name: _record_extents(p)[1] for p in (local / "step1").iterdir()}
    s3.accounting.reset()
    assert main(["inspect", url]) == 0
    assert "step1" in capsys.readouterr().out
    assert s3.accounting.gets > 0
    for path, header in s3.accounting.ranges:
        if not header:  # a listing (ListObjectsV2 is a GET of the bucket)
            continue
        name = path.rsplit("/", 1)[-1].split("?")[0]
        first, _, last = header.removeprefix("bytes=").partition("-")
        start, end = int(first), int(last) if last else 2**62
        for lo, hi in extents.get(name, []):
            assert end < lo or start >= hi, (name, header, lo, hi)
    assert s3.accounting.body_bytes < 200_000


def test_open_and_read_make_few_requests(s3, capsys):
    """GETs, counted by the server: a rank file's metadata is three (end records, zip directory, whole pickle
    record), and a small rank file's data one more (fetched whole); plus the listing and ``latest``. The old
    per-read requests (signature bytes, record headers, each tensor) made 18 and 34 here."""
    name = "z2_ws2_fp32"
    url = f"s3://fixtures/{name}"
    ranks = len(list((FIXTURES / name).glob("global_step*/*.pt")))
    s3.accounting.reset()
    with zeroio.open(url) as ckpt:
        opened = s3.accounting.gets
        ckpt.state_dict()
    assert opened <= 2 + 3 * ranks, s3.accounting.ranges
    assert s3.accounting.gets <= 2 + 4 * ranks, s3.accounting.ranges
    s3.accounting.reset()
    assert main(["inspect", url]) == 0
    assert name in capsys.readouterr().out
    assert s3.accounting.gets <= 2 + 3 * ranks, s3.accounting.ranges


def _listings(ranges: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(recursive, one-level) ListObjectsV2 requests among the GETs: a recursive one has an empty delimiter."""
    from urllib.parse import parse_qs, urlsplit

    lists = [urlsplit(path).query for path, _ in ranges if "list-type=" in path]
    deep = [q for q in lists if not parse_qs(q).get("delimiter")]
    return deep, [q for q in lists if q not in deep]


@pytest.mark.parametrize("sub", ["", "/global_step2"], ids=["root", "tag folder"])
def test_convert_lists_the_source_once(s3, tmp_path, sub):
    """``convert(url)`` makes the one recursive listing ``open`` makes (the side files are looked up in it, not
    in a second one; a tag folder's parent, where the HF Trainer keeps config.json, is listed one level), and
    no more GETs than opening and reading every tensor: the listing, ``latest``, three metadata GETs and one
    data GET per rank file. Before, the side files' fresh path listed the source again."""
    name = "z3_ws2_fp32"
    ranks = len(list((FIXTURES / name).glob("global_step*/*.pt")))
    s3.accounting.reset()
    zeroio.convert(f"s3://fixtures/{name}{sub}", tmp_path / "out", progress=False)
    deep, shallow = _listings(s3.accounting.ranges)
    assert len(deep) == 1, s3.accounting.ranges
    assert len(shallow) == (1 if sub else 0), s3.accounting.ranges
    assert s3.accounting.gets <= 2 + 4 * ranks, s3.accounting.ranges


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("faults", [["reset"], ["500", "503"], ["slow"], ["truncate"], ["503"] * 3])
def test_transient_faults_are_retried(s3, faults):
    """Connection resets, 5xx, slow and cut-short responses on ranged GETs: retried, same tensors."""
    name = "z2_ws2_fp32"
    with zeroio.open(FIXTURES / name) as ckpt:
        expected = {k: v.clone() for k, v in ckpt.items()}
    s3.slow_s = 1.0
    s3.faults[:] = list(faults)
    try:
        with zeroio.open(f"s3://fixtures/{name}") as ckpt:
            got = {k: v.clone() for k, v in ckpt.items()}
    finally:
        s3.faults.clear()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_wrong_credentials_name_the_url_and_the_fix(s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-the-key")
    with pytest.raises(RemoteStorageError) as excinfo:
        zeroio.open("s3://fixtures/z2_ws2_fp32")
    message = str(excinfo.value)
    assert "'s3://fixtures/z2_ws2_fp32" in message and "AWS_ACCESS_KEY_ID" in message
    assert "\n" not in message


def test_missing_credentials_name_the_url_and_the_fix(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteStorageError) as excinfo:
        zeroio.open("s3://fixtures/z2_ws2_fp32")
    assert "'s3://fixtures/z2_ws2_fp32" in str(excinfo.value) and "AWS_PROFILE" in str(excinfo.value)


def test_url_of_one_object(s3):
    """A URL naming one object (not a folder) opens that file: its size comes from the object's metadata."""
    url = "s3://fixtures/z3_ws2_fp32/expected/engine.pt"
    with zeroio.open(url) as remote, zeroio.open(FIXTURES / "z3_ws2_fp32" / "expected" / "engine.pt") as local:
        assert list(remote) == list(local)
        assert all(torch.equal(remote[k], local[k]) for k in local)


def test_storage_options_give_the_credentials(s3, monkeypatch):
    """storage_options= passes credentials and the endpoint to s3fs, without any AWS variable."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key)
    env = s3.env()
    options = {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"], "endpoint_url": s3.endpoint}
    with zeroio.open("s3://fixtures/z3_ws2_fp32", storage_options=options) as ckpt:
        assert ckpt["emb.weight"].shape == (13, 7)


def test_storage_options_reach_every_verb(s3, monkeypatch, tmp_path, hub_server, hub_api, xet_disabled):
    """convert, verify, load, reshard and push_to_hub pass storage_options to the source URL's filesystem."""
    env = s3.env()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key)
    options = {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"], "endpoint_url": s3.endpoint}
    name = "z3_ws2_fp32"
    url, local = f"s3://fixtures/{name}", FIXTURES / name
    with pytest.raises(RemoteStorageError):  # without the options nothing is readable
        zeroio.convert(url, tmp_path / "refused", progress=False)
    zeroio.convert(local, tmp_path / "ref", progress=False)
    zeroio.convert(url, tmp_path / "out", progress=False, storage_options=options)
    assert _sha256_tree(tmp_path / "out") == _sha256_tree(tmp_path / "ref")
    assert zeroio.verify(url, tmp_path / "ref", storage_options=options).ok
    assert zeroio.verify(tmp_path / "ref", url, storage_options=options).ok
    with pytest.raises(ValueError, match="URLs only"):
        zeroio.verify(local, tmp_path / "ref", storage_options=options)
    with pytest.raises(ValueError, match="URLs only"):
        zeroio.convert(local, tmp_path / "never", storage_options=options)

    with zeroio.open(local) as ckpt:
        model = torch.nn.Module()
        for key, info in ckpt.infos.items():
            module = model
            *parents, leaf = key.split(".")
            for part in parents:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_buffer(leaf, torch.zeros(info.shape, dtype=info.dtype))
        expected = ckpt.state_dict()
    report = zeroio.load(url, model, storage_options=options)
    assert not report.missing_keys
    assert report.loaded_keys and all(torch.equal(model.get_buffer(k), v) for k, v in expected.items())

    zeroio.reshard(local, tmp_path / "ws1_ref", world_size=1)
    zeroio.reshard(url, tmp_path / "ws1", world_size=1, storage_options=options)
    tag = (tmp_path / "ws1_ref" / "latest").read_text().strip()
    assert _sha256_tree(tmp_path / "ws1" / tag) == _sha256_tree(tmp_path / "ws1_ref" / tag)

    pushed = zeroio.push_to_hub(url, f"{DEFAULT_USER}/from-s3", token=DEFAULT_TOKEN, progress=False,
                                storage_options=options)  # fmt: skip
    assert "model.safetensors" in pushed.files
    on_hub = hub_server.read_file(f"{DEFAULT_USER}/from-s3", "model.safetensors")
    assert on_hub == (tmp_path / "ref" / "model.safetensors").read_bytes()


def test_hf_url_reads_only_the_weights(big, hub_server, hub_api, xet_disabled, monkeypatch, tmp_path):
    """A raw checkpoint folder on the (local) Hub: hf://user/repo@rev/path converts to the local result, byte for
    byte, and the server sends the weights and pickles, not the Adam moments (HF_ENDPOINT/HF_TOKEN standard)."""
    local, _ = big
    repo = f"{DEFAULT_USER}/raw-run"
    hub_api.create_repo(repo)
    hub_api.upload_folder(repo_id=repo, folder_path=local, path_in_repo="ckpt")
    monkeypatch.setenv("HF_TOKEN", DEFAULT_TOKEN)
    pickles = sum(_record_extents(p)[0] for p in (local / "step1").iterdir())
    folder = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    zeroio.convert(local, tmp_path / "ref", progress=False)

    hub_server.body_bytes_sent = 0
    result = zeroio.convert(f"hf://{repo}@main/ckpt", tmp_path / "out", progress=False)
    served = hub_server.body_bytes_sent
    assert _sha256_tree(tmp_path / "out") == _sha256_tree(tmp_path / "ref")
    assert served <= 1.05 * (result.total_size + pickles), (served, result.total_size, pickles)
    assert served < 0.4 * folder
    with zeroio.open(f"hf://{repo}/ckpt") as ckpt:
        assert str(ckpt.metadata.path) == f"hf://{repo}/ckpt/step1"
    monkeypatch.delenv("HF_TOKEN")  # the repo is public on the test server, so a wrong token is what is refused
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises((RemoteStorageError, CheckpointNotFoundError)):
        zeroio.open(f"hf://{repo}/ckpt")


def test_truncated_object_is_a_format_error_naming_the_url(s3):
    tag = next(p.name for p in (FIXTURES / "z2_ws2_fp32").iterdir() if p.is_dir() and p.name.startswith("global"))
    rank = FIXTURES / "z2_ws2_fp32" / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    s3.upload_tree(FIXTURES / "z2_ws2_fp32", "cut", "z2")
    s3.client.put_object(Bucket="cut", Key=f"z2/{tag}/{rank.name}", Body=rank.read_bytes()[: rank.stat().st_size // 2])
    with pytest.raises(CheckpointFormatError) as excinfo, zeroio.open("s3://cut/z2") as ckpt:
        ckpt.state_dict()
    assert f"s3://cut/z2/{tag}/{rank.name}" in str(excinfo.value)


def test_rank_files_fetched_together_fail_as_one_by_one(s3, tmp_path):
    """Remote rank files' metadata is fetched concurrently; with two corrupted files the error is still the first
    file's, exactly as opening the same folder locally (one file after another) reports it."""
    local = tmp_path / "z3"
    shutil.copytree(FIXTURES / "z3_ws4_fp32", local)
    tag = (local / "latest").read_text().strip()
    for rank in (1, 3):  # the first is an optimizer file, the second a later model file
        kind = "optim" if rank == 1 else "model"
        path = local / tag / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
        path.write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(CheckpointFormatError) as at_home:
        zeroio.open(local)
    s3.upload_tree(local, "twocut", "z3")
    with pytest.raises(CheckpointFormatError) as remote:
        zeroio.open("s3://twocut/z3")
    assert str(remote.value) == str(at_home.value).replace(str(local), "s3://twocut/z3")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in str(remote.value)


def _tree(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder`` (nested: tag folders)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.mark.parametrize("kind", ["reshard", "universal"])
def test_checkpoint_outputs_to_url_equal_local_and_upload_latest_last(s3, tmp_path, kind):
    """reshard and convert(fmt="universal") write to s3:// exactly the files they write locally; the file DeepSpeed's
    loader starts from (``latest`` / ``latest_universal``) is uploaded last, so nothing looks complete before the
    rank files are there; a second write is refused without overwrite and replaces zeroio's own files with it."""
    name, url = "z3_ws2_fp32", f"s3://outputs/{kind}"
    src, remote_src = FIXTURES / name, f"s3://fixtures/{name}"
    s3.upload_tree(tmp_path / "none", "outputs", "") if (tmp_path / "none").mkdir() is None else None
    if kind == "reshard":
        marker = "latest"

        def write(source: object, dst: object, **kw: object) -> object:
            return zeroio.reshard(source, dst, world_size=3, **kw)
    else:
        marker = "latest_universal"

        def write(source: object, dst: object, **kw: object) -> object:
            return zeroio.convert(source, dst, fmt="universal", progress=False, **kw)

    write(src, tmp_path / "local")
    s3.accounting.reset()
    result = write(remote_src, url)
    assert _s3_tree(s3, "outputs", kind) == _tree(tmp_path / "local")
    puts = [p for p in s3.accounting.puts if p.startswith(f"/outputs/{kind}/")]
    assert len(puts) == len(_tree(tmp_path / "local")) and puts[-1] == f"/outputs/{kind}/{marker}"
    files = result.files  # type: ignore[attr-defined]
    assert files and all(str(p).startswith(url + "/") for p in files)
    with pytest.raises(OutputError, match="already holds"):
        write(src, url)
    write(src, url, overwrite=True)
    assert _s3_tree(s3, "outputs", kind) == _tree(tmp_path / "local")
    s3.client.put_object(Bucket="outputs", Key=f"{kind}/notes.txt", Body=b"mine")
    with pytest.raises(OutputError, match="notes.txt"):
        write(src, url, overwrite=True)
    assert s3.client.get_object(Bucket="outputs", Key=f"{kind}/notes.txt")["Body"].read() == b"mine"


def test_lightning_checkpoint_to_url_is_one_object(s3, tmp_path):
    """convert(fmt="lightning") to s3://.../model.ckpt uploads exactly the local file as one object; an existing
    object is refused without overwrite and replaced with it; a prefix holding objects (a folder) is refused."""
    name = "z3_ws2_fp32"
    zeroio.convert(FIXTURES / name, tmp_path / "model.ckpt", fmt="lightning", progress=False)
    s3.upload_tree(tmp_path / "none", "outputs", "") if (tmp_path / "none").mkdir() is None else None
    url = "s3://outputs/lightning/model.ckpt"
    result = zeroio.convert(f"s3://fixtures/{name}", url, fmt="lightning", progress=False)
    assert [str(p) for p in result.files] == [url]
    assert _s3_tree(s3, "outputs", "lightning") == {"model.ckpt": _tree(tmp_path)["model.ckpt"]}
    with pytest.raises(OutputError, match="object exists"):
        zeroio.convert(FIXTURES / name, url, fmt="lightning", progress=False)
    zeroio.convert(FIXTURES / name, url, fmt="lightning", progress=False, overwrite=True)
    assert _s3_tree(s3, "outputs", "lightning") == {"model.ckpt": _tree(tmp_path)["model.ckpt"]}
    with pytest.raises(OutputError, match="is a folder"):
        zeroio.convert(FIXTURES / name, "s3://outputs/lightning", fmt="lightning", progress=False, overwrite=True)


def test_missing_object_is_not_found(s3):
    with pytest.raises(CheckpointNotFoundError, match="s3://fixtures/no-such-run"):
        zeroio.open("s3://fixtures/no-such-run")


def test_missing_extra_names_the_pip_install(monkeypatch):
    pytest.importorskip("s3fs")
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed (the [test] extra installs it)
    with pytest.raises(RemoteStorageError, match=r"pip install gcsfs \(zeroio's \[gcs\] extra\)"):
        zeroio.open("gs://bucket/run")


# --------------------------------------------------------------------------- the CLI


def test_cli_inspect_convert_verify_accept_urls(s3, tmp_path, capsys):
    url = "s3://fixtures/z3_ws2_bf16"
    assert main(["inspect", url, "--json"]) == 0
    assert url in capsys.readouterr().out
    assert main(["convert", url, str(tmp_path / "out"), "--quiet"]) == 0
    assert main(["verify", url, str(tmp_path / "out")]) == 0
    s3.upload_tree(tmp_path / "empty", "outputs", "") if (tmp_path / "empty").mkdir() is None else None
    assert main(["convert", url, "s3://outputs/cli", "--quiet"]) == 0  # a URL destination: staged, then uploaded
    assert _s3_tree(s3, "outputs", "cli") == _sha256_tree(tmp_path / "out")
    assert main(["convert", url, "s3://outputs/cli", "--quiet"]) == 1  # an existing destination, without --overwrite
    assert "already holds" in capsys.readouterr().err


def test_convert_from_url_imports_no_torch(s3, tmp_path):
    """``zeroio convert s3://...`` as stored and cast to bf16 runs with torch, safetensors, huggingface_hub and tqdm
    refused at import (tests/torch_free_worker.py), and writes exactly the local conversion's bytes."""
    name = "z3_ws2_bf16"
    url = f"s3://fixtures/{name}"
    cases = {"stored": ["convert", url, "--quiet"], "bf16": ["convert", url, "--quiet", "--dtype", "bf16"]}
    refused = "torch,safetensors,huggingface_hub,tqdm"
    worker = Path(__file__).with_name("torch_free_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), refused, str(tmp_path / "tf"), json.dumps(cases)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["asked"] == [] and report["loaded"] == []
    for case, dtype in (("stored", None), ("bf16", "bf16")):
        result = report["cases"][case]
        assert result["code"] == 0, result["stderr"]
        zeroio.convert(FIXTURES / name, tmp_path / case, dtype=dtype, progress=False)
        assert result["files"] == _sha256_tree(tmp_path / case)


def test_cli_push_and_reshard_accept_urls(s3, tmp_path, capsys, hub_server, hub_api, xet_disabled, monkeypatch):
    """``zeroio push s3://...`` uploads what a local push would; ``zeroio reshard s3://... DST`` writes the files a
    local reshard writes (credentials from the environment, as for inspect/convert/verify)."""
    name = "z3_ws2_fp32"
    url, local = f"s3://fixtures/{name}", FIXTURES / name
    monkeypatch.setenv("HF_TOKEN", DEFAULT_TOKEN)
    zeroio.convert(local, tmp_path / "ref", progress=False)
    repo = f"{DEFAULT_USER}/cli-from-s3"
    assert main(["push", url, repo, "--quiet"]) == 0
    assert repo in capsys.readouterr().out
    assert hub_server.read_file(repo, "model.safetensors") == (tmp_path / "ref" / "model.safetensors").read_bytes()

    zeroio.reshard(local, tmp_path / "ws3_ref", world_size=3)
    assert main(["reshard", url, str(tmp_path / "ws3"), "--world-size", "3", "--quiet"]) == 0
    tag = (tmp_path / "ws3_ref" / "latest").read_text().strip()
    assert (tmp_path / "ws3" / "latest").read_text().strip() == tag
    assert _sha256_tree(tmp_path / "ws3" / tag) == _sha256_tree(tmp_path / "ws3_ref" / tag)
    assert len(_sha256_tree(tmp_path / "ws3" / tag)) >= 6  # model and optimizer states of 3 ranks


def test_http_url_of_one_file(hub_server, hub_api, xet_disabled, tmp_path):
    """A plain-HTTP URL names one file (a web server has no listing): a safetensors file served with Range support
    (here the Hub's resolve URL, redirected to its CDN) converts to the same bytes."""
    pytest.importorskip("aiohttp")
    zeroio.convert(FIXTURES / "z3_ws2_bf16", tmp_path / "ref", progress=False)
    repo = f"{DEFAULT_USER}/converted"
    hub_api.create_repo(repo)
    hub_api.upload_folder(repo_id=repo, folder_path=tmp_path / "ref")
    url = f"{hub_server.endpoint}/{repo}/resolve/main/model.safetensors"
    with zeroio.open(url) as ckpt:
        assert ckpt.metadata.format == "safetensors" and str(ckpt.metadata.path) == url
    zeroio.convert(url, tmp_path / "out", progress=False)
    ref = tmp_path / "ref" / "model.safetensors"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == ref.read_bytes()
    with pytest.raises(CheckpointNotFoundError):
        zeroio.open(f"{hub_server.endpoint}/{repo}/resolve/main/no-such.safetensors")


# --------------------------------------------------------------------------- outputs at URLs


def _s3_tree(s3, bucket: str, prefix: str) -> dict[str, str]:
    """name -> sha256 of every object under s3://bucket/prefix/ (read straight from moto)."""
    listed = s3.client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {
        o["Key"][len(prefix) + 1 :]: hashlib.sha256(
            s3.client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        ).hexdigest()
        for o in listed
    }


def test_convert_to_s3_equals_local_and_refuses_existing(s3, tmp_path):
    """convert to s3://: the same bytes as a local output; an existing prefix is refused unless overwrite, and
    overwrite refuses a prefix holding files zeroio does not write."""
    name = "z3_ws2_fp32"
    s3.client.create_bucket(Bucket="outputs")
    local = zeroio.convert(FIXTURES / name, tmp_path / "ref", progress=False, max_shard_size=200)
    assert local.index_path is not None
    result = zeroio.convert(f"s3://fixtures/{name}", "s3://outputs/model", progress=False, max_shard_size=200)
    assert _s3_tree(s3, "outputs", "model") == _sha256_tree(tmp_path / "ref")
    assert [str(p) for p in result.files] == [f"s3://outputs/model/{p.name}" for p in local.files]
    assert str(result.index_path) == "s3://outputs/model/model.safetensors.index.json"
    assert zeroio.verify(f"s3://fixtures/{name}", "s3://outputs/model").ok
    with pytest.raises(zeroio.errors.OutputError, match="already holds"):
        zeroio.convert(FIXTURES / name, "s3://outputs/model", progress=False)
    zeroio.convert(FIXTURES / name, tmp_path / "one", progress=False)
    zeroio.convert(FIXTURES / name, "s3://outputs/model", progress=False, overwrite=True)  # one file: shards go
    assert _s3_tree(s3, "outputs", "model") == _sha256_tree(tmp_path / "one")
    s3.client.put_object(Bucket="outputs", Key="model/notes.txt", Body=b"mine")
    with pytest.raises(zeroio.errors.OutputError, match="notes.txt"):
        zeroio.convert(FIXTURES / name, "s3://outputs/model", progress=False, overwrite=True)
    assert "notes.txt" in _s3_tree(s3, "outputs", "model")


def test_failed_upload_leaves_nothing_that_looks_complete(s3, tmp_path):
    """A PUT refused mid-upload (the third shard): OutputError naming the URL, and every object zeroio uploaded is
    removed, so no index and no shard are left at the destination."""
    s3.client.create_bucket(Bucket="outputs")
    s3.put_faults[:] = ["model-00003-of-"]
    try:
        with pytest.raises(zeroio.errors.OutputError, match="s3://outputs/failed"):
            zeroio.convert(FIXTURES / "z3_ws2_fp32", "s3://outputs/failed", progress=False, max_shard_size=200)
    finally:
        s3.put_faults.clear()
    assert _s3_tree(s3, "outputs", "failed") == {}
