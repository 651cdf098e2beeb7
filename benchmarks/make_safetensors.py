"""A random bf16 GPT checkpoint in safetensors shards with its index, in seconds, for read-path benchmarks.

The same shapes as ``make_checkpoint.py --params P`` (tied head stored once), so ``loaders_side_by_side.py`` can
load it into its meta-built model; the values are random (what is timed is reading, not training). Writes
``manifest.json`` (``config``) beside the shards. ``--hf`` writes the same shapes as a transformers GPT-2 model
instead (its names and Conv1D layouts, ``config.json``), so ``from_pretrained`` can load it too::

    python benchmarks/make_safetensors.py --params 1.3B --shards 2 --out /tmp/zb/st-bf16
    python benchmarks/make_safetensors.py --params 1.3B --shards 2 --hf --dtype fp32 --out /tmp/zb/hf-fp32
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> int:
    import make_checkpoint as make
    import torch
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="1.3B")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--hf", action="store_true", help="a transformers GPT-2 model (names, config.json)")
    args = parser.parse_args(argv)
    cfg = make.config_for(args.params, vocab=50304, n_ctx=1024, tied=True)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hf:
        import transformers

        hf = transformers.GPT2Config(
            vocab_size=cfg.vocab, n_positions=cfg.n_ctx, n_embd=cfg.d_model, n_layer=cfg.n_layer,
            n_head=max(1, cfg.d_model // 64), tie_word_embeddings=True, dtype=args.dtype.replace("bf16", "bfloat16")
            .replace("fp32", "float32"),
        )  # fmt: skip
        hf.save_pretrained(args.out)
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(hf)
    else:
        with torch.device("meta"):
            model = make.build_model(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte.weight
    state = {k: v for k, v in state.items() if v.is_floating_point()}
    total = sum(v.numel() * dtype.itemsize for v in state.values())
    g = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0
    names = list(state)
    for i, name in enumerate(names):
        shard[name] = (torch.randn(state[name].shape, generator=g) * 0.02).to(dtype)
        size += shard[name].numel() * dtype.itemsize
        if size >= total / args.shards or i == len(names) - 1:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(args.out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (args.out / "manifest.json").write_text(json.dumps({"config": asdict(cfg), "params": cfg.num_params()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
