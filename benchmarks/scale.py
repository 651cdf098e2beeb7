"""Scale in ranks and tensors: open, inspect, plan and convert of ZeRO layouts of R ranks x T tensors (and of an
MoE checkpoint of thousands of expert files), against DeepSpeed's lazy mode on the same files. Each measurement is
a fresh process: wall seconds, CPU seconds (user + system: the box may be shared) and peak RSS.

Layouts, built cheaply and genuine:

- ``gpt``: a real DeepSpeed ZeRO-3 checkpoint of a narrow, deep GPT (``--layers`` blocks of width 64: 12 tensors
  each, plus 4, so 41 / 166 / 666 layers give 496 / 1,996 / 7,996 parameters; vocabulary 512, context 64, tied
  head) made on 2 CPU ranks by ``benchmarks/make_checkpoint.py`` (torchrun, DeepSpeed's engine and
  ``save_checkpoint``), then ``zeroio.reshard`` to each rank count: DeepSpeed's own record layout at that world
  size, as ``engine.load_checkpoint`` reads it (tests/test_reshard.py resumes DeepSpeed from such files).
- ``--lora R``: the same GPT fine-tuned with PEFT's LoRA of rank ``R`` on each block's four linears (the base frozen:
  ZeRO-3 keeps a fragment of every frozen parameter in each rank's model-states file), its ``adapter_config.json``
  copied beside each resharded layout; ``--merge-lora`` opens it with ``merge_lora=True`` (``convert --merge-lora``).
- ``moe``: a real DeepSpeed ZeRO-2 checkpoint of ``deepspeed.moe.layer.MoE`` layers (``--moe LAYERSxEXPERTS``:
  each expert a 2-layer MLP, 4 tensors; one ``layer_L_expert_E_mp_rank_00_model_states.pt`` file per expert),
  trained one step on 2 CPU ranks with expert parallelism 2 and saved by ``engine.save_checkpoint``.

    python benchmarks/scale.py --work /tmp/zeroio-scale --layers 166 41 666 --ranks 64 256 1024 \\
        --json benchmarks/results/scale-2core-gpt.json
    python benchmarks/scale.py --work /tmp/zeroio-scale --moe 8x64 16x128 32x256 --json benchmarks/results/scale-2core-moe.json
    # zeroio before this work, on the same files (--tree: the tree whose zeroio the timed processes import):
    mkdir -p /tmp/zeroio-before && git archive 641a1ba zeroio | tar -x -C /tmp/zeroio-before
    python benchmarks/scale.py --work /tmp/zeroio-scale --tree /tmp/zeroio-before --layers 166 --ranks 1024 \\
        --methods open inspect plan --json benchmarks/results/scale-2core-before.json
    python benchmarks/scale.py --work /tmp/zeroio-scale --tree /tmp/zeroio-before --layers 166 --ranks 256 \\
        --methods convert --json benchmarks/results/scale-2core-before-convert.json

Methods (each in its own process, after one warm-up read of the files, so the page cache holds them):

- ``open``: ``zeroio.open(ckpt)`` and its ``infos`` (every tensor's name, shape, dtype): the metadata parse.
- ``inspect``: ``python -m zeroio inspect CKPT`` (the CLI: parse + describe + print).
- ``plan``: ``zeroio.open`` + ``ckpt.byte_ranges`` of every tensor (tied names: of their source): each tensor's read
  plan, as file byte ranges.
- ``convert``: ``python -m zeroio convert CKPT OUT --quiet`` (fp32 safetensors, fsynced).
- ``state_dict``: ``zeroio.open`` + ``ckpt.state_dict()``: every tensor read into memory.
- ``load``: ``zeroio.open`` + ``zeroio.load(ckpt, model)`` into a model of every key as a meta parameter (built in
  the timed part): the CPU load path.
- ``ds_lazy``: ``get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)`` (DeepSpeed 0.19.8): its metadata
  pass, every tensor a lazy stand-in (no data materialised).
- ``verify`` (GPT layouts): ``python -m zeroio verify SRC CKPT``, every tensor of the resharded layout against the
  2-rank checkpoint DeepSpeed saved (exit 0: all equal).
- ``reshard`` (GPT layouts): ``zeroio.reshard`` of the 2-rank DeepSpeed save to the layout's rank count again (into
  a scratch folder, removed after): the layout builder, timed. (The ``reshard`` rows with ``reused`` are the builds.)

``--repeat N`` runs each method N times; ``--cold`` drops the files' pages from the page cache before each method
(``posix_fadvise(DONTNEED)`` per file after a sync; ``cached_before``: the share ``fincore`` still finds cached)
instead of reading them first.

Each child also reports the seconds of the call itself (``call_s``: after its imports). ``convert`` records the sha256
of the folder it wrote (``out_sha256``); ``--digest`` runs ``state_dict`` and ``load`` to hash the tensors they return
(``sha256``; not timings): outputs compared between the zeroio trees (``--tree``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

_TIMED = (
    "import json, time\n{imports}\nt0 = time.perf_counter()\n{body}\nout = {{'call_s': time.perf_counter() - t0, 'n': n}}\n"
    "{digest}print(json.dumps(out))\n"
)
_DIGEST = (
    "if DIGEST:\n    import hashlib, torch\n    h = hashlib.sha256()\n    for k in sorted(T):\n"
    "        t = T[k].detach().contiguous().reshape(-1)\n        h.update(f'{{k}} {{t.dtype}} {{tuple(T[k].shape)}}'.encode())\n"
    "        h.update(t.view(torch.uint8).numpy().tobytes())\n    out['sha256'] = h.hexdigest()\n"
)
"""``--digest``: the tensors a pass returned (``T``), hashed after the call (names, dtypes, shapes and bytes)."""
CHILD = {
    "open": _TIMED.format(
        imports="import zeroio", body="c = zeroio.open(SRC, **OPTS)\nn = len(c.infos)\nc.close()", digest=""
    ),
    "plan": _TIMED.format(
        imports="import zeroio",
        body=(
            "c = zeroio.open(SRC, **OPTS)\nn = 0\nfor name in c.infos:\n"
            "    n += len(c.byte_ranges(c.source_name(name)) or ())\nc.close()"
        ),
        digest="",
    ),
    "state_dict": _TIMED.format(
        imports="import zeroio",
        body="c = zeroio.open(SRC, **OPTS)\nT = c.state_dict()\nn = len(T)\nc.close()",
        digest=_DIGEST,
    ),
    "load": _TIMED.format(
        imports="import torch\nimport zeroio",
        body=(
            "c = zeroio.open(SRC, **OPTS)\nm = torch.nn.Module()\nfor name, info in c.infos.items():\n"
            "    *path, leaf = name.split('.')\n    mod = m\n    for part in path:\n"
            "        if part not in mod._modules:\n            mod.add_module(part, torch.nn.Module())\n"
            "        mod = mod._modules[part]\n"
            "    t = torch.empty(info.shape, dtype=info.dtype, device='meta')\n"
            "    mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))\n"
            "n = len(zeroio.load(c, m).loaded_keys)\nc.close()\nT = m.state_dict()"
        ),
        digest=_DIGEST,
    ),
    "ds_lazy": _TIMED.format(
        imports="from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g",
        body="sd = g(SRC, lazy_mode=True)\nn = sum(1 for v in sd.values() if v.shape is not None)",
        digest="",
    ),
}

_WRAPPER = """import json, resource, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
dt = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
out = {'seconds': dt, 'cpu_s': ru.ru_utime + ru.ru_stime, 'peak_rss_bytes': ru.ru_maxrss * 1024,
       'exit': p.returncode}
for line in reversed(p.stdout.strip().splitlines()):
    if line.startswith('{'):
        out.update(json.loads(line))
        break
if p.returncode:
    out['err'] = p.stderr.strip()[-600:]
print(json.dumps(out))
"""


def _measure(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Wall and CPU seconds and peak RSS of one fresh process (measured by a wrapper process, its only child)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _WRAPPER, *cmd],
            env=env,
            cwd=tempfile.gettempdir(),  # not a checkout: its zeroio would come before PYTHONPATH's (--tree)
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"seconds": None, "timed_out": timeout}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tree_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _warm(path: Path) -> None:
    """Read every file once, so each method finds the page cache warm."""
    for p in path.rglob("*.pt"):
        with p.open("rb") as fh:
            while fh.read(1 << 24):
                pass


def _evict(path: Path) -> None:
    """Drop the checkpoint's pages from the page cache (``POSIX_FADV_DONTNEED`` per file, after a sync): a cold
    checkpoint, while the interpreter, torch and zeroio stay cached (this box's other users keep theirs)."""
    subprocess.run(["sync"], check=True)
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _cached_fraction(path: Path) -> float | None:
    """Share of the checkpoint's bytes in the page cache (``fincore``), None where it is missing."""
    files = [str(p) for p in path.rglob("*") if p.is_file()]
    try:
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES,SIZE", *files], capture_output=True, text=True,
                             check=True).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    res, size = sum(map(int, out[0::2])), sum(map(int, out[1::2]))
    return res / size if size else None


def build_gpt(work: Path, layers: int, lora: int = 0) -> Path:
    """The 2-rank DeepSpeed ZeRO-3 source checkpoint of ``layers`` blocks of width 64 (``lora``: PEFT's LoRA of
    that rank on each block's linears, the base frozen; ``adapter_config.json`` beside ``latest``)."""
    src = work / (f"src-{layers}-lora{lora}" if lora else f"src-{layers}")
    if not (src / "manifest.json").is_file():
        sys.path.insert(0, str(HERE))
        import make_checkpoint as make

        cfg = make.GPTConfig(vocab=512, n_ctx=64, n_layer=layers, d_model=64, tied=True, lora=lora)
        make.make_checkpoint(src, params=str(cfg.num_params()), cfg=cfg, vocab=512, n_ctx=64, world_size=2,
                             overwrite=True, launcher="torchrun")  # fmt: skip
    return src


def reshard(src: Path, dst: Path, ranks: int, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``zeroio.reshard(src, dst, world_size=ranks)`` in a fresh process (timed), unless ``dst`` exists; a LoRA
    run's ``adapter_config.json`` is copied beside (reshard writes the rank files and ``latest`` only)."""
    if (dst / "latest").is_file():
        return {"reused": True}
    body = f"import zeroio\nzeroio.reshard({str(src)!r}, {str(dst)!r}, world_size={ranks})\nn = {ranks}"
    made = _measure([sys.executable, "-c", _TIMED.format(imports="", body=body, digest="")], env, timeout)
    if (src / "adapter_config.json").is_file():
        shutil.copy2(src / "adapter_config.json", dst / "adapter_config.json")
    return made


def _folder_sha256(path: Path) -> str:
    """sha256 over a folder's files (relative names and bytes, in name order): outputs compared across trees."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        with file.open("rb") as fh:
            while block := fh.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- the MoE checkpoint (DeepSpeed, 2 ranks)


def moe_worker(layers: int, experts: int, out: Path) -> None:
    """Runs on each of 2 ranks under torchrun: ``layers`` MoE layers of ``experts`` experts, one step, save."""
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    dim, hidden, vocab = 8, 8, 64

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.moes = nn.ModuleList(
                MoE(hidden_size=dim, expert=nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim)),
                    num_experts=experts, ep_size=2, k=1, min_capacity=4, drop_tokens=False)
                for _ in range(layers)
            )  # fmt: skip
            self.head = nn.Linear(dim, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for moe in self.moes:
                x = x + moe(x)[0]
            return self.head(x)

    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = Net()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    loss = engine(ids).float().logsumexp(-1).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(out), tag="global_step1")
    torch.distributed.barrier()


def build_moe(work: Path, layers: int, experts: int) -> Path:
    """The DeepSpeed MoE checkpoint (2 ranks, expert parallel 2, ZeRO-2), built once."""
    out = work / f"moe-{layers}x{experts}"
    if (out / "latest").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    sys.path.insert(0, str(HERE))
    import make_checkpoint as make

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(make._free_port()), str(Path(__file__).resolve()),
           "--moe-worker", f"{layers}x{experts}", "--work", str(out)]  # fmt: skip
    log = work / f".moe-{layers}x{experts}.log"
    with log.open("w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode:
        raise SystemExit(f"DeepSpeed MoE build failed; see {log}")
    for script in out.glob("*.py"):
        script.unlink()
    return out


# --------------------------------------------------------------------------- the runs


def run_methods(
    ckpt: Path,
    methods: list[str],
    work: Path,
    env: dict[str, str],
    timeout: float,
    facts: dict[str, Any],
    source: Path | None = None,
    cold: bool = False,
    options: dict[str, Any] | None = None,
    digest: bool = False,
) -> list[dict[str, Any]]:
    """Each method once on ``ckpt``; ``options``: ``zeroio.open``'s keywords (``merge_lora``) for the methods that
    open it, ``--merge-lora`` for convert; ``digest``: state_dict and load hash the tensors they return."""
    files, nbytes = _tree_bytes(ckpt)
    options = options or {}
    results = []
    for method in methods:
        if method in ("verify", "reshard") and (source is None or options):
            continue
        made = work / "reshard-out"
        shutil.rmtree(made, ignore_errors=True)
        read = source if method == "reshard" and source is not None else ckpt  # the files the method reads
        if cold:
            _evict(read)
        else:
            _warm(read)
        if method == "reshard":  # the layout itself, written again from DeepSpeed's 2-rank save
            call = f"zeroio.reshard({str(source)!r}, {str(made)!r}, world_size={ckpt_ranks(ckpt)})"
            cmd = [sys.executable, "-c", _TIMED.format(imports="import zeroio", body=f"{call}\nn = 0", digest="")]
        elif method == "verify":  # every tensor of the resharded layout against DeepSpeed's own 2-rank save
            cmd = [sys.executable, "-m", "zeroio", "verify", str(source), str(ckpt)]
        elif method in CHILD:
            head = f"SRC = {str(ckpt)!r}\nOPTS = {options!r}\nDIGEST = {digest!r}\n"
            cmd = [sys.executable, "-c", head + CHILD[method]]
        elif method == "inspect":
            cmd = [sys.executable, "-m", "zeroio", "inspect", str(ckpt)]
        else:
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "zeroio", "convert", str(ckpt), str(out), "--quiet"]
            cmd += ["--merge-lora"] if options.get("merge_lora") else []
        run = {**facts, "files": files, "bytes": nbytes, "method": method, "load_avg": os.getloadavg()[0],
               "cache": "cold" if cold else "warm"}  # fmt: skip
        if cold:
            run["cached_before"] = _cached_fraction(read)
        run.update(_measure(cmd, env, timeout))
        if method == "convert" and run.get("exit") == 0:
            run["out_sha256"] = _folder_sha256(work / "out")  # the same bytes from every zeroio compared
        results.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "err"}), flush=True)
        if run.get("exit"):
            print(run.get("err"), file=sys.stderr, flush=True)
    shutil.rmtree(work / "out", ignore_errors=True)
    shutil.rmtree(work / "reshard-out", ignore_errors=True)
    return results


def ckpt_ranks(ckpt: Path) -> int:
    """The data-parallel ranks of a GPT layout (its optimizer-state files)."""
    tag = (ckpt / "latest").read_text().strip()
    return len(list((ckpt / tag).glob("*optim_states.pt")))


def _host() -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    mem = next((line.split(":")[1].strip() for line in meminfo if line.startswith("MemTotal")), None)
    cpu = next((line.split(":")[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    import deepspeed
    import torch

    git = ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, check=False, capture_output=True, text=True).stdout.strip()
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_total": mem, "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "zeroio_commit": commit,
            "load_avg_start": os.getloadavg()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/zeroio-scale"))
    parser.add_argument("--layers", type=int, nargs="*", default=[], help="GPT sources: blocks of 12 tensors each")
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--moe", nargs="*", default=[], help="MoE sources: LAYERSxEXPERTS, e.g. 8x64")
    parser.add_argument("--methods", nargs="+", default=["open", "inspect", "plan", "convert", "ds_lazy", "verify"])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each method")
    parser.add_argument("--cold", action="store_true", help="drop the files' pages before each method, not read them")
    parser.add_argument("--tree", type=Path, default=REPO, help="the tree whose zeroio the timed processes import")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--lora", type=int, default=0, help="GPT sources with PEFT's LoRA of this rank (base frozen)")
    parser.add_argument("--merge-lora", action="store_true", help="open with merge_lora=True; convert --merge-lora")
    parser.add_argument("--digest", action="store_true", help="state_dict and load hash their tensors (not timings)")
    parser.add_argument("--moe-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.moe_worker:
        layers, experts = map(int, args.moe_worker.split("x"))
        moe_worker(layers, experts, args.work)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    # Bytecode compiled once and kept, as an installed wheel has it (this box sets PYTHONDONTWRITEBYTECODE=1, so
    # each process would otherwise compile zeroio from source first).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(args.tree), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(args.tree / "zeroio")], env=env, check=True)
    out: dict[str, Any] = {"host": _host(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "runs": []}
    out["host"]["bytecode"] = "zeroio compiled once (compileall), PYTHONDONTWRITEBYTECODE unset in the runs"
    out["host"]["tree"] = str(args.tree)

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")

    options = {"merge_lora": True} if args.merge_lora else {}
    for layers in args.layers:
        src = build_gpt(args.work, layers, args.lora)
        for ranks in args.ranks:
            ckpt = args.work / (f"r{layers}-lora{args.lora}-{ranks}" if args.lora else f"r{layers}-{ranks}")
            made = reshard(src, ckpt, ranks, env, args.timeout)
            facts = {"layout": "gpt", "layers": layers, "tensors": 12 * layers + 4, "ranks": ranks, "lora": args.lora,
                     **options, "digest": args.digest}  # fmt: skip
            out["runs"].append(
                {**facts, "method": "reshard", **made, **dict(zip(("files", "bytes"), _tree_bytes(ckpt)))}
            )
            print(json.dumps(out["runs"][-1]), flush=True)
            for _ in range(args.repeat):
                out["runs"] += run_methods(
                    ckpt, args.methods, args.work, env, args.timeout, facts, src, args.cold, options, args.digest
                )
                save()
    for spec in args.moe:
        layers, experts = map(int, spec.split("x"))
        ckpt = build_moe(args.work, layers, experts)
        facts = {"layout": "moe", "layers": layers, "experts": layers * experts, "tensors": None, "ranks": 2}
        runs = run_methods(ckpt, args.methods, args.work, env, args.timeout, facts)
        for run in runs:
            run["expert_tensors"] = 4 * layers * experts
        out["runs"] += runs
        save()
    out["host"]["load_avg_end"] = os.getloadavg()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
