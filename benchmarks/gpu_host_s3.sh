#!/usr/bin/env bash
# Issue 34 goal 3 on the GPU host: distributed convert from an object store (the loopback S3 server of
# benchmarks/s3_source.py: moto, ranged GETs answered by seeking), 1 process against torchrun x2/x4/x8 with 1, 2, 4
# or 8 readers per host, per-connection caps as an object store's. One command, stopping by
# DEADLINE_S (default 540 s after its start), refreshing OUT/res-s3.tgz after every step.
#
#   ZEROIO_COMMIT=<commit> WHEELS=.whl bash benchmarks/gpu_host_s3.sh OUT
#
# WHEELS holds moto's S3 server and s3fs with their dependencies for the host's Python (3.12), made on a machine
# with the package index (41 wheels, 33 MB; checked: installed with --no-index into a clean 3.12 target, moto's
# server and s3fs ranged reads work):
#   pip download -d .whl --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform any 'moto[s3]==5.2.1' flask flask-cors 's3fs==2026.9.0'
# plus deepspeed's wheel unless CK names a checkpoint built before (make_checkpoint.py builds the ZeRO-3 checkpoint
# with DeepSpeed on CPU ranks).
# CK (default: a new 355M-parameter ZeRO-3 checkpoint on 4 ranks, 4.3 GB, 1.42 GB of fp32 weights to read) may name
# one built before. CAPS (default "50 0 25", as far as the deadline allows): per-connection MB/s caps, 0 for none;
# FIRST_BYTE_MS (default 20). PROCS (default "2 4 8"): torchrun process counts, each run with
# ZEROIO_READERS_PER_HOST=1, 2, 4, 8 up to P. The JSON is written after every conversion, so a run the deadline
# stops keeps what it measured.
set -u
OUT=${1:?usage: gpu_host_s3.sh OUT}
START=$(date +%s)
DEADLINE=$((START + ${DEADLINE_S:-540}))
W=${WORK:-/tmp/zs3}
TREE=${TREE:-$(cd "$(dirname "$0")/.." && pwd)}
WHEELS=${WHEELS:-.whl}
R=/tmp/res-s3
mkdir -p "$OUT" "$W" "$R"
export PYTHONUNBUFFERED=1
left() { echo $((DEADLINE - $(date +%s))); }
note() {
    echo "$1 at +$(($(date +%s) - START)) s, load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$R/env.txt"
    cp "$R/env.txt" "$OUT/env-s3.txt"
    tar czf "$OUT/res-s3.tgz" -C /tmp res-s3
}
NEED=""
python3 -c 'import moto.server, s3fs' 2>/dev/null || NEED="moto[s3] flask flask-cors s3fs"
[ -f "${CK:-$W/ck}/manifest.json" ] || python3 -c 'import deepspeed' 2>/dev/null || NEED="$NEED deepspeed"
if [ -n "$NEED" ]; then
    python3 -m pip install -q --no-index --no-cache-dir --find-links "$WHEELS" --target /tmp/site-s3 $NEED \
        >"$R/pip.txt" 2>&1 || { note "wheels missing ($WHEELS: $NEED)"; exit 1; }
    export PYTHONPATH=/tmp/site-s3${PYTHONPATH:+:$PYTHONPATH}  # keeps a deepspeed installed before
fi
{
    date -u; nproc; free -g; uname -r
    python3 -c 'import sys, torch, moto, s3fs; print(sys.version.split()[0], torch.__version__, moto.__version__, s3fs.__version__)'
    echo "commit ${ZEROIO_COMMIT:-unknown} tree $TREE"
} >>"$R/env.txt" 2>&1
unset PYTHONDONTWRITEBYTECODE
TORCH_DIR=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
python3 -m compileall -q -j 16 "$TORCH_DIR" "$TREE/zeroio" "$TREE/benchmarks" ${PYTHONPATH:+"$PYTHONPATH"} \
    >/dev/null 2>&1
B=$TREE/benchmarks
CK=${CK:-$W/ck}
if [ ! -f "$CK/manifest.json" ]; then
    python3 "$B/make_checkpoint.py" --params 355M --world-size 4 --launcher torchrun --out "$CK" >"$R/build.log" 2>&1 \
        || { tail -30 "$R/build.log" >>"$R/env.txt"; note "build failed"; exit 1; }
fi
cp "$CK/manifest.json" "$R/ck-manifest.json"
note "checkpoint ready"
# ~1.42 GB of fp32 out: shards of 100 MB give 8 readers work to share. One upload per cap (~1 min for 4.3 GB):
# a plain convert, then torchrun xP for each P with 1, 2, ... P readers per host.
PROCS=${PROCS:-2 4 8}
for cap in ${CAPS:-50 0 25}; do
    [ "$(left)" -gt 150 ] || break
    timeout $(($(left) - 20)) python3 "$B/distributed.py" --checkpoint "$CK" --source s3 --s3-cap-mbps "$cap" \
        --s3-first-byte-ms "${FIRST_BYTE_MS:-20}" --processes $PROCS --readers 1 2 4 8 --repeats "${REPEATS:-1}" \
        --verify first --max-shard-size 100MB --work "$W/dist" --json "$R/s3-cap$cap.json" >>"$R/dist.log" 2>&1
    note "s3, cap $cap MB/s per connection, torchrun x${PROCS// /, x}"
done
grep -iE 'error|Traceback' "$R/dist.log" | tail -8
cat "$R/env.txt"
python3 - "$R" <<'PY'
import json, pathlib, sys

for f in sorted(pathlib.Path(sys.argv[1]).glob("s3-*.json")):  # written after each conversion: may be partial
    for row in json.loads(f.read_text())["summary"]:
        print(f.name, row["method"], "wall", round(row["wall_s_median"], 2), "convert", round(row["convert_s_median"], 2),
              "after plan", round(row["after_plan_s_median"], 2), "GETs at once", row["served_max_concurrent_gets"])
PY
