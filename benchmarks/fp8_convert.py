"""Convert a multi-GB synthetic block-scaled FP8 checkpoint (DeepSeek-V3 shapes) to bf16 safetensors; time and RSS.

    python benchmarks/fp8_convert.py --layers 5 --dir /tmp/zeroio-fp8-bench      # ~2.9 GB of FP8, then convert
    python benchmarks/fp8_convert.py --layers 5 --dir /tmp/zeroio-fp8-bench --keep   # keep the files afterwards
    python benchmarks/fp8_convert.py --layers 5 --hub     # from hf://, served by the tests' local Hub server

Writes ``DIR/fp8`` in DeepSeek-V3's layout (``config.json`` with its ``quantization_config``, one safetensors
shard per layer and ``model.safetensors.index.json``): each layer holds V3's dense-layer linear weights
(``q_a_proj`` [1536, 7168], ``q_b_proj`` [24576, 1536], ``kv_a_proj_with_mqa`` [576, 7168], ``kv_b_proj``
[32768, 512], ``o_proj`` [7168, 16384], ``gate_proj`` / ``up_proj`` [18432, 7168], ``down_proj`` [7168, 18432])
as random ``float8_e4m3fn`` (NaN codes replaced) with random float32 ``weight_scale_inv`` per 128x128 block, and
its bf16 norms. Then runs ``/usr/bin/time -v python -m zeroio convert DIR/fp8 DIR/bf16 --quiet`` and prints wall
time, peak RSS, checkpoint and output sizes and the largest tensor as JSON; ``--check`` also compares one weight
of the output with DeepSeek's algorithm (torch, on CPU). With ``--hub`` the checkpoint is uploaded to the local
Hub-protocol server of the tests (``tests/hub_server.py``, localhost, Git LFS path) and converted from
``hf://user/fp8-bench``: every byte then comes through ranged HTTP reads. The files are deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

LINEARS = {
    "self_attn.q_a_proj": (1536, 7168),
    "self_attn.q_b_proj": (24576, 1536),
    "self_attn.kv_a_proj_with_mqa": (576, 7168),
    "self_attn.kv_b_proj": (32768, 512),
    "self_attn.o_proj": (7168, 16384),
    "mlp.gate_proj": (18432, 7168),
    "mlp.up_proj": (18432, 7168),
    "mlp.down_proj": (7168, 18432),
}
NORMS = {"input_layernorm": 7168, "post_attention_layernorm": 7168, "self_attn.q_a_layernorm": 1536}
BLOCK = 128


def _fp8(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    raw[(raw & 0x7F) == 0x7F] = 0x40  # e4m3fn's NaN codes -> 2.0
    return raw.view(torch.float8_e4m3fn)


def build(root: Path, layers: int) -> int:
    """The synthetic checkpoint; returns its size in bytes."""
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0
    for layer in range(layers):
        tensors: dict[str, torch.Tensor] = {}
        for name, (rows, cols) in LINEARS.items():
            key = f"model.layers.{layer}.{name}.weight"
            tensors[key] = _fp8((rows, cols), gen)
            scale = torch.rand((-(-rows // BLOCK), -(-cols // BLOCK)), generator=gen) * 1e-3 + 1e-5
            tensors[key + "_scale_inv"] = scale
        for name, size in NORMS.items():
            tensors[f"model.layers.{layer}.{name}.weight"] = torch.ones(size, dtype=torch.bfloat16)
        filename = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(root / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "num_hidden_layers": layers,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
        },
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return sum(p.stat().st_size for p in root.iterdir())


def _check(src: Path, dst: Path) -> bool:
    """One weight of the output equals DeepSeek's ``weight_dequant`` (fp32 product per block, then bf16)."""
    from safetensors import safe_open

    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 576 rows: an edge row block
    source = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(src / source), "pt") as f:
        x, s = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
    index_path = dst / "model.safetensors.index.json"
    shard = json.loads(index_path.read_text())["weight_map"][name] if index_path.exists() else "model.safetensors"
    with safe_open(str(dst / shard), "pt") as f:
        got = f.get_tensor(name)
    expanded = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: x.shape[0], : x.shape[1]]
    want = (x.to(torch.float32) * expanded).to(torch.bfloat16)
    return bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))


def _serve_on_hub(src: Path, home: Path) -> tuple[object, str, dict[str, str]]:
    """Upload ``src`` to a local Hub server; return the server, the ``hf://`` URL and the child's environment."""
    env = {"HF_HOME": str(home), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    os.environ.update(env)  # read by huggingface_hub at import
    sys.path.insert(0, str(REPO / "tests"))
    from hub_server import DEFAULT_TOKEN, DEFAULT_USER, HubServer
    from huggingface_hub import HfApi

    server = HubServer().start()
    api = HfApi(endpoint=server.endpoint, token=DEFAULT_TOKEN)
    repo = f"{DEFAULT_USER}/fp8-bench"
    api.create_repo(repo)
    api.upload_folder(repo_id=repo, folder_path=src)
    return server, f"hf://{repo}", {**env, "HF_ENDPOINT": server.endpoint, "HF_TOKEN": DEFAULT_TOKEN}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/zeroio-fp8-bench"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the output")
    parser.add_argument("--check", action="store_true", help="compare one output weight with DeepSeek's algorithm")
    parser.add_argument("--hub", action="store_true", help="convert from hf:// (the tests' local Hub server)")
    args = parser.parse_args()
    if args.dir.exists():
        sys.exit(f"{args.dir} exists: remove it or pass another --dir")
    src, dst = args.dir / "fp8", args.dir / "bf16"
    server = None
    try:
        started = time.perf_counter()
        size = build(src, args.layers)
        built = time.perf_counter() - started
        source, env = str(src), dict(os.environ)
        if args.hub:
            server, source, hub_env = _serve_on_hub(src, args.dir / "hf-home")
            env.update(hub_env)
        command = [sys.executable, "-m", "zeroio", "convert", source, str(dst), "--quiet"]
        done = subprocess.run(
            ["/usr/bin/time", "-v", *command], capture_output=True, text=True, check=True, env=env, cwd=REPO
        )
        wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", done.stderr)
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
        assert wall is not None and rss is not None, done.stderr
        seconds = int(wall[1] or 0) * 3600 + int(wall[2]) * 60 + float(wall[3])
        largest = max(r * c for r, c in LINEARS.values())
        result = {
            "command": " ".join(["/usr/bin/time", "-v", "python", *command[1:]]),
            "checkpoint_bytes": size,
            "output_bytes": sum(p.stat().st_size for p in dst.iterdir()),
            "tensors": args.layers * (len(LINEARS) + len(NORMS)),
            "largest_tensor_bf16_bytes": largest * 2,
            "wall_s": seconds,
            "peak_rss_bytes": int(rss[1]) * 1024,
            "build_s": round(built, 1),
        }
        if args.check:
            result["bit_exact_sample"] = _check(src, dst)
        print(json.dumps(result, indent=2))
    finally:
        if server is not None:
            server.stop()  # type: ignore[attr-defined]
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
