#!/usr/bin/env bash
# Issue 34 goals 1-3 on the GPU host: which read pattern gives the most cold bandwidth there, zeroio's load to CUDA
# against it and against the other loaders (bf16 and fp32, cold and warm), the ZeRO-3 source, and distributed
# convert where storage serves parallel readers (tmpfs). One command per phase, each stopping by DEADLINE_S
# (default 550 s after its start) and refreshing OUT/res-PHASE.tgz after every step (the runner brings back few files).
#
#   ZEROIO_COMMIT=<commit> TREE=<tree> WHEELS=.whl bash benchmarks/gpu_host_reads.sh OUT PHASE
#
# TREE (default: this script's repository) holds zeroio/, benchmarks/, tests/ and pyproject.toml (fixtures/ beside
# it or linked). WHEELS: fastsafetensors, runai-model-streamer, deepspeed and its missing dependencies.
# PHASE reads: the CUDA tests; a random 1.3B GPT-2 (transformers names, benchmarks/make_safetensors.py --hf) in bf16
#   (2.63 GB) and fp32 (5.25 GB), 2 shards each; the read-pattern sweep (threads x block x O_DIRECT / buffered /
#   fadvise, the files evicted before each run) and the pinned host-to-device limit; loaders side by side, cold
#   files and warm, with zeroio's read variants (ZEROIO_READ_BLOCK, ZEROIO_DIRECT_READS, ZEROIO_PREFETCH_BYTES).
# PHASE zero: the 8-rank ZeRO-3 checkpoint (DeepSpeed, make_checkpoint.py) while the CUDA tests run; side by side
#   of the default tree on the bf16 files and from the ZeRO-3 source, cold files and warm; distributed convert with
#   the source on /dev/shm (1, 2, 4 processes; one reader per host and one per process) and on the disk.
# PHASE engines: the bf16 and fp32 files and the ZeRO-3 checkpoint built at once (with the CUDA tests); then, each
#   step only while DEADLINE allows: read_engines.py on the cold bf16 files (fastsafetensors' C++ reader, Python
#   threads, one Python thread driving Linux AIO), zeroio.load against fastsafetensors on them (cold files, warm),
#   distributed convert (plain and torchrun x4, ZEROIO_READERS_PER_HOST 1 and 4) from /dev/shm and from the disk
#   (cold files), and read_engines.py on the cold fp32 files.
# PHASE onehost (issue 34 goal 3, one reader per host): the ZeRO-3 checkpoint, then plain convert against torchrun x4
#   --distributed from /dev/shm (3 rounds) and from the disk (cold files, 2 rounds), for TREE and, when BEFORE names
#   another tree (e.g. `git archive` of the commit before a change), for it too, alternating; each process's timeline
#   in the JSON (benchmarks/timeline.py prints it), the medians in onehost-summary.md.
# PHASE leaseD: the bf16 and fp32 files on the disk, the 1.3B 8-rank ZeRO-3 checkpoint and the 355M 4-rank one
#   (for gpu_host_s3.sh) built in /dev/shm so that nothing else writes to the disk before the reads, with the CUDA
#   tests; then zeroio.load against fastsafetensors and the parallel read limit, bf16 and fp32, cold files, ROUNDS
#   (default 3) rounds; then the 1.3B checkpoint copied to the disk and benchmarks/read_bytes.py on it (traced
#   and hashed, warm; then cold files, untraced, CRC read + copy_file_range against pread + pwrite
#   (ZEROIO_NO_COPY_FILE_RANGE=1) alternating, COLD_REPEATS (default 3) each; bf16 once), then PHASE dist's steps
#   while DEADLINE allows.
# PHASE dist: distributed convert of the 1.3B checkpoint (/dev/shm/ck, else built), plain against torchrun x4 with
#   ZEROIO_READERS_PER_HOST 1 and 4, from /dev/shm (warm, two repeats) and from the disk (cold files, one repeat);
#   a step that a leaseD or dist phase of this machine already ran to its end (/tmp/dist-done) is skipped.
set -u
OUT=${1:?usage: gpu_host_reads.sh OUT PHASE}
PHASE=${2:-reads}
START=$(date +%s)
DEADLINE=$((START + ${DEADLINE_S:-550}))
W=${WORK:-/tmp/zr}
TREE=${TREE:-$(cd "$(dirname "$0")/.." && pwd)}
WHEELS=${WHEELS:-.whl}
R=/tmp/res-$PHASE
mkdir -p "$OUT" "$W" "$R"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
left() { echo $((DEADLINE - $(date +%s))); }
note() {
    echo "$1 at +$(($(date +%s) - START)) s" >>"$R/env.txt"
    cp "$R/env.txt" "$OUT/env-$PHASE.txt"
    tar czf "$OUT/res-$PHASE.tgz" -C /tmp "res-$PHASE"
}
if [ ! -d /tmp/site/fastsafetensors ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site
{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g
    df -hT /tmp /dev/shm; lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT 2>/dev/null; uname -r
    for q in read_ahead_kb max_sectors_kb nr_requests scheduler rotational; do
        echo "vda $q $(cat /sys/block/vda/queue/$q 2>/dev/null)"
    done
    python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'
    echo "commit ${ZEROIO_COMMIT:-unknown} tree $TREE"
} >>"$R/env.txt" 2>&1
unset PYTHONDONTWRITEBYTECODE
TORCH_DIR=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
TF_DIR=$(python3 -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')
B=$TREE/benchmarks
SBS="python3 $B/loaders_side_by_side.py --hf"

if [ "$PHASE" = reads ]; then
    python3 -m compileall -q -j 16 "$TORCH_DIR" "$TF_DIR" /tmp/site "$TREE/zeroio" "$B" "$TREE/tests" \
        >/dev/null 2>&1 &
    COMPILE=$!
    (for d in bf16 fp32; do
        [ -f $W/hf-$d/config.json ] || python3 $B/make_safetensors.py --params ${PARAMS:-1.3B} --shards 2 --hf --dtype $d \
            --out $W/hf-$d || exit 1
    done) >$W/make.log 2>&1 &
    GEN=$!
    (cd "$TREE" && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_load.py -k "cuda or imports" \
        tests/test_cuda_sharded.py tests/test_read_parts.py >"$R/cuda_tests.txt" 2>&1
     echo "cuda tests exit $?" >>"$R/cuda_tests.txt")
    note "cuda tests"
    wait $COMPILE
    note "bytecode compiled"
    wait $GEN || { tail -30 $W/make.log >>"$R/env.txt"; note "make failed"; exit 1; }
    du -sb $W/hf-bf16 $W/hf-fp32 >>"$R/env.txt"
    note "checkpoints made"
    RL="python3 $B/read_limit.py --files $W/hf-bf16/model-0000*.safetensors --evict"
    $RL --modes direct --threads 8 16 32 64 --block-kib 256 512 1024 4096 16384 \
        --json "$R/sweep-direct.json" >"$R/sweep.log" 2>&1
    note "sweep, O_DIRECT"
    $RL --modes cold --threads 16 32 --block-kib 512 1024 4096 32768 --advice none sequential --h2d \
        --json "$R/sweep-buffered.json" >>"$R/sweep.log" 2>&1
    note "sweep, buffered"
    $RL --modes cold --threads 1 16 --block-kib 32768 --advice willneed \
        --json "$R/sweep-willneed.json" >>"$R/sweep.log" 2>&1
    note "sweep, willneed"
    VARIANTS="zeroio zeroio@b=512KiB zeroio@b=1MiB zeroio@b=512KiB,d=1 zeroio@b=1MiB,d=1 zeroio@d=1 zeroio@b=512KiB,d=1,p=0"
    for d in bf16 fp32; do
        F="--folder $W/hf-$d --config $W/hf-$d/manifest.json --dtype $d"
        $SBS $F --rounds $([ $d = bf16 ] && echo 3 || echo 2) --cache cold-files --deadline $((DEADLINE - 200)) \
            --methods $VARIANTS fastsafetensors read-limit@d16x512 read-limit@b16x32768 \
            --json "$R/sbs-$d-coldfiles.json" >>"$R/sbs.log" 2>&1
        note "side by side $d, cold files"
        $SBS $F --rounds 2 --cache warm --deadline $((DEADLINE - 120)) \
            --methods zeroio zeroio@b=512KiB zeroio@b=512KiB,d=1 zeroio@b=1MiB,d=1 safetensors fastsafetensors \
            runai transformers --json "$R/sbs-$d-warm.json" >>"$R/sbs.log" 2>&1
        note "side by side $d, warm"
    done
    for d in bf16 fp32; do
        $SBS --folder $W/hf-$d --config $W/hf-$d/manifest.json --dtype $d --rounds 2 --cache cold-files \
            --deadline $((DEADLINE - 15)) --methods safetensors runai transformers \
            --json "$R/sbs-$d-coldfiles-others.json" >>"$R/sbs.log" 2>&1
        note "side by side $d, cold files, other loaders"
    done
elif [ "$PHASE" = zero ]; then
    LIMIT=${RL_BEST:-b16x32768}  # the read pattern the reads phase found fastest from Python
    python3 -m compileall -q -j 16 "$TORCH_DIR" "$TF_DIR" /tmp/site "$TREE/zeroio" "$B" "$TREE/tests" \
        >/dev/null 2>&1 &
    COMPILE=$!
    (
        [ -f $W/ck/manifest.json ] || python3 $B/make_checkpoint.py --params 1.3B --world-size 8 --launcher torchrun \
            --out $W/ck || exit 1
    ) >$W/build.log 2>&1 &
    BUILD=$!
    [ -f $W/hf-fp32/config.json ] || python3 $B/make_safetensors.py --params 1.3B --shards 2 --hf --dtype fp32 \
        --out $W/hf-fp32 >$W/make.log 2>&1
    (cd "$TREE" && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_load.py -k "cuda or imports" \
        tests/test_cuda_sharded.py tests/test_read_parts.py >"$R/cuda_tests.txt" 2>&1
     echo "cuda tests exit $?" >>"$R/cuda_tests.txt")
    note "cuda tests"
    wait $COMPILE
    wait $BUILD || { tail -30 $W/build.log >>"$R/env.txt"; note "build failed"; exit 1; }
    du -sb $W/ck $W/hf-fp32 >>"$R/env.txt"
    cp $W/ck/manifest.json "$R/ck-manifest.json"
    note "checkpoints built"
    Z="--folder $W/hf-fp32 --zero $W/ck --config $W/ck/manifest.json --dtype bf16"
    python3 $B/loaders_side_by_side.py $Z --rounds 2 --cache cold-files --deadline $((DEADLINE - 240)) \
        --methods zeroio-zero3 read-limit-zero3@$LIMIT read-limit-zero3@d8x256 \
        --json "$R/sbs-zero3-coldfiles.json" >>"$R/sbs.log" 2>&1
    note "ZeRO-3 source, cold files"
    python3 $B/loaders_side_by_side.py $Z --rounds 2 --cache warm --deadline $((DEADLINE - 220)) \
        --methods zeroio-zero3 --json "$R/sbs-zero3-warm.json" >>"$R/sbs.log" 2>&1
    python3 $B/read_limit.py --checkpoint $W/ck --modes warm --threads 16 --block-kib 16384 --h2d \
        --json "$R/limit-zero3-warm.json" >>"$R/sbs.log" 2>&1
    note "ZeRO-3 source, warm"
    rm -rf /dev/shm/ck && cp -r $W/ck /dev/shm/ck && note "copied to /dev/shm"
    D="python3 $B/distributed.py --checkpoint /dev/shm/ck --work /dev/shm/dist --repeats 1 --verify first --cache warm"
    [ "$(left)" -gt 150 ] && $D --processes 2 4 --json "$R/dist-shm-readers1.json" >"$R/dist.log" 2>&1
    note "distributed, /dev/shm, one reader per host"
    [ "$(left)" -gt 110 ] && ZEROIO_READERS_PER_HOST=4 $D --processes 2 4 --json "$R/dist-shm-readersall.json" \
        >>"$R/dist.log" 2>&1
    note "distributed, /dev/shm, every process reads"
    rm -rf /dev/shm/ck /dev/shm/dist
    F="--folder $W/hf-fp32 --config $W/hf-fp32/manifest.json --dtype fp32"
    $SBS $F --rounds 2 --cache cold-files --deadline $((DEADLINE - 40)) \
        --methods zeroio fastsafetensors read-limit@$LIMIT --json "$R/sbs-fp32-coldfiles.json" >>"$R/sbs.log" 2>&1
    note "side by side fp32, cold files"
    $SBS $F --rounds 1 --cache warm --deadline $((DEADLINE - 10)) --methods fastsafetensors zeroio \
        --json "$R/sbs-fp32-warm.json" >>"$R/sbs.log" 2>&1
    note "side by side fp32, warm"
elif [ "$PHASE" = engines ]; then
    python3 -m compileall -q -j 16 "$TORCH_DIR" "$TF_DIR" /tmp/site "$TREE/zeroio" "$B" "$TREE/tests" \
        >/dev/null 2>&1 &
    COMPILE=$!
    (for d in bf16 fp32; do
        [ -f $W/hf-$d/config.json ] || python3 $B/make_safetensors.py --params 1.3B --shards 2 --hf --dtype $d \
            --out $W/hf-$d || exit 1
    done) >$W/make.log 2>&1 &
    GEN=$!
    (
        [ -f $W/ck/manifest.json ] || python3 $B/make_checkpoint.py --params 1.3B --world-size 8 --launcher torchrun \
            --out $W/ck || exit 1
    ) >$W/build.log 2>&1 &
    BUILD=$!
    (cd "$TREE" && timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_load.py -k "cuda or imports" \
        tests/test_cuda_sharded.py tests/test_read_parts.py >"$R/cuda_tests.txt" 2>&1
     echo "cuda tests exit $?" >>"$R/cuda_tests.txt")
    note "cuda tests"
    wait $COMPILE
    wait $GEN || { tail -30 $W/make.log >>"$R/env.txt"; note "make failed"; exit 1; }
    CK=1
    wait $BUILD || { CK=0; tail -30 $W/build.log >>"$R/env.txt"; note "build failed"; }
    du -sb $W/hf-bf16 $W/hf-fp32 $W/ck >>"$R/env.txt" 2>&1
    note "checkpoints built"
    ENGINES="fst@16,16384,1 fst@16,16384,0 threads@d16x512 threads@b16x32768 aio@16x512 aio@32x512 aio@16x4096
        aio@32x4096"
    python3 $B/read_engines.py --files $W/hf-bf16/model-0000*.safetensors --rounds 2 --methods $ENGINES \
        --deadline $((DEADLINE - 300)) --json "$R/engines-bf16.json" >"$R/engines.log" 2>&1
    note "read engines, bf16"
    F="--folder $W/hf-bf16 --config $W/hf-bf16/manifest.json --dtype bf16"
    $SBS $F --rounds 2 --cache cold-files --deadline $((DEADLINE - 260)) --methods zeroio fastsafetensors \
        --json "$R/sbs-bf16-coldfiles.json" >"$R/sbs.log" 2>&1
    $SBS $F --rounds 2 --cache warm --deadline $((DEADLINE - 240)) --methods zeroio fastsafetensors \
        --json "$R/sbs-bf16-warm.json" >>"$R/sbs.log" 2>&1
    note "side by side bf16"
    if [ $CK = 1 ] && [ "$(left)" -gt 200 ]; then
        cp $W/ck/manifest.json "$R/ck-manifest.json"
        rm -rf /dev/shm/ck && cp -r $W/ck /dev/shm/ck && note "copied to /dev/shm"
        D="python3 $B/distributed.py --max-shard-size 500MB --processes 4 --verify first"
        for n in 1 4; do
            [ "$(left)" -gt 150 ] && ZEROIO_READERS_PER_HOST=$n $D --checkpoint /dev/shm/ck --work /dev/shm/dist \
                --cache warm --repeats 2 --json "$R/dist-shm-readers$n.json" >>"$R/dist.log" 2>&1
            note "distributed, /dev/shm, $n readers per host"
        done
        rm -rf /dev/shm/ck /dev/shm/dist
        for n in 1 4; do
            [ "$(left)" -gt 100 ] && ZEROIO_READERS_PER_HOST=$n $D --checkpoint $W/ck --work $W/dist \
                --cache cold-files --repeats 1 --json "$R/dist-disk-readers$n.json" >>"$R/dist.log" 2>&1
            note "distributed, disk, cold files, $n readers per host"
        done
    fi
    python3 $B/read_engines.py --files $W/hf-fp32/model-0000*.safetensors --rounds 2 --methods $ENGINES \
        --deadline $((DEADLINE - 15)) --json "$R/engines-fp32.json" >>"$R/engines.log" 2>&1
    note "read engines, fp32"
elif [ "$PHASE" = onehost ]; then
    python3 -m compileall -q -j 16 "$TORCH_DIR" /tmp/site "$TREE/zeroio" "$B" ${BEFORE:+"$BEFORE/zeroio"} \
        >/dev/null 2>&1 &
    COMPILE=$!
    [ -f $W/ck/manifest.json ] || python3 $B/make_checkpoint.py --params 1.3B --world-size 8 --launcher torchrun \
        --out $W/ck >$W/build.log 2>&1 || { tail -30 $W/build.log >>"$R/env.txt"; note "build failed"; exit 1; }
    wait $COMPILE
    cp $W/ck/manifest.json "$R/ck-manifest.json"
    rm -rf /dev/shm/ck && cp -r $W/ck /dev/shm/ck && note "checkpoint built, copied to /dev/shm"
    D="python3 $B/distributed.py --max-shard-size 500MB --processes 4 --repeats 1 --verify first"
    TREES="after=$TREE${BEFORE:+ before=$BEFORE}"
    for i in 1 2 3; do  # the trees alternate, each run a plain convert and torchrun x4 (one reader per host)
        for t in $TREES; do
            [ "$(left)" -gt 150 ] && $D --tree "${t#*=}" --checkpoint /dev/shm/ck --work /dev/shm/dist --cache warm \
                --json "$R/onehost-shm-${t%%=*}-$i.json" >>"$R/dist.log" 2>&1
        done
        note "one host, /dev/shm, round $i"
    done
    rm -rf /dev/shm/ck /dev/shm/dist
    for i in 1 2; do
        for t in $TREES; do
            [ "$(left)" -gt 60 ] && $D --tree "${t#*=}" --checkpoint $W/ck --work $W/dist --cache cold-files \
                --json "$R/onehost-disk-${t%%=*}-$i.json" >>"$R/dist.log" 2>&1
        done
        note "one host, disk, cold files, round $i"
    done
    python3 $B/timeline.py "$R"/onehost-*.json --summary >"$R/onehost-summary.md" 2>&1
    cat "$R/onehost-summary.md"
    note "one host summary"
elif [ "$PHASE" = leaseD ]; then
    python3 -m compileall -q -j 16 "$TORCH_DIR" "$TF_DIR" /tmp/site "$TREE/zeroio" "$B" "$TREE/tests" \
        >/dev/null 2>&1 &
    COMPILE=$!
    (for d in bf16 fp32; do
        [ -f $W/hf-$d/config.json ] || python3 $B/make_safetensors.py --params 1.3B --shards 2 --hf --dtype $d \
            --out $W/hf-$d || exit 1
    done) >$W/make.log 2>&1 &
    GEN=$!
    ([ -f /dev/shm/ck/manifest.json ] || python3 $B/make_checkpoint.py --params 1.3B --world-size 8 \
        --launcher torchrun --out /dev/shm/ck) >$W/build.log 2>&1 &
    BUILD=$!
    ([ -f /dev/shm/zs3ck/manifest.json ] || python3 $B/make_checkpoint.py --params 355M --world-size 4 \
        --launcher torchrun --out /dev/shm/zs3ck) >$W/build-s3.log 2>&1 &
    BUILD_S3=$!
    (cd "$TREE" && timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_load.py -k "cuda or imports" \
        tests/test_cuda_sharded.py tests/test_read_parts.py >"$R/cuda_tests.txt" 2>&1
     echo "cuda tests exit $?" >>"$R/cuda_tests.txt")
    note "cuda tests"
    wait $COMPILE
    wait $GEN || { tail -30 $W/make.log >>"$R/env.txt"; note "make failed"; exit 1; }
    CK=1
    wait $BUILD || { CK=0; tail -30 $W/build.log >>"$R/env.txt"; note "build failed"; }
    wait $BUILD_S3 || { tail -30 $W/build-s3.log >>"$R/env.txt"; note "355M build failed"; }
    du -sb $W/hf-bf16 $W/hf-fp32 /dev/shm/ck /dev/shm/zs3ck >>"$R/env.txt" 2>&1
    sync
    sleep 10
    note "checkpoints built, synced"
    for d in bf16 fp32; do
        $SBS --folder $W/hf-$d --config $W/hf-$d/manifest.json --dtype $d --rounds ${ROUNDS:-3} --cache cold-files \
            --deadline $((DEADLINE - 170)) --methods zeroio fastsafetensors read-limit@b16x32768 \
            --json "$R/sbs-$d-coldfiles.json" >>"$R/sbs.log" 2>&1
        note "side by side $d, cold files"
    done
    if [ $CK = 1 ] && [ "$(left)" -gt 120 ]; then
        cp /dev/shm/ck/manifest.json "$R/ck-manifest.json"
        rm -rf $W/ck && cp -r /dev/shm/ck $W/ck && sync && note "1.3B checkpoint copied to the disk"
        RB="python3 $B/read_bytes.py --checkpoint $W/ck --work $W/rb"
        $RB --dtype stored bf16 --hash --json "$R/rb-traced.json" >"$R/rb.log" 2>&1
        note "read_bytes traced, warm"
        for i in $(seq ${COLD_REPEATS:-3}); do
            [ "$(left)" -gt 60 ] || break
            $RB --no-trace --cache cold-files --dtype stored --json "$R/rb-cold-cfr-$i.json" >>"$R/rb.log" 2>&1
            ZEROIO_NO_COPY_FILE_RANGE=1 $RB --no-trace --cache cold-files --dtype stored \
                --json "$R/rb-cold-pwrite-$i.json" >>"$R/rb.log" 2>&1
            note "read_bytes cold files, fp32, copy_file_range and pwrite, round $i"
        done
        [ "$(left)" -gt 45 ] && $RB --no-trace --cache cold-files --dtype bf16 --json "$R/rb-cold-bf16.json" \
            >>"$R/rb.log" 2>&1 && note "read_bytes cold files, bf16"
        rm -rf $W/rb
    fi
fi
if [ "$PHASE" = leaseD ] || [ "$PHASE" = dist ]; then
    if [ ! -f /dev/shm/ck/manifest.json ] && [ "$PHASE" = dist ] && [ "$(left)" -gt 300 ]; then
        python3 $B/make_checkpoint.py --params 1.3B --world-size 8 --launcher torchrun --out /dev/shm/ck \
            >$W/build.log 2>&1 || tail -30 $W/build.log >>"$R/env.txt"
    fi
    D="python3 $B/distributed.py --max-shard-size 500MB --processes 4 --verify first"
    done_before() { [ -f "/tmp/dist-done/$1" ]; }  # steps that ran to their end on this machine
    mkdir -p /tmp/dist-done
    if [ -f /dev/shm/ck/manifest.json ]; then
        for n in 1 4; do
            done_before shm$n && continue
            [ "$(left)" -gt 60 ] || break
            ZEROIO_READERS_PER_HOST=$n timeout $(($(left) - 10)) $D --checkpoint /dev/shm/ck --work /dev/shm/dist \
                --cache warm --repeats 2 --json "$R/dist-shm-readers$n.json" >>"$R/dist.log" 2>&1 \
                && touch /tmp/dist-done/shm$n
            note "distributed, /dev/shm, $n readers per host"
        done
        rm -rf /dev/shm/dist
        [ -f $W/ck/manifest.json ] || { [ "$(left)" -gt 120 ] && cp -r /dev/shm/ck $W/ck && sync; }
    fi
    if [ -f $W/ck/manifest.json ]; then
        for n in 1 4; do
            done_before disk$n && continue
            [ "$(left)" -gt 65 ] || break
            ZEROIO_READERS_PER_HOST=$n timeout $(($(left) - 10)) $D --checkpoint $W/ck --work $W/dist \
                --cache cold-files --repeats 1 --json "$R/dist-disk-readers$n.json" >>"$R/dist.log" 2>&1 \
                && touch /tmp/dist-done/disk$n
            note "distributed, disk, cold files, $n readers per host"
        done
        rm -rf $W/dist
    fi
    ls "$R"/dist-*.json >/dev/null 2>&1 && python3 $B/timeline.py "$R"/dist-*.json --summary >"$R/dist-timeline.md" 2>&1
fi
grep -v WARNING "$R"/*.log 2>/dev/null | grep -iE 'error|Traceback' | tail -8
tail -3 "$R/cuda_tests.txt" 2>/dev/null
cat "$R/env.txt"
python3 - "$R" <<'PY'
import json, pathlib, sys

for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    for row in d.get("summary", []) if isinstance(d.get("summary"), list) else []:
        print(f.name, row["method"], round(row["wall_s_median"], 2), round(row["convert_s_median"], 2),
              row["per_rank_rchar_GB"])
    if isinstance(d.get("summary"), list):
        continue
    for k, v in d.get("summary", {}).items():
        print(f.name, k, round(v["median_s"], 3), [round(x, 3) for x in v["runs_s"]])
    for dtype, runs in d.get("runs", {}).items() if isinstance(d.get("runs"), dict) else []:  # read_bytes.py
        for r in runs:
            print(f.name, dtype, "convert", r["convert_s"], "cpu", r["cpu_s"], "rchar GB", round(r["rchar"] / 1e9, 2),
                  "device GB", round(r["read_bytes"] / 1e9, 2))
    if "best" in d:
        print(f.name, "best", d["best"], "h2d", d.get("h2d"))
        for r in d["runs"]:
            print(" ", r["mode"], r["threads"], r["block_mib"], r["advice"], round(r["seconds"], 3))
PY
