// Kernel lab for the causal prefill attention (src/cuda/prefill_attention.cu): the fused kernel
// checked against the float64 reference (one sequence's first kv-head group) and against the GEMM
// path on the whole shape, then both timed in the same run.
//
//   lab_prefill_attention [B n H_q H_kv Dh start reps]     default: 64 2048 32 32 64 0 20
//
// Napkin math (the 2B model's layer: B = 64, n = 2048, H = 32, Dh = 64, start 0): the causal
// products are 4·B·H·Dh·(n(n+1)/2) = 1.1 TFLOP, 1.4 ms at the ~790 TFLOP/s of dense bf16 on the
// H200 (mma.sync reaches well under that); q, K, V and the output are 0.5 GiB each, 0.7 ms of HBM.
// The GEMM path also writes and reads fp32 scores (32 GiB at this shape) and bf16 probabilities (16 GiB).
//
// Timing: CUDA events around each call, 5 warm-up calls, median of `reps` calls.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/prefill_attention.h"
#include "lab_common.h"
#include "twell/bench_record.h"
#include "twell/cuda.h"
#include "twell/error.h"
#include "twell/reference.h"

using namespace twell;

namespace {

using cuda::model_kernels::AttentionShape;

// values[i] = a hash of (seed, i) mapped to bf16 in [-2, 2): inputs of any size without a host pass.
__global__ void fill_random(bf16* values, int64_t count, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32) * 40503u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    values[i] = to_bf16(static_cast<float>(x >> 8) * (4.0f / 16777216.0f) - 2.0f);
  }
}

cuda::DeviceArray<bf16> random_device(int64_t count, uint32_t seed) {
  cuda::DeviceArray<bf16> values = cuda::make_device_array<bf16>(count);
  fill_random<<<1024, 256>>>(values.get(), count, seed);
  TWELL_CUDA_CHECK_LAUNCH();
  return values;
}

int run(int32_t batch, int32_t n, int32_t n_heads, int32_t n_kv_heads, int32_t dh, int32_t start, int reps) {
  const int32_t capacity = (start + n + 7) / 8 * 8;
  const AttentionShape shape{batch, n, n_heads, n_kv_heads, dh, capacity};
  const int64_t q_elements = int64_t{batch} * n_heads * n * dh;
  const int64_t cache_elements = int64_t{batch} * n_kv_heads * capacity * dh;
  const cuda::DeviceArray<bf16> q = random_device(q_elements, 1), keys = random_device(cache_elements, 2),
                                values = random_device(cache_elements, 3);
  cuda::DeviceArray<bf16> fused_out = cuda::make_device_array<bf16>(q_elements),
                          gemm_out = cuda::make_device_array<bf16>(q_elements);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  cuda::RowMajorGemm gemm;
  cuda::GemmPrefillAttention gemm_attention;
  auto fused = [&](int) {
    cuda::fused_prefill_attention(q.get(), keys.get(), values.get(), shape, start, scale, fused_out.get(), nullptr);
  };
  auto materialized = [&](int) {
    gemm_attention.run(gemm, q.get(), keys.get(), values.get(), shape, start, scale, gemm_out.get(), nullptr);
  };
  fused(0);
  materialized(0);
  TWELL_CUDA_CHECK(cudaDeviceSynchronize());

  // Check: sequence 0's first group of query heads (they share kv head 0) against float64, and the
  // whole output against the GEMM path.
  const int32_t group = n_heads / n_kv_heads;
  const std::vector<float> q_host = cuda::download_bf16(q.get(), int64_t{group} * n * dh);
  const std::vector<float> keys_host = cuda::download_bf16(keys.get(), int64_t{capacity} * dh);
  const std::vector<float> values_host = cuda::download_bf16(values.get(), int64_t{capacity} * dh);
  const std::vector<double> expected = ref::causal_attention(q_host.data(), keys_host.data(), values_host.data(),
                                                             {1, n, group, 1, dh, capacity, start}, scale);
  const std::vector<float> fused_host = cuda::download_bf16(fused_out.get(), q_elements);
  const std::vector<float> gemm_host = cuda::download_bf16(gemm_out.get(), q_elements);
  std::vector<float> fused_group(expected.size());  // rows of sequence 0, columns of the group's heads
  for (int32_t t = 0; t < n; ++t)
    std::copy_n(fused_host.begin() + int64_t{t} * n_heads * dh, int64_t{group} * dh,
                fused_group.begin() + int64_t{t} * group * dh);
  const double error = relative_l2_error(fused_group.data(), expected.data(), expected.size());
  const std::vector<double> gemm_as_double(gemm_host.begin(), gemm_host.end());
  const double difference = relative_l2_error(fused_host.data(), gemm_as_double.data(), gemm_as_double.size());
  std::printf("check: fused vs float64 (sequence 0, heads 0..%d) relative L2 %.3g; fused vs GEMM path %.3g\n",
              group - 1, error, difference);
  const bool ok = error < 1e-2 && difference < 1e-2;

  const TimingStats fused_time = lab::time_calls(reps, 1, fused);
  const TimingStats gemm_time = lab::time_calls(std::max(3, reps / 4), 1, materialized);
  double products = 0;  // visible (query, key) pairs
  for (int32_t t = 0; t < n; ++t) products += start + t + 1;
  const double flops = 4.0 * batch * n_heads * dh * products;
  std::printf("%s, B %d n %d H_q %d H_kv %d Dh %d start %d\n", cuda::device_name(), batch, n, n_heads,
              n_kv_heads, dh, start);
  std::printf("fused      median %8.3f ms (p10 %.3f, p90 %.3f)  %6.1f TFLOP/s\n", fused_time.median_ms,
              fused_time.p10_ms, fused_time.p90_ms, flops / fused_time.median_ms * 1e-9);
  std::printf("GEMM path  median %8.3f ms (p10 %.3f, p90 %.3f)  %6.1f TFLOP/s\n", gemm_time.median_ms, gemm_time.p10_ms,
              gemm_time.p90_ms, flops / gemm_time.median_ms * 1e-9);
  std::printf("fused / GEMM path speedup %.2fx\n", gemm_time.median_ms / fused_time.median_ms);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return lab::run_main("lab_prefill_attention", [&] {
    const auto arg = [&](int index, int fallback) { return argc > index ? std::atoi(argv[index]) : fallback; };
    return run(arg(1, 64), arg(2, 2048), arg(3, 32), arg(4, 32), arg(5, 64), arg(6, 0), arg(7, 20));
  });
}
