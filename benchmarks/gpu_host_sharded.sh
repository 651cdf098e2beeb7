#!/usr/bin/env bash
# The GPU-host run of issues 24 (goal 5 CUDA part, goal 6) and 25 (goal 6), in one command per lease.
#
#   ZEROIO_COMMIT=<commit> bash benchmarks/gpu_host_sharded.sh OUT_DIR [PHASE] [PARAMS]
#
# (ZEROIO_COMMIT: the commit under test, written into every result file; the host's copy of .git may be stale.)
#
# PHASE 1 (default): CUDA correctness tests (tests/test_cuda_sharded.py, while the checkpoint builds), the PARAMS
# (default 1.3B) 8-rank ZeRO-3 checkpoint, its FSDP2 DCP copy, the cold-read limits, the sharded loads on 2 and 4
# CPU ranks and 1 CUDA rank (benchmarks/sharded_load.py), then DCP -> safetensors (benchmarks/dcp_convert.py) if
# time is left. PHASE 2: the CUDA tests again, checkpoint + DCP again (a lease starts bare), DCP -> safetensors, then
# DeepSpeed's load_checkpoint at world size 8. PHASE 3: the CUDA tests, the checkpoint, then the reader threads at
# 4 ranks (1, 2 = the default, 4 per rank) and the 1-rank CUDA load against dcp.load, two repeats. PHASE 4: the
# checkpoint, then staging chunks of 4, 16 (the default) and 64 MiB at 4 ranks and on CUDA, two repeats. PHASE 5: the
# CUDA tests, the checkpoint, zeroio at 4 ranks and on CUDA against dcp.load on CUDA, two repeats. Every step stops by DEADLINE_S (default 540 s after the start) and writes its JSON as it goes.
# Wheels carried in .whl/ (deepspeed and its missing dependencies, accelerate) are installed first.
set -u
OUT=${1:?usage: gpu_host_sharded.sh OUT_DIR [PHASE] [PARAMS]}
PHASE=${2:-1}
PARAMS=${3:-1.3B}
START=$(date +%s)
DEADLINE=$((START + ${DEADLINE_S:-540}))
W=/tmp/zb
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -h /tmp
    python3 -c 'import torch, deepspeed, accelerate; print(torch.__version__, deepspeed.__version__, accelerate.__version__)'
} >"$OUT/env.txt" 2>&1
left() { echo $((DEADLINE - $(date +%s))); }

if [ -f $W/ck/manifest.json ]; then  # a warm lease still holds the last call's checkpoint
    true &
else
    python3 benchmarks/make_checkpoint.py --params "$PARAMS" --world-size 8 --launcher torchrun --out $W/ck \
        >"$W/build.log" 2>&1 &
fi
BUILD=$!
if [ -z "${NO_CUDA_TESTS:-}" ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_sharded.py tests/test_load.py -k "cuda" \
        >"$OUT/cuda_tests.txt" 2>&1
    echo "cuda tests exit $?" >>"$OUT/cuda_tests.txt"
fi
wait $BUILD || { tail -50 "$W/build.log" >>"$OUT/env.txt"; exit 1; }
echo "build done at +$(( $(date +%s) - START )) s" >>"$OUT/env.txt"

if [ "$PHASE" = 3 ]; then
    python3 benchmarks/sharded_load.py --checkpoint $W/ck --dcp $W/dcp --make-dcp --dcp-world 4 --worlds 4 \
        --methods zeroio_r1 zeroio zeroio_r4 --cuda-methods zeroio dcp --limits --repeats 2 --work $W/sl \
        --deadline "$DEADLINE" --json "$OUT/sharded_load.json" >"$OUT/sharded_load.log" 2>&1
elif [ "$PHASE" = 4 ]; then
    python3 benchmarks/sharded_load.py --checkpoint $W/ck --worlds 4 --methods zeroio zeroio_c64 zeroio_c4 \
        --cuda-methods zeroio zeroio_c64 zeroio_c4 --limits --repeats 2 --work $W/sl \
        --deadline "$DEADLINE" --json "$OUT/sharded_load.json" >"$OUT/sharded_load.log" 2>&1
elif [ "$PHASE" = 5 ]; then
    python3 benchmarks/sharded_load.py --checkpoint $W/ck --dcp $W/dcp --make-dcp --dcp-world 4 --worlds 4 \
        --methods zeroio --cuda-methods zeroio dcp --limits --repeats 2 --work $W/sl \
        --deadline "$DEADLINE" --json "$OUT/sharded_load.json" >"$OUT/sharded_load.log" 2>&1
elif [ "$PHASE" = 1 ]; then
    python3 benchmarks/sharded_load.py --checkpoint $W/ck --dcp $W/dcp --make-dcp --dcp-world 4 --worlds 2 4 \
        --methods zeroio zeroio_bcast rank0 dcp --cuda-methods zeroio rank0 dcp --limits --work $W/sl \
        --deadline "$DEADLINE" --json "$OUT/sharded_load.json" >"$OUT/sharded_load.log" 2>&1
else
    python3 benchmarks/sharded_load.py --checkpoint $W/ck --dcp $W/dcp --make-dcp --dcp-world 4 --worlds \
        --methods --work $W/sl --deadline "$DEADLINE" --json "$OUT/sharded_load_dcp.json" >"$OUT/sharded_load.log" 2>&1
fi
echo "sharded_load done at +$(( $(date +%s) - START )) s" >>"$OUT/env.txt"
if [ "$PHASE" -lt 3 ] && [ "$(left)" -gt 100 ]; then
    timeout "$(left)" python3 benchmarks/dcp_convert.py --dcp $W/dcp --work $W/dc --keep \
        --json "$OUT/dcp_convert.json" >"$OUT/dcp_convert.log" 2>&1
    echo "dcp_convert exit $? at +$(( $(date +%s) - START )) s" >>"$OUT/env.txt"
    rm -rf $W/dc
fi
if [ "$PHASE" = 2 ] || [ "$PHASE" = 3 ] && [ "$(left)" -gt 60 ]; then
    python3 benchmarks/sharded_load.py --checkpoint $W/ck --worlds --methods --ds-world 8 --work $W/sl \
        --deadline "$DEADLINE" --json "$OUT/sharded_load_ds.json" >>"$OUT/sharded_load.log" 2>&1
    echo "deepspeed load done at +$(( $(date +%s) - START )) s" >>"$OUT/env.txt"
fi
cp $W/ck/manifest.json "$OUT/manifest.json" 2>/dev/null
grep -v WARNING "$OUT"/*.log | tail -40
