#!/usr/bin/env bash
# Prepare the wheels run_h200.sh installs on the GPU machine (no network there, at most 64 MiB
# of carried files per command). Usage, from the repository root, on a machine with network:
#   bash benchmarks/carry_wheels.sh          # .whl: FlashInfer + apache-tvm-ffi (~41 MiB)
#   bash benchmarks/carry_wheels.sh nixl     # also .whl_nixl: nixl-cu13 (~57 MiB)
# The folders are ignored by git (.gitignore: /.whl*/). The two together exceed one command's
# carry: carry .whl in one call and .whl_nixl in the next on the same warm machine (run_h200.sh
# installs each into /tmp/site once; a later call reuses it).
# FlashInfer's wheel (62 MB) is cut to fit: its JIT sources for sampling, MoE, GEMM and the other
# non-attention modules (data/csrc/...) are dropped; attention, MLA and the sink wrapper keep
# theirs. A module built from a dropped folder would fail to compile there.
set -euo pipefail
V_FLASHINFER=0.7.2.post1 V_TVM_FFI=0.1.15.post2 V_NIXL=1.5.1
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dl "$tmp" flashinfer-python==$V_FLASHINFER apache-tvm-ffi==$V_TVM_FFI
rm -rf .whl && mkdir -p .whl
fi_wheel=$(ls "$tmp"/flashinfer_python-*.whl)
dropped=(cake_sampling kda cake_dsv4 fused_moe gdn blackwell_bf16_fp4 cake_batch_deepgemm_fp8
         cake_bgmv_moe cake_all_gather_matmul cake_grouped_fp8_gemm)
patterns=(); for d in "${dropped[@]}"; do patterns+=("flashinfer/data/csrc/$d/*"); done
zip -q -d "$fi_wheel" "${patterns[@]}" 'flashinfer/data/csrc/alphamoe_nvfp4_sm100.cu'
mv "$fi_wheel" "$tmp"/apache_tvm_ffi-*.whl .whl/
if [ "${1:-}" = nixl ]; then
    rm -rf .whl_nixl && mkdir -p .whl_nixl
    dl .whl_nixl nixl-cu13==$V_NIXL
fi
du -sh .whl* | sed 's/^/carry: /'
