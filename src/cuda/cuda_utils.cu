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

SideStream::SideStream() {
  TWELL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TWELL_CUDA_CHECK(cudaEventCreateWithFlags(&main_mark_, cudaEventDisableTiming));
  TWELL_CUDA_CHECK(cudaEventCreateWithFlags(&side_mark_, cudaEventDisableTiming));
}

SideStream::~SideStream() {
  cudaStreamSynchronize(stream_);
  cudaEventDestroy(side_mark_);
  cudaEventDestroy(main_mark_);
  cudaStreamDestroy(stream_);
}

void SideStream::wait_for(cudaStream_t main) {
  TWELL_CUDA_CHECK(cudaEventRecord(main_mark_, main));
  TWELL_CUDA_CHECK(cudaStreamWaitEvent(stream_, main_mark_));
}

void SideStream::join_into(cudaStream_t main) {
  TWELL_CUDA_CHECK(cudaEventRecord(side_mark_, stream_));
  TWELL_CUDA_CHECK(cudaStreamWaitEvent(main, side_mark_));
}

}  // namespace twell::cuda
