"""Shard planning: sizes parsed and tensors split exactly as huggingface_hub does, HF names and index."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroio._write.sharding import index_json, parse_size, plan_shards

PATTERN = "model{suffix}.safetensors"


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param("5GB", 5_000_000_000, id="5GB"),
        pytest.param("1.5GB", 1_500_000_000, id="fraction"),
        pytest.param("500MB", 500_000_000, id="MB"),
        pytest.param("64KB", 64_000, id="KB"),
        pytest.param("2TB", 2_000_000_000_000, id="TB"),
        pytest.param("5gb", 5_000_000_000, id="lower-case"),
        pytest.param(" 5 GB ", 5_000_000_000, id="spaces"),
        pytest.param("0.5KB", 500, id="sub-unit"),
    ],
)
def test_parse_size_decimal_units_like_huggingface_hub(text, expected):
    """Sizes with units are decimal and agree with huggingface_hub's parse_size_to_int."""
    assert parse_size(text) == expected == parse_size_to_int(text)


@pytest.mark.parametrize("value, expected", [(1, 1), (123_456, 123_456), ("1000", 1000)], ids=["one", "int", "digits"])
def test_parse_size_accepts_byte_counts(value, expected):
    """An int, or a string of digits, is a byte count."""
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        pytest.param(
            "5XB",
            "Cannot parse max_shard_size '5XB': use a number with a unit TB, GB, MB or KB (decimal, e.g. '5GB', "
            "'500MB') or a byte count.",
            id="unit",
        ),
        pytest.param("GB", "Cannot parse max_shard_size 'GB': '' is not a number. Use e.g. '5GB'.", id="no-number"),
        pytest.param("xMB", "Cannot parse max_shard_size 'xMB': 'x' is not a number. Use e.g. '5GB'.", id="letters"),
        pytest.param("infGB", "max_shard_size must be finite, got 'infGB'.", id="inf"),
        pytest.param(0, "max_shard_size must be positive, got 0.", id="zero"),
        pytest.param(-5, "max_shard_size must be positive, got -5.", id="negative"),
        pytest.param("0MB", "max_shard_size must be positive, got '0MB'.", id="zero-unit"),
    ],
)
def test_parse_size_rejects_bad_values(value, message):
    """Unparseable or non-positive sizes raise ValueError saying what to write."""
    with pytest.raises(ValueError) as excinfo:
        parse_size(value)
    assert str(excinfo.value) == message


@pytest.mark.parametrize("value", [True, 5.0, None], ids=["bool", "float", "none"])
def test_parse_size_rejects_other_types(value):
    """Anything but an int or a string is a TypeError."""
    with pytest.raises(TypeError) as excinfo:
        parse_size(value)
    assert str(excinfo.value) == f"max_shard_size must be an int or a string like '5GB', got {value!r}."


def _hf_split(sizes: dict[str, int], limit: int, ties: dict[str, str] | None = None):
    tensors: dict[str, torch.Tensor] = {}
    for name, size in sizes.items():
        source = (ties or {}).get(name)
        tensors[name] = tensors[source] if source else torch.empty(size, dtype=torch.uint8)
    return split_torch_state_dict_into_shards(tensors, max_shard_size=limit, filename_pattern=PATTERN)


@pytest.mark.parametrize(
    "sizes, limit, expected",
    [
        pytest.param(
            {"a": 6, "b": 6, "c": 2, "d": 6, "e": 2, "f": 2}, 10, [["a"], ["b", "c"], ["d", "e", "f"]], id="hf-doc"
        ),
        pytest.param({"a": 1, "b": 2, "c": 3}, 100, [["a", "b", "c"]], id="one-shard"),
        pytest.param({"a": 3, "big": 50, "b": 3, "c": 5}, 10, [["big"], ["a", "b"], ["c"]], id="oversized-own-shard"),
        pytest.param({"a": 10, "b": 10}, 10, [["a"], ["b"]], id="exactly-full"),
        pytest.param({"a": 4, "b": 4, "c": 4}, 1, [["a"], ["b"], ["c"]], id="all-oversized"),
    ],
)
def test_plan_matches_huggingface_hub_split(sizes, limit, expected):
    """Shards are filled in key order and closed before overflowing, as huggingface_hub splits them."""
    plan = plan_shards(sizes, max_shard_size=limit, filename_pattern=PATTERN)
    assert [list(names) for _, names in plan.shards] == expected
    hf = _hf_split(sizes, limit)
    assert {f: list(n) for f, n in plan.shards} == hf.filename_to_tensors
    assert plan.weight_map == hf.tensor_to_filename
    assert list(plan.weight_map) == list(hf.tensor_to_filename)
    assert plan.total_size == hf.metadata["total_size"] == sum(sizes.values())
    assert plan.is_sharded == hf.is_sharded


def test_file_names_follow_hugging_face():
    """One shard is `model.safetensors`; several are `model-0000K-of-0000N.safetensors`."""
    one = plan_shards({"a": 1}, max_shard_size=10, filename_pattern=PATTERN)
    assert [f for f, _ in one.shards] == ["model.safetensors"]
    three = plan_shards({"a": 5, "b": 5, "c": 5}, max_shard_size=5, filename_pattern="pytorch_model{suffix}.bin")
    assert [f for f, _ in three.shards] == [
        "pytorch_model-00001-of-00003.bin",
        "pytorch_model-00002-of-00003.bin",
        "pytorch_model-00003-of-00003.bin",
    ]


def test_tied_aliases_join_their_source_and_count_once():
    """A tied alias takes no space and lands in its source's shard, after that shard's keys (huggingface_hub)."""
    sizes = {"emb": 8, "x": 8, "y": 8, "head": 8, "z": 8}
    ties = {"head": "emb"}
    plan = plan_shards(sizes, max_shard_size=16, filename_pattern=PATTERN, aliases=ties)
    assert [list(n) for _, n in plan.shards] == [["emb", "x", "head"], ["y", "z"]]
    assert plan.total_size == 32
    hf = _hf_split(sizes, 16, ties)
    assert plan.weight_map == hf.tensor_to_filename and list(plan.weight_map) == list(hf.tensor_to_filename)
    assert plan.total_size == hf.metadata["total_size"]


def test_no_tensors_gives_one_empty_file():
    """An empty selection still plans one (empty) `model.safetensors`, so the output is loadable."""
    plan = plan_shards({}, max_shard_size=10, filename_pattern=PATTERN)
    assert plan.shards == (("model.safetensors", ()),)
    assert plan.total_size == 0 and not plan.is_sharded


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=12),
    limit=st.integers(min_value=1, max_value=80),
    tie_pairs=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 11)), max_size=3),
)
def test_plan_equals_huggingface_hub_for_any_sizes(sizes, limit, tie_pairs):
    """For any sizes, limit and ties, the plan is huggingface_hub's split (files, order, total size)."""
    names = [f"t{i}" for i in range(len(sizes))]
    ties: dict[str, str] = {}
    for a, b in tie_pairs:  # alias t<b> of source t<a>; a source is never itself an alias
        if a < b < len(names) and names[a] not in ties and names[b] not in ties and names[b] not in ties.values():
            ties[names[b]] = names[a]
    sized = {n: s for n, s in zip(names, sizes)}
    for alias, src in ties.items():
        sized[alias] = sized[src]
    plan = plan_shards(sized, max_shard_size=limit, filename_pattern=PATTERN, aliases=ties)
    hf = _hf_split(sized, limit, ties)
    assert {f: list(n) for f, n in plan.shards} == hf.filename_to_tensors
    assert list(plan.weight_map.items()) == list(hf.tensor_to_filename.items())
    assert plan.total_size == hf.metadata["total_size"]


def test_index_json_golden():
    """The index text is huggingface_hub's: total_size and tie records in metadata, indent=2, no newline."""
    plan = plan_shards({"emb": 8, "x": 8, "y": 8}, max_shard_size=16, filename_pattern=PATTERN)
    text = index_json(plan, extra_metadata={"head": "emb"})
    assert text == (
        "{\n"
        '  "metadata": {\n'
        '    "total_size": 24,\n'
        '    "head": "emb"\n'
        "  },\n"
        '  "weight_map": {\n'
        '    "emb": "model-00001-of-00002.safetensors",\n'
        '    "x": "model-00001-of-00002.safetensors",\n'
        '    "y": "model-00002-of-00002.safetensors"\n'
        "  }\n"
        "}"
    )
    assert json.loads(text) == {
        "metadata": {"total_size": 24, "head": "emb"},
        "weight_map": {
            "emb": "model-00001-of-00002.safetensors",
            "x": "model-00001-of-00002.safetensors",
            "y": "model-00002-of-00002.safetensors",
        },
    }
