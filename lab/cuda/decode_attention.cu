// Kernel lab for the decode step's RoPE and attention (model_kernels::decode_attention_rope,
// src/cuda/model_kernels.cu): each shape checked against float64 (RoPE of the query and the new key,
// then the attention; every head), then timed.
//
//   lab_decode_attention [reps]     default 50
//
// Shapes: the 2B model's decode step (B = 1, H_q = H_kv = 32, Dh = 64, no qkv bias, theta 1e4) at
// 128, 192, 512, 2048 and 4096 cached positions, and B = 4 at 512; the cache stride is the length + 1
// rounded up to 8, as CudaModel::reset gives a cache just large enough.
//
// Napkin math: a call reads K and V of the cached positions, B·H_kv·length·Dh·2 bytes each: 1.6 MB at
// B = 1 and 192 positions, 0.4 us at the H200's ~4 TB/s, far under a launch's latency; 33.6 MB at
// 4096 positions, 8.4 us. The qkv row (12 KB at B = 1) and the angles (a powf and a cosf/sinf per
// pair) are small beside them. Before the fusion the step ran qkv_rope (3.0 us under ncu), then the
// split attention of an already rotated query, which this lab timed at 5.84, 7.07, 7.38, 11.05,
// 13.97 and 12.78 us per call at these shapes in DRAM (docs/perf-notes.md, sixth session).
//
// Timing: a CUDA graph of kCallsPerGraph calls, each reading its own copy of the caches so that no
// call finds another's K and V in the L2 ("dram": the L2 is emptied before each replay, as a
// model's layer finds its cache behind the FFN weights), and the same graph on one copy ("l2", all
// but the first call find it there). CUDA events around each replay; median, p10 and p90 over
// `reps` replays of the time per call. Each graph is timed twice: "fused", decode_attention_rope
// alone, as the model's decode step runs it, and "rope+fused", with qkv_rope in front of every call:
// the launch the fusion took out of the step, put back (it stores the same key and value the fused
// kernel stores), so the difference is what the fusion saves per layer.
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/model_kernels.h"
#include "lab_common.h"
#include "twell/cuda.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

using namespace twell;

namespace {

namespace mk = cuda::model_kernels;

constexpr int kCallsPerGraph = 20;
constexpr float kRopeTheta = 1e4f;

struct DecodeShape {
  int32_t batch, n_heads, length;  // H_q = H_kv; the query sees positions 0 ..= length
};

std::vector<float> random_bf16(int64_t count, uint64_t seed) {
  std::vector<float> values = make_normal(count, 1.0, seed);
  for (float& value : values) value = round_to_bf16(value);
  return values;
}

// Checks the shape against float64 and prints its timings; false when the check fails.
bool run_shape(const DecodeShape& d, int reps, const cuda::L2Evictor& evictor) {
  const int32_t dh = 64, visible = d.length + 1;
  const int32_t stride = (visible + 7) / 8 * 8;
  const mk::AttentionShape shape{d.batch, 1, d.n_heads, d.n_heads, dh, stride};
  const int64_t q_elements = int64_t{d.batch} * d.n_heads * dh;
  const int64_t cache_elements = int64_t{d.batch} * d.n_heads * stride * dh;
  const std::vector<float> qkv_host = random_bf16(3 * q_elements, 1), keys_host = random_bf16(cache_elements, 2),
                           values_host = random_bf16(cache_elements, 3);
  const cuda::DeviceArray<bf16> qkv = cuda::upload_bf16(qkv_host.data(), qkv_host.size());  // [B, 3·H·Dh]
  // [copies, B, H_kv, stride, Dh] each; copy 0 uploaded, the others device copies of it.
  cuda::DeviceArray<bf16> keys = cuda::make_device_array<bf16>(kCallsPerGraph * cache_elements),
                          values = cuda::make_device_array<bf16>(kCallsPerGraph * cache_elements);
  const size_t cache_bytes = cache_elements * sizeof(bf16);
  {
    const cuda::DeviceArray<bf16> keys0 = cuda::upload_bf16(keys_host.data(), keys_host.size()),
                                  values0 = cuda::upload_bf16(values_host.data(), values_host.size());
    for (int copy = 0; copy < kCallsPerGraph; ++copy) {
      TWELL_CUDA_CHECK(
          cudaMemcpy(keys.get() + copy * cache_elements, keys0.get(), cache_bytes, cudaMemcpyDeviceToDevice));
      TWELL_CUDA_CHECK(
          cudaMemcpy(values.get() + copy * cache_elements, values0.get(), cache_bytes, cudaMemcpyDeviceToDevice));
    }
  }
  cuda::DeviceArray<int32_t> length = cuda::make_device_array<int32_t>(1);
  cuda::copy_to_device(length.get(), &d.length, sizeof(int32_t));
  cuda::DeviceArray<bf16> out = cuda::make_device_array<bf16>(q_elements);
  TWELL_CUDA_CHECK(cudaMemset(out.get(), 0xff, q_elements * sizeof(bf16)));  // NaN until written
  cuda::DeviceArray<bf16> rotated_q = cuda::make_device_array<bf16>(q_elements);  // qkv_rope's, unread
  const size_t workspace_bytes = mk::decode_attention_workspace_bytes(shape);
  cuda::DeviceArray<std::byte> workspace = cuda::make_device_array<std::byte>(workspace_bytes);
  TWELL_CUDA_CHECK(cudaMemset(workspace.get(), 0, workspace_bytes));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  auto fused = [&](int copy, cudaStream_t stream) {
    mk::decode_attention_rope(qkv.get(), nullptr, shape, length.get(), kRopeTheta, keys.get() + copy * cache_elements,
                              values.get() + copy * cache_elements, scale, out.get(), workspace.get(), workspace_bytes,
                              stream);
  };
  auto rope_then_fused = [&](int copy, cudaStream_t stream) {
    mk::qkv_rope(qkv.get(), nullptr, shape, length.get(), kRopeTheta, rotated_q.get(),
                 keys.get() + copy * cache_elements, values.get() + copy * cache_elements, stream);
    fused(copy, stream);
  };
  fused(0, nullptr);
  TWELL_CUDA_CHECK(cudaDeviceSynchronize());

  // The query, new key and value are rounded to bf16 as the cache stores them, and the output:
  // within 1e-2 relatively (tests/test_decode_attention_cuda.cpp).
  const std::vector<double> expected =
      ref::decode_attention_rope(qkv_host.data(), nullptr, keys_host, values_host,
                                 {d.batch, 1, d.n_heads, d.n_heads, dh, stride, d.length}, kRopeTheta,
                                 1.0 / std::sqrt(static_cast<double>(dh)));
  const std::vector<float> got = cuda::download_bf16(out.get(), q_elements);
  const double error = relative_l2_error(got.data(), expected.data(), expected.size());
  const bool ok = error < 1e-2;

  const TimingStats dram = cuda::time_graph(fused, kCallsPerGraph, reps, &evictor);
  const TimingStats l2 = cuda::time_graph([&](int, cudaStream_t stream) { fused(0, stream); }, kCallsPerGraph, reps);
  const TimingStats rope_dram = cuda::time_graph(rope_then_fused, kCallsPerGraph, reps, &evictor);
  const TimingStats rope_l2 =
      cuda::time_graph([&](int, cudaStream_t stream) { rope_then_fused(0, stream); }, kCallsPerGraph, reps);
  const double bytes = 2.0 * d.batch * d.n_heads * d.length * dh * sizeof(bf16);  // K and V read
  std::printf(
      "B %d H %2d Dh %d length %4d  splits %3d  check %.2e %s  K+V %6.2f MB  fused: dram %6.2f us (p10 %.2f, p90 "
      "%.2f) %6.0f GB/s  l2 %6.2f us  rope+fused: dram %6.2f us  l2 %6.2f us  saved: dram %5.2f us  l2 %5.2f us\n",
      d.batch, d.n_heads, dh, d.length, mk::decode_attention_splits(shape), error, ok ? "ok" : "FAILED", bytes * 1e-6,
      dram.median_ms * 1e3, dram.p10_ms * 1e3, dram.p90_ms * 1e3, bytes / (dram.median_ms * 1e-3) * 1e-9,
      l2.median_ms * 1e3, rope_dram.median_ms * 1e3, rope_l2.median_ms * 1e3,
      (rope_dram.median_ms - dram.median_ms) * 1e3, (rope_l2.median_ms - l2.median_ms) * 1e3);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  return lab::run_main("lab_decode_attention", [&] {
    const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
    TWELL_REQUIRE(reps >= 1, "reps must be >= 1, got {}", reps);
    std::printf("%s, %d calls per graph, median over %d replays\n", cuda::device_name(), kCallsPerGraph, reps);
    const cuda::L2Evictor evictor;
    bool ok = true;
    for (const DecodeShape& shape : {DecodeShape{1, 32, 128}, DecodeShape{1, 32, 192}, DecodeShape{1, 32, 512},
                                     DecodeShape{1, 32, 2048}, DecodeShape{1, 32, 4096}, DecodeShape{4, 32, 512}})
      ok = run_shape(shape, reps, evictor) && ok;
    return ok ? 0 : 1;
  });
}
