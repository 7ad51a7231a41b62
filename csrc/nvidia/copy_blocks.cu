// copy_block_runs: move runs of whole KV blocks between GPU memory and pinned host memory.
//
// Python (kvcore_nvidia.ops.copy_blocks) coalesces a block mapping into runs of adjacent
// blocks, so a run is one contiguous byte range on each side; this file issues one copy per
// run, in one of three ways (see kvcore_nvidia.h).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvcore_nvidia.h"

namespace kvcore_nvidia {
namespace {

constexpr int kMethodBatch = 0;
constexpr int kMethodPerRun = 1;
constexpr int kMethodKernel = 2;

// Runs handed to one kernel launch through its parameters, so no descriptor buffer has to
// be staged on the device.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kRunsPerLaunch = 256;  // ~6 KB: CUDA 12.1 raised the parameter limit to 32 KB
#else
constexpr int kRunsPerLaunch = 64;  // ~1.6 KB, under the classic 4 KB limit
#endif

struct RunBatch {
  const uint4* src[kRunsPerLaunch];
  uint4* dst[kRunsPerLaunch];
  int64_t vectors[kRunsPerLaunch];  // 16-byte vectors in the run
};

// blockIdx.y picks the run; the CTAs along x stride through it 16 bytes per thread, four
// independent loads in flight per thread (PCIe reads from pinned memory are high-latency).
__global__ void copy_runs_kernel(const RunBatch batch) {
  const uint4* __restrict__ src = batch.src[blockIdx.y];
  uint4* __restrict__ dst = batch.dst[blockIdx.y];
  const int64_t n = batch.vectors[blockIdx.y];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// A pointer the GPU can dereference: device memory as is, pinned host memory at the device
// address CUDA mapped it to (with unified addressing, cudaHostAlloc memory is mapped).
void* device_view(void* ptr, const at::Tensor& t) {
  if (t.is_cuda()) return ptr;
  cudaPointerAttributes attributes{};
  C10_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  TORCH_CHECK(attributes.devicePointer != nullptr,
              "method='kernel' needs host memory mapped into the GPU's address space "
              "(pinned by cudaHostAlloc); use method='batch'");
  return attributes.devicePointer;
}

// Make `waiter` wait for the work queued so far on `producer`.
void order_after(cudaStream_t waiter, cudaStream_t producer) {
  cudaEvent_t event;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(event, producer));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, event, 0));
  C10_CUDA_CHECK(cudaEventDestroy(event));  // released once the wait no longer needs it
}

cudaMemcpyKind kind_of(const at::Tensor& src, const at::Tensor& dst) {
  if (src.is_cuda() && dst.is_cuda()) return cudaMemcpyDeviceToDevice;
  return src.is_cuda() ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
}

// The copies [first, last) on `stream`, one cudaMemcpyAsync each.
void copy_per_run(const std::vector<void*>& dsts, const std::vector<const void*>& srcs,
                  const std::vector<size_t>& sizes, size_t first, size_t last,
                  cudaMemcpyKind kind, cudaStream_t stream) {
  for (size_t i = first; i < last; ++i) {
    C10_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], kind, stream));
  }
}

// The copies [first, last) on `stream` (never the legacy default stream, which the batch API
// refuses), in one cudaMemcpyBatchAsync.
void copy_batch(std::vector<void*>& dsts, std::vector<const void*>& srcs,
                std::vector<size_t>& sizes, size_t first, size_t last, cudaMemcpyKind kind,
                cudaStream_t stream) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  (void)kind;
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t first_copy = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts.data() + first, srcs.data() + first,
                                      sizes.data() + first, last - first, &attributes,
                                      &first_copy, 1, stream));
#else
  size_t failed = 0;
  C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts.data() + first,
                                      const_cast<void**>(srcs.data() + first),
                                      sizes.data() + first, last - first, &attributes,
                                      &first_copy, 1, &failed, stream));
#endif
#else
  // Before CUDA 12.8 there is no batch API: the same copies, one call each.
  copy_per_run(dsts, srcs, sizes, first, last, kind, stream);
#endif
}

void copy_kernel(const std::vector<void*>& dsts, const std::vector<const void*>& srcs,
                 const std::vector<size_t>& sizes, cudaStream_t stream, int device) {
  const int threads = 256;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  for (size_t first = 0; first < sizes.size(); first += kRunsPerLaunch) {
    const size_t count = std::min<size_t>(kRunsPerLaunch, sizes.size() - first);
    RunBatch batch{};
    int64_t longest = 0;
    for (size_t j = 0; j < count; ++j) {
      batch.src[j] = static_cast<const uint4*>(srcs[first + j]);
      batch.dst[j] = static_cast<uint4*>(dsts[first + j]);
      batch.vectors[j] = static_cast<int64_t>(sizes[first + j] / sizeof(uint4));
      longest = std::max(longest, batch.vectors[j]);
    }
    // ~4 vectors per thread of the longest run; at most 8 CTAs per SM across the launch
    // (enough loads in flight for HBM; one long run then spreads over the whole GPU).
    const int64_t cap = std::max<int64_t>(1, 8 * static_cast<int64_t>(sms) / count);
    const int64_t ctas = std::min<int64_t>(cap, (longest + 4 * threads - 1) / (4 * threads));
    const dim3 grid(static_cast<unsigned int>(std::max<int64_t>(ctas, 1)),
                    static_cast<unsigned int>(count));
    copy_runs_kernel<<<grid, threads, 0, stream>>>(batch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

void copy_block_runs(const at::Tensor& src, at::Tensor& dst, const at::Tensor& runs,
                     int64_t method, int64_t streams) {
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "copy_block_runs: one side must be on a GPU");
  TORCH_CHECK(!runs.is_cuda() && runs.scalar_type() == at::kLong && runs.dim() == 2 &&
                  runs.size(1) == 3,
              "runs must be an (n, 3) int64 CPU tensor");
  TORCH_CHECK(streams >= 1, "streams must be >= 1, got ", streams);
  const int64_t n = runs.size(0);
  if (n == 0) return;
  const at::Tensor& gpu = src.is_cuda() ? src : dst;
  const c10::cuda::CUDAGuard guard(gpu.device());
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
  const int64_t page_bytes = src.numel() / src.size(0) * src.element_size();
  const int64_t src_block_bytes = src.stride(0) * src.element_size();
  const int64_t dst_block_bytes = dst.stride(0) * dst.element_size();
  auto* src_base = static_cast<char*>(src.data_ptr());
  auto* dst_base = static_cast<char*>(dst.data_ptr());
  if (method == kMethodKernel) {
    src_base = static_cast<char*>(device_view(src_base, src));
    dst_base = static_cast<char*>(device_view(dst_base, dst));
  }
  const auto r = runs.accessor<int64_t, 2>();
  std::vector<void*> dsts(n);
  std::vector<const void*> srcs(n);
  std::vector<size_t> sizes(n);
  for (int64_t i = 0; i < n; ++i) {
    srcs[i] = src_base + r[i][0] * src_block_bytes;
    dsts[i] = dst_base + r[i][1] * dst_block_bytes;
    sizes[i] = static_cast<size_t>(r[i][2] * page_bytes);
  }
  if (method == kMethodKernel) {
    copy_kernel(dsts, srcs, sizes, current.stream(), gpu.get_device());
    return;
  }
  TORCH_CHECK(method == kMethodBatch || method == kMethodPerRun,
              "method must be 0 (batch), 1 (per run) or 2 (kernel), got ", method);
  const cudaMemcpyKind kind = kind_of(src, dst);
  const bool legacy = current.stream() == nullptr || current.stream() == cudaStreamLegacy;
  const size_t lanes = static_cast<size_t>(std::min<int64_t>(streams, n));
  if (lanes == 1 && !(method == kMethodBatch && legacy)) {
    if (method == kMethodBatch) {
      copy_batch(dsts, srcs, sizes, 0, sizes.size(), kind, current.stream());
    } else {
      copy_per_run(dsts, srcs, sizes, 0, sizes.size(), kind, current.stream());
    }
    return;
  }
  // Pooled side streams, one contiguous share of the copies each, ordered after the caller's
  // queued work and before its next: several copies in flight hide the per-copy gaps of one
  // queue, and the batch API never sees the legacy default stream.
  std::vector<c10::cuda::CUDAStream> sides;
  for (size_t lane = 0; lane < lanes; ++lane) {
    sides.push_back(c10::cuda::getStreamFromPool());
    order_after(sides.back().stream(), current.stream());
  }
  for (size_t lane = 0; lane < lanes; ++lane) {
    const size_t first = sizes.size() * lane / lanes;
    const size_t last = sizes.size() * (lane + 1) / lanes;
    if (method == kMethodBatch) {
      copy_batch(dsts, srcs, sizes, first, last, kind, sides[lane].stream());
    } else {
      copy_per_run(dsts, srcs, sizes, first, last, kind, sides[lane].stream());
    }
  }
  for (const auto& side : sides) order_after(current.stream(), side.stream());
}

}  // namespace kvcore_nvidia
