"""The subcommands: each parses its flags and makes one call into the library."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import zeroio

from .. import errors
from . import _args
from ._errors import cli_spelling
from ._flags import add_dcp_keys, add_keep_quantized, add_names, add_progress, add_tp_rules, read_keywords
from ._progress import choose_mode, progress_for


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    return f"{n} B"


# --------------------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a checkpoint's tensors and metadata without reading tensor bytes."""
    with zeroio.open(
        args.path,
        tag=args.tag,
        **read_keywords(args),
    ) as ckpt:
        summary = ckpt.describe()
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    meta = summary["metadata"]
    out = sys.stdout
    out.write(f"checkpoint  {meta['path']}\n")
    facts = [
        ("format", meta["format"]),
        ("tag", meta["tag"]),
        ("zero stage", meta["zero_stage"]),
        ("world size", meta["world_size"]),
        ("train dtype", meta["train_dtype"]),
        ("deepspeed", meta["ds_version"]),
        ("global step", meta["global_step"]),
    ]
    if meta["format"] == "zero":
        facts.append(("fp32 master", "yes" if meta["has_fp32_master"] else "no (16-bit weights only)"))
    facts += [
        ("layout", meta.get("layout")),
        ("parallel", " ".join(f"{k}={v}" for k, v in meta.get("parallel", {}).items()) or None),
        ("offload", meta.get("offload")),
        (
            "serialized",
            "legacy (no CRC-32 in the files to check)"
            if meta.get("serialization") == "legacy"
            else meta.get("serialization"),
        ),
        ("optimizer", meta.get("optimizer")),
        ("vocabulary", meta.get("vocab")),
        ("not read", meta.get("not_read")),
        ("dcp keys", cli_spelling(meta["dcp_keys"]) if meta.get("dcp_keys") else None),
    ]
    for label, value in facts:
        if value is not None:
            out.write(f"{label:<11} {value}\n")
    rows = summary["tensors"]
    name_w = max([len("name")] + [len(r["name"]) for r in rows])
    shape_w = max([len("shape")] + [len(str(tuple(r["shape"]))) for r in rows])
    out.write("\n")
    out.write(f"{'name':<{name_w}}  {'shape':<{shape_w}}  {'dtype':<5}  {'size':>10}  {'kind':<9}  source\n")
    for r in rows:
        source = (
            f"tied to {r['tied_to']}"
            if r["tied_to"]
            else ", ".join(r["files"][:2]) + (f" +{len(r['files']) - 2}" if len(r["files"]) > 2 else "")
        )
        dtype = r["dtype"] if r["dtype"] == r["stored_dtype"] else f"{r['dtype']}*"
        out.write(
            f"{r['name']:<{name_w}}  {tuple(r['shape'])!s:<{shape_w}}  {dtype:<5}  "
            f"{_human_bytes(r['nbytes']):>10}  {r['kind']:<9}  {source}\n"
        )
    out.write(
        f"\n{summary['num_tensors']} tensors ({len(summary['tied'])} tied), {summary['num_params']:,} elements, "
        f"{_human_bytes(summary['total_bytes'])}\n"
    )
    if any(r["dtype"] != r["stored_dtype"] and not r["stored_dtype"].startswith("float8") for r in rows):
        out.write("* stored in another dtype on disk (DeepSpeed's consolidation upcasts floating buffers to fp32)\n")
    if any(r["dtype"] != r["stored_dtype"] and r["stored_dtype"].startswith("float8") for r in rows):
        out.write("* block-scaled float8 on disk, dequantized with its *_scale_inv (--keep-quantized: as stored)\n")
    return 0


# --------------------------------------------------------------------------- convert / verify / push


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint to safetensors / torch files (streaming, atomic)."""
    pushing = getattr(args, "push_to_hub", None) and not (args.distributed and os.environ.get("RANK", "0") != "0")
    if pushing:  # the Hub's answer before a long conversion: a bad token fails in seconds
        zeroio.create_hub_repo(args.push_to_hub)
    try:
        result = zeroio.convert(
            args.src,
            args.dst,
            fmt=args.format,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            tag=args.tag,
            exclude_frozen=args.exclude_frozen,
            overwrite=args.overwrite,
            workers=args.workers,
            progress=progress_for(_progress_mode(args), "zeroio convert"),
            distributed=args.distributed,
            include_optimizer=args.include_optimizer,
            verify_crc=not args.no_verify_crc,
            dcp_layout=args.dcp_layout,
            merge_lora=args.merge_lora,
            adapter_config=args.adapter_config,
            **read_keywords(args),
        )
    except errors.OutputError as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):  # Ctrl-C: say what was cleaned up, exit like SIGINT
            print(f"Output error: {exc}", file=sys.stderr)
            return 130
        raise
    if args.distributed and os.environ.get("RANK", "0") != "0":
        return 0  # every process returns the same result; rank 0 reports it (and pushes)
    if not args.quiet and args.format == "universal":
        print(
            f"Wrote a DeepSpeed universal checkpoint ({result.num_tensors} parameters with optimizer state, "
            f"{_human_bytes(result.total_size)}) in {len(result.files)} files to {args.dst}; resume it with "
            '"checkpoint": {"load_universal": true}'
        )
    elif not args.quiet:
        print(
            # Counted as inspect and verify count them: every name, tied aliases included (issue 23).
            f"Wrote {result.num_tensors + len(result.tied)} tensors ({len(result.tied)} tied, "
            f"{_human_bytes(result.total_size)}) in {len(result.files)} file(s) to {args.dst}"
        )
    if getattr(args, "push_to_hub", None):
        pushed = zeroio.push_to_hub(
            args.dst, args.push_to_hub, progress=progress_for(choose_mode(args.progress, args.quiet), "zeroio push")
        )
        if not args.quiet:
            print(f"Pushed to {pushed.commit_url}")
    return 0


def _progress_mode(args: argparse.Namespace) -> str:
    """``--distributed``: rank 0 reports (its own bytes), as it prints the summary; the others print nothing."""
    if args.distributed and os.environ.get("RANK", "0") != "0":
        return "none"
    return choose_mode(args.progress, args.quiet)


def _validate_convert(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    problem = _args.folder_destination_problem(args.dst, args.format)
    if problem is not None:
        parser.error(problem)
    if args.format in ("universal", "dcp") and (args.distributed or getattr(args, "push_to_hub", None)):
        parser.error(
            f"--format {args.format} writes a checkpoint to resume training from: drop --distributed/--push-to-hub"
        )
    if not args.distributed:
        return
    if args.format == "lightning":
        parser.error("--distributed writes sharded folders; --format lightning writes one file: drop --distributed")
    if not _args.running_under_torchrun():
        parser.error(
            "--distributed runs under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set): "
            "torchrun --nnodes N --nproc-per-node P -m zeroio convert SRC DST --distributed"
        )


def cmd_verify(args: argparse.Namespace) -> int:
    """Compare every tensor of two checkpoints; exit 1 on any difference."""
    report = zeroio.verify(
        args.a,
        args.b,
        dtype=args.dtype,
        tag=args.tag,
        max_report=args.max_report,
        verify_crc=not args.no_verify_crc,
        **read_keywords(args),
    )
    print(report.summary())
    return 0 if report.ok else 1


TOKEN_ON_COMMAND_LINE_WARNING = (
    "warning: --token is visible to other users in process listings and shell history; set HF_TOKEN or run "
    "`hf auth login` instead."
)
"""Printed on stderr when ``--token`` is used (docs/hub.md, Authentication)."""


def cmd_push(args: argparse.Namespace) -> int:
    """Push a checkpoint (converted on the fly) or a converted folder, local or at a URL, to the Hugging Face Hub."""
    if args.token is not None:  # issue 15: a token in argv is readable by other users (ps, /proc, history)
        print(TOKEN_ON_COMMAND_LINE_WARNING, file=sys.stderr)
    result = zeroio.push_to_hub(
        args.src,
        args.repo_id,
        token=args.token,
        private=args.private,
        revision=args.revision,
        create_pr=args.create_pr,
        commit_message=args.commit_message,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        tag=args.tag,
        endpoint=args.endpoint,
        model_card=not args.no_model_card,
        progress=progress_for(choose_mode(args.progress, args.quiet), "zeroio push"),
        verify_crc=not args.no_verify_crc,
        **read_keywords(args),
    )
    print(f"Pushed to {result.pr_url or result.commit_url}")
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    """Rewrite a ZeRO-3 checkpoint for another data-parallel world size (DeepSpeed resumes from it)."""
    result = zeroio.reshard(
        args.src,
        args.dst,
        world_size=args.world_size,
        tag=args.tag,
        output_tag=args.output_tag,
        sub_group_size=args.sub_group_size,
        overwrite=args.overwrite,
        progress=progress_for(choose_mode(args.progress, args.quiet), "zeroio reshard"),
        verify_crc=not args.no_verify_crc,
    )
    if not args.quiet:
        print(
            f"Wrote a ZeRO-3 checkpoint for world size {result.world_size} (from {result.source_world_size}) "
            f"to {result.path}/{result.tag}: {len(result.files)} files, {_human_bytes(result.total_size)}"
        )
    return 0


def _validate_push(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.create_pr and args.revision:
        parser.error("--create-pr opens a pull request against the main branch; it cannot be combined with --revision")


# --------------------------------------------------------------------------- parser


def _add_inspect(sub: Any) -> None:
    """``zeroio inspect``: list tensors and metadata."""
    p = sub.add_parser("inspect", allow_abbrev=False, help="list tensors and metadata (reads no tensor bytes)")
    p.add_argument("path", help="checkpoint root, tag folder, or consolidated checkpoint")
    p.add_argument("--tag", help="tag folder to read (default: the one in 'latest')")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    add_names(
        p,
        "hf: a Megatron GPT of the Llama family (Qwen3 with QK norms; MoE: Mixtral, Qwen2-MoE or Qwen3-MoE) under "
        "transformers' names",
    )
    add_tp_rules(p)
    add_keep_quantized(p)
    add_dcp_keys(p)
    p.set_defaults(func=cmd_inspect)


def _add_convert(sub: Any) -> None:
    """``zeroio convert``: write another format."""
    p = sub.add_parser("convert", allow_abbrev=False, help="write safetensors (or torch) files, streaming and atomic")
    p.add_argument("src", help="checkpoint to read")
    p.add_argument(
        "dst", help="output folder (created; must not exist unless --overwrite); the .ckpt file for --format lightning"
    )
    p.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "torch", "lightning", "universal", "dcp", "peft"],
        help="output format: safetensors (default), torch (pytorch_model.bin), lightning (one .ckpt file for "
        "LightningModule.load_from_checkpoint), universal (a DeepSpeed universal checkpoint to resume at another "
        "world size or ZeRO stage), dcp (a PyTorch Distributed Checkpoint that FSDP2 resumes from), or peft (the "
        "LoRA adapter of a PEFT run: adapter_model.safetensors + adapter_config.json for PeftModel.from_pretrained; "
        "a named adapter in DST/NAME/)",
    )
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="the source is a PEFT LoRA run: write the plain base model with the adapter merged in "
        "(W + lora_alpha/r * B @ A in fp32, as PEFT's merge_and_unload), in any --format but peft/universal",
    )
    p.add_argument(
        "--adapter-config",
        metavar="PATH",
        help="with --format peft or --merge-lora: the run's adapter_config.json (or the folder save_pretrained "
        "wrote) when it is not beside the checkpoint (checkpoint-N/adapter_config.json)",
    )
    p.add_argument(
        "--dcp-layout",
        default="torchtitan",
        choices=["torchtitan", "accelerate"],
        help="with --format dcp: torchtitan (DST is the step-N folder; default) or accelerate "
        "(DST/pytorch_model_fsdp_0 + DST/optimizer_0)",
    )
    add_names(
        p,
        "hf: write a Megatron GPT of the Llama family (Qwen3 with QK norms; MoE: Mixtral, Qwen2-MoE or Qwen3-MoE) "
        "under transformers' names, with "
        "config.json",
    )
    p.add_argument("--dtype", type=_args.dtype, metavar="{fp32,fp16,bf16}", help="cast floating tensors")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        type=_args.shard_size,
        help="largest shard, e.g. 5GB, 500MB, 2GiB, or bytes (default: 5GB)",
    )
    p.add_argument("--tag", help="tag folder to read (default: the one in 'latest')")
    p.add_argument("--exclude-frozen", action="store_true", help="leave out frozen parameters")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument(
        "--include-optimizer",
        action="store_true",
        help="also write the consolidated Adam moments (optimizer.safetensors + optimizer.json)",
    )
    p.add_argument("--workers", type=int, help="IO threads (default: chosen from the CPU count)")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="push the result to this Hub repo afterwards")
    p.add_argument("--quiet", action="store_true", help="no progress and no summary line")
    add_progress(p)
    p.add_argument(
        "--distributed",
        action="store_true",
        help="run as one process of a torchrun job: each process writes its share of the shards (DST and SRC on "
        "a filesystem shared by all processes)",
    )
    p.add_argument("--no-verify-crc", action="store_true", help="do not check the CRC-32 of the records read")
    add_tp_rules(p)
    add_keep_quantized(p)
    add_dcp_keys(p)
    p.set_defaults(func=cmd_convert, validate=_validate_convert)


def _add_verify(sub: Any) -> None:
    """``zeroio verify``: compare two checkpoints."""
    p = sub.add_parser(
        "verify", allow_abbrev=False, help="compare every tensor of two checkpoints (exit 1 on any difference)"
    )
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument(
        "--dtype", type=_args.dtype, metavar="{fp32,fp16,bf16}", help="compare after casting A to this dtype"
    )
    p.add_argument("--tag", help="tag of A, when A is a DeepSpeed checkpoint root")
    p.add_argument("--max-report", type=int, default=10, help="mismatches to print (default: 10)")
    p.add_argument("--no-verify-crc", action="store_true", help="do not check the CRC-32 of the records read")
    add_names(
        p,
        "hf: read A, a Megatron GPT, under transformers' names, as convert --names hf wrote B (with the same "
        "--true-vocab-size)",
    )
    add_keep_quantized(p)
    add_dcp_keys(p)
    p.set_defaults(func=cmd_verify)


def _add_push(sub: Any) -> None:
    """``zeroio push``: push to the Hub."""
    p = sub.add_parser("push", allow_abbrev=False, help="push to the Hugging Face Hub (converting first if needed)")
    p.add_argument("src", help="checkpoint or converted folder")
    p.add_argument("repo_id", help="e.g. my-org/my-model")
    p.add_argument("--token", help="Hub token; prefer HF_TOKEN or `hf auth login` (argv is visible in ps)")
    p.add_argument("--private", action="store_true", default=None, help="create the repo as private")
    p.add_argument("--revision", help="branch to push to (created if missing)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--commit-message", help="commit title")
    p.add_argument(
        "--dtype", type=_args.dtype, metavar="{fp32,fp16,bf16}", help="cast floating tensors when converting"
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        type=_args.shard_size,
        help="largest shard when converting, e.g. 5GB, 2GiB (default: 5GB)",
    )
    p.add_argument("--tag", help="tag folder to read when converting (default: the one in 'latest')")
    p.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co)")
    p.add_argument("--no-model-card", action="store_true", help="do not write a README.md model card")
    add_names(p, "hf: convert a Megatron GPT of the Llama family under transformers' names, with config.json")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_progress(p)
    p.add_argument("--no-verify-crc", action="store_true", help="do not check the CRC-32 of the records read")
    add_tp_rules(p)
    add_dcp_keys(p)
    p.set_defaults(func=cmd_push, validate=_validate_push)


def _add_reshard(sub: Any) -> None:
    """``zeroio reshard``: rewrite for another world size."""
    p = sub.add_parser(
        "reshard",
        allow_abbrev=False,
        help="rewrite a ZeRO-3 checkpoint for another number of GPUs (DeepSpeed resumes it)",
    )
    p.add_argument("src", help="DeepSpeed ZeRO-3 checkpoint (root or tag folder) with optimizer state")
    p.add_argument("dst", help="output checkpoint folder (created; pass it to engine.load_checkpoint)")
    p.add_argument("--world-size", type=int, required=True, metavar="M", help="data-parallel ranks that will load it")
    p.add_argument("--tag", help="tag folder to read (default: the one in 'latest')")
    p.add_argument("--output-tag", help="tag folder to write (default: the source's tag)")
    p.add_argument("--sub-group-size", type=int, help="zero_optimization.sub_group_size of the run that will load it")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_progress(p)
    p.add_argument("--no-verify-crc", action="store_true", help="do not check the CRC-32 of the records read")
    p.set_defaults(func=cmd_reshard)


def build_parser() -> argparse.ArgumentParser:
    """The ``zeroio`` argument parser (also the source of the CLI reference in docs/)."""
    parser = argparse.ArgumentParser(
        prog="zeroio",
        allow_abbrev=False,  # `--exclude` must not silently mean --exclude-frozen
        description="Read, convert and publish DeepSpeed ZeRO checkpoints without DeepSpeed.",
    )
    parser.add_argument("--version", action="version", version=f"zeroio {zeroio.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_inspect(sub)
    _add_convert(sub)
    _add_verify(sub)
    _add_push(sub)
    _add_reshard(sub)
    return parser
