"""DeepSpeed's on-disk vocabulary (file names, dict keys) and Hugging Face output names."""

from __future__ import annotations

import re

# --- DeepSpeed checkpoint folders (checked against DeepSpeed 0.19.8's engine.py / checkpoint/constants.py)
LATEST_FILE = "latest"
ZERO_OPTIM_FILE = re.compile(
    r"^(?P<prefix>bf16_|fp16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$"
)
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
MODEL_FILE = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
# Layouts zeroio refuses (yet): MoE expert files and pipeline-parallel layer files.
MOE_OPTIM_FILE = re.compile(r"^(bf16_)?expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
MOE_EXPERT_FILE = re.compile(r"^(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$")
PIPELINE_LAYER_FILE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
STATES_SUFFIX = "_states.pt"

# model_states keys
MODULE = "module"
BUFFER_NAMES = "buffer_names"
PARAM_SHAPES = "param_shapes"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
SHARED_PARAMS = "shared_params"
DS_VERSION = "ds_version"
GLOBAL_STEPS = "global_steps"
DS_CONFIG = "ds_config"
MP_WORLD_SIZE = "mp_world_size"
DP_WORLD_SIZE = "dp_world_size"

# optim_states keys
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
ZERO_STAGE = "zero_stage"
PARTITION_COUNT = "partition_count"
FP32_FLAT_GROUPS = "fp32_flat_groups"  # ZeRO-3
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"  # ZeRO-1/2
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"  # ZeRO-1/2, newer DeepSpeed
PARAM_SLICE_MAPPINGS = "param_slice_mappings"  # ZeRO-1/2: {name: fragment_address(start, numel)} per group, per rank
BASE_OPTIMIZER_STATE = "base_optimizer_state"  # ZeRO-1/2: the torch optimizer's state_dict()

# --- safetensors
SAFETENSORS_MAX_HEADER_SIZE = 100_000_000
"""safetensors refuses headers larger than this (``MAX_HEADER_SIZE`` in its Rust crate); reader and writer share it."""

# --- Hugging Face output naming (as transformers / huggingface_hub write it)
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SHARD = "model-{index:05d}-of-{total:05d}.safetensors"
TORCH_SINGLE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SHARD = "pytorch_model-{index:05d}-of-{total:05d}.bin"
