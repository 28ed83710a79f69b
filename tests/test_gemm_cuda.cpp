// RowMajorGemm (src/cuda/gemm.h) at a size it tunes (>= 8 GFLOP: cuBLASLt's algorithms timed on the
// first call): the timing runs must leave the caller's C alone (beta = 1 adds to it exactly once),
// and a second instance, which takes the tuned choice from the first, computes the same product.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cuda/gemm.h"
#include "cuda_test_support.h"
#include "op_harness.h"
#include "twell/bf16.h"

namespace twell {
namespace {

std::vector<float> random_values(size_t count, uint64_t seed, bool bf16_exact) {
  std::mt19937_64 engine(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = bf16_exact ? round_to_bf16(normal(engine)) : normal(engine);
  return values;
}

class TunedGemm : public test::CudaTest<> {};

TEST_F(TunedGemm, AddsToCOnceAndAgreesAcrossInstances) {
  // C [m, n] = C + A [m, k] · B^T, B stored [n, k]: 2·m·n·k = 8.6 GFLOP, odd m.
  const int64_t m = 1031, n = 2048, k = 2048;
  const std::vector<float> a = random_values(m * k, 1, true), b = random_values(n * k, 2, true);
  const std::vector<float> c0 = random_values(m * n, 3, false);
  const cuda::DeviceArray<bf16> a_device = cuda::upload_bf16(a.data(), a.size());
  const cuda::DeviceArray<bf16> b_device = cuda::upload_bf16(b.data(), b.size());
  cuda::DeviceArray<float> c = cuda::make_device_array<float>(m * n);
  cuda::DeviceArray<float> c_second = cuda::make_device_array<float>(m * n);
  TWELL_CUDA_CHECK(cudaMemcpy(c.get(), c0.data(), c0.size() * sizeof(float), cudaMemcpyHostToDevice));
  TWELL_CUDA_CHECK(cudaMemcpy(c_second.get(), c0.data(), c0.size() * sizeof(float), cudaMemcpyHostToDevice));

  cuda::RowMajorGemm first, second;
  first.run(m, n, k, {a_device.get(), k, false}, {b_device.get(), k, true}, c.get(), n, cuda::GemmOutput::f32, 1.0f,
            nullptr);
  second.run(m, n, k, {a_device.get(), k, false}, {b_device.get(), k, true}, c_second.get(), n,
             cuda::GemmOutput::f32, 1.0f, nullptr);
  std::vector<float> got(m * n), got_second(m * n);
  TWELL_CUDA_CHECK(cudaMemcpy(got.data(), c.get(), got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  TWELL_CUDA_CHECK(
      cudaMemcpy(got_second.data(), c_second.get(), got_second.size() * sizeof(float), cudaMemcpyDeviceToHost));

  // float64 reference on 17 rows spread over m; fp32 accumulation of exact bf16 products: ~1e-6.
  std::vector<float> rows, rows_second;
  std::vector<double> expected;
  for (int64_t r = 0; r < m; r += m / 16) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = c0[r * n + j];
      for (int64_t i = 0; i < k; ++i) sum += static_cast<double>(a[r * k + i]) * b[j * k + i];
      expected.push_back(sum);
      rows.push_back(got[r * n + j]);
      rows_second.push_back(got_second[r * n + j]);
    }
  }
  EXPECT_TRUE(test::near_relative_l2("C (first instance)", rows.data(), expected.data(), expected.size(), 1e-5));
  EXPECT_TRUE(
      test::near_relative_l2("C (second instance)", rows_second.data(), expected.data(), expected.size(), 1e-5));
}

}  // namespace
}  // namespace twell
