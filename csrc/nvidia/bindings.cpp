// Python bindings of the kvcore-nvidia extension (built by kvcore_nvidia/ops/_build.py).
#include <torch/extension.h>

#include "kvcore_nvidia.h"

using namespace pybind11::literals;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvcore-nvidia CUDA C++ ops; call them through kvcore_nvidia.ops, which validates";
  m.def("reshape_and_cache_flash", &kvcore_nvidia::reshape_and_cache_flash, "key"_a, "value"_a,
        "key_cache"_a, "value_cache"_a, "slot_mapping"_a, "fp8_kind"_a, "k_scale_tensor"_a,
        "v_scale_tensor"_a, "k_scale"_a, "v_scale"_a);
  m.def("copy_block_runs", &kvcore_nvidia::copy_block_runs, "src"_a, "dst"_a, "runs"_a,
        "method"_a, "streams"_a);
}
