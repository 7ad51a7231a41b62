#!/usr/bin/env bash
# One combined GPU session on the H200 (device tool): GPU tests first, then each benchmark.
# Logs and JSON land under $OUT; every step runs even if an earlier one fails.
# Usage (device run): bash benchmarks/run_h200.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/plugins/rocm:$PWD/plugins/mla:${PYTHONPATH:-}
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
export PATH=$(dirname "$(which python3)"):$PATH
step() {  # step NAME TIMEOUT CMD...
    local name=$1 limit=$2; shift 2
    echo "=== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name rc=$?"
    tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step gpu_tests ${GPU_TESTS_LIMIT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests plugins/rocm/tests plugins/mla/tests
# name:seconds; the limits keep the whole script inside one 10-minute device call
for entry in ${BENCHES:-bench_offload:110 bench_mla:170 bench_rocm_portable:70}; do
    bench=${entry%%:*}
    [ -f "benchmarks/$bench.py" ] && step "$bench" "${entry##*:}" python3 "benchmarks/$bench.py"
done
