"""Megatron-FSDP's ``fsdp_dtensor`` checkpoints are plain DCP folders whose shards do not follow torch.chunk
(fixtures/megatron_fsdp/, Megatron's uneven-chunk save hooks on torch's DCP): zeroio's DCP reader places every
chunk by its recorded offsets, so open and convert equal the full tensors bit for bit (Megatron-LM PR #6024)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

import zeroio
from zeroio.cli import main

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_fsdp" / "mfsdp_uneven_ws2"
ITER = FIXTURE / "iter_0000002"


def test_uneven_chunks_read_bit_exact(tmp_path):
    """10 + 3 rows (torch.chunk would cut 7 + 6), 0 + 5 (rank 0 empty), 4 + 3 and a replicated tensor: open and
    convert give the full tensors every rank cut its piece from."""
    full = torch.load(FIXTURE / "expected" / "model.pt", weights_only=True)
    splits = json.loads((FIXTURE / "manifest.json").read_text())["splits"]
    assert splits["embedding.word_embeddings.weight"]["rank0_rows"] == 10
    with zeroio.open(ITER) as ckpt:
        assert (ckpt.metadata.format, ckpt.metadata.layout) == ("dcp", "dcp")
        assert set(ckpt) == set(full)
        for key, want in full.items():
            assert torch.equal(ckpt[key], want) and ckpt[key].dtype == want.dtype, key
    assert main(["convert", str(ITER), str(tmp_path / "out"), "--quiet"]) == 0
    written = load_file(tmp_path / "out" / "model.safetensors")
    for key, want in full.items():
        assert torch.equal(written[key], want), key
