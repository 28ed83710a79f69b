// Small CUDA helpers shared by every CUDA op: error checks that become twell::Error, an owning
// device buffer, and device facts read at run time (never hard-coded).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include <cuda_runtime.h>

#include "twell/error.h"

#define TWELL_CUDA_CHECK(expression)                                                                  \
  do {                                                                                                \
    cudaError_t twell_status_ = (expression);                                                         \
    if (twell_status_ != cudaSuccess)                                                                 \
      ::twell::fail("CUDA error '{}' in {} ({}:{})", cudaGetErrorString(twell_status_), #expression, \
                    __FILE__, __LINE__);                                                              \
  } while (0)

// After a launch: launch-configuration errors surface here, execution errors at the next sync.
#define TWELL_CUDA_CHECK_LAUNCH() TWELL_CUDA_CHECK(cudaGetLastError())

namespace twell::cuda {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) { resize(count); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }

  // Reallocates only when growing; contents are not preserved.
  void resize(size_t count) {
    if (count <= count_ && data_) return;
    release();
    if (count == 0) return;
    cudaError_t status = cudaMalloc(&data_, count * sizeof(T));
    if (status != cudaSuccess) {
      data_ = nullptr;
      cudaGetLastError();  // clear the sticky-free allocation error
      ::twell::fail("out of GPU memory: cannot allocate {} bytes ({} elements of {} bytes)", count * sizeof(T),
                    count, sizeof(T));
    }
    count_ = count;
  }
  void upload(const T* host, size_t count, cudaStream_t stream = nullptr) {
    resize(count);
    TWELL_CUDA_CHECK(cudaMemcpyAsync(data_, host, count * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  void download(T* host, size_t count, cudaStream_t stream = nullptr) const {
    TWELL_REQUIRE(count <= count_, "download of {} elements from a device buffer of {}", count, count_);
    TWELL_CUDA_CHECK(cudaMemcpyAsync(host, data_, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
    TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  void release() {
    if (data_) cudaFree(data_);
    data_ = nullptr;
    count_ = 0;
  }
  T* data_ = nullptr;
  size_t count_ = 0;
};

struct DeviceFacts {
  int device = 0;
  int sm_count = 0;
  int max_smem_per_block_optin = 0;  // bytes a block may use after cudaFuncSetAttribute
  int l2_bytes = 0;
  int major = 0, minor = 0;
  char name[256] = {};
};
// Read once per device and cached.
const DeviceFacts& device_facts();
// True when a CUDA device can be used; tests skip cleanly when false.
bool gpu_available();

// A second stream beside a caller's, for work that can run alongside the caller's own (a split FFN's
// dense part beside its sparse part). Non-blocking, so it never waits for the legacy default stream.
class SideStream {
 public:
  SideStream();
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t get() const { return stream_; }
  // Work queued on the side stream from now on waits for the work queued on `main` so far.
  void wait_for(cudaStream_t main);
  // Work queued on `main` from now on waits for the work queued on the side stream so far.
  void join_into(cudaStream_t main);

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t main_mark_ = nullptr, side_mark_ = nullptr;
};

// Launches `kernel` as a programmatic dependent launch (PDL): it may start while the stream's previous
// kernel is still ending. The kernel must call wait_for_previous_grid() (cuda/warp_math.cuh) before it
// reads or writes anything the previous kernels touch, and may call allow_dependent_grids() once every
// block is past that wait, so the next launch overlaps it in turn. Before the wait it may read only
// data no kernel of the stream writes (weights), which is the point: a decode step's small kernels
// then load their weights while the kernel before them finishes. Launch errors throw here.
template <typename... Params, typename... Args>
void launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                         Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  TWELL_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace twell::cuda
