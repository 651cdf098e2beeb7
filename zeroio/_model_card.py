"""The Hub model card of a conversion: the facts it states (where the weights came from, what they are now) and
the ``README.md`` (and default commit message) rendered from them.

Its own module, below both verbs that need it: ``convert`` records the facts (``ConvertResult.card_facts``) and
``push_to_hub`` renders them, and ``push_to_hub`` calls ``convert``, so neither may import the other's facts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._dtypes import DType
from ._metadata import CheckpointMetadata, dtype_name
from ._text import listing

if TYPE_CHECKING:
    import torch

__all__ = ["CARD_TAGS", "card_facts", "default_commit_message", "render_model_card"]

CARD_TAGS = ("deepspeed", "zeroio")
"""Tags every model card carries (``safetensors`` is added for safetensors weights)."""


def card_facts(
    source: CheckpointMetadata,
    *,
    fmt: str,
    target: torch.dtype | DType | None,
    out_dtypes: Iterable[torch.dtype | DType],
    excluded: Sequence[str],
    num_params: int,
) -> dict[str, Any]:
    """``ConvertResult.card_facts``: ``source_format``, ``tag``, ``ds_version``, ``zero_stage``, ``world_size``,
    ``global_step``, ``train_dtype``, ``output_dtype``, ``format``, ``num_params``, ``excluded_frozen``.

    ``output_dtype`` is the cast asked for, else the floating dtypes written joined with ``+`` (None if none).
    """
    floating = sorted({dtype_name(d) for d in out_dtypes if d.is_floating_point})
    output_dtype: str | None
    if target is not None:
        output_dtype = dtype_name(target)
    else:
        output_dtype = "+".join(floating) if floating else None
    return {
        "source_format": source.format,
        "tag": source.tag,
        "ds_version": source.ds_version,
        "zero_stage": source.zero_stage,
        "world_size": source.world_size,
        "global_step": source.global_step,
        "train_dtype": dtype_name(source.train_spec) if source.train_spec is not None else None,
        "output_dtype": output_dtype,
        "format": fmt,
        "num_params": num_params,
        "excluded_frozen": list(excluded),
    }


# --------------------------------------------------------------------------- the card and commit message


def render_model_card(repo_id: str, facts: Mapping[str, Any], *, files: list[str] | tuple[str, ...] = ()) -> str:
    """The ``README.md`` pushed with the weights: YAML front matter, then what the files are and where they came from.

    ``facts`` are ``ConvertResult.card_facts``; without them the card stays generic.
    """
    has_config = "config.json" in files
    tags = [*CARD_TAGS]
    if any(f.endswith(".safetensors") for f in files) or facts.get("format") == "safetensors":
        tags.append("safetensors")
    lines = ["---", f"library_name: {'transformers' if has_config else 'pytorch'}", "tags:"]
    lines += [f"- {t}" for t in tags]
    lines += ["---", "", f"# {repo_id.split('/')[-1]}", ""]

    zeroio_link = "[zeroio](https://pypi.org/project/zeroio/)"
    if facts.get("source_format") == "zero":
        intro = (
            f"These weights were converted from a DeepSpeed ZeRO checkpoint with {zeroio_link}, which reads the "
            "checkpoint's rank files directly (no DeepSpeed, no GPU)."
        )
    elif facts:
        intro = f"These weights were converted from a {facts.get('source_format')} checkpoint with {zeroio_link}."
    else:
        intro = (
            f"These weights were uploaded with {zeroio_link}, a reader and converter for DeepSpeed ZeRO checkpoints."
        )
    lines += [intro, ""]

    rows = _fact_rows(facts)
    if rows:
        lines += ["| Source checkpoint | |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in rows]
        lines.append("")

    weights = [f for f in files if f.endswith((".safetensors", ".bin"))]
    if weights:
        lines += ["## Files", ""]
        lines += [f"- `{f}`" for f in weights]
        lines.append("")

    lines += ["## Usage", ""]
    if has_config:
        lines += [
            "```python",
            "from transformers import AutoModel",
            "",
            f'model = AutoModel.from_pretrained("{repo_id}")',
            "```",
            "",
        ]
    else:
        lines += [
            "```python",
            "from huggingface_hub import snapshot_download",
            "from safetensors.torch import load_file",
            "",
            f'folder = snapshot_download("{repo_id}")',
            'state_dict = load_file(f"{folder}/model.safetensors")  # sharded: see model.safetensors.index.json',
            "```",
            "",
        ]
    return "\n".join(lines)


def _fact_rows(facts: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if facts.get("zero_stage") is not None:
        rows.append(("ZeRO stage", str(facts["zero_stage"])))
    if facts.get("world_size") is not None:
        rows.append(("Data-parallel world size", str(facts["world_size"])))
    if facts.get("ds_version"):
        rows.append(("DeepSpeed version", f"`{facts['ds_version']}`"))
    if facts.get("tag"):
        rows.append(("Tag", f"`{facts['tag']}`"))
    if facts.get("global_step") is not None:
        rows.append(("Global step", f"{facts['global_step']:,}"))
    if facts.get("train_dtype"):
        rows.append(("Training dtype", str(facts["train_dtype"])))
    if facts.get("output_dtype"):
        rows.append(("Weights dtype", str(facts["output_dtype"])))
    if facts.get("num_params") is not None:
        rows.append(("Parameters", f"{facts['num_params']:,}"))
    excluded = facts.get("excluded_frozen") or []
    if excluded:
        rows.append(("Frozen parameters left out", listing(excluded, show=lambda n: f"`{n}`")))
    return rows


def default_commit_message(facts: Mapping[str, Any], *, converted: bool) -> str:
    """The Hub commit message when none is given: says a ZeRO checkpoint was converted, and its tag."""
    if converted or facts.get("source_format") != "zero":
        return "Upload model with zeroio"
    tag = f" {facts['tag']}" if facts.get("tag") else ""
    return f"Upload DeepSpeed ZeRO checkpoint{tag} converted with zeroio"
