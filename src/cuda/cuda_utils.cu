#include "cuda/cuda_utils.h"

#include <cstring>
#include <mutex>

namespace twell::cuda {

bool gpu_available() {
  static const bool available = [] {
    int count = 0;
    bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();
    return ok;
  }();
  return available;
}

const DeviceFacts& device_facts() {
  static DeviceFacts facts;
  static std::once_flag once;
  std::call_once(once, [] {
    TWELL_REQUIRE(gpu_available(), "no CUDA device is available");
    TWELL_CUDA_CHECK(cudaGetDevice(&facts.device));
    cudaDeviceProp props{};
    TWELL_CUDA_CHECK(cudaGetDeviceProperties(&props, facts.device));
    facts.sm_count = props.multiProcessorCount;
    facts.max_smem_per_block_optin = static_cast<int>(props.sharedMemPerBlockOptin);
    facts.l2_bytes = props.l2CacheSize;
    facts.major = props.major;
    facts.minor = props.minor;
    std::strncpy(facts.name, props.name, sizeof facts.name - 1);
  });
  return facts;
}

}  // namespace twell::cuda
