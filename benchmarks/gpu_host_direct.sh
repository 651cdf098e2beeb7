#!/usr/bin/env bash
# The GPU-host run of direct reads (issue 34 goals 1-2) in one fresh lease of about 5 minutes: no DeepSpeed build (a
# random bf16 GPT of 1.3B parameters in safetensors shards, benchmarks/make_safetensors.py), the CUDA load tests of
# the tree, a cold load checked bit for bit with direct reads on and off (check_direct.py: what stayed in the page
# cache shows which path read), then loaders side by side in the same tree, direct reads on and off
# (ZEROIO_DIRECT_READS), fastsafetensors if its wheel is in $WHEELS, and the buffered / O_DIRECT read limits:
# cold checkpoint files (the files evicted, torch cached) then warm.
#
#   ZEROIO_COMMIT=<commit> TREE=<tree> bash benchmarks/gpu_host_direct.sh OUT_DIR
#
# TREE (default: this script's repository) holds zeroio/, benchmarks/, tests/, pyproject.toml and fixtures. Torch,
# the wheels and the tree are compiled to bytecode (PYTHONDONTWRITEBYTECODE unset) while the checkpoint is made and
# the CUDA tests run. Every side-by-side run starts before DEADLINE_S (default 285 s after the start); the JSON is
# written at the end of each side-by-side step. OUT_DIR gets at most 7 files.
set -u
OUT=${1:?usage: gpu_host_direct.sh OUT_DIR}
START=$(date +%s)
DEADLINE=$((START + ${DEADLINE_S:-285}))
W=/tmp/zd
TREE=${TREE:-$(cd "$(dirname "$0")/.." && pwd)}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
note() { echo "$1 at +$(($(date +%s) - START)) s" >>"$OUT/env.txt"; }
FSST=""
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
    ls /tmp/site | grep -q fastsafetensors && FSST=fastsafetensors
fi
{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -hT /tmp
    lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT 2>/dev/null
    echo "read_ahead_kb $(cat /sys/block/vda/queue/read_ahead_kb) max_sectors_kb $(cat /sys/block/vda/queue/max_sectors_kb)"
    python3 -c 'import torch; print(torch.__version__)'; echo "commit ${ZEROIO_COMMIT:-unknown}"
} >>"$OUT/env.txt" 2>&1
unset PYTHONDONTWRITEBYTECODE
TORCH_DIR=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
python3 -m compileall -q -j 16 "$TORCH_DIR" /tmp/site "$TREE/zeroio" "$TREE/benchmarks" "$TREE/tests" >/dev/null 2>&1 &
COMPILE=$!
python3 "$TREE/benchmarks/make_safetensors.py" --params 1.3B --shards 2 --out $W/st >$W/make.log 2>&1 &
GEN=$!
(cd "$TREE" && timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_load.py -k cuda \
    >"$OUT/cuda_tests.txt" 2>&1; echo "cuda tests exit $?" >>"$OUT/cuda_tests.txt")
note "cuda tests"
wait $COMPILE
note "bytecode compiled"
wait $GEN || { tail -30 $W/make.log >>"$OUT/env.txt"; exit 1; }
du -sb $W/st >>"$OUT/env.txt"
note "checkpoint made"
B=$TREE/benchmarks
for d in 1 0; do
    ZEROIO_DIRECT_READS=$d python3 $B/check_direct.py --folder $W/st --config $W/st/manifest.json \
        --json "$OUT/check-direct-$d.json" >>"$OUT/sbs.log" 2>&1
    echo "check_direct ZEROIO_DIRECT_READS=$d exit $?" >>"$OUT/env.txt"
done
note "bit-exact checks"
SBS="python3 $B/loaders_side_by_side.py --folder $W/st --config $W/st/manifest.json --dtype bf16"
$SBS --rounds 5 --cache cold-files --deadline $((DEADLINE - 75)) \
    --methods zeroio-direct zeroio-buffered $FSST read-limit read-limit-direct \
    --json "$OUT/sbs-coldfiles.json" >>"$OUT/sbs.log" 2>&1
note "side by side, cold files"
$SBS --rounds 4 --cache warm --deadline $((DEADLINE - 5)) --methods zeroio-direct zeroio-buffered $FSST \
    --json "$OUT/sbs-warm.json" >>"$OUT/sbs.log" 2>&1
note "side by side, warm"
tail -4 "$OUT/cuda_tests.txt"; grep -v WARNING "$OUT/sbs.log" | grep -E 'Error|error' | tail -5
cat "$OUT/env.txt"
python3 - "$OUT" <<'PY'
import json, pathlib, sys

for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    if "summary" in d:
        for k, v in d["summary"].items():
            print(f.name, k, round(v["median_s"], 3), [round(x, 3) for x in v["runs_s"]])
    else:
        keys = ["ZEROIO_DIRECT_READS", "file_system", "supports_direct", "load_s", "file_bytes"]
        keys += ["resident_after_load", "tensors_compared", "bit_exact"]
        print(f.name, {k: d.get(k) for k in keys})
PY
