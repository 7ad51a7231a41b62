// reshape_and_cache_flash: write new tokens' K and V into a paged cache of any strides.
//
// One CTA per token: it looks up the token's slot once, then its threads copy the token's
// num_kv_heads * head_size elements of K and of V. When the innermost dims are contiguous
// and 16-byte aligned each thread moves 16 bytes of input per access (VEC elements), else
// one element. Every offset is int64: a per-layer view of a cross-layer cache reaches far
// beyond 2**31 elements from its base.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "kvcore_nvidia.h"

namespace kvcore_nvidia {
namespace {

enum Fp8Kind : int { kNoFp8 = 0, kE4M3 = 1, kE5M2 = 2 };

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// fp8 stores x * float32(1 / scale) (kvcore.ops.fp8_inverse_scale: the one definition shared
// with the reference and the Triton write), never x / scale: the two differ in the last bit
// for scales that are not powers of two.
template <typename scalar_t, typename cache_t, int KIND>
__device__ __forceinline__ cache_t convert(scalar_t x, float inv_scale) {
  if constexpr (KIND == kNoFp8) {
    return x;  // same dtype: the bytes are copied unchanged
  } else {
    // IEEE multiply (no fast math, no contraction) then round-to-nearest-even with saturation
    // to the largest finite value: exactly the reference's clamp-then-convert.
    const float y = __fmul_rn(static_cast<float>(x), inv_scale);
    return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, KIND == kE4M3 ? __NV_E4M3 : __NV_E5M2);
  }
}

struct Strides {
  int64_t token, head, dim;
};

struct CacheStrides {
  int64_t block, slot, head, dim;
};

template <typename scalar_t, typename cache_t, int KIND, int VEC, typename index_t>
__global__ void reshape_and_cache_flash_kernel(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    cache_t* __restrict__ key_cache, cache_t* __restrict__ value_cache,
    const index_t* __restrict__ slot_mapping, const int64_t block_size, const int num_heads,
    const int head_size, const Strides ks, const Strides vs, const CacheStrides kcs,
    const CacheStrides vcs, const float* __restrict__ k_scale_ptr,
    const float* __restrict__ v_scale_ptr, const float k_scale_arg, const float v_scale_arg) {
  const int64_t token = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(slot_mapping[token]);
  if (slot < 0) return;  // padding
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  float k_scale = 1.f, v_scale = 1.f;  // the reciprocals of the fp8 scales
  if constexpr (KIND != kNoFp8) {
    k_scale = __frcp_rn(k_scale_ptr != nullptr ? *k_scale_ptr : k_scale_arg);
    v_scale = __frcp_rn(v_scale_ptr != nullptr ? *v_scale_ptr : v_scale_arg);
  }
  const scalar_t* k_src = key + token * ks.token;
  const scalar_t* v_src = value + token * vs.token;
  cache_t* k_dst = key_cache + block * kcs.block + offset * kcs.slot;
  cache_t* v_dst = value_cache + block * vcs.block + offset * vcs.slot;
  const int vecs_per_head = head_size / VEC;
  const int total = num_heads * vecs_per_head;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t head = i / vecs_per_head;
    const int64_t dim = static_cast<int64_t>(i % vecs_per_head) * VEC;
    if constexpr (VEC == 1) {
      k_dst[head * kcs.head + dim * kcs.dim] = convert<scalar_t, cache_t, KIND>(
          k_src[head * ks.head + dim * ks.dim], k_scale);
      v_dst[head * vcs.head + dim * vcs.dim] = convert<scalar_t, cache_t, KIND>(
          v_src[head * vs.head + dim * vs.dim], v_scale);
    } else if constexpr (KIND == kNoFp8) {
      // Vector path, same dtype: move the 16 bytes as they are (one 128-bit load and store
      // each; element-wise copies of 2-byte types get split into 32-bit stores). Dim strides
      // are 1 and every address is aligned (checked on the host).
      *reinterpret_cast<uint4*>(k_dst + head * kcs.head + dim) =
          *reinterpret_cast<const uint4*>(k_src + head * ks.head + dim);
      *reinterpret_cast<uint4*>(v_dst + head * vcs.head + dim) =
          *reinterpret_cast<const uint4*>(v_src + head * vs.head + dim);
    } else {
      const auto k_in = *reinterpret_cast<const Vec<scalar_t, VEC>*>(k_src + head * ks.head + dim);
      const auto v_in = *reinterpret_cast<const Vec<scalar_t, VEC>*>(v_src + head * vs.head + dim);
      Vec<cache_t, VEC> k_out, v_out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        k_out.v[j] = convert<scalar_t, cache_t, KIND>(k_in.v[j], k_scale);
        v_out.v[j] = convert<scalar_t, cache_t, KIND>(v_in.v[j], v_scale);
      }
      *reinterpret_cast<Vec<cache_t, VEC>*>(k_dst + head * kcs.head + dim) = k_out;
      *reinterpret_cast<Vec<cache_t, VEC>*>(v_dst + head * vcs.head + dim) = v_out;
    }
  }
}

bool aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

// Whether VEC-element accesses are legal for a tensor: contiguous last dim and every
// vector start (base + token/head/slot/block strides + multiples of VEC) on a vector boundary.
bool vectorizable(const at::Tensor& t, int64_t vec_bytes, int64_t elem_bytes) {
  if (t.stride(-1) != 1 || !aligned(t.data_ptr(), vec_bytes)) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if ((t.stride(d) * elem_bytes) % vec_bytes != 0) return false;
  }
  return true;
}

template <typename scalar_t, typename cache_t, int KIND, int VEC, typename index_t>
void launch(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
            at::Tensor& value_cache, const at::Tensor& slot_mapping,
            const float* k_scale_ptr, const float* v_scale_ptr, float k_scale, float v_scale) {
  const int64_t num_tokens = key.size(0);
  const int num_heads = static_cast<int>(key.size(1));
  const int head_size = static_cast<int>(key.size(2));
  const int vectors = num_heads * (head_size / VEC);
  // Enough threads for one vector of K and one of V each, in whole warps, at most 512.
  const int threads = std::min(512, std::max(32, (vectors + 31) / 32 * 32));
  const Strides ks{key.stride(0), key.stride(1), key.stride(2)};
  const Strides vs{value.stride(0), value.stride(1), value.stride(2)};
  const CacheStrides kcs{key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                         key_cache.stride(3)};
  const CacheStrides vcs{value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                         value_cache.stride(3)};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  reshape_and_cache_flash_kernel<scalar_t, cache_t, KIND, VEC, index_t>
      <<<static_cast<unsigned int>(num_tokens), threads, 0, stream>>>(
          key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
          reinterpret_cast<cache_t*>(key_cache.data_ptr()),
          reinterpret_cast<cache_t*>(value_cache.data_ptr()), slot_mapping.data_ptr<index_t>(),
          key_cache.size(1), num_heads, head_size, ks, vs, kcs, vcs, k_scale_ptr, v_scale_ptr,
          k_scale, v_scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename cache_t, int KIND>
void dispatch_vec_index(const at::Tensor& key, const at::Tensor& value,
                        at::Tensor& key_cache, at::Tensor& value_cache,
                        const at::Tensor& slot_mapping, const float* k_scale_ptr,
                        const float* v_scale_ptr, float k_scale, float v_scale) {
  constexpr int VEC = 16 / sizeof(scalar_t);
  const int64_t in_bytes = sizeof(scalar_t);
  const int64_t out_vec_bytes = VEC * static_cast<int64_t>(sizeof(cache_t));
  const bool vec = key.size(2) % VEC == 0 && vectorizable(key, 16, in_bytes) &&
                   vectorizable(value, 16, in_bytes) &&
                   vectorizable(key_cache, out_vec_bytes, sizeof(cache_t)) &&
                   vectorizable(value_cache, out_vec_bytes, sizeof(cache_t));
  const bool i64 = slot_mapping.scalar_type() == at::kLong;
#define KVCORE_LAUNCH(V, I)                                                                  \
  launch<scalar_t, cache_t, KIND, V, I>(key, value, key_cache, value_cache, slot_mapping,    \
                                        k_scale_ptr, v_scale_ptr, k_scale, v_scale)
  if (vec && i64) {
    KVCORE_LAUNCH(VEC, int64_t);
  } else if (vec) {
    KVCORE_LAUNCH(VEC, int32_t);
  } else if (i64) {
    KVCORE_LAUNCH(1, int64_t);
  } else {
    KVCORE_LAUNCH(1, int32_t);
  }
#undef KVCORE_LAUNCH
}

const float* scale_pointer(const std::optional<at::Tensor>& scale, const at::Tensor& cache,
                           const char* name) {
  if (!scale.has_value()) return nullptr;
  TORCH_CHECK(scale->device() == cache.device() && scale->scalar_type() == at::kFloat &&
                  scale->numel() == 1,
              name, " must be a 1-element float32 tensor on ", cache.device());
  return scale->data_ptr<float>();
}

}  // namespace

void reshape_and_cache_flash(const at::Tensor& key, const at::Tensor& value,
                             at::Tensor& key_cache, at::Tensor& value_cache,
                             const at::Tensor& slot_mapping, int64_t fp8_kind,
                             const std::optional<at::Tensor>& k_scale_tensor,
                             const std::optional<at::Tensor>& v_scale_tensor,
                             double k_scale, double v_scale) {
  TORCH_CHECK(key.is_cuda() && value.is_cuda() && key_cache.is_cuda() && value_cache.is_cuda() &&
                  slot_mapping.is_cuda(),
              "reshape_and_cache_flash: every tensor must be on a CUDA device");
  TORCH_CHECK(key.dim() == 3 && key_cache.dim() == 4, "reshape_and_cache_flash: bad ranks");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong ||
                  slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int32 or int64");
  if (key.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const float* ksp = scale_pointer(k_scale_tensor, key_cache, "k_scale");
  const float* vsp = scale_pointer(v_scale_tensor, key_cache, "v_scale");
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  // Model dtypes kvcore's backends use; kvcore_nvidia.ops refuses others before calling.
  const auto dispatch = [&](auto tag) {
    using scalar_t = decltype(tag);
    switch (fp8_kind) {
      case kNoFp8:
        TORCH_CHECK(key_cache.scalar_type() == key.scalar_type(),
                    "key_cache must have key's dtype when no fp8 conversion is asked for");
        dispatch_vec_index<scalar_t, scalar_t, kNoFp8>(key, value, key_cache, value_cache,
                                                       slot_mapping, ksp, vsp, ks, vs);
        break;
      case kE4M3:
      case kE5M2:
        TORCH_CHECK(key_cache.element_size() == 1, "an fp8 cache must have 1-byte elements");
        if (fp8_kind == kE4M3) {
          dispatch_vec_index<scalar_t, __nv_fp8_storage_t, kE4M3>(
              key, value, key_cache, value_cache, slot_mapping, ksp, vsp, ks, vs);
        } else {
          dispatch_vec_index<scalar_t, __nv_fp8_storage_t, kE5M2>(
              key, value, key_cache, value_cache, slot_mapping, ksp, vsp, ks, vs);
        }
        break;
      default:
        TORCH_CHECK(false, "fp8_kind must be 0, 1 or 2, got ", fp8_kind);
    }
  };
  switch (key.scalar_type()) {
    case at::kHalf:
      dispatch(c10::Half{});
      break;
    case at::kBFloat16:
      dispatch(c10::BFloat16{});
      break;
    case at::kFloat:
      dispatch(float{});
      break;
    default:
      TORCH_CHECK(false, "key must be float16, bfloat16 or float32, got ", key.scalar_type());
  }
}

}  // namespace kvcore_nvidia
