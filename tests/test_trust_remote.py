"""Hostile or racing object storage (issue 23, items 4-6), against moto's S3 server on localhost (tests/s3_server.py).

* a URL output that is, holds or lies inside its URL source is refused before anything is listed or written;
* an object created at the destination after zeroio listed it is never replaced without ``overwrite``
  (``If-None-Match: *``);
* a source object replaced mid-read, same size, is a typed error naming it (``If-Match`` with the listed ETag);
* credentials in URLs never reach a message, a log record or the CLI's output.
"""

from __future__ import annotations

import io
import logging
import struct
import time
import zipfile
from collections.abc import Iterator

import pytest
from fixture_data import FIXTURES
from s3_server import S3Server

import zeroio
from zeroio.cli import main
from zeroio.errors import OutputError, RemoteStorageError

pytest.importorskip("s3fs")

NAME = "z3_ws2_fp32"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The server with one fixture at s3://trust/ckpt, and the AWS variables pointing at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env().items():
            mp.setenv(key, value)
        server.upload_tree(FIXTURES / NAME, "trust", "ckpt")
        yield server
    server.stop()


def _objects(s3: S3Server, bucket: str, prefix: str = "") -> dict[str, str]:
    """key -> ETag of every object under ``prefix``."""
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


# --------------------------------------------------------------------------- item 5: outputs onto their source


@pytest.mark.parametrize(
    ("call", "dst"),
    [
        ("convert", "s3://trust/ckpt"),  # the same prefix: --overwrite deleted all 9 source objects
        ("convert", "s3a://trust//ckpt/"),  # the same, spelled with a scheme alias and extra slashes
        ("convert", "s3://trust/ckpt/global_step2"),  # inside the source
        ("convert", "s3://trust"),  # the source inside the destination
        ("universal", "s3://trust/ckpt"),
        ("reshard", "s3://trust/ckpt"),
        ("reshard", "s3://trust/ckpt/ws3"),
    ],
)
def test_url_output_overlapping_its_source_is_refused(s3, call, dst):
    before = _objects(s3, "trust")
    with pytest.raises(OutputError, match="Write to another prefix") as excinfo:
        if call == "reshard":
            zeroio.reshard("s3://trust/ckpt", dst, world_size=3, overwrite=True, progress=False)
        else:
            fmt = "universal" if call == "universal" else "safetensors"
            zeroio.convert("s3://trust/ckpt", dst, fmt=fmt, overwrite=True, progress=False)
    assert "s3://trust/ckpt" in str(excinfo.value)
    assert _objects(s3, "trust") == before  # nothing deleted, nothing written


def test_lightning_output_onto_its_source_is_refused(s3, tmp_path):
    """A Lightning .ckpt converted onto itself lost optimizer_states; now refused, and the object is unchanged."""
    zeroio.convert(FIXTURES / NAME, tmp_path / "model.ckpt", fmt="lightning", progress=False)
    s3.client.put_object(Bucket="trust", Key="lightning/model.ckpt", Body=(tmp_path / "model.ckpt").read_bytes())
    before = _objects(s3, "trust", "lightning/")
    with pytest.raises(OutputError, match="it is the source"):
        zeroio.convert(
            "s3://trust/lightning/model.ckpt", "s3://trust/lightning/model.ckpt", fmt="lightning", overwrite=True,
            progress=False,
        )  # fmt: skip
    assert _objects(s3, "trust", "lightning/") == before


def test_cli_convert_onto_its_source_is_refused(s3, capsys):
    before = _objects(s3, "trust")
    assert main(["convert", "s3://trust/ckpt", "s3://trust/ckpt", "--overwrite", "--quiet"]) == 1
    assert "it is the source" in capsys.readouterr().err
    assert _objects(s3, "trust") == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_object_created_after_the_listing_is_not_replaced(s3, overwrite):
    """Someone else's object that appears between zeroio's listing and its upload is left as it is, with
    ``overwrite`` too (it replaces only what the listing found and checked); reshard, universal and Lightning
    outputs take the same conditional put."""
    prefix, fmt = f"race-{overwrite}", "safetensors"
    target = f"{prefix}/model.safetensors"
    url = f"s3://trust/{prefix}"

    def meanwhile(done: int, total: int) -> None:  # runs while zeroio writes its staging folder: after the listing
        s3.client.put_object(Bucket="trust", Key=target, Body=b"theirs")

    with pytest.raises(OutputError, match="created after zeroio listed"):
        zeroio.convert(FIXTURES / NAME, url, fmt=fmt, progress=meanwhile, overwrite=overwrite)
    assert s3.client.get_object(Bucket="trust", Key=target)["Body"].read() == b"theirs"
    assert list(_objects(s3, "trust", prefix + "/")) == [target]  # zeroio's other uploads were removed


# --------------------------------------------------------------------------- item 4: credentials in messages

SECRET = "SuperSecret42"


def _secret_free(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text


def _chain(exc: BaseException | None) -> str:
    """Every message of ``exc`` and its causes (what a traceback prints)."""
    texts = []
    while exc is not None:
        texts.append(f"{exc!s} {exc!r} {exc.args!r}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(texts)


def test_s3_credentials_in_the_url_never_reach_errors_logs_or_the_cli(s3, caplog, capsys, monkeypatch):
    """``s3://KEY:SECRET@bucket``: the keys are used (a wrong one is refused) and never shown."""
    caplog.set_level(logging.DEBUG, logger="zeroio")
    wrong = f"s3://WRONGKEY:{SECRET}@trust/ckpt"
    with pytest.raises(RemoteStorageError, match="was refused") as excinfo:
        zeroio.open(wrong)
    _secret_free(_chain(excinfo.value), str(excinfo.value.path))
    assert main(["inspect", wrong]) == 1
    _secret_free(*capsys.readouterr())
    monkeypatch.setenv("ZEROIO_DEBUG", "1")
    with pytest.raises(RemoteStorageError) as excinfo:
        main(["inspect", wrong])
    _secret_free(_chain(excinfo.value))
    monkeypatch.delenv("ZEROIO_DEBUG")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unused")  # the URL's keys are the ones that work
    right = "s3://zeroio-test-key:zeroio-test-secret@trust/ckpt"
    with zeroio.open(right) as ckpt:
        assert "zeroio-test-secret" not in f"{ckpt.metadata.path} {ckpt.metadata.path!r} {ckpt.describe()}"
    assert main(["inspect", right]) == 0
    out, err = capsys.readouterr()
    assert "trust/ckpt" in out and "zeroio-test-secret" not in out + err
    _secret_free(*(r.getMessage() for r in caplog.records))


def test_hf_endpoint_credentials_never_reach_errors(s3, capsys, monkeypatch):
    """An ``HF_ENDPOINT`` with ``user:pass@``, refused by the server (403): the error quotes no password."""
    monkeypatch.setenv("HF_ENDPOINT", s3.endpoint.replace("http://", f"http://user:{SECRET}@"))
    with pytest.raises(RemoteStorageError) as excinfo:
        zeroio.open("hf://user/repo")
    _secret_free(_chain(excinfo.value))
    assert main(["inspect", "hf://user/repo"]) == 1
    _secret_free(*capsys.readouterr())


# --------------------------------------------------------------------------- item 6: one version per object


def test_object_replaced_mid_read_is_a_typed_error(s3):
    """Objects replaced after open by others of the same size: the ETag listed at open is sent as If-Match with
    every ranged GET, and S3's 412 is a RemoteStorageError naming the object (before: exit 0, two versions mixed).
    CRC checks are off: a new version written by a trainer has valid CRCs (these flipped bytes have not)."""
    s3.upload_tree(FIXTURES / "z2_ws2_fp32", "trust", "swap")
    keys = sorted(_objects(s3, "trust", "swap/"))
    with zeroio.open("s3://trust/swap", verify_crc=False) as ckpt:
        names = list(ckpt)
        ckpt[names[0]]  # some tensors read from the listed version
        for key in keys:  # then every object replaced: same size, other tensor bytes (a later save)
            data = s3.client.get_object(Bucket="trust", Key=key)["Body"].read()
            s3.client.put_object(Bucket="trust", Key=key, Body=_other_tensor_bytes(data))
        with pytest.raises(RemoteStorageError, match=r"'s3://trust/swap/.*' changed while it was read"):
            {name: ckpt[name] for name in names}


def _other_tensor_bytes(data: bytes) -> bytes:
    """A torch zip with every tensor record's bytes flipped, its structure (headers, pickles) unchanged."""
    if not zipfile.is_zipfile(io.BytesIO(data)):
        return data
    out = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename:
                header = struct.unpack("<IHHHHHIIIHH", data[info.header_offset : info.header_offset + 30])
                start = info.header_offset + 30 + header[9] + header[10]
                out[start : start + info.file_size] = bytes(b ^ 0x5A for b in data[start : start + info.file_size])
    return bytes(out)


def test_stalled_s3_is_a_typed_error_within_seconds(s3):
    """Every ranged GET answered after 8 s: botocore's and s3fs's own retries took 63 s with read_timeout=1; the
    retry budget now cancels the call, retries included."""
    s3.slow_s, s3.faults = 8.0, ["slow"] * 40
    started = time.monotonic()
    try:
        with pytest.raises(RemoteStorageError, match="Timeout"):
            zeroio.open("s3://trust/ckpt", storage_options={"read_timeout": 1, "retry_timeout": 2})
    finally:
        s3.slow_s, s3.faults = 0.0, []
    assert time.monotonic() - started < 6
