#!/usr/bin/env bash
# One combined GPU session on the H200 (device tool): GPU tests first, then each benchmark.
# Logs and JSON land under $OUT; every step runs even if an earlier one fails.
# Usage (device run): bash benchmarks/run_h200.sh
#   STEPS="gpu_tests conformance benches" (default) picks steps; also nvidia_tests (the NVIDIA
#   plugin's GPU tests: carry .whl for FlashInfer) and sanitizer (the offload connector's GPU
#   tests under PyTorch's CUDA stream sanitizer, which reports unsynchronised cross-stream use).
#   On a machine with two GPUs the p2p NCCL tests in gpu_tests run instead of skipping.
#   step_tests: the engine-step tests whole (builders, graphs, bench_step --smoke; not only the
#   gpu-marked ones, since the CPU-written ones must also pass where a GPU is present); demos:
#   `kvcore demo` (graph replay on a GPU) with each backend of DEMO_BACKENDS.
#   NVIDIA_TESTS narrows nvidia_tests to some files.
set -u
STEPS=${STEPS:-gpu_tests conformance benches}
has() { [[ " $STEPS " == *" $1 "* ]]; }
export NCCL_NVLS_ENABLE=0  # never NVLink multicast (shared machines)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
# flash-attn-4 (FLASH_ATTN on Hopper): carry .fa4b after a call that carried .fa4a (see
# ../shared/tools/fa4_wheels.sh); its install.sh puts it on PYTHONPATH.
[ -f .fa4b/install.sh ] && { source .fa4b/install.sh || echo "!!! flash-attn-4 not installed"; }
export PATH=$(dirname "$(which python3)"):$PATH
# Install kvcore and the in-repo plugins (editable, offline) so entry points are discovered
# exactly as on a user's machine.
plugins=(); for p in plugins/*/ examples/*/; do [ -f "$p/pyproject.toml" ] && plugins+=(-e "$p"); done
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . "${plugins[@]}" \
    || echo "!!! editable install failed: plugins will not register"
step() {  # step NAME TIMEOUT CMD...
    local name=$1 limit=$2; shift 2
    echo "=== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name rc=$?"
    tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ "$(nvidia-smi -L | wc -l)" -gt 1 ] && nvidia-smi topo -m
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
has gpu_tests && step gpu_tests ${GPU_TESTS_LIMIT:-200} python3 -m pytest -m gpu -q \
    -p no:cacheprovider -o addopts="" tests plugins/rocm/tests plugins/mla/tests
has step_tests && step step_tests ${STEP_TESTS_LIMIT:-150} python3 -m pytest -q \
    -p no:cacheprovider -o addopts="" tests/test_builder.py tests/test_triton_builder.py \
    tests/test_cuda_graphs.py plugins/mla/tests/test_mla_builder.py
has nvidia_tests && step nvidia_tests ${NVIDIA_TESTS_LIMIT:-240} python3 -m pytest -m gpu -q \
    -p no:cacheprovider -o addopts="" ${NVIDIA_TESTS:-plugins/nvidia/tests}
has sanitizer && step sanitizer ${SANITIZER_LIMIT:-200} env TORCH_CUDA_SANITIZER=1 \
    python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/connectors/test_offload.py tests/connectors/test_offload_staging.py
# The conformance suite on every GPU backend that is installed (a missing one fails its step).
conformance=(); for b in ${CONFORMANCE_BACKENDS:-TRITON_ATTN TRITON_ATTN_HND SDPA_GATHER}; do
    conformance+=(--kvcore-backend "$b"); done
has conformance && step conformance_gpu ${CONFORMANCE_LIMIT:-120} python3 -m pytest -q \
    -p no:cacheprovider -o addopts="" "${conformance[@]}" --kvcore-device cuda
# name:seconds; the limits keep the whole script inside one 10-minute device call
if has benches; then
    for entry in ${BENCHES:-bench_offload:110 bench_mla:170 bench_rocm_portable:70 \
                           bench_backends:240}; do
        bench=${entry%%:*}
        [ -f "benchmarks/$bench.py" ] && step "$bench" "${entry##*:}" python3 "benchmarks/$bench.py"
    done
fi
if has demos; then
    for b in ${DEMO_BACKENDS:-TRITON_ATTN FLASHINFER}; do
        step "demo_$b" ${DEMO_LIMIT:-60} kvcore demo --backend "$b" --no-progress
    done
fi
