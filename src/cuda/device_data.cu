// Device memory, FFN weights and TwELL buffers on the device: the data half of include/twell/cuda.h.
#include <algorithm>

#include "cuda/cuda_utils.h"
#include "twell/cuda.h"

namespace twell::cuda {

bool available() { return gpu_available(); }

const char* device_name() { return device_facts().name; }
size_t l2_bytes() { return static_cast<size_t>(device_facts().l2_bytes); }

void* device_allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* pointer = nullptr;
  cudaError_t status = cudaMalloc(&pointer, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls do not report it
    fail("out of GPU memory: cannot allocate {} bytes ({})", bytes, cudaGetErrorString(status));
  }
  return pointer;
}

void device_free(void* pointer) noexcept {
  if (pointer) cudaFree(pointer);
}

namespace {
__global__ void read_words(const uint4* words, size_t count, unsigned* sink) {
  unsigned bits = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = words[i];
    bits |= v.x | v.y | v.z | v.w;
  }
  if (bits == 0xdeadbeefu) *sink = bits;  // never true (the buffer is zero): keeps the loads
}
}  // namespace

L2Evictor::L2Evictor()
    : words_(2 * static_cast<size_t>(device_facts().l2_bytes) / sizeof(uint4)),
      buffer_(make_device_array<uint4>(words_)),
      sink_(make_device_array<unsigned>(1)) {
  TWELL_CUDA_CHECK(cudaMemset(buffer_.get(), 0, words_ * sizeof(uint4)));
}

void L2Evictor::run(cudaStream_t stream) const {
  const unsigned blocks = static_cast<unsigned>(device_facts().sm_count) * 4;
  read_words<<<blocks, 256, 0, stream>>>(buffer_.get(), words_, sink_.get());
  TWELL_CUDA_CHECK_LAUNCH();
}

TimingStats time_graph(const std::function<void(int, cudaStream_t)>& run, int calls, int reps,
                       const L2Evictor* evictor) {
  cudaStream_t stream;
  TWELL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  TWELL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) run(i, stream);
  TWELL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  TWELL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  TWELL_CUDA_CHECK(cudaEventCreate(&start));
  TWELL_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> per_call_ms;
  for (int i = -3; i < reps; ++i) {  // 3 warm-up replays
    if (evictor) evictor->run(stream);
    TWELL_CUDA_CHECK(cudaEventRecord(start, stream));
    TWELL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    TWELL_CUDA_CHECK(cudaEventRecord(stop, stream));
    TWELL_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TWELL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 0) per_call_ms.push_back(ms / calls);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return summarize_ms(per_call_ms);
}

void copy_to_device(void* device, const void* host, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  TWELL_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream));
  // The host buffer may be a temporary: wait until the copy has read it.
  TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void copy_to_host(void* host, const void* device, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) TWELL_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream));
  TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));
}

DeviceArray<bf16> upload_bf16(const float* host, size_t count, cudaStream_t stream) {
  std::vector<bf16> rounded(count);
  for (size_t i = 0; i < count; ++i) rounded[i] = to_bf16(host[i]);
  DeviceArray<bf16> device = make_device_array<bf16>(count);
  copy_to_device(device.get(), rounded.data(), count * sizeof(bf16), stream);
  return device;
}

std::vector<float> download_bf16(const bf16* device, size_t count, cudaStream_t stream) {
  std::vector<bf16> raw(count);
  copy_to_host(raw.data(), device, count * sizeof(bf16), stream);
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = to_float(raw[i]);
  return values;
}

DeviceFfnView DeviceFfnView::neurons(int32_t begin, int32_t end) const {
  TWELL_REQUIRE(0 <= begin && begin < end && end <= d_hidden, "DeviceFfnView: neurons [{}, {}) outside [0, {})", begin,
                end, d_hidden);
  const int64_t offset = int64_t{begin} * d_model;
  return {d_model, end - begin, gated, gated ? gate + offset : nullptr, up + offset, down + offset};
}

DeviceFfnWeights upload_weights(const FfnWeights& weights) {
  validate(weights);
  TWELL_REQUIRE(weights.d_model % 64 == 0, "CUDA FFN: d_model must be a multiple of 64, got {}", weights.d_model);
  TWELL_REQUIRE(weights.d_hidden <= kTwellMaxColumns, "CUDA FFN: d_hidden must be <= {}, got {}",
                kTwellMaxColumns, weights.d_hidden);
  DeviceFfnWeights device;
  device.d_model = weights.d_model;
  device.d_hidden = weights.d_hidden;
  device.gated = weights.gated;
  const size_t count = static_cast<size_t>(weights.d_hidden) * weights.d_model;
  if (weights.gated) device.gate = upload_bf16(weights.gate.data(), count);
  device.up = upload_bf16(weights.up.data(), count);
  device.down = upload_bf16(weights.down.data(), count);
  return device;
}

void reserve(DeviceTwell& packed, const TwellShape& shape, int64_t spill_rows) {
  TWELL_REQUIRE(twell_tile_supported(shape.tile), "TwELL tile must be 128 or 256, got {}", shape.tile);
  TWELL_REQUIRE(twell_compression_supported(shape.compression), "TwELL compression must be 2, 4 or 8, got {}",
                shape.compression);
  TWELL_REQUIRE(shape.cols >= 1 && shape.cols <= kTwellMaxColumns, "TwELL cols must be in [1, {}], got {}",
                kTwellMaxColumns, shape.cols);
  TWELL_REQUIRE(shape.rows >= 1, "TwELL rows must be >= 1, got {}", shape.rows);
  if (shape.slot_count() > packed.slot_capacity) {
    packed.slots = make_device_array<TwellSlot>(shape.slot_count());
    packed.slot_capacity = shape.slot_count();
  }
  if (shape.tile_count() > packed.tile_capacity) {
    packed.tile_nnz = make_device_array<int32_t>(shape.tile_count());
    packed.tile_capacity = shape.tile_count();
  }
  // The spill is counted in rows of T values: a change of T keeps the bytes but not the row count.
  const int64_t spill_elements = std::max<int64_t>(spill_rows, 1) * shape.tile;
  if (!packed.spill || spill_elements > packed.spill_capacity * packed.shape.tile) {
    packed.spill = make_device_array<bf16>(spill_elements);
    packed.spill_capacity = spill_elements / shape.tile;
  } else {
    packed.spill_capacity = packed.spill_capacity * packed.shape.tile / shape.tile;
  }
  if (!packed.spill_used) {
    packed.spill_used = make_device_array<int32_t>(1);
    packed.nnz_total = make_device_array<unsigned long long>(1);
    TWELL_CUDA_CHECK(cudaMemset(packed.spill_used.get(), 0, sizeof(int32_t)));
    TWELL_CUDA_CHECK(cudaMemset(packed.nnz_total.get(), 0, sizeof(unsigned long long)));
  }
  packed.shape = shape;
}

int32_t spill_rows_used(const DeviceTwell& packed, cudaStream_t stream) {
  int32_t used = 0;
  copy_to_host(&used, packed.spill_used.get(), sizeof used, stream);
  return used;
}

TwellMatrix download(const DeviceTwell& packed, cudaStream_t stream) {
  TWELL_REQUIRE(!packed.empty(), "download of an empty DeviceTwell");
  TwellMatrix host;
  host.shape = packed.shape;
  host.slots.resize(packed.shape.slot_count());
  host.tile_nnz.resize(packed.shape.tile_count());
  copy_to_host(host.slots.data(), packed.slots.get(), host.slots.size() * sizeof(TwellSlot), stream);
  copy_to_host(host.tile_nnz.data(), packed.tile_nnz.get(), host.tile_nnz.size() * sizeof(int32_t), stream);
  host.spill_used = spill_rows_used(packed, stream);
  // Only the rows in use carry data; the host copy's capacity is the device's, so complete() agrees.
  host.spill.resize(static_cast<size_t>(packed.spill_capacity) * packed.shape.tile);
  const int64_t rows_written = std::min<int64_t>(host.spill_used, packed.spill_capacity);
  copy_to_host(host.spill.data(), packed.spill.get(), rows_written * packed.shape.tile * sizeof(bf16), stream);
  return host;
}

void upload(const TwellMatrix& packed, DeviceTwell& out, cudaStream_t stream) {
  TWELL_REQUIRE(packed.slots.size() == static_cast<size_t>(packed.shape.slot_count()),
                "TwellMatrix slots: expected {} entries, got {}", packed.shape.slot_count(), packed.slots.size());
  TWELL_REQUIRE(packed.tile_nnz.size() == static_cast<size_t>(packed.shape.tile_count()),
                "TwellMatrix tile_nnz: expected {} entries, got {}", packed.shape.tile_count(),
                packed.tile_nnz.size());
  reserve(out, packed.shape, packed.spill_capacity());
  copy_to_device(out.slots.get(), packed.slots.data(), packed.slots.size() * sizeof(TwellSlot), stream);
  copy_to_device(out.tile_nnz.get(), packed.tile_nnz.data(), packed.tile_nnz.size() * sizeof(int32_t), stream);
  copy_to_device(out.spill.get(), packed.spill.data(), packed.spill.size() * sizeof(bf16), stream);
  copy_to_device(out.spill_used.get(), &packed.spill_used, sizeof(int32_t), stream);
  // An uploaded packing keeps the host's capacity, so lost rows (spill_used > capacity) stay lost.
  out.spill_capacity = packed.spill_capacity();
}

}  // namespace twell::cuda
