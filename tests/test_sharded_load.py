"""zeroio.load into models sharded across ranks (FSDP2, tensor parallel, 2-D meshes): every rank fills its own local
shards, bit for bit equal to torch's own sharding of the engine's tensors, reading only its slice. Sources: ZeRO-2/3,
universal, safetensors, torch files, DCP folders (FSDP2, tensor parallel, 4-rank uneven, one saved by the job
itself), http:// and s3://; targets fp32, bf16 and fp16 (the model's dtype or ``dtype=``).

Each job (2 ranks, then 4) starts its processes once and runs every case in them (tests/sharded_worker.py); the
tests below assert on the records it printed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fixture_data import FIXTURES
from test_distributed import finish, free_port, worker_env
from test_remote_http import _Ranged as Ranged
from test_remote_http import _serve as serve

import zeroio

WORKER = Path(__file__).with_name("sharded_worker.py")
Z3 = FIXTURES / "z3_ws2_fp32"
Z3_ENGINE = Z3 / "expected" / "engine.pt"
BF16 = FIXTURES / "z2_ws2_bf16"
UNIVERSAL = FIXTURES / "universal" / "universal_z3_ws2_fp32"
UNIVERSAL_BF16 = FIXTURES / "universal" / "universal_z1_ws3_bf16"
FP16 = FIXTURES / "z3_ws2_fp16"
DCP = FIXTURES / "dcp" / "dcp_fsdp2_ws2_fp32"  # row chunks (FSDP2's Shard(0))
DCP_TP = FIXTURES / "dcp" / "dcp_tp_ws2"  # column chunks (Rowwise mlp_in), row chunks, replicated tensors
DCP_BF16 = FIXTURES / "dcp" / "dcp_fsdp2_ws2_bf16"
DCP_UNEVEN = FIXTURES / "dcp" / "dcp_fsdp2_ws4_uneven"
DCP_HF = FIXTURES / "dcp_hf" / "dcp_hf_ws2"  # torchtitan's per-rank safetensors (HuggingFaceStorageWriter)
VERL = FIXTURES / "verl" / "verl_fsdp2_ws2_fp32"  # verl's FSDP2 per-rank DTensor pickles
VERL_BF16 = FIXTURES / "verl" / "verl_fsdp2_ws2_bf16"
MEGATRON = FIXTURES / "megatron" / "gpt_tp2_untied"  # Megatron-Core torch_dist, tensor parallel 2
BIG = {"vocab": 515, "dim": 96, "hidden": 67}  # uneven on 2 and 4 ranks; ~250 KB of fp32
BIG_BYTES = 4 * (515 * 96 + 96 * 96 + 96 + 67 * 96 + 67 + 96 * 67 + 2 * 96 + 96)  # its tensors, in fp32


def case(id: str, src: Path | str, engine: Path | str = Z3_ENGINE, **kw: Any) -> dict[str, Any]:
    return {"id": id, "src": str(src), "engine": str(engine), **kw}


def ref(src: Path) -> Path:
    """A fixture's reference: the engine's tensors (DeepSpeed fixtures) or the live run's state (DCP fixtures)."""
    expected = src / "expected"
    return expected / "engine.pt" if (expected / "engine.pt").exists() else expected / "model.pt"


DOCS = Path(__file__).resolve().parent.parent / "docs" / "loading.md"
DOC_BLOCKS = re.findall(r'```python title="(sharded[^"]*)"[^\n]*\n(.*?)```', DOCS.read_text(), flags=re.DOTALL)


def run(tmp_path: Path, world: int, cases: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Run every case on ``world`` local gloo ranks; ``{case id: [record of rank 0, rank 1, ...]}``.

    The docs' "Sharded models" examples for ``world`` ranks run first, in the same processes."""
    spec = tmp_path / f"spec{world}.json"
    prefix = {2: "sharded:", 4: "sharded-4:"}.get(world)
    docs = [(title, block) for title, block in DOC_BLOCKS if prefix and title.startswith(prefix)]
    spec.write_text(json.dumps({"cases": cases, "timeout": 180, "docs": docs}))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(spec)],
            env=worker_env(rank, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = finish(procs, timeout=240)
    by_case: dict[str, list[dict[str, Any]]] = {c["id"]: [] for c in [*cases, {"id": "docs"}]}
    for rank, (code, records, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
        for record in records:
            by_case[record["id"]].append(record)
    return by_case


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Sources beyond the fixtures: safetensors and torch conversions, and a larger safetensors model for byte
    counts."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("sharded_sources")
    zeroio.convert(Z3, root / "st")
    zeroio.convert(Z3, root / "bin", fmt="torch")
    zeroio.convert(MEGATRON, root / "megatron_hf", names="hf", progress=False)
    from layout_checks import tiny_model  # the fixtures' TinyLM builder

    torch.manual_seed(0)
    big = type(tiny_model())(**BIG)
    state = {k: v.detach().clone() for k, v in big.state_dict().items() if k != "head.weight"}  # head is tied
    save_file(state, str(root / "big.safetensors"))
    torch.save(big.state_dict(), root / "big_engine.pt")
    return {
        "st": root / "st",
        "bin": root / "bin" / "pytorch_model.bin",
        "big": root / "big.safetensors",
        "big_engine": root / "big_engine.pt",
        "megatron_hf": root / "megatron_hf",
    }


@pytest.fixture(scope="module")
def web(sources: dict[str, Path]) -> Iterator[str]:
    """An http:// server answering Range requests (as object stores and CDNs do) over the sources' folder."""
    pytest.importorskip("aiohttp")  # fsspec's HTTP filesystem
    yield from serve(Ranged, sources["st"].parent)


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[str, dict[str, str]]]:
    """A local S3 server (moto) holding a ZeRO-3 fixture: ``(s3://bucket, storage_options)``."""
    pytest.importorskip("s3fs")
    import logging

    from s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server()
    try:
        server.upload_tree(Z3, "sharded", "z3")
        env = server.env()
        yield "s3://sharded", {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"],
                               "endpoint_url": server.endpoint}  # fmt: skip
    finally:
        server.stop()


def source_cases(sources: dict[str, Path], s3: tuple[str, dict[str, str]]) -> list[dict[str, Any]]:
    """Every source kind into FSDP2 (Shard(0)) and tensor-parallel (Shard(0), Shard(1), Replicate) models."""
    bucket, options = s3
    remote = {"open": {"storage_options": options}}
    return [
        case("tp-universal", UNIVERSAL, ref(UNIVERSAL), shard="tp", build="meta"),
        case("fsdp2-universal-bf16", UNIVERSAL_BF16, ref(UNIVERSAL_BF16), shard="fsdp2", build="meta", dtype="bf16"),
        case("fsdp2-torch-pt", Z3_ENGINE, shard="fsdp2", build="meta"),
        case("tp-torch-bin", sources["bin"], shard="tp", build="meta"),
        case("fsdp2-dcp", DCP, ref(DCP), shard="fsdp2", build="meta"),
        case("tp-dcp", DCP, ref(DCP), shard="tp"),
        case("tp-dcp-tp", DCP_TP, ref(DCP_TP), shard="tp", build="meta"),
        case("fsdp2-dcp-tp", DCP_TP, ref(DCP_TP), shard="fsdp2"),
        case("tp-dcp-bf16", DCP_BF16, ref(DCP_BF16), shard="tp", build="meta", dtype="bf16"),
        case("fsdp2-dcp-hf", DCP_HF, ref(DCP_HF), shard="fsdp2", build="meta"),
        case("tp-dcp-hf", DCP_HF, ref(DCP_HF), shard="tp", build="meta"),
        case("tp-s3-zero3", f"{bucket}/z3", shard="tp", build="meta", **remote),
    ]


def framework_cases(sources: dict[str, Path]) -> list[dict[str, Any]]:
    """Other frameworks' checkpoints into FSDP2-sharded transformers models (tests/sharded_worker.py run_hf_case).

    verl: the live run's full state is the reference. Megatron with ``names="hf"``: zeroio's plain conversion,
    whose logits equal Megatron's own forward (tests/test_megatron_hf.py), is the reference for the sharded load.
    """
    return [
        case("hf-verl", VERL, ref(VERL), shard="fsdp2", hf_config=str(VERL / "huggingface")),
        case("hf-verl-bf16", VERL_BF16, ref(VERL_BF16), shard="fsdp2", hf_config=str(VERL_BF16 / "huggingface"),
             dtype="bf16"),
        case("hf-megatron", MEGATRON, sources["megatron_hf"] / "model.safetensors", shard="fsdp2",
             hf_config=str(sources["megatron_hf"]), open={"names": "hf"}),
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["hf-verl", "hf-verl-bf16", "hf-megatron"])
def test_other_frameworks_fill_fsdp2_transformers_models(two_ranks: dict[str, list[dict]], name: str) -> None:
    """verl's and Megatron's checkpoints fill an FSDP2-sharded transformers model built on meta, bit for bit."""
    records = two_ranks[name]
    assert [r["rank"] for r in records] == [0, 1]
    for record in records:
        assert record["ok"], record
        assert record["differ"] == [] and record["compared"] > 10, record
        assert record["sharded"] >= record["compared"] - 1, record  # every parameter a DTensor
        assert record["missing"] == [] and record["reference_unused"] == [], record
        assert all("rotary_emb" in key for key in record["meta"]), record  # non-persistent buffers only


def dtype_cases() -> list[dict[str, Any]]:
    """Targets fp32, bf16 and fp16, by the model's own dtype or by dtype=, from fp32, bf16 and fp16 sources."""
    return [
        case("fsdp2-dtype-fp16", Z3, shard="fsdp2", build="meta", kwargs={"dtype": "fp16"}, dtype_ref="fp16"),
        case("tp-dtype-fp16", Z3, shard="tp", kwargs={"dtype": "fp16"}, dtype_ref="fp16"),
        case("tp-dtype-fp32", BF16, ref(BF16), shard="tp", dtype="bf16", kwargs={"dtype": "fp32"}, dtype_ref="fp32"),
        case("tp-fp16-model", FP16, ref(FP16), shard="tp", build="meta", dtype="fp16"),
        case("fsdp2-dcp-bf16-to-fp16", DCP_BF16, ref(DCP_BF16), shard="fsdp2", build="meta", kwargs={"dtype": "fp16"},
             dtype_ref="fp16"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Path], web: str, s3: tuple[str, dict[str, str]]
) -> dict[str, list[dict]]:
    big = {"dims": BIG}
    rank0 = {"broadcast_from_rank0": True}
    cases = [
        case("fsdp2", Z3, shard="fsdp2", forward=True),
        case("fsdp2-meta", Z3, shard="fsdp2", build="meta", forward=True),
        case("fsdp2-to_empty", Z3, shard="fsdp2", build="to_empty", forward=True),
        case("fsdp2-bf16-mp", BF16, BF16 / "expected" / "engine.pt", shard="fsdp2", mp=True, dtype="bf16",
             build="meta", forward=True),
        case("fsdp2-dtype-arg", Z3, shard="fsdp2", build="meta", kwargs={"dtype": "bf16"}, dtype_ref="bf16"),
        case("fsdp2-universal", UNIVERSAL, UNIVERSAL / "expected" / "engine.pt", shard="fsdp2", build="meta"),
        case("fsdp2-safetensors", sources["st"], shard="fsdp2", build="meta"),
        case("tp-http", f"{web}/st/model.safetensors", shard="tp", build="meta"),
        case("tp", Z3, shard="tp"),
        case("tp-rowwise-embedding", Z3, shard="tp_rowemb", build="meta"),
        case("tp-bf16", BF16, BF16 / "expected" / "engine.pt", shard="tp", dtype="bf16"),
        case("big-fsdp2", sources["big"], sources["big_engine"], shard="fsdp2", build="meta", **big),
        case("big-tp", sources["big"], sources["big_engine"], shard="tp", build="meta", **big),
        case("mismatch-on-rank-1", Z3, shard="fsdp2", mismatch_rank=1),
        case("mismatch-everywhere", Z3, shard="tp", build="meta", mismatch_rank="all"),
        case("fsdp1", Z3, shard="fsdp1"),
        case("broadcast-fsdp2", Z3, shard="fsdp2", build="meta", kwargs=rank0, forward=True),
        case("broadcast-tp", BF16, BF16 / "expected" / "engine.pt", shard="tp", kwargs=rank0),
        case("broadcast-unsharded", Z3, shard="none", build="meta", kwargs=rank0, forward=True),
        case("broadcast-big-tp", sources["big"], sources["big_engine"], shard="tp", kwargs=rank0, **big),
        # Saved by torch's dcp.save from the tensor-parallel model: column chunks for the Colwise embedding.
        case("big-tp-dcp", tmp_path_factory.mktemp("big_dcp"), sources["big_engine"], shard="tp", build="meta",
             save_dcp=True, **big),
        case("after-errors", Z3, shard="fsdp2"),
        # 64-byte staging: every tensor crosses chunks, column blocks go row by row or in 2-row blocks, casts staged.
        case("tp-small-chunks", Z3, shard="tp", build="meta", kwargs={"dtype": "bf16"}, dtype_ref="bf16",
             staging_bytes=64),
        case("big-tp-dcp-small-chunks", tmp_path_factory.mktemp("big_dcp_small"), sources["big_engine"], shard="tp",
             build="meta", save_dcp=True, staging_bytes=4096, **big),
        *source_cases(sources, s3),
        *dtype_cases(),
        *framework_cases(sources),
        # Last: importing DeepSpeed takes seconds.
        case("zero-init", Z3, shard="zero_init"),
        case("zero-init-bf16", BF16, BF16 / "expected" / "engine.pt", shard="zero_init", dtype="bf16"),
    ]  # fmt: skip
    return run(tmp_path_factory.mktemp("two_ranks"), 2, cases)


LOADS = [
    "fsdp2",
    "fsdp2-meta",
    "fsdp2-to_empty",
    "fsdp2-bf16-mp",
    "fsdp2-dtype-arg",
    "fsdp2-universal",
    "fsdp2-safetensors",
    "tp-http",
    "tp",
    "tp-rowwise-embedding",
    "tp-bf16",
    "big-fsdp2",
    "big-tp",
    "after-errors",
    "tp-small-chunks",
    "big-tp-dcp-small-chunks",
    "broadcast-fsdp2",
    "broadcast-tp",
    "broadcast-unsharded",
    "broadcast-big-tp",
    "big-tp-dcp",
    "tp-universal",
    "fsdp2-universal-bf16",
    "fsdp2-torch-pt",
    "tp-torch-bin",
    "fsdp2-dcp",
    "tp-dcp",
    "tp-dcp-tp",
    "fsdp2-dcp-tp",
    "tp-dcp-bf16",
    "fsdp2-dcp-hf",
    "tp-dcp-hf",
    "tp-s3-zero3",
    "fsdp2-dtype-fp16",
    "tp-dtype-fp16",
    "tp-dtype-fp32",
    "tp-fp16-model",
    "fsdp2-dcp-bf16-to-fp16",
]


@pytest.mark.parametrize("name", LOADS)
def test_each_rank_holds_torchs_own_shards(two_ranks: dict[str, list[dict]], name: str) -> None:
    """Every local shard equals torch's sharding of the engine's tensors, bit for bit; layout and ties unchanged."""
    records = two_ranks[name]
    assert [r["rank"] for r in records] == [0, 1]
    for record in records:
        assert record["ok"], record
        assert record["differ"] == [], record
        assert record["same_layout"], record
        assert record["tied"], record
        assert record["missing"] == []
    if name.startswith("tp"):  # the placements asked for: Colwise and Rowwise weights, replicated biases
        assert {"['S(0)']", "['S(1)']", "['R']"} <= set(records[0]["placements"]), records[0]["placements"]
        if "forward_equal" in record:
            assert record["forward_equal"], record


@pytest.mark.parametrize("name", ["big-fsdp2", "big-tp"])
def test_each_rank_reads_only_its_slice(two_ranks: dict[str, list[dict]], name: str) -> None:
    """Bytes a rank reads while loading (after open read the header) are <= 1.1x its local shards' bytes."""
    for record in two_ranks[name]:
        assert record["load_bytes"] <= 1.1 * record["local_bytes"], record
        assert record["load_bytes"] >= record["local_bytes"], record  # the counter sees the reads at all


def test_column_blocks_are_read_in_row_blocks(two_ranks: dict[str, list[dict]]) -> None:
    """A Shard(1) column block (the Colwise embedding: 515 rows) is read in blocks of rows, not row by row: stored
    as torch's column chunks (DCP), each block is one read; stored whole (safetensors), each row's own bytes only.
    Bytes beyond the local shards are DCP's chunk headers."""
    for record in two_ranks["big-tp-dcp"]:
        # ~100 reads, most of them locating each chunk's archive; row by row they were 715.
        assert record["load_reads"] < 200, record
        assert record["local_bytes"] <= record["load_bytes"] <= 1.1 * record["local_bytes"], record
    for record in two_ranks["big-tp"]:
        assert record["load_bytes"] <= 1.1 * record["local_bytes"], record


def test_broadcast_from_rank0_reads_on_rank_0_only(two_ranks: dict[str, list[dict]]) -> None:
    """broadcast_from_rank0=True: rank 0 reads the tensors (all of them), rank 1 reads no tensor data at all."""
    first, second = two_ranks["broadcast-big-tp"]
    assert first["load_bytes"] >= BIG_BYTES, first
    assert second["load_bytes"] < 1024, second


def test_zero3_reads_its_slice(two_ranks: dict[str, list[dict]]) -> None:
    """From ZeRO-3 rank files too: beyond the local shards only record headers are read (the first load of a
    process also reads the rank files' metadata, so a later case of the job is measured)."""
    for record in two_ranks["after-errors"]:
        assert record["local_bytes"] <= record["load_bytes"] <= record["local_bytes"] + 1024, record


@pytest.mark.parametrize("name", ["zero-init", "zero-init-bf16"])
def test_zero_init_partitions(two_ranks: dict[str, list[dict]], name: str) -> None:
    """A deepspeed.zero.Init model: each rank fills its own ds_tensor (DeepSpeed's flat padded partition), so
    GatheredParameters yields the engine's tensors; partitions keep their shapes, reads stay near them."""
    for record in two_ranks[name]:
        assert record["ok"], record
        assert record["differ"] == [] and record["same_layout"] and record["tied"] and record["missing"] == []
    # The second case of the job is past the first read of the rank files' metadata.
    for record in two_ranks["zero-init-bf16"]:
        assert record["load_bytes"] <= 2 * record["local_bytes"] + 1024, record  # fp32 masters into bf16


def test_strict_mismatch_on_one_rank_raises_on_every_rank(two_ranks: dict[str, list[dict]]) -> None:
    """A mismatch on rank 1 only: rank 1 raises StateDictMismatchError, rank 0 a ShardedModelError naming rank 1,
    and nobody hangs (the job went on to the next case)."""
    first, second = two_ranks["mismatch-on-rank-1"]
    assert second["type"] == "StateDictMismatchError" and "size mismatch for mlp_in.weight" in second["message"]
    assert first["type"] == "ShardedModelError" and first["error_rank"] == 1
    assert (
        first["message"].startswith("Rank 1 could not load '") and "size mismatch for mlp_in.weight" in first["message"]
    )


def test_strict_mismatch_everywhere(two_ranks: dict[str, list[dict]]) -> None:
    """Global shapes are checked: a model whose global shape differs fails on every rank before anything is read."""
    for record in two_ranks["mismatch-everywhere"]:
        assert record["type"] == "StateDictMismatchError", record
        assert (
            "torch.Size([5, 7]) from checkpoint, the shape in current model is torch.Size([6, 7])" in record["message"]
        )


def test_fsdp1_is_refused_with_the_route_that_works(two_ranks: dict[str, list[dict]]) -> None:
    """FSDP1's flat parameters are not filled: a typed error on every rank names loading before wrapping, or FSDP2."""
    for record in two_ranks["fsdp1"]:
        assert record["type"] == "ShardedModelError", record
        assert record["message"] == (
            f"Cannot load '{Z3 / 'global_step2'}' into FullyShardedDataParallel: the model is wrapped by FSDP1 "
            "(FullyShardedDataParallel), whose flat parameters zeroio does not fill. Call zeroio.load on the model "
            "before wrapping it, or shard it with FSDP2 (torch.distributed.fsdp.fully_shard), whose DTensor "
            "parameters zeroio fills rank by rank."
        )


def test_two_dimensional_mesh(tmp_path: Path) -> None:
    """4 ranks: FSDP2 over tensor parallel on a 2x2 mesh (strided-shard placements, uneven rows), HSDP on a 2x2
    mesh (Replicate, Shard), HSDP over tensor parallel on a 2x1x2 mesh, and FSDP2 with an empty shard."""
    cases = [
        case("2d", Z3, shard="2d"),
        case("2d-meta", Z3, shard="2d", build="meta"),
        # 5 rows on 4 ranks: torch.chunk gives 2, 2, 1 and an empty shard on rank 3.
        case(
            "fsdp2-4-ranks",
            FIXTURES / "z3_ws4_fp32",
            FIXTURES / "z3_ws4_fp32" / "expected" / "engine.pt",
            shard="fsdp2",
            build="meta",
            forward=True,
        ),
        case("2d-z3-ws4", FIXTURES / "z3_ws4_fp32", FIXTURES / "z3_ws4_fp32" / "expected" / "engine.pt", shard="2d"),
        case("hsdp-meta", Z3, shard="hsdp", build="meta"),  # (Replicate, Shard(0)) placements
        case("3d", Z3, shard="3d", build="meta"),  # HSDP over tensor parallel, 3 mesh dimensions
        # DCP written by FSDP2 on 4 ranks with uneven rows and an empty chunk, into the same sharding.
        case("fsdp2-4-ranks-dcp", DCP_UNEVEN, ref(DCP_UNEVEN), shard="fsdp2", build="meta"),
    ]
    records = run(tmp_path, 4, cases)
    assert [r["ok"] for r in records.pop("docs")] == [True] * 4
    for name, by_rank in records.items():
        assert len(by_rank) == 4, name
        for record in by_rank:
            assert record["ok"], record
            assert record["differ"] == [] and record["same_layout"] and record["tied"], record
            if "forward_equal" in record:
                assert record["forward_equal"], record
            if name.startswith("fsdp2-4-ranks"):
                assert record["rank"] != 3 or record["mlp_in_local_rows"] == 0, record
                continue
            if name == "hsdp-meta":  # replicated across the two groups, row-sharded within each
                assert "['R', 'S(0)']" in record["placements"], record["placements"]
                continue
            if name == "3d":  # three mesh dimensions: replicate, FSDP (strided over tp), tp
                assert "['R', '_S(0, 2)', 'S(0)']" in record["placements"], record["placements"]
                assert "['R', 'S(0)', 'S(1)']" in record["placements"], record["placements"]
                continue
            # FSDP2 over TP: a row-sharded (Colwise) weight becomes _StridedShard on dp, Shard(0) on tp.
            assert "['_S(0, 2)', 'S(0)']" in record["placements"], record["placements"]
            assert "['S(0)', 'S(1)']" in record["placements"], record["placements"]


def test_three_dimensional_mesh(tmp_path: Path) -> None:
    """8 ranks: HSDP over tensor parallel on a 2x2x2 mesh, where the strided shard over the FSDP dimension splits
    rows for real (on the 2x1x2 mesh of the 4-rank test it holds them all), and 5 rows leave ranks empty."""
    cases = [
        case("3d-meta", Z3, shard="3d", build="meta"),
        case("3d-dcp-tp", DCP_TP, ref(DCP_TP), shard="3d"),
    ]
    records = run(tmp_path, 8, cases)
    for name, by_rank in records.items():
        if name == "docs":
            continue
        assert len(by_rank) == 8, name
        for record in by_rank:
            assert record["ok"], record
            assert record["differ"] == [] and record["same_layout"] and record["tied"], record
            assert "['R', '_S(0, 2)', 'S(0)']" in record["placements"], record["placements"]
            assert "['R', 'S(0)', 'S(1)']" in record["placements"], record["placements"]


def test_docs_examples_run(two_ranks: dict[str, list[dict]]) -> None:
    """docs/loading.md's "Sharded models" examples ran verbatim on both ranks (the 4-rank one in the 2-D test)."""
    assert len(DOC_BLOCKS) == 6
    assert [r["ok"] for r in two_ranks["docs"]] == [True, True]


def test_broadcast_from_rank0_needs_a_process_group() -> None:
    """Without torch.distributed initialised, broadcast_from_rank0=True is refused before anything is read."""
    from layout_checks import tiny_model

    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(zeroio.errors.ShardedModelError, match=r"^broadcast_from_rank0=True needs an initialised"):
        zeroio.load(Z3, model, broadcast_from_rank0=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
