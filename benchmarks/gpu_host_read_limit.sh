#!/usr/bin/env bash
# The GPU-host run of issue 34 (load at the read limit, loaders side by side, distributed convert), one lease.
#
#   ZEROIO_COMMIT=<commit> bash benchmarks/gpu_host_read_limit.sh OUT_DIR [PHASE] [PARAMS]
#
# Run from a tree holding zeroio/ and benchmarks/ (PYTHONPATH is set to it), with the wheels to install in
# $WHEELS (default .whl/: deepspeed 0.19.8 and its missing dependencies, fastsafetensors 0.5.0,
# runai-model-streamer 0.17.1). Torch is compiled to bytecode once and PYTHONDONTWRITEBYTECODE unset before any
# timing, as a user's install would be (the host's torch ships no .pyc files).
# PHASE 1: what a CUDA load imports; the PARAMS (default 1.3B) 8-rank ZeRO-3 checkpoint; its bf16 and fp32
# safetensors (zeroio convert); the parallel read limits and the pinned host-to-device limit; zeroio's reader
# threads and staging sizes on the ZeRO-3 source; loaders side by side (bf16, then fp32), one round.
# PHASE 2: checkpoint and conversions again; side by side, two rounds, bf16 and fp32; distributed convert with
# 1, 2 and 4 processes against one plain process (this tree and, as "before", $BEFORE if set).
# PHASE 3: read limits by block size and split, zeroio's staging sizes (3 cold, 2 warm rounds), torchrun's own
# start-up, side by side in fp32.
# Every step stops by DEADLINE_S (default 570 s after the start) and writes its JSON as it goes.
set -u
OUT=${1:?usage: gpu_host_read_limit.sh OUT_DIR [PHASE] [PARAMS]}
PHASE=${2:-1}
PARAMS=${3:-1.3B}
START=$(date +%s)
DEADLINE=$((START + ${DEADLINE_S:-570}))
W=/tmp/zb
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
TORCH_DIR=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
# Bytecode for torch and the carried packages, while the checkpoint builds (the build itself compiles nothing).
(unset PYTHONDONTWRITEBYTECODE; python3 -m compileall -q -j 16 "$TORCH_DIR" /tmp/site >/dev/null 2>&1) &
COMPILE=$!
{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -h /tmp
    lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT 2>/dev/null; cat /sys/block/*/queue/nr_requests 2>/dev/null | head -3
    python3 -c 'import torch, deepspeed; print(torch.__version__, deepspeed.__version__)'
    echo "commit ${ZEROIO_COMMIT:-unknown}"
} >"$OUT/env.txt" 2>&1
left() { echo $((DEADLINE - $(date +%s))); }
note() { echo "$1 at +$(( $(date +%s) - START )) s" >>"$OUT/env.txt"; }

if [ -f $W/ck/manifest.json ]; then
    true &
else
    python3 benchmarks/make_checkpoint.py --params "$PARAMS" --world-size 8 --launcher torchrun --out $W/ck \
        >"$W/build.log" 2>&1 &
fi
BUILD=$!
wait $COMPILE
note "bytecode compiled"
unset PYTHONDONTWRITEBYTECODE
if [ "$PHASE" = 1 ]; then
    for build in cpu meta; do
        python3 benchmarks/load_imports.py --device cuda --build $build >"$OUT/imports-cuda-$build.json" 2>>"$OUT/imports.log"
    done
    python3 benchmarks/load_imports.py --device cpu --build cpu >"$OUT/imports-cpu-cpu.json" 2>>"$OUT/imports.log"
    python3 -X importtime -c 'import torch, zeroio' 2>"$W/importtime.txt"
    note "imports probed"
fi
[ "$PHASE" = 1 ] || [ -n "${NO_CUDA_TESTS:-}" ] || {  # the CUDA paths, while the checkpoint builds
    timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_sharded.py tests/test_load.py \
        -k cuda >"$OUT/cuda_tests.txt" 2>&1
    echo "cuda tests exit $?" >>"$OUT/cuda_tests.txt"
}
wait $BUILD || { tail -50 "$W/build.log" >>"$OUT/env.txt"; exit 1; }
note "build done"
cp $W/ck/manifest.json "$OUT/manifest.json"
for dt in bf16 fp32; do
    [ -d $W/st-$dt ] || python3 -m zeroio convert $W/ck $W/st-$dt --quiet --dtype $dt >>"$OUT/env.txt" 2>&1
done
du -sb $W/st-bf16 $W/st-fp32 >>"$OUT/env.txt"
note "converted"

SBS="python3 benchmarks/loaders_side_by_side.py --zero $W/ck --config $W/ck/manifest.json --deadline $DEADLINE"
if [ "$PHASE" = 1 ]; then
    python3 benchmarks/read_limit.py --checkpoint $W/ck --threads 1 4 16 32 --block-mib 8 32 --direct --h2d \
        --json "$OUT/read-limit-zero3.json" >"$OUT/read-limit.log" 2>&1
    python3 benchmarks/read_limit.py --files $W/st-bf16/*.safetensors --threads 1 16 --block-mib 32 \
        --json "$OUT/read-limit-st-bf16.json" >>"$OUT/read-limit.log" 2>&1
    note "read limits"
    $SBS --folder $W/st-bf16 --dtype bf16 --rounds 1 \
        --methods zeroio-zero3@t5c32 zeroio-zero3@t16c32 zeroio-zero3@t16c16 zeroio-zero3@t32c16 zeroio-zero3@t16c64 \
        --json "$OUT/zero3-sweep.json" >"$OUT/sweep.log" 2>&1
    note "zero3 sweep"
    $SBS --folder $W/st-bf16 --dtype bf16 --rounds 1 \
        --methods zeroio zeroio@t5c32 safetensors fastsafetensors runai read-limit zeroio-zero3 \
        --json "$OUT/side-by-side-bf16.json" >"$OUT/sbs.log" 2>&1
    note "side by side bf16"
    $SBS --folder $W/st-fp32 --dtype fp32 --rounds 1 \
        --methods zeroio safetensors fastsafetensors runai read-limit zeroio-zero3 \
        --json "$OUT/side-by-side-fp32.json" >>"$OUT/sbs.log" 2>&1
    note "side by side fp32"
elif [ "$PHASE" = 3 ]; then
    python3 benchmarks/read_limit.py --files $W/st-bf16/*.safetensors --threads 1 4 16 --block-mib 16 32 64 \
        --split queue shares --json "$OUT/read-limit-st-bf16.json" >"$OUT/read-limit.log" 2>&1
    note "read limits"
    $SBS --folder $W/st-bf16 --dtype bf16 --rounds 3 --cache cold \
        --methods zeroio zeroio@t16c32 zeroio@t8c32 zeroio@t16c64 fastsafetensors read-limit \
        --json "$OUT/chunks-cold.json" >"$OUT/sbs.log" 2>&1
    note "chunks cold"
    $SBS --folder $W/st-bf16 --dtype bf16 --rounds 2 --cache warm --methods zeroio zeroio@t16c32 zeroio@t8c32 \
        --json "$OUT/chunks-warm.json" >>"$OUT/sbs.log" 2>&1
    note "chunks warm"
    for i in 1 2; do  # torchrun's own cost: a job of 2 workers that do nothing
        t0=$(date +%s.%N); python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m zeroio --version >/dev/null 2>&1
        echo "torchrun x2 of 'zeroio --version': $(python3 -c "print(round($(date +%s.%N) - $t0, 2))") s" >>"$OUT/env.txt"
    done
    $SBS --folder $W/st-fp32 --dtype fp32 --rounds 1 \
        --methods zeroio safetensors fastsafetensors runai read-limit zeroio-zero3 \
        --json "$OUT/side-by-side-fp32.json" >>"$OUT/sbs.log" 2>&1
    note "side by side fp32"
else
    for dt in ${DTYPES:-bf16}; do
        $SBS --folder $W/st-$dt --dtype $dt --rounds 2 ${BEFORE:+--before $BEFORE} \
            --methods zeroio ${BEFORE:+zeroio-before} safetensors fastsafetensors runai read-limit zeroio-zero3 \
            ${BEFORE:+zeroio-zero3-before} --json "$OUT/side-by-side-$dt.json" >>"$OUT/sbs.log" 2>&1
        note "side by side $dt"
    done
    if [ "$(left)" -gt 60 ]; then
        python3 benchmarks/distributed.py --checkpoint $W/ck --processes 2 4 --repeats 1 --cache cold \
            --work $W/dist --json "$OUT/distributed.json" >"$OUT/distributed.log" 2>&1
        note "distributed"
    fi
    if [ -n "${BEFORE:-}" ] && [ "$(left)" -gt 45 ]; then
        (cd "$BEFORE" && python3 benchmarks/distributed.py --checkpoint $W/ck --processes 4 --repeats 1 --cache cold \
            --work $W/dist --json "$OUT/distributed-before.json") >"$OUT/distributed-before.log" 2>&1
        note "distributed before"
    fi
fi
grep -v WARNING "$OUT"/*.log | tail -60
