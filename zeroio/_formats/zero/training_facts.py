"""How a ZeRO checkpoint was trained, as its files tell: serialization, offload device, optimizer.

Read from metadata only: the rank files' serialization (zip or legacy), the ``ds_config`` DeepSpeed stores in the
model states (``zero_optimization.offload_optimizer/offload_param.device``, ``optimizer.type``) and, for a client
optimizer the config does not name, the names of the state each parameter carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..._pickles import RankFile
from ..metadata import CheckpointMetadata

__all__ = ["offload_device", "optimizer_name", "training_facts"]

_STATE_SIGNATURES = (
    (frozenset({"exp_avg", "exp_avg_sq"}), "Adam"),
    (frozenset({"momentum_buffer"}), "SGD"),
    (frozenset({"exp_avg"}), "Lion"),
)
"""Per-parameter tensor state of torch's and DeepSpeed's optimizers, when the config does not name the optimizer."""


def offload_device(ds_config: Any) -> str | None:
    """``nvme`` or ``cpu`` when the config offloads optimizer state or parameters there (nvme wins), else None."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    if not isinstance(zero, dict):
        return None
    devices = set()
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        device = section.get("device") if isinstance(section, dict) else None
        if isinstance(device, str):
            devices.add(device.lower())
    return "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else None


def _state_keys(base_state: Any) -> frozenset[str]:
    state = base_state.get("state") if isinstance(base_state, dict) else None
    keys: set[str] = set()
    for entry in state.values() if isinstance(state, dict) else ():
        if isinstance(entry, dict):
            keys.update(k for k in entry if isinstance(k, str) and k != "step")
    return frozenset(keys)


def optimizer_name(ds_config: Any, optimizer_states: Sequence[Any]) -> str | None:
    """The config's ``optimizer.type``; else the optimizer whose state keys rank 0's state holds; else None."""
    section = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    kind = section.get("type") if isinstance(section, dict) else None
    if isinstance(kind, str) and kind:
        return kind
    if not optimizer_states:
        return None
    keys = _state_keys(optimizer_states[0])
    return next((name for signature, name in _STATE_SIGNATURES if keys == signature), None)


def training_facts(
    metadata: CheckpointMetadata, files: Sequence[RankFile], optimizer_states: Sequence[Any]
) -> CheckpointMetadata:
    """``metadata`` with ``serialization``, ``offload`` and ``optimizer`` filled in from the files."""
    kinds = {file.serialization for file in files}
    ds_config = metadata.extra.get("ds_config")
    return dataclasses.replace(
        metadata,
        serialization=metadata.serialization or ("legacy" if "legacy" in kinds else "zip" if kinds else None),
        offload=metadata.offload or offload_device(ds_config),
        optimizer=metadata.optimizer or optimizer_name(ds_config, optimizer_states),
    )
