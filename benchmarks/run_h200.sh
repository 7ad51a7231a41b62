#!/usr/bin/env bash
# One combined GPU session on the H200 (device tool): GPU tests first, then each benchmark.
# Logs and JSON land under $OUT; every step runs even if an earlier one fails.
# Usage (device run): bash benchmarks/run_h200.sh
#   STEPS="gpu_tests conformance benches" (default) picks steps; also nvidia_tests (the NVIDIA
#   plugin's GPU tests: carry .whl for FlashInfer) and sanitizer (the offload connector's GPU
#   tests under PyTorch's CUDA stream sanitizer, which reports unsynchronised cross-stream use).
#   On a machine with two GPUs the p2p NCCL tests in gpu_tests run instead of skipping;
#   GPU_TESTS_PATHS narrows gpu_tests to some folders or files.
#   step_tests: the engine-step tests whole (builders, graphs, bench_step --smoke; not only the
#   gpu-marked ones, since the CPU-written ones must also pass where a GPU is present); demos:
#   `kvcore demo` (graph replay on a GPU) with each backend of DEMO_BACKENDS.
#   NVIDIA_TESTS narrows nvidia_tests to some files. STEPS=none only installs the carried
#   wheels (FlashInfer into /tmp/site, kept while the machine stays warm).
#   connectors: the connectors' GPU tests, bench_offload (start-up and first transfers
#   included) and the disaggregated demo in bfloat16 and float32 (nixl carried in .whl_nixl);
#   PARALLEL=1: the test steps run side by side (then the benchmarks, alone).
#   fimla: FLASHINFER_MLA's GPU tests, conformance and benchmark (FlashInfer carried);
#   nixl_matrix: bench_nixl's UCX transport matrix, 1 GiB, both layouts (~5 min: its own call);
#   NIXL_MATRIX_ONLY=TEXT keeps the configurations whose name contains TEXT, NIXL_MATRIX_MIB sizes.
#   two_gpus: issue 21's transfers between two GPUs of one host (kind nvidia-h200-x2; nixl carried
#   in .whl_nixl): bench_nixl --grid, 1 GiB (32 layers x 512 blocks) from a producer on cuda:0 to
#   a consumer on cuda:1, nixl and p2p (NCCL) x cross-layer/per-layer x contiguous/scattered
#   block ids, each beside dst.copy_(src) from cuda:0 to cuda:1 in the same run (~3-4 min,
#   at most TWO_GPUS_LIMIT s), then the disaggregated demo with prefill on cuda:0 and decode on
#   cuda:1 in bfloat16 and float32; with fewer than two GPUs it says so and skips.
#   mla_tma: TRITON_MLA's TMA decode path and key-split scores: their tests (small cases
#   compiled on the GPU, then the gpu-marked real size), then bench_mla's sweep (the TMA
#   candidates first; MLA_SWEEP_HEADS=128 limits it to those shapes; carry .whl so FlashInfer
#   MLA is timed beside it).
#   gluon_prefill: TRITON_ATTN's Gluon Hopper prefill kernels: their GPU tests (ping-pong's
#   apart, under GLUON_PINGPONG_TESTS_LIMIT), then
#   bench_triton_prefill (its Gluon tiles are probed in a child, then swept beside the table's
#   Triton row; carry .whl so FlashInfer is timed beside them). PREFILL_BENCH_ARGS=--gluon-only
#   keeps only the table row and the Gluon tiles and skips the decode sweep.
#   mla_rounds: bench_gluon_mla.py --rounds 5 (the Gluon MLA kernel and FlashInfer MLA timed in
#   interleaved rounds: medians and the spread of their ratio).
#   mla_table: bench_mla's production sweep cut to TRITON_MLA's table config (--table-only) at
#   the 128-head shapes, FlashInfer MLA beside it when .whl is carried.
#   profiles: ncu (stall reasons included) on sm90's prefill row at chunked prefill and on
#   TRITON_MLA's Gluon decode (and merge) at B8 x 32768 with 8 splits beside B64 x 4096.
#   ab: bench_ab.py, the public ops of an earlier tree (.ab/before, carried) against this one.
#   readme: the README's kvcore commands as written, timed cold and warm (carry .whl).
set -u
STEPS=${STEPS:-gpu_tests conformance benches}
has() { [[ " $STEPS " == *" $1 "* ]]; }
export NCCL_NVLS_ENABLE=0  # never NVLink multicast (shared machines)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Carried wheels: .whl (FlashInfer and apache-tvm-ffi), .whl_fi (FlashInfer alone, beside .fa4b,
# which holds the same apache-tvm-ffi), .whl_nixl (nixl-cu13), .whl_tf (transformers 5.25 and its
# pure-Python dependencies, for bench_transformers). Each folder is installed into
# /tmp/site once per warm machine; later calls reuse it without carrying it again.
# benchmarks/carry_wheels.sh prepares .whl and .whl_nixl.
mkdir -p /tmp/site
for w in .whl .whl_fi .whl_nixl .whl_tf; do
    [ -d $w ] && [ ! -f /tmp/site/.done$w ] && python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target /tmp/site $w/*.whl && touch /tmp/site/.done$w
done
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
# flash-attn-4: a first call carrying .fa4a leaves /tmp/fa4/ir.so.xz, then a call carrying .fa4b
# installs it (see ../shared/tools/fa4_wheels.sh); FA4=prepare only copies the first part.
if [ "${FA4:-}" = prepare ]; then mkdir -p /tmp/fa4 && cp .fa4a/ir.so.xz /tmp/fa4/ && exit 0; fi
[ -f .fa4b/install.sh ] && { source .fa4b/install.sh || echo "!!! flash-attn-4 not installed"; }
export PATH=$(dirname "$(which python3)"):$PATH
# Install kvcore and the in-repo plugins (editable, offline) so entry points are discovered
# exactly as on a user's machine.
plugins=(); for p in plugins/*/ examples/*/; do [ -f "$p/pyproject.toml" ] && plugins+=(-e "$p"); done
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . "${plugins[@]}" \
    || echo "!!! editable install failed: plugins will not register"
step() {  # step NAME TIMEOUT CMD...: the command's exit code is the step's
    local name=$1 limit=$2 rc; shift 2
    echo "=== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "=== $name rc=$rc"
    tail -n 25 "$OUT/$name.log"
    return $rc
}
# PARALLEL=1 runs the test steps side by side (correctness only: they share the GPU, and
# FlashInfer's JIT compiles on the CPU cores); benchmarks always run alone, after them.
test_step() {
    if [ -n "${PARALLEL:-}" ]; then step "$@" & else step "$@"; fi
}
# pytest_step NAME TIMEOUT PYTEST-ARGS...: with PYTEST_WORKERS=N the cases run in N
# pytest-xdist workers (correctness only: they share the GPU), and when some fail they run again
# alone (NAME_rerun), so a failure that sharing the GPU caused shows apart from a real one.
pytest_step() {
    local name=$1 limit=$2; shift 2
    if [ -z "${PYTEST_WORKERS:-}" ]; then
        test_step "$name" "$limit" python3 -m pytest -q -p no:cacheprovider -o addopts="" "$@"
        return
    fi
    step "$name" "$limit" python3 -m pytest -q -o addopts="" -o cache_dir="/tmp/pytest_$name" \
        -n "$PYTEST_WORKERS" "$@"
    [ $? -eq 1 ] && step "${name}_rerun" "$limit" python3 -m pytest -q -o addopts="" \
        -o cache_dir="/tmp/pytest_$name" --last-failed --last-failed-no-failures none "$@"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ "$(nvidia-smi -L | wc -l)" -gt 1 ] && nvidia-smi topo -m
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# cuda_ext: build the NVIDIA plugin's CUDA C++ extension once, alone, before the steps that use
# it run side by side (so no step's time limit includes nvcc).
if has cuda_ext; then
    step cuda_ext ${CUDA_EXT_LIMIT:-200} python3 -c \
        "from kvcore_nvidia import ops; import time; t = time.time(); print(ops.build_extension(), time.time() - t)"
fi
has gpu_tests && pytest_step gpu_tests ${GPU_TESTS_LIMIT:-200} -m gpu \
    ${GPU_TESTS_PATHS:-tests plugins/rocm/tests plugins/mla/tests}
has step_tests && pytest_step step_tests ${STEP_TESTS_LIMIT:-150} tests/test_builder.py \
    tests/test_triton_builder.py tests/test_cuda_graphs.py plugins/mla/tests/test_mla_builder.py
# lean_tests: the TRITON_ATTN engine path whole (op, cache write, builder, graphs, host path),
# the CPU-written cases included: they must also pass where a GPU is present.
has lean_tests && pytest_step lean_tests ${LEAN_TESTS_LIMIT:-150} tests/ops/test_triton_attention.py \
    tests/ops/test_triton_cache.py tests/test_triton_builder.py tests/test_cuda_graphs.py \
    tests/ops/test_host_path.py
has nvidia_tests && pytest_step nvidia_tests ${NVIDIA_TESTS_LIMIT:-240} -m gpu \
    ${NVIDIA_TESTS:-plugins/nvidia/tests}
has sanitizer && step sanitizer ${SANITIZER_LIMIT:-200} env TORCH_CUDA_SANITIZER=1 \
    python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/connectors/test_offload.py tests/connectors/test_offload_staging.py
# The conformance suite on every GPU backend that is installed (a missing one fails its step).
conformance=(); for b in ${CONFORMANCE_BACKENDS:-TRITON_ATTN TRITON_ATTN_HND SDPA_GATHER}; do
    conformance+=(--kvcore-backend "$b"); done
# CONFORMANCE_SHARDS=N runs the collected cases in N pytest processes side by side (FlashInfer
# JIT-compiles a module per case on the CPU: N processes use N cores), each at most
# CONFORMANCE_LIMIT s, one log per shard.
if has conformance; then
    if [ "${CONFORMANCE_SHARDS:-1}" -gt 1 ]; then
        python3 -m pytest -q --co -p no:cacheprovider -o addopts="" "${conformance[@]}" \
            --kvcore-device cuda 2>/dev/null | grep '::' > /tmp/conformance_ids
        echo "=== conformance: $(wc -l < /tmp/conformance_ids) cases in $CONFORMANCE_SHARDS shards"
        for ((i = 0; i < CONFORMANCE_SHARDS; i++)); do
            # The suite's module is added by the plugin whatever the arguments: select by -k
            # on the whole test names (brackets included, so no name matches a longer one).
            mapfile -t ids < <(awk -v n="$CONFORMANCE_SHARDS" -v i=$i 'NR % n == i' \
                /tmp/conformance_ids | sed 's/.*:://')
            expr=$(printf '%s or ' "${ids[@]}")
            step "conformance_gpu_$i" ${CONFORMANCE_LIMIT:-120} python3 -m pytest -q \
                -p no:cacheprovider -o addopts="" "${conformance[@]}" --kvcore-device cuda \
                -k "${expr% or }" &
        done
        wait
    else
        pytest_step conformance_gpu ${CONFORMANCE_LIMIT:-120} "${conformance[@]}" \
            --kvcore-device cuda
    fi
fi
# FLASHINFER_MLA (FlashInfer carried): its GPU tests, the conformance suite on it, the benchmark.
if has fimla; then
    test_step fimla_tests ${FIMLA_TESTS_LIMIT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider \
        -o addopts="" plugins/nvidia/tests/test_nvidia_flashinfer_mla_gpu.py
    test_step fimla_conformance ${FIMLA_CONFORMANCE_LIMIT:-180} python3 -m pytest -q \
        -p no:cacheprovider -o addopts="" --kvcore-backend FLASHINFER_MLA --kvcore-device cuda
fi
wait  # for the test steps run side by side
has fimla && step bench_flashinfer_mla ${FIMLA_BENCH_LIMIT:-150} python3 \
    benchmarks/bench_flashinfer_mla.py ${FIMLA_BENCH_ARGS:---fp8}
# name:seconds; the limits keep the whole script inside one 10-minute device call
if has benches; then
    for entry in ${BENCHES:-bench_offload:110 bench_mla:170 bench_rocm_portable:70 \
                           bench_backends:240}; do
        bench=${entry%%:*}
        [ -f "benchmarks/$bench.py" ] && step "$bench" "${entry##*:}" python3 "benchmarks/$bench.py"
    done
fi
if has connectors; then
    step conn_gpu_tests ${CONN_TESTS_LIMIT:-150} python3 -m pytest -m gpu -q \
        -p no:cacheprovider -o addopts="" tests/connectors
    step bench_offload ${BENCH_OFFLOAD_LIMIT:-240} python3 benchmarks/bench_offload.py --no-sweep
    for dtype in bfloat16 float32; do
        step "demo_disagg_$dtype" ${DISAGG_LIMIT:-90} kvcore demo --disaggregated \
            --platform cuda --model large --dtype "$dtype"
    done
fi
if has mla_tma; then
    step mla_tma_tests ${MLA_TMA_TESTS_LIMIT:-180} python3 -m pytest -q -p no:cacheprovider \
        -o addopts="" plugins/mla/tests/test_mla_decode_tma.py \
        plugins/mla/tests/test_mla_decode_score_split.py
    step bench_mla_sweep ${MLA_SWEEP_LIMIT:-240} python3 benchmarks/bench_mla.py --sweep-only \
        --budget-s ${MLA_SWEEP_BUDGET:-170} ${MLA_SWEEP_HEADS:+--heads $MLA_SWEEP_HEADS}
fi
# mla_table: TRITON_MLA's table config re-timed at the 128-head shapes (its split variants, the
# merge, cross-layer in interleaved rounds, FlashInfer MLA when .whl is carried): ~1 min.
if has mla_table; then
    step bench_mla_table ${MLA_TABLE_LIMIT:-240} python3 benchmarks/bench_mla.py --sweep-only \
        --table-only --heads 128 --budget-s 150
fi
# mla_rounds: the Gluon MLA kernel beside FlashInfer MLA, five interleaved rounds a shape
# (bench_gluon_mla.py --rounds 5: medians and the spread of the ratio), carry .whl: ~2 min.
has mla_rounds && step bench_gluon_mla_rounds ${MLA_ROUNDS_LIMIT:-240} python3 \
    benchmarks/bench_gluon_mla.py --rounds ${MLA_ROUNDS:-5}
if has gluon_prefill; then
    step gluon_prefill_tests ${GLUON_PREFILL_TESTS_LIMIT:-200} python3 -m pytest -m gpu -q \
        -p no:cacheprovider -o addopts="" tests/ops/test_gluon_prefill.py -k "not pp"
    # The ping-pong variant apart, under its own limit: a deadlock there costs only this step.
    step gluon_prefill_pingpong_tests ${GLUON_PINGPONG_TESTS_LIMIT:-90} python3 -m pytest \
        -m gpu -q -p no:cacheprovider -o addopts="" tests/ops/test_gluon_prefill.py -k pp
    step bench_triton_prefill ${PREFILL_BENCH_LIMIT:-330} python3 \
        benchmarks/bench_triton_prefill.py --budget-s ${PREFILL_BENCH_BUDGET:-120} \
        ${PREFILL_BENCH_ARGS:-}
fi
has nixl_matrix && step bench_nixl_matrix ${NIXL_MATRIX_LIMIT:-560} python3 \
    benchmarks/bench_nixl.py --device cuda --mib "${NIXL_MATRIX_MIB:-1024}" --trials 3 --matrix \
    ${NIXL_MATRIX_ONLY:+--matrix-only "$NIXL_MATRIX_ONLY"} \
    --out "$OUT/nixl_matrix"
if has two_gpus; then
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        # Each case waits at most 100 s and the grid starts none after 300 s, so the table
        # prints within the step's limit; with the two demos the step stays under 10 min.
        step two_gpus ${TWO_GPUS_LIMIT:-360} python3 benchmarks/bench_nixl.py --grid \
            --serve-device cuda:0 --device cuda:1 --mib 1024 --layers 32 --block-kib 64 \
            --trials ${TWO_GPUS_TRIALS:-6} --run-timeout 100 --budget-s 300 \
            --out "$OUT/two_gpus"
        for dtype in bfloat16 float32; do
            step "demo_disagg_two_gpus_$dtype" ${DISAGG_LIMIT:-90} kvcore demo --disaggregated \
                --platform cuda --model large --dtype "$dtype" --prefill-device cuda:0 \
                --decode-device cuda:1
        done
    else
        echo "=== two_gpus skipped: nvidia-smi lists fewer than two GPUs (needs nvidia-h200-x2)"
    fi
fi
# profiles: ncu on the kernels the open speed targets hinge on, with the stall reasons
# (SourceCounters' warp-state sampling) the default sections leave out: TRITON_ATTN's sm90
# prefill row (ping-pong, 128 x 3) at chunked prefill (4 x 512 over 16k), and TRITON_MLA's
# Gluon decode kernel and merge at B8 x 32768 (8 splits) beside B64 x 4096 (one split, two).
# Each profile is kept as a report, then printed three ways: the sections, the stall-reason
# metrics of the raw page, and the SASS with its per-instruction stall samples (CSV).
# PROFILES picks some of: prefill mla_8x32768x8 mla_64x4096x1 mla_64x4096x2.
if has profiles; then
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats
              --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis)
    profile() {  # profile NAME NCU-ARGS... CMD...
        local name=$1; shift
        step "ncu_$name" ${PROFILE_LIMIT:-150} "$NCU" "${sections[@]}" -f -o "$OUT/ncu_$name" "$@"
        [ -f "$OUT/ncu_$name.ncu-rep" ] || return
        "$NCU" --import "$OUT/ncu_$name.ncu-rep" --print-details all > "$OUT/ncu_${name}_details.txt" 2>&1
        "$NCU" --import "$OUT/ncu_$name.ncu-rep" --page raw --csv 2>&1 | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
for row in rows[head + 2:] if head is not None else []:
    got = dict(zip(rows[head], row))
    print("##", got["Kernel Name"][:60], got.get("gpu__time_duration.sum", ""), "ns")
    stalls = [(float(v.replace(",", "")), k) for k, v in got.items()
              if "issue_stalled" in k and v.replace(",", "").replace(".", "").isdigit()]
    for value, key in sorted(stalls, reverse=True)[:40]:
        print(f"{value:14.2f}  {key}")' > "$OUT/ncu_${name}_stalls.txt"
        head -n 16 "$OUT/ncu_${name}_stalls.txt"
        "$NCU" --import "$OUT/ncu_$name.ncu-rep" --page source --print-source sass --csv \
            > "$OUT/ncu_${name}_sass.csv" 2>&1
    }
    for what in ${PROFILES:-prefill mla_8x32768x8 mla_64x4096x1 mla_64x4096x2}; do
        if [ "$what" = prefill ]; then
            PROF_SHAPE=4,512,16384 PROF_TILE=128,3 PROF_VARIANT=ws-pp profile prefill_row \
                -k regex:gluon_prefill_ws --launch-count 1 python3 benchmarks/prof_gluon_prefill.py
        else
            shape=${what#mla_}
            PROF_SHAPE=${shape//x/,} profile "$what" -k regex:"gluon_mla_decode|merge_splits" \
                --launch-skip 2 --launch-count 2 python3 benchmarks/prof_gluon_mla.py
        fi
    done
fi
# ab: bench_ab.py, the public ops of the tree in AB_BEFORE (default .ab/before, carried: e.g.
# `git archive REV kvcore plugins/*/kvcore_*` unpacked with the plugin packages at its top)
# against this tree, AB_ROUNDS rounds taking turns (~2 min a round on an H100); AB_ARGS passes
# e.g. `--only MLA` (cases whose name holds the text).
has ab && step ab ${AB_LIMIT:-330} python3 benchmarks/bench_ab.py --before "${AB_BEFORE:-.ab/before}" \
    --rounds ${AB_ROUNDS:-2} --out "$OUT" ${AB_ARGS:-}
# readme: the README's kvcore commands as written, each timed (wall seconds in the log's last
# line): the demos twice (the first run builds what the second loads from the caches), FlashInfer
# warmed ahead by `kvcore warmup`, then the commands that only look around.
if has readme; then
    timed() {  # timed NAME LIMIT CMD...
        local name=$1 limit=$2; shift 2
        local start=$SECONDS
        step "$name" "$limit" "$@"
        echo "=== $name wall_s=$((SECONDS - start))" | tee -a "$OUT/readme_times.txt"
    }
    export KVCORE_PROGRESS=1
    for run in cold warm; do
        timed "demo_$run" 120 kvcore demo
        timed "demo_mla_small_$run" 120 kvcore demo --model mla-small
    done
    timed warmup_flashinfer_cold 240 kvcore warmup --backend FLASHINFER
    timed demo_flashinfer_warm 120 kvcore demo --backend FLASHINFER
    timed select_explain 60 kvcore select --explain --head-size 128 --dtype bfloat16
    timed layout_hnd 60 kvcore layout TRITON_ATTN_HND --cross-layer
    timed list 60 kvcore list
    timed plugins 60 kvcore plugins
    timed transformers_example 180 python3 examples/transformers_llama.py --device cuda
fi
# transformers: bench_transformers.py (transformers' continuous batching on kvcore's backends
# against its own sdpa path; carry .whl_tf, and .whl for FLASHINFER). TRANSFORMERS_ARGS narrows it.
has transformers && step bench_transformers ${TRANSFORMERS_LIMIT:-420} python3 \
    benchmarks/bench_transformers.py --json "$OUT/bench_transformers.json" ${TRANSFORMERS_ARGS:-}
# matrix: bench_matrix.py over MATRIX_MODELS (model presets), every valid backend beside the
# peers; tune: `kvcore tune` writes this device's ranking, then `select --explain` quotes it.
if has matrix; then
    models=(); for m in ${MATRIX_MODELS:-llama-3.1-8b}; do models+=(--model "$m"); done
    step bench_matrix ${MATRIX_LIMIT:-300} python3 benchmarks/bench_matrix.py "${models[@]}" \
        --budget-s $(( ${MATRIX_LIMIT:-300} - 30 )) ${MATRIX_ARGS:-}
fi
if has tune; then
    step tune ${TUNE_LIMIT:-200} kvcore tune --budget-s $(( ${TUNE_LIMIT:-200} - 30 )) \
        --output "$OUT/ranking.json" --verbose
    KVCORE_RANKING_FILE="$OUT/ranking.json" step select_measured 60 kvcore select --explain \
        --head-size 128 --dtype bfloat16
fi
# engine_step: issue 44's standing measurements: bench_step (per-layer host table, the
# synchronous step), the MLA pipeline against the same math around FlashInfer MLA, and
# FlashInfer through kvcore against FlashInfer direct (carry FlashInfer).
if has engine_step; then
    step bench_step ${BENCH_STEP_LIMIT:-240} python3 benchmarks/bench_step.py --out "$OUT/bench_step"
    step bench_mla_pipeline ${MLA_PIPELINE_LIMIT:-150} python3 benchmarks/bench_mla_pipeline.py \
        --out "$OUT/bench_mla_pipeline"
    step bench_flashinfer ${BENCH_FLASHINFER_LIMIT:-180} python3 benchmarks/bench_flashinfer.py
fi
# replay: vLLM's recorded steps (benchmarks/replay_vllm.py record, carried as REPLAY_DIR)
# through kvcore's GPU backends, attention and greedy tokens compared with vLLM's.
has replay && step replay_vllm ${REPLAY_LIMIT:-240} python3 benchmarks/replay_vllm.py replay \
    --recording "${REPLAY_DIR:-build/replay_vllm}/steps.pt" \
    --backends "${REPLAY_BACKENDS:-TRITON_ATTN,FLASHINFER,FLASH_ATTN}" --json "$OUT/replay_vllm.json"
# docs: every kvcore command of the README and docs/ as written, timed, twice (cold, warm);
# DOCS_SKIP (a regular expression) lists some without running them.
has docs && step doc_commands ${DOCS_LIMIT:-420} python3 benchmarks/doc_commands.py --repeat \
    --out "$OUT/docs" --limit-s ${DOCS_COMMAND_LIMIT:-150} ${DOCS_SKIP:+--skip "$DOCS_SKIP"}
if has demos; then
    for b in ${DEMO_BACKENDS:-TRITON_ATTN FLASHINFER}; do
        step "demo_$b" ${DEMO_LIMIT:-60} kvcore demo --backend "$b" --no-progress
    done
fi
# At most 8 files come back from the device machine: pack everything into one archive.
if [ -z "${KEEP_OUT_FILES:-}" ]; then
    tar czf /tmp/run_h200_out.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete \
        && mv /tmp/run_h200_out.tgz "$OUT/run_h200_${RUN_TAG:-out}.tgz"
fi
