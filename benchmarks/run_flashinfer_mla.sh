#!/usr/bin/env bash
# FLASHINFER_MLA on the H200 in one device call: its GPU tests, kvcore's conformance suite on
# it, then the benchmark against FlashInfer direct (table last). Needs flashinfer-python (e.g.
# its wheel in .whl/, installed by run_h200.sh's preamble, or installed already).
# Usage (device run, after the editable installs of run_h200.sh):
#   STEPS=none bash benchmarks/run_h200.sh && bash benchmarks/run_flashinfer_mla.sh
# Logs under $OUT; every step runs even if an earlier one fails.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Where run_h200.sh's preamble installs wheels carried in .whl/ (FlashInfer among them).
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
step() {  # step NAME TIMEOUT CMD...
    local name=$1 limit=$2; shift 2
    echo "=== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name rc=$?"
    tail -n 25 "$OUT/$name.log"
}
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
step fimla_tests ${FIMLA_TESTS_LIMIT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider \
    -o addopts="" plugins/nvidia/tests/test_nvidia_flashinfer_mla_gpu.py
step fimla_conformance ${FIMLA_CONFORMANCE_LIMIT:-180} python3 -m pytest -q \
    -p no:cacheprovider -o addopts="" --kvcore-backend FLASHINFER_MLA --kvcore-device cuda
step bench_flashinfer_mla ${FIMLA_BENCH_LIMIT:-150} python3 benchmarks/bench_flashinfer_mla.py \
    ${FIMLA_BENCH_ARGS:---fp8}
