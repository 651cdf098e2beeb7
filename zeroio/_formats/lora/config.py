"""A LoRA adapter's ``adapter_config.json``: found beside the checkpoint or given, read, and its merge scale."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ..._io.remote_path import RemotePath
from ...errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError
from .names import EMBEDDING_LAYER_NAMES, AdapterFileRules

__all__ = ["ADAPTER_CONFIG", "AdapterConfig", "AdapterConfigSource", "adapter_config_folder", "read_adapter_configs"]

ADAPTER_CONFIG = "adapter_config.json"
"""What ``PeftModel.save_pretrained`` writes beside the adapter weights (the HF Trainer: into ``checkpoint-N/``)."""

AdapterConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], None]
"""``adapter_config=``: an ``adapter_config.json`` file, a folder laid out as ``save_pretrained`` writes it
(``adapter_config.json``, ``<name>/adapter_config.json`` for a named adapter), the config as a dict, or None
(look beside the checkpoint)."""

_MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a config is a few KB; a huge file is not one

# LoRA variants whose merge is not ``W + scale * B @ A`` (peft 0.21.2 ``LoraLayer`` / ``LoraConfig``): refused by
# name rather than merged wrongly.
_UNMERGEABLE = {
    "use_dora": "DoRA (use_dora=True) rescales each merged column by its magnitude vector",
    "use_qalora": "QALoRA (use_qalora=True) pools the input features",
    "lora_bias": "lora_bias=True adds lora_B's bias to the base bias",
    "use_bdlora": "BD-LoRA (use_bdlora) uses block-diagonal factors",
    "alpha_pattern": "alpha_pattern gives some modules another lora_alpha",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) applies the adapter only after its invocation tokens, "
    "which PEFT itself refuses to merge",
    "arrow_config": "Arrow (arrow_config) routes between adapters per token, which PEFT itself refuses to merge",
    "kasa_config": "KaSA (kasa_config) truncates the base weight's singular values and scales the delta by its own "
    "singular values",
}


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """One adapter's config: the bytes to write out and the facts a merge needs."""

    adapter: str
    """The adapter name (``default`` unless the run named it)."""
    raw: bytes
    """The JSON as found (written out unchanged) or as given."""
    values: Mapping[str, Any]
    """The parsed JSON."""
    where: str
    """Where it came from (a path, or ``adapter_config=``), for messages."""

    def merge_scale(self, rank: int) -> float:
        """PEFT's ``scaling``: ``lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``), ``r`` read off the shapes.

        Raises:
            UnsupportedCheckpointError: a variant whose merge is not ``W + scale * B @ A`` (DoRA, ...), by name.
            CheckpointFormatError: ``lora_alpha`` missing, or not LoRA at all.
        """
        values = self.values
        if str(values.get("peft_type", "LORA")).upper() != "LORA":
            raise UnsupportedCheckpointError(
                f"{self.where}: adapter '{self.adapter}' is {values.get('peft_type')}, not LoRA; zeroio merges LoRA "
                "adapters only. Write the adapter with fmt='peft' and merge it with PEFT.",
                path=self.where, name=self.adapter, found=values.get("peft_type"),
            )  # fmt: skip
        for key, why in _UNMERGEABLE.items():
            if values.get(key):
                raise UnsupportedCheckpointError(
                    f"{self.where}: adapter '{self.adapter}' uses {key}: {why}, which merge_lora does not support. "
                    "Write the adapter with fmt='peft' and merge it with PEFT's merge_and_unload().",
                    path=self.where, name=self.adapter, found=key,
                )  # fmt: skip
        alpha = values.get("lora_alpha")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise CheckpointFormatError(
                f"{self.where}: adapter '{self.adapter}' has no numeric lora_alpha ({alpha!r}); the merge scale is "
                "lora_alpha / r. Pass the run's adapter_config.json with adapter_config=.",
                path=self.where, name=self.adapter,
            )  # fmt: skip
        # The very expressions of peft 0.21.2 LoraLayer.update_layer (a Python float, applied as `tensor * scaling`).
        return alpha / math.sqrt(rank) if values.get("use_rslora") else alpha / rank

    def file_rules(self, modules: Iterable[str]) -> AdapterFileRules:
        """What PEFT's adapter file holds besides the adapter's tensors, for a model of ``modules`` (the base
        model's module names): peft 0.21.2 ``get_peft_model_state_dict`` with ``save_embedding_layers="auto"``.

        Raises:
            CheckpointFormatError: ``target_modules`` is a pattern that is not a valid regular expression.
        """
        values = self.values
        bias = values.get("bias")
        target = values.get("target_modules")
        tokens = values.get("trainable_token_indices") is not None or values.get("peft_type") == "TRAINABLE_TOKENS"
        embeddings = False
        if isinstance(target, str) and target != "all-linear":
            try:
                pattern = re.compile(target)
            except re.error as exc:
                raise CheckpointFormatError(
                    f"{self.where}: adapter '{self.adapter}' has target_modules {target[:80]!r}, which is not a "
                    f"regular expression ({exc}). Pass the run's adapter_config.json with adapter_config=.",
                    path=self.where, name=self.adapter,
                ) from None  # fmt: skip
            layer = re.compile(r"(.*\.)?(" + "|".join(EMBEDDING_LAYER_NAMES) + r")$")
            embeddings = any(layer.match(m) and pattern.fullmatch(m) for m in modules)
        elif isinstance(target, list):
            embeddings = any(name in target for name in EMBEDDING_LAYER_NAMES)
        return AdapterFileRules(bias=bias if isinstance(bias, str) else "none", embeddings=embeddings and not tokens)

    @property
    def fan_in_fan_out(self) -> bool:
        """Whether the base weight is stored ``[in, out]`` (GPT-2's ``Conv1D``): the delta is transposed."""
        return bool(self.values.get("fan_in_fan_out"))


def adapter_config_folder(folder: Path | RemotePath, adapter: str) -> Path | RemotePath:
    """Where ``save_pretrained`` puts ``adapter``'s files under ``folder``: ``folder`` for ``default``, else
    ``folder/<adapter>`` (peft 0.21.2 ``PeftModel.save_pretrained``)."""
    return folder if adapter == "default" else folder / adapter


def read_adapter_configs(
    adapters: list[str], beside: list[Path | RemotePath], given: AdapterConfigSource
) -> dict[str, AdapterConfig]:
    """``{adapter: AdapterConfig}`` for every adapter: from ``given``, else from the first folder in ``beside``
    (the training output folder: ``checkpoint-N/``, then the tag folder) that holds it.

    Raises:
        CheckpointNotFoundError: an adapter's ``adapter_config.json`` is nowhere; the message names the adapter,
            the places looked in and ``adapter_config=`` / ``--adapter-config``.
        CheckpointFormatError: a config is not a JSON object.
    """
    if isinstance(given, Mapping):
        if len(adapters) != 1:
            raise ValueError(
                f"adapter_config= as a dict describes one adapter, but the checkpoint holds {len(adapters)} "
                f"({', '.join(adapters)}): pass a folder laid out as save_pretrained writes it "
                "(adapter_config.json, <name>/adapter_config.json)."
            )
        raw = (json.dumps(dict(given), indent=2, sort_keys=True) + "\n").encode()
        return {adapters[0]: AdapterConfig(adapters[0], raw, dict(given), "adapter_config=")}
    if given is not None:
        path = Path(os.fspath(given))
        if path.is_file():
            if len(adapters) != 1:
                raise ValueError(
                    f"adapter_config='{path}' is one file, but the checkpoint holds {len(adapters)} adapters "
                    f"({', '.join(adapters)}): pass the folder save_pretrained wrote (adapter_config.json, "
                    "<name>/adapter_config.json)."
                )
            return {adapters[0]: _read(path, adapters[0])}
        if not path.is_dir():
            raise CheckpointNotFoundError(f"adapter_config='{path}' does not exist.", path=path)
        beside = [path]
    configs = {}
    for adapter in adapters:
        candidates = [adapter_config_folder(folder, adapter) / ADAPTER_CONFIG for folder in beside]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            looked = ", ".join(f"'{c}'" for c in candidates)
            raise CheckpointNotFoundError(
                f"No adapter_config.json for LoRA adapter '{adapter}' (looked in {looked}): lora_alpha and the "
                "target layers are not in the checkpoint. Pass the run's adapter_config.json with adapter_config=PATH.",
                path=str(candidates[0]), name=adapter,
            )  # fmt: skip
        configs[adapter] = _read(found, adapter)
    return configs


def _read(path: Path | RemotePath, adapter: str) -> AdapterConfig:
    size = path.stat().st_size
    if size > _MAX_CONFIG_BYTES:
        raise CheckpointFormatError(
            f"'{path}' is {size} bytes, too large for an adapter_config.json: point adapter_config= at the right file.",
            path=str(path), name=adapter,
        )  # fmt: skip
    raw = path.read_bytes()
    try:
        values = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise CheckpointFormatError(
            f"'{path}' is not JSON ({exc}): it should be the adapter_config.json that PEFT's save_pretrained wrote.",
            path=str(path), name=adapter,
        ) from None  # fmt: skip
    if not isinstance(values, dict):
        raise CheckpointFormatError(
            f"'{path}' is not a JSON object: it should be the adapter_config.json that save_pretrained wrote.",
            path=str(path), name=adapter,
        )  # fmt: skip
    return AdapterConfig(adapter, raw, values, str(path))
