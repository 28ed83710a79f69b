// RowMajorGemm (src/cuda/gemm.h) at sizes it tunes (>= 8 GFLOP: cuBLASLt's algorithms timed on the
// first call): with beta = 1 the timing runs must leave the caller's C alone (it is added to
// exactly once), a second instance, which takes the tuned choice from the first, computes the same
// product, and with beta = 0 (timed in the caller's C) a poisoned C is overwritten. Skipped without
// a GPU. And at any alignment: operands a few bytes off cuBLASLt's assumed 256, batch strides too.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>
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

// got [m, n] against c0 (when given) + a [m, k] · b^T (b stored [n, k]) in float64, on 17 rows
// spread over m; fp32 accumulation of exact bf16 products stays near 1e-6.
testing::AssertionResult matches_on_sampled_rows(const std::string& what, const std::vector<float>& got,
                                                 const std::vector<float>& a, const std::vector<float>& b,
                                                 const std::vector<float>* c0, int64_t m, int64_t n, int64_t k) {
  std::vector<float> rows;
  std::vector<double> expected;
  for (int64_t r = 0; r < m; r += m / 16) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = c0 ? (*c0)[r * n + j] : 0.0;
      for (int64_t i = 0; i < k; ++i) sum += static_cast<double>(a[r * k + i]) * b[j * k + i];
      expected.push_back(sum);
      rows.push_back(got[r * n + j]);
    }
  }
  return test::near_relative_l2(what, rows.data(), expected.data(), expected.size(), 1e-5);
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

  EXPECT_TRUE(matches_on_sampled_rows("C (first instance)", got, a, b, &c0, m, n, k));
  EXPECT_TRUE(matches_on_sampled_rows("C (second instance)", got_second, a, b, &c0, m, n, k));

  // beta = 0 at a shape not timed yet (m - 1 rows), into NaN: the product alone.
  const int64_t m0 = m - 1;
  const std::vector<float> nan(m0 * n, std::numeric_limits<float>::quiet_NaN());
  TWELL_CUDA_CHECK(cudaMemcpy(c.get(), nan.data(), nan.size() * sizeof(float), cudaMemcpyHostToDevice));
  first.run(m0, n, k, {a_device.get(), k, false}, {b_device.get(), k, true}, c.get(), n, cuda::GemmOutput::f32, 0.0f,
            nullptr);
  std::vector<float> got_plain(m0 * n);
  TWELL_CUDA_CHECK(
      cudaMemcpy(got_plain.data(), c.get(), got_plain.size() * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(matches_on_sampled_rows("C (beta 0)", got_plain, a, b, nullptr, m0, n, k));
}

// Operands 2 to 16 bytes off a 256-byte boundary, C 4 bytes off, and a batch of two whose B stride
// is 8 bytes off a multiple of 16: cuBLASLt is told each alignment (by default it assumes 256 bytes
// and may pick a kernel that faults), and every product is right.
TEST_F(TunedGemm, ComputesAtAnyAlignment) {
  const int64_t m = 37, n = 72, k = 40;
  const std::vector<float> a = random_values(m * k, 4, true), b = random_values(2 * n * k, 5, true);
  const cuda::DeviceArray<bf16> a_packed = cuda::upload_bf16(a.data(), a.size());
  const cuda::DeviceArray<bf16> b_packed = cuda::upload_bf16(b.data(), b.size());
  const cuda::DeviceArray<bf16> a_device = cuda::make_device_array<bf16>(m * k + 16);
  const cuda::DeviceArray<bf16> b_device = cuda::make_device_array<bf16>(2 * n * k + 32);
  cuda::DeviceArray<float> c = cuda::make_device_array<float>(2 * m * n + 8);
  cuda::RowMajorGemm gemm;
  for (const int64_t offset : {1, 4, 8}) {
    SCOPED_TRACE(testing::Message() << "operands " << offset << " elements off");
    bf16* const a_at = a_device.get() + offset;
    bf16* const b_at = b_device.get() + offset;
    float* const c_at = c.get() + 1;
    TWELL_CUDA_CHECK(cudaMemcpy(a_at, a_packed.get(), m * k * sizeof(bf16), cudaMemcpyDeviceToDevice));
    // The batch's second B lies n·k + 4 elements after the first.
    const int64_t stride_b = n * k + 4;
    TWELL_CUDA_CHECK(cudaMemcpy(b_at, b_packed.get(), n * k * sizeof(bf16), cudaMemcpyDeviceToDevice));
    TWELL_CUDA_CHECK(cudaMemcpy(b_at + stride_b, b_packed.get() + n * k, n * k * sizeof(bf16), cudaMemcpyDeviceToDevice));
    TWELL_CUDA_CHECK(cudaMemset(c.get(), 0xff, (2 * m * n + 8) * sizeof(float)));
    gemm.run(m, n, k, {a_at, k, false}, {b_at, k, true}, c_at, n, cuda::GemmOutput::f32, 0.0f, nullptr);
    std::vector<float> got(m * n);
    TWELL_CUDA_CHECK(cudaMemcpy(got.data(), c_at, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    EXPECT_TRUE(matches_on_sampled_rows("C", got, a, b, nullptr, m, n, k));

    TWELL_CUDA_CHECK(cudaMemset(c.get(), 0xff, (2 * m * n + 8) * sizeof(float)));
    gemm.run(m, n, k, {a_at, k, false}, {b_at, k, true}, c_at, n, cuda::GemmOutput::f32, 0.0f, nullptr,
             cuda::GemmEpilogue::none, {.count = 2, .stride_a = 0, .stride_b = stride_b, .stride_c = m * n + 2});
    for (int entry = 0; entry < 2; ++entry) {
      TWELL_CUDA_CHECK(cudaMemcpy(got.data(), c_at + entry * (m * n + 2), got.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost));
      const std::vector<float> b_entry(b.begin() + entry * n * k, b.begin() + (entry + 1) * n * k);
      EXPECT_TRUE(matches_on_sampled_rows("C of batch entry " + std::to_string(entry), got, a, b_entry, nullptr, m, n, k));
    }
  }
}

}  // namespace
}  // namespace twell
