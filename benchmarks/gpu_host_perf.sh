#!/usr/bin/env bash
# The GPU-host runs of issue 34 goals 1-3 after the read-ahead / out-of-order filler work: before and after in one
# lease, one command per phase.
#
#   ZEROIO_COMMIT=<commit> AFTER=<tree> bash benchmarks/gpu_host_perf.sh OUT_DIR PHASE [TGZ]
#
# (TGZ: a tarball of OUT_DIR refreshed after every step, for a runner that brings back few files.)
# Run from the "before" tree (its zeroio/ is the baseline); AFTER (default .perf/after) holds the tree under test
# (zeroio/, benchmarks/, tests/, pyproject.toml, fixtures -> ../../fixtures). Wheels in $WHEELS (default .whl/:
# deepspeed and its missing dependencies, fastsafetensors, runai-model-streamer) go to /tmp/site. Torch and both
# trees are compiled to bytecode once and PYTHONDONTWRITEBYTECODE unset before any timing. A warm lease keeps
# /tmp/zb (the 1.3B 8-rank ZeRO-3 checkpoint and its bf16 safetensors) and the bytecode.
# PHASE load: the CUDA tests of the AFTER tree (while the checkpoint builds); timelines of a cold load (before,
#   after, after without read-ahead) from the safetensors and the ZeRO-3 source; loaders side by side (cold
#   checkpoint files x3, every cache dropped x1, warm x2).
# PHASE dist: torchrun's own start and exit; distributed convert (plain, torchrun x1/x2/x4) for before and after,
#   and after with workers ending in os._exit; the same with every cache dropped for plain and x4.
# Every step stops by DEADLINE_S (default 560 s after the start) and writes its JSON as it goes.
set -u
OUT=${1:?usage: gpu_host_perf.sh OUT_DIR PHASE [TGZ]}
PHASE=${2:-load}
TGZ=${3:-}
START=$(date +%s)
DEADLINE=$((START + ${DEADLINE_S:-560}))
W=/tmp/zb
BEFORE=$PWD
AFTER=${AFTER:-$PWD/.perf/after}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
left() { echo $((DEADLINE - $(date +%s))); }
note() {
    echo "$1 at +$(($(date +%s) - START)) s" >>"$OUT/env.txt"
    [ -z "$TGZ" ] || tar czf "$TGZ" -C "$(dirname "$OUT")" "$(basename "$OUT")"
}
if [ ! -d /tmp/site/deepspeed ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site
{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -h /tmp
    lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT 2>/dev/null; cat /sys/block/*/queue/read_ahead_kb 2>/dev/null | head -3
    python3 -c 'import torch; print(torch.__version__)'; echo "commit ${ZEROIO_COMMIT:-unknown} warm=$([ -f $W/.compiled ] && echo y)"
} >>"$OUT/env.txt" 2>&1
TORCH_DIR=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
if [ ! -f $W/.compiled ]; then
    (unset PYTHONDONTWRITEBYTECODE; python3 -m compileall -q -j 16 "$TORCH_DIR" /tmp/site >/dev/null 2>&1) &
    COMPILE=$!
else
    true & COMPILE=$!
fi
if [ -f $W/ck/manifest.json ]; then
    true & BUILD=$!
else
    (PYTHONPATH=/tmp/site:$BEFORE python3 benchmarks/make_checkpoint.py --params 1.3B --world-size 8 \
        --launcher torchrun --out $W/ck >"$W/build.log" 2>&1) &
    BUILD=$!
fi
wait $COMPILE
touch $W/.compiled
unset PYTHONDONTWRITEBYTECODE
python3 -m compileall -q "$BEFORE/zeroio" "$AFTER/zeroio" "$AFTER/benchmarks" "$AFTER/tests" >/dev/null 2>&1
note "bytecode compiled"
if [ "$PHASE" = load ]; then  # the CUDA paths of the tree under test, while the checkpoint builds
    (cd "$AFTER" && timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_load.py -k "cuda or imports" \
        tests/test_cuda_sharded.py tests/test_load_imports.py >"$OUT/cuda_tests.txt" 2>&1
     echo "cuda tests exit $?" >>"$OUT/cuda_tests.txt")
    note "cuda tests"
fi
wait $BUILD || { tail -50 "$W/build.log" >>"$OUT/env.txt"; exit 1; }
note "checkpoint built"
[ -d $W/st-bf16 ] || PYTHONPATH=/tmp/site:$BEFORE python3 -m zeroio convert $W/ck $W/st-bf16 --quiet --dtype bf16 \
    >>"$OUT/env.txt" 2>&1
note "converted"
cp $W/ck/manifest.json "$OUT/manifest.json"
B=$AFTER/benchmarks

if [ "$PHASE" = load ]; then
    for src in st-bf16 ck; do
        python3 $B/load_timeline.py --source $W/$src --config $W/ck/manifest.json --dtype bf16 --rounds 2 \
            --trees "before=$BEFORE" "after=$AFTER" "after-noahead=$AFTER:ZEROIO_PREFETCH_BYTES=0" \
            --json "$OUT/timeline-$src.json" >>"$OUT/timeline.log" 2>&1
        note "timeline $src"
    done
    SBS="python3 $B/loaders_side_by_side.py --folder $W/st-bf16 --zero $W/ck --config $W/ck/manifest.json --dtype bf16"
    $SBS --before "$BEFORE" --rounds 3 --cache cold-files --deadline $((DEADLINE - 150)) \
        --methods zeroio zeroio-before fastsafetensors runai safetensors read-limit zeroio-zero3 zeroio-zero3-before \
        read-limit-zero3 --json "$OUT/sbs-coldfiles.json" >"$OUT/sbs.log" 2>&1
    note "side by side, cold files"
    $SBS --before "$BEFORE" --rounds 1 --cache cold --deadline $((DEADLINE - 60)) \
        --methods zeroio zeroio-before fastsafetensors runai read-limit zeroio-zero3 read-limit-zero3 \
        --json "$OUT/sbs-cold.json" >>"$OUT/sbs.log" 2>&1
    note "side by side, cold"
    $SBS --before "$BEFORE" --rounds 2 --cache warm --deadline $((DEADLINE - 10)) \
        --methods zeroio zeroio-before fastsafetensors runai safetensors zeroio-zero3 zeroio-zero3-before \
        --json "$OUT/sbs-warm.json" >>"$OUT/sbs.log" 2>&1
    note "side by side, warm"
elif [ "$PHASE" = dist ]; then
    {
        for c in cold warm; do
            for n in 1 4; do
                [ $c = cold ] && { sync; echo 3 >/proc/sys/vm/drop_caches; }
                t0=$(date +%s.%N)
                python3 -m torch.distributed.run --standalone --nproc-per-node $n -m zeroio --version >/dev/null 2>&1
                echo "torchrun x$n of 'zeroio --version', $c: $(python3 -c "print(round($(date +%s.%N) - $t0, 2))") s"
            done
            [ $c = cold ] && { sync; echo 3 >/proc/sys/vm/drop_caches; }
            t0=$(date +%s.%N)
            python3 -c 'import time, torch; print(time.time())' >$W/t.txt
            t1=$(date +%s.%N)
            echo "python3 -c 'import torch', $c: $(python3 -c "print(round($t1 - $t0, 2), 'of which exit', round($t1 - float(open('$W/t.txt').read()), 2))") s"
        done
    } >"$OUT/torchrun.txt" 2>&1
    note "torchrun probes"
    D="python3 $B/distributed.py --checkpoint $W/ck --repeats 1 --verify first --work $W/dist"
    $D --tree "$BEFORE" --processes 1 2 4 --cache cold-files --json "$OUT/dist-before.json" >"$OUT/dist.log" 2>&1
    note "distributed before"
    $D --tree "$AFTER" --processes 1 2 4 --cache cold-files --json "$OUT/dist-after.json" >>"$OUT/dist.log" 2>&1
    note "distributed after"
    [ "$(left)" -gt 80 ] && $D --tree "$AFTER" --processes 1 4 --cache cold-files --fast-exit \
        --json "$OUT/dist-after-fastexit.json" >>"$OUT/dist.log" 2>&1
    note "distributed after, fast exit"
    [ "$(left)" -gt 70 ] && $D --tree "$AFTER" --processes 4 --cache cold --verify none \
        --json "$OUT/dist-after-cold.json" >>"$OUT/dist.log" 2>&1
    note "distributed after, every cache dropped"
fi
grep -v WARNING "$OUT"/*.log 2>/dev/null | tail -40
cat "$OUT/env.txt"
