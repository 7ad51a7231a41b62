// kvcore-nvidia CUDA C++ ops. Python validates every argument first (kvcore_nvidia/ops/bindings.py,
// with kvcore.ops' validators); the TORCH_CHECKs here guard only what a direct caller of the
// extension could get wrong in a way that would corrupt memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kvcore_nvidia {

// Scatter key/value (num_tokens, num_kv_heads, head_size) into key_cache/value_cache
// (num_blocks, block_size, num_kv_heads, head_size) views of any strides at slot_mapping
// (int32/int64; negative = skip). fp8_kind: 0 = same dtype copy, 1 = e4m3, 2 = e5m2 (stores
// satfinite(round_to_nearest_even(x * float32(1 / scale)))). A scale tensor (1 float32
// element on the cache's device, read in the kernel) wins over the float.
void reshape_and_cache_flash(const at::Tensor& key, const at::Tensor& value,
                             at::Tensor& key_cache, at::Tensor& value_cache,
                             const at::Tensor& slot_mapping, int64_t fp8_kind,
                             const std::optional<at::Tensor>& k_scale_tensor,
                             const std::optional<at::Tensor>& v_scale_tensor,
                             double k_scale, double v_scale);

// Copy runs of whole blocks: for each row (src_block, dst_block, num_blocks) of `runs`
// (int64, CPU), the num_blocks * page_bytes bytes starting at block src_block of `src` go to
// block dst_block of `dst`. Blocks are dim 0; each block's bytes are contiguous and a run's
// blocks are adjacent (Python checks both). Each side is CUDA memory or pinned host memory.
// method: 0 = cudaMemcpyBatchAsync (per-run cudaMemcpyAsync before CUDA 12.8), 1 = one
// cudaMemcpyAsync per run, 2 = an SM copy kernel through UVA. Methods 0 and 1 split the runs
// over `streams` pooled side streams (joined back into the current stream) when streams > 1.
void copy_block_runs(const at::Tensor& src, at::Tensor& dst, const at::Tensor& runs,
                     int64_t method, int64_t streams);

}  // namespace kvcore_nvidia
