"""The streaming safetensors writer: golden header bytes, byte-identical files, bounded chunks."""

from __future__ import annotations

import os
import struct

import pytest
import torch
from fixture_data import FIXTURES, reference
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_save

import zeroio
from zeroio._io.fileio import ChunkBuffers as _Buffers
from zeroio._io.fileio import preallocate, pwrite_all
from zeroio._write.safetensors_writer import plan_file, write_chunks


def _write(path, tensors: dict[str, torch.Tensor], metadata=None, chunk_elems: int | None = None) -> bytes:
    """Write ``tensors`` with the streaming writer, cutting each into chunks of ``chunk_elems`` elements."""
    layout = plan_file([(n, t.dtype, t.shape) for n, t in tensors.items()], metadata=metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        preallocate(fd, layout.size)
        pwrite_all(fd, layout.header, 0)
        for slot in layout.slots:
            flat = tensors[slot.name].reshape(-1)
            step = chunk_elems or max(1, flat.numel())
            write_chunks(fd, slot, [flat[i : i + step] for i in range(0, flat.numel(), step)])
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == layout.size
    return data


def test_golden_header_bytes(tmp_path):
    """A tiny file's header is exactly: 8-byte LE length, compact JSON, space padding to a multiple of 8."""
    tensors = {"w": torch.tensor([[1.0, 2.0]]), "n": torch.tensor(3, dtype=torch.int64)}
    data = _write(tmp_path / "t.safetensors", tensors, metadata={"format": "pt"})
    header = (
        b'{"__metadata__":{"format":"pt"},"n":{"dtype":"I64","shape":[],"data_offsets":[0,8]},'
        b'"w":{"dtype":"F32","shape":[1,2],"data_offsets":[8,16]}}'
    )
    padded = header + b" " * (-len(header) % 8)
    assert data[:8] == struct.pack("<Q", len(padded)) == b"\x90\x00\x00\x00\x00\x00\x00\x00"
    assert data[8 : 8 + len(padded)] == padded
    assert data[8 + len(padded) :] == struct.pack("<q", 3) + struct.pack("<2f", 1.0, 2.0)


def test_tie_metadata_golden_header(tmp_path):
    """Metadata is written in the order given: format first, then `alias: source` records."""
    tensors = {"emb.weight": torch.zeros(2, dtype=torch.bfloat16)}
    data = _write(tmp_path / "t.safetensors", tensors, metadata={"format": "pt", "head.weight": "emb.weight"})
    (length,) = struct.unpack("<Q", data[:8])
    assert data[8 : 8 + length] == (
        b'{"__metadata__":{"format":"pt","head.weight":"emb.weight"},'
        b'"emb.weight":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}      '
    )


EVERY_DTYPE = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
]  # fmt: skip


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(
        0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return raw.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)


def test_byte_identical_to_safetensors_for_every_dtype(tmp_path):
    """With every dtype safetensors knows, scalars, empty and non-ASCII names, the file equals save_file's bytes."""
    tensors = {f"t{i}.{str(dt).removeprefix('torch.')}": _sample(dt, (3, 2), i) for i, dt in enumerate(EVERY_DTYPE)}
    tensors["scalar"] = torch.tensor(1.5)
    tensors["empty"] = torch.empty(0, 4)
    tensors["émbed.ü"] = torch.ones(2, dtype=torch.float16)
    data = _write(tmp_path / "t.safetensors", tensors, metadata={"format": "pt"}, chunk_elems=1)
    assert data == safetensors_save(tensors, metadata={"format": "pt"})


@settings(max_examples=60, deadline=None)
@given(
    specs=st.dictionaries(
        st.text(alphabet="abcxyz._0123456789", min_size=1, max_size=6),
        st.tuples(st.sampled_from(EVERY_DTYPE[:10]), st.lists(st.integers(0, 4), max_size=3)),
        max_size=6,
    ),
    chunk=st.integers(1, 7),
    seed=st.integers(0, 1000),
)
def test_byte_identical_to_safetensors_for_any_tensors(tmp_path_factory, specs, chunk, seed):
    """For any names, dtypes, shapes and chunk sizes, the streamed file equals safetensors' own bytes."""
    tensors = {name: _sample(dt, tuple(shape), seed + i) for i, (name, (dt, shape)) in enumerate(specs.items())}
    path = tmp_path_factory.mktemp("w") / "t.safetensors"
    data = _write(path, tensors, metadata={"format": "pt"}, chunk_elems=chunk)
    assert data == safetensors_save(tensors, metadata={"format": "pt"})
    loaded = load_file(path)
    assert {k: v.reshape(-1).view(torch.uint8).tolist() for k, v in loaded.items()} == {
        k: v.reshape(-1).view(torch.uint8).tolist() for k, v in tensors.items()
    }


@pytest.mark.parametrize(
    "tensors, metadata, message",
    [
        pytest.param(
            [("a", torch.float32, (1,)), ("a", torch.float32, (1,))],
            None,
            "Cannot write tensor name 'a' twice (or as '__metadata__') in one safetensors file.",
            id="duplicate",
        ),
        pytest.param(
            [("__metadata__", torch.float32, (1,))],
            None,
            "Cannot write tensor name '__metadata__' twice (or as '__metadata__') in one safetensors file.",
            id="reserved",
        ),
        pytest.param(
            [("c", torch.complex128, (1,))],
            None,
            "safetensors cannot store torch.complex128; convert with fmt='torch'.",
            id="dtype",
        ),
    ],
)
def test_plan_rejects_what_safetensors_cannot_hold(tensors, metadata, message):
    """Duplicate or reserved names and unknown dtypes fail before any byte is written."""
    with pytest.raises(ValueError) as excinfo:
        plan_file(tensors, metadata=metadata)
    assert str(excinfo.value) == message


def test_plan_rejects_non_string_metadata():
    """safetensors metadata maps strings to strings; anything else is a TypeError."""
    with pytest.raises(TypeError) as excinfo:
        plan_file([("a", torch.float32, (1,))], metadata={"format": 1})
    assert str(excinfo.value) == "safetensors metadata must map str to str, got 'format': 1."


def test_write_chunks_checks_dtype_and_length(tmp_path):
    """Chunks of the wrong dtype, too many bytes or too few bytes are refused."""
    layout = plan_file([("w", torch.float32, (4,))])
    slot = layout.slots[0]
    fd = os.open(tmp_path / "t", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(
            ValueError, match=r"^'w': chunk dtype torch.float16 differs from the planned torch.float32\.$"
        ):
            write_chunks(fd, slot, [torch.zeros(4, dtype=torch.float16)])
        with pytest.raises(ValueError, match=r"^'w': chunks hold more than the planned 16 bytes\.$"):
            write_chunks(fd, slot, [torch.zeros(5)])
        with pytest.raises(ValueError, match=r"^'w': chunks hold 8 bytes, the slot 16\.$"):
            write_chunks(fd, slot, [torch.zeros(2)])
    finally:
        os.close(fd)


class _RecordingView(zeroio.Checkpoint):
    """A checkpoint view over a real DeepSpeed checkpoint that records the size of every read it is asked for."""

    def __init__(self, inner: zeroio.Checkpoint) -> None:
        super().__init__(inner.metadata, inner.infos, inner.tied)
        self.inner = inner
        self.reads: list[int] = []

    def read_into(self, name, start, out):
        self.reads.append(out.numel() * out.element_size())
        self.inner.read_into(name, start, out)


@pytest.mark.parametrize("dtype", [None, "bf16"])
@pytest.mark.parametrize("chunk_bytes", [8, 64])
def test_streaming_reads_never_exceed_chunk_bytes(tmp_path, chunk_bytes, dtype):
    """Converting a real checkpoint reads at most chunk_bytes at a time, into reused buffers, and writes it right."""
    with zeroio.open(FIXTURES / "z3_ws3_bf16") as inner:
        view = _RecordingView(inner)
        names = [n for n in view.infos if n not in view.tied]
        target = {None: None, "bf16": torch.bfloat16}[dtype]
        # Floating tensors take the requested dtype; integer and bool tensors keep theirs.
        specs = [
            (n, target if target is not None and view.info(n).dtype.is_floating_point else view.info(n).dtype,
             view.info(n).shape)
            for n in names
        ]  # fmt: skip
        layout = plan_file(specs, metadata={"format": "pt"})
        path = tmp_path / "model.safetensors"
        buffers = _Buffers()
        pointers = set()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            pwrite_all(fd, layout.header, 0)
            for slot in layout.slots:
                chunks: list[torch.Tensor] = []

                def watched(stream, chunks=chunks):
                    for chunk in stream:
                        pointers.add(chunk.data_ptr())
                        chunks.append(chunk.clone())
                        yield chunk

                write_chunks(fd, slot, watched(view.chunks(slot.name, target, chunk_bytes, buffers.get)))
                # Same elements, chunking and rounding as the checkpoint's own iter_chunks.
                expected = list(inner.iter_chunks(slot.name, dtype=target, chunk_bytes=chunk_bytes))
                assert [c.view(torch.uint8).tolist() for c in chunks] == [
                    c.view(torch.uint8).tolist() for c in expected
                ]
        finally:
            os.close(fd)
    assert view.reads and max(view.reads) <= chunk_bytes
    # One buffer per dtype (fp32, bf16, int64), reused for every chunk; the bf16 one grows once (bf16 chunks
    # cast to fp32 hold half as many elements as plain bf16 chunks).
    assert len(pointers) <= 4 < len(view.reads)
    reference_state = reference("z3_ws3_bf16")
    loaded = load_file(path)
    for name, tensor in loaded.items():
        want = reference_state[name]
        if target is not None and want.is_floating_point():
            want = want.to(target)
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
