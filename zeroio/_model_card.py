"""The Hub model card of a conversion: the facts it states (where the weights came from, what they are now) and
the ``README.md`` (and default commit message) rendered from them.

Its own module, below both verbs that need it: ``convert`` records the facts (``ConvertResult.card_facts``) and
``push_to_hub`` renders them, and ``push_to_hub`` calls ``convert``, so neither may import the other's facts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._dtypes import DType
from ._formats import CheckpointMetadata, dtype_name
from ._messages import listing
from ._write import CardInputs

if TYPE_CHECKING:
    import torch

__all__ = ["CARD_TAGS", "card_facts", "default_commit_message", "render_model_card", "written_card_facts"]

CARD_TAGS = ("deepspeed", "zeroio")
"""Tags every model card carries (``safetensors`` is added for safetensors weights)."""

MAX_VALUE_CHARS = 200
"""Longest checkpoint-derived value shown in a card (a version, a tag, a tensor name); longer ones are cut."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
_PLAIN_YAML = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]<>#|~])")


# --------------------------------------------------------------------------- values from the checkpoint
# A checkpoint's values (ds_version, tag, tensor and file names) are the attacker's: a ds_version holding
# "\n# Install\ncurl ... | sh" would add a heading and a command to the pushed README. Each is shown on one line.


def one_line(value: object) -> str:
    """``value`` as text on one line: control characters and line breaks become a space, cut to
    :data:`MAX_VALUE_CHARS`."""
    text = _CONTROL.sub(" ", str(value)).strip()
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def markdown_code(value: object) -> str:
    """A Markdown code span of ``value``: one line, backticks neutralised (a code span cannot escape them), ``|``
    escaped for table cells."""
    return "`" + one_line(value).replace("`", "'").replace("|", "\\|") + "`"


def markdown_text(value: object) -> str:
    """``value`` as Markdown text: one line, every character that could start a structure backslash-escaped."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", one_line(value))


def yaml_scalar(value: object) -> str:
    """``value`` as a YAML scalar: plain when it is a simple word, else double-quoted (JSON strings are YAML)."""
    text = str(value)
    return text if _PLAIN_YAML.match(text) else json.dumps(text)


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
    lines += [f"- {yaml_scalar(t)}" for t in tags]
    lines += ["---", "", f"# {one_line(repo_id.split('/')[-1])}", ""]

    zeroio_link = "[zeroio](https://pypi.org/project/zeroio/)"
    if facts.get("source_format") == "zero":
        intro = (
            f"These weights were converted from a DeepSpeed ZeRO checkpoint with {zeroio_link}, which reads the "
            "checkpoint's rank files directly (no DeepSpeed, no GPU)."
        )
    elif facts:
        source = markdown_text(facts.get("source_format"))
        intro = f"These weights were converted from a {source} checkpoint with {zeroio_link}."
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
        lines += [f"- {markdown_code(f)}" for f in weights]
        lines.append("")

    lines += ["## Usage", ""]
    if has_config:
        lines += [
            "```python",
            "from transformers import AutoModel",
            "",
            f"model = AutoModel.from_pretrained({json.dumps(one_line(repo_id))})",
            "```",
            "",
        ]
    else:
        lines += [
            "```python",
            "from huggingface_hub import snapshot_download",
            "from safetensors.torch import load_file",
            "",
            f"folder = snapshot_download({json.dumps(one_line(repo_id))})",
            'state_dict = load_file(f"{folder}/model.safetensors")  # sharded: see model.safetensors.index.json',
            "```",
            "",
        ]
    return "\n".join(lines)


def _fact_rows(facts: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if facts.get("zero_stage") is not None:
        rows.append(("ZeRO stage", markdown_text(facts["zero_stage"])))
    if facts.get("world_size") is not None:
        rows.append(("Data-parallel world size", markdown_text(facts["world_size"])))
    if facts.get("ds_version"):
        rows.append(("DeepSpeed version", markdown_code(facts["ds_version"])))
    if facts.get("tag"):
        rows.append(("Tag", markdown_code(facts["tag"])))
    if facts.get("global_step") is not None:
        rows.append(("Global step", _count(facts["global_step"])))
    if facts.get("train_dtype"):
        rows.append(("Training dtype", markdown_text(facts["train_dtype"])))
    if facts.get("output_dtype"):
        rows.append(("Weights dtype", markdown_text(facts["output_dtype"])))
    if facts.get("num_params") is not None:
        rows.append(("Parameters", _count(facts["num_params"])))
    excluded = facts.get("excluded_frozen") or []
    if excluded:
        rows.append(("Frozen parameters left out", listing([str(n) for n in excluded], show=markdown_code)))
    return rows


def _count(value: object) -> str:
    """``1,234`` for an int; anything else (a hostile file's string) as escaped text."""
    return f"{value:,}" if isinstance(value, int) else markdown_text(value)


def default_commit_message(facts: Mapping[str, Any], *, converted: bool) -> str:
    """The Hub commit message when none is given: says a ZeRO checkpoint was converted, and its tag."""
    if converted or facts.get("source_format") != "zero":
        return "Upload model with zeroio"
    tag = f" {one_line(facts['tag'])}" if facts.get("tag") else ""
    return f"Upload DeepSpeed ZeRO checkpoint{tag} converted with zeroio"


def written_card_facts(card: CardInputs | None) -> dict[str, Any]:
    """:func:`card_facts` of what a writer wrote (``{}`` for a format without card facts)."""
    if card is None:
        return {}
    return card_facts(
        card.source, fmt=card.fmt, target=card.target, out_dtypes=card.out_dtypes, excluded=card.excluded,
        num_params=card.num_params,
    )  # fmt: skip
