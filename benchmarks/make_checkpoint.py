"""Build a real DeepSpeed ZeRO-3 checkpoint of a GPT-like model, on CPU, for the benchmarks.

DeepSpeed's own launcher runs this file in ``--worker`` mode on 2 ranks (gloo,
``DS_ACCELERATOR=cpu``): the model is built under ``deepspeed.zero.Init`` so no
rank ever holds a full replica, trained for one step in bf16 with torch's
fused AdamW (DeepSpeed's ``torch_adam``), and saved with
``engine.save_checkpoint``. The driver then writes ``manifest.json`` next to
``latest`` with the model's configuration, its parameter count, the bytes on
disk and the build's wall time and peak memory.

    python benchmarks/make_checkpoint.py --params 125M --out /tmp/zeroio-bench/gpt-125M
    python benchmarks/make_checkpoint.py --params 350M --untied --out /tmp/zeroio-bench/gpt-350M-untied

Write checkpoints outside the repository: they are gigabytes (about 14 bytes per
parameter: bf16 weights are not stored for ZeRO-3, but the fp32 master weights
and both Adam moments are). Peak RAM while building is roughly 30 bytes per
parameter; 470M parameters need ~15 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve()

# GPT-2/GPT-3 shapes (n_layer, d_model) for the usual names; other sizes are solved for below.
PRESETS: dict[str, tuple[int, int]] = {
    "125M": (12, 768),
    "350M": (24, 1024),
    "760M": (24, 1536),
    "1.3B": (24, 2048),
}


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT-like model."""

    vocab: int
    n_ctx: int
    n_layer: int
    d_model: int
    tied: bool
    lora: int = 0
    """LoRA rank (0: none): PEFT's LoRA on every block's four linears (``c_attn``, ``c_proj``, ``c_fc``,
    ``mlp_proj``), the base frozen, as a fine-tuning run saves it (benchmarks/scale.py ``--lora``)."""

    def num_params(self) -> int:
        """Exact parameter count (tied head counted once)."""
        d = self.d_model
        block = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
        head = 0 if self.tied else self.vocab * d
        return self.vocab * d + self.n_ctx * d + self.n_layer * block + 2 * d + head


def parse_count(text: str) -> int:
    """``"125M"`` -> 125_000_000; accepts K, M, B (or G) suffixes and plain integers."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBG]?)\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (use e.g. 125M, 1.3B)")
    scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


def config_for(params: str, *, vocab: int, n_ctx: int, tied: bool) -> GPTConfig:
    """A GPT-like shape near ``params`` parameters: a named preset, else layers of a width chosen by size."""
    if params.upper() in PRESETS and vocab == 50304:
        n_layer, d_model = PRESETS[params.upper()]
        return GPTConfig(vocab, n_ctx, n_layer, d_model, tied)
    target = parse_count(params)
    # Width grows with size like the GPT-3 family; layers fill the rest (at least one).
    d_model = 64
    for width in (64, 128, 256, 512, 768, 1024, 1536, 2048, 2560):
        if 12 * width * width * max(4, width // 64) + vocab * width <= target:
            d_model = width
    per_layer = (
        GPTConfig(vocab, n_ctx, 1, d_model, tied).num_params() - GPTConfig(vocab, n_ctx, 0, d_model, tied).num_params()
    )
    base = GPTConfig(vocab, n_ctx, 0, d_model, tied).num_params()
    n_layer = max(1, round((target - base) / per_layer))
    return GPTConfig(vocab, n_ctx, n_layer, d_model, tied)


# --------------------------------------------------------------------------- worker side


def build_model(cfg: GPTConfig):  # type: ignore[no-untyped-def]
    """A GPT-2-style decoder (pre-LayerNorm, learned positions, GELU MLP) with an optionally tied head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)
            self.ln_2 = nn.LayerNorm(d)
            self.c_fc = nn.Linear(d, 4 * d)
            self.mlp_proj = nn.Linear(4 * d, d)
            self.n_head = max(1, d // 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
            self.wpe = nn.Embedding(cfg.n_ctx, cfg.d_model)
            self.h = nn.ModuleList(Block(cfg.d_model) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
            if cfg.tied:
                self.lm_head.weight = self.wte.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


def ds_config(stage: int = 3) -> dict:
    """ZeRO-3 (or ``stage``), bf16, torch's fused AdamW (the default foreach AdamW is OOM-killed in step() at ~700M
    here)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def worker(cfg: GPTConfig, out: Path, stage: int = 3) -> None:
    """Runs on every rank under DeepSpeed's launcher: build, one step, save (ZeRO-1/2: the whole model on each rank,
    built in bf16 as zero.Init builds it)."""
    import contextlib

    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(1234)
    config = ds_config(stage)
    init = deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16) if stage == 3 else None
    with init or contextlib.nullcontext():
        model = build_model(cfg)
    if init is None:
        model = model.to(torch.bfloat16)
    if cfg.lora:  # as fixtures/generate_peft.py does: the base built under zero.Init, then wrapped
        from peft import LoraConfig, get_peft_model

        targets = ["c_attn", "c_proj", "c_fc", "mlp_proj"]
        model = get_peft_model(model, LoraConfig(r=cfg.lora, lora_alpha=2 * cfg.lora, target_modules=targets))
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    ids = torch.randint(0, cfg.vocab, (1, 8), generator=torch.Generator().manual_seed(rank))
    logits = engine(ids)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab), ids.roll(1, dims=1).reshape(-1))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(out), tag="global_step1")
    if cfg.lora and rank == 0:
        model.peft_config["default"].save_pretrained(str(out))  # adapter_config.json: the merge's scale
    torch.distributed.barrier()


# --------------------------------------------------------------------------- driver side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_checkpoint(
    out: Path,
    *,
    params: str,
    tied: bool = True,
    vocab: int = 50304,
    n_ctx: int = 1024,
    world_size: int = 2,
    overwrite: bool = False,
    launcher: str = "deepspeed",
    cfg: GPTConfig | None = None,
    stage: int = 3,
) -> dict:
    """Build the checkpoint at ``out`` (a DeepSpeed checkpoint root) and return its manifest.

    ``launcher="torchrun"`` starts the ranks with ``torch.distributed.run`` instead of DeepSpeed's launcher: the
    same ranks, engine and files, ~8 s sooner (DeepSpeed's runner and its launch.py each import DeepSpeed first).
    The tests use it; the benchmarks keep DeepSpeed's own launcher. ``cfg`` gives the exact shape instead of
    ``params`` (benchmarks/scale.py: narrow, deep models of thousands of tensors)."""
    cfg = cfg or config_for(params, vocab=vocab, n_ctx=n_ctx, tied=tied)
    out = out.resolve()
    repo = HERE.parent.parent
    if out == repo or repo in out.parents:
        raise SystemExit(f"refusing to write a benchmark checkpoint inside the repository: {out}")
    if out.exists():
        if not overwrite:
            raise SystemExit(f"{out} exists; pass --overwrite to rebuild it")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    port = str(_free_port())
    if launcher == "deepspeed":
        start = ["deepspeed", "--master_port", port, "--num_gpus", str(world_size), "--num_nodes", "1"]
    elif launcher == "torchrun":
        start = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world_size),
                 "--master_addr", "127.0.0.1", "--master_port", port]  # fmt: skip
    else:
        raise ValueError(f"launcher must be 'deepspeed' or 'torchrun', got {launcher!r}")
    cmd = [
        *start,
        str(HERE),
        "--worker",
        "--out",
        str(out),
        "--config",
        json.dumps(asdict(cfg)),
        "--stage",
        str(stage),
    ]
    log = out.parent / f".{out.name}.build.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        # the log's first error lines travel with the message: a test's tmp folder (and the log) may be gone later
        lines = log.read_text(errors="replace").splitlines()
        first = [line for line in lines if any(w in line for w in ("Error", "error", "terminate", "Abort"))][:12]
        raise SystemExit(
            f"DeepSpeed build of {out} failed (exit {proc.returncode}); see {log}. First error lines:\n"
            + "\n".join(first or lines[-12:])
        )
    log.unlink()
    for script in out.glob("*.py"):  # DeepSpeed copies zero_to_fp32.py next to the checkpoint
        script.unlink()
    files = sorted(p for p in out.rglob("*") if p.is_file())
    import deepspeed
    import torch

    manifest = {
        "params": cfg.num_params(),
        "params_arg": params,
        "config": asdict(cfg),
        "world_size": world_size,
        "dtype": "bf16",
        "zero_stage": stage,
        "optimizer": "AdamW (torch, fused)",
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "build_seconds": round(seconds, 1),
        # ru_maxrss of the largest single child (a rank), in KiB on Linux.
        "build_peak_rss_bytes_one_rank": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "bytes_on_disk": sum(p.stat().st_size for p in files),
        "files": {str(p.relative_to(out)): p.stat().st_size for p in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="125M", help="model size: 125M, 350M, 760M, 1.3B, or any count like 470M")
    parser.add_argument("--out", type=Path, help="checkpoint root to create (outside the repository)")
    parser.add_argument(
        "--untied", action="store_true", help="separate lm_head (DeepSpeed's safetensors path needs it)"
    )
    parser.add_argument("--tied", dest="untied", action="store_false", help="tie lm_head to wte (default)")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--n-layer", type=int, help="layers (with --d-model: this exact shape instead of --params)")
    parser.add_argument("--d-model", type=int, help="width (with --n-layer), e.g. few wide layers: MB-sized tensors")
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=3, help="ZeRO stage (default 3)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument(
        "--launcher",
        choices=["deepspeed", "torchrun"],
        default="deepspeed",
        help="torchrun: the same ranks and files, without DeepSpeed's launcher (~8 s sooner)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the shape and parameter count only")
    # worker mode (used by DeepSpeed's launcher, which also passes --local_rank)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(GPTConfig(**json.loads(args.config)), args.out, args.stage)
        return 0
    cfg = config_for(args.params, vocab=args.vocab, n_ctx=args.n_ctx, tied=not args.untied)
    if (args.n_layer is None) != (args.d_model is None):
        parser.error("--n-layer and --d-model go together")
    if args.n_layer is not None:
        cfg = GPTConfig(args.vocab, args.n_ctx, args.n_layer, args.d_model, not args.untied)
    if args.dry_run:
        print(json.dumps({**asdict(cfg), "params": cfg.num_params()}))
        return 0
    if args.out is None:
        parser.error("--out is required")
    manifest = make_checkpoint(
        args.out,
        params=args.params,
        tied=not args.untied,
        vocab=args.vocab,
        n_ctx=args.n_ctx,
        world_size=args.world_size,
        overwrite=args.overwrite,
        launcher=args.launcher,
        stage=args.stage,
        cfg=cfg,
    )
    print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
