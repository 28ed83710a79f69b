// The decode step's GEMV (src/cuda/decode_gemv.h) against float64 sums on random bf16 x and W: 1..4
// rows, N odd and smaller than a warp's share, K from one 16-byte piece to more than one round of
// pieces in flight; bf16 rows or the RMSNorm of fp32 rows as input, bf16 or fp32-accumulate output.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda/decode_gemv.h"
#include "cuda_test_support.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell {
namespace {

struct GemvCase {
  std::string name;
  int32_t rows, n, k;
  bool normalize;
  cuda::GemvOutput output;
};

std::vector<float> rounded_normal(int64_t count, double stddev, uint64_t seed) {
  std::vector<float> values = make_normal(count, stddev, seed);
  for (float& value : values) value = round_to_bf16(value);
  return values;
}

using cuda::GemvOutput;

class DecodeGemvTest : public test::CudaTest<testing::TestWithParam<GemvCase>> {};

TEST_P(DecodeGemvTest, MatchesFloat64) {
  const GemvCase& c = GetParam();
  const uint64_t seed = static_cast<uint64_t>(c.rows * 7919 + c.n * 31 + c.k);
  const std::vector<float> w = rounded_normal(int64_t{c.n} * c.k, 0.05, seed);
  // x as the kernel sees it: given, or bf16 of weight ⊙ h / rms(h) (float64 here; the kernel's fp32
  // may round an element the other way, which the normalized tolerance covers).
  std::vector<float> x, hidden, norm_weight;
  if (c.normalize) {
    hidden = make_normal(int64_t{c.rows} * c.k, 3.0, seed + 1);
    norm_weight = make_normal(c.k, 1.0, seed + 2);
    for (double v : ref::rms_norm(hidden.data(), c.rows, c.k, norm_weight.data(), 1e-5f))
      x.push_back(round_to_bf16(static_cast<float>(v)));
  } else {
    x = rounded_normal(int64_t{c.rows} * c.k, 1.0, seed + 1);
  }
  const bool add = c.output == GemvOutput::f32_add;
  // An accumulating call adds to what y holds; a bf16 y starts as NaN, so an element left unwritten fails.
  const std::vector<float> y_start = add ? make_normal(int64_t{c.rows} * c.n, 1.0, seed + 3) : std::vector<float>{};
  std::vector<double> expected(static_cast<size_t>(c.rows) * c.n);
  for (int32_t m = 0; m < c.rows; ++m)
    for (int32_t n = 0; n < c.n; ++n) {
      double sum = add ? y_start[m * c.n + n] : 0.0;
      for (int32_t k = 0; k < c.k; ++k) sum += double{x[m * c.k + k]} * w[int64_t{n} * c.k + k];
      expected[m * c.n + n] = sum;
    }

  const cuda::DeviceArray<bf16> w_device = cuda::upload_bf16(w.data(), w.size());
  cuda::DeviceArray<bf16> x_device;
  cuda::DeviceArray<float> hidden_device, norm_device;
  cuda::GemvInput input;
  if (c.normalize) {
    hidden_device = cuda::make_device_array<float>(hidden.size());
    norm_device = cuda::make_device_array<float>(norm_weight.size());
    cuda::copy_to_device(hidden_device.get(), hidden.data(), hidden.size() * sizeof(float));
    cuda::copy_to_device(norm_device.get(), norm_weight.data(), norm_weight.size() * sizeof(float));
    input = cuda::GemvInput::rms_norm(hidden_device.get(), norm_device.get(), 1e-5f);
  } else {
    x_device = cuda::upload_bf16(x.data(), x.size());
    input = cuda::GemvInput::rows(x_device.get());
  }
  std::vector<float> got(expected.size());
  const std::vector<float> poison(got.size(), std::numeric_limits<float>::quiet_NaN());
  if (c.output != GemvOutput::bf16) {
    cuda::DeviceArray<float> y = cuda::make_device_array<float>(got.size());
    cuda::copy_to_device(y.get(), (add ? y_start : poison).data(), got.size() * sizeof(float));
    cuda::decode_gemv(c.rows, c.n, c.k, input, w_device.get(), y.get(), c.output, nullptr);
    cuda::copy_to_host(got.data(), y.get(), got.size() * sizeof(float));
  } else {
    cuda::DeviceArray<bf16> y = cuda::upload_bf16(poison.data(), poison.size());
    cuda::decode_gemv(c.rows, c.n, c.k, input, w_device.get(), y.get(), c.output, nullptr);
    got = cuda::download_bf16(y.get(), got.size());
  }
  // fp32 sums of bf16 products: ~1e-6 relative; a bf16 output rounds each element (<= 2^-9 relative);
  // a normalized x element rounded the other way moves by one bf16 step (2^-8) on a few elements.
  const double tolerance = c.output == GemvOutput::bf16 ? 5e-3 : c.normalize ? 2e-3 : 1e-5;
  EXPECT_LT(relative_l2_error(got.data(), expected.data(), got.size()), tolerance);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << "element " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeGemvTest,
    testing::Values(GemvCase{"one_piece", 1, 5, 8, false, GemvOutput::bf16},
                    GemvCase{"odd_n_bf16", 1, 333, 136, false, GemvOutput::bf16},
                    GemvCase{"odd_n_add", 3, 333, 136, false, GemvOutput::f32_add},
                    GemvCase{"past_one_round", 2, 77, 2056, false, GemvOutput::f32_add},
                    GemvCase{"model_qkv", 1, 6144, 2048, true, GemvOutput::bf16},
                    GemvCase{"model_o", 1, 2048, 2048, false, GemvOutput::f32_add},
                    GemvCase{"decode_gates_store", 1, 5632, 2048, false, GemvOutput::f32},
                    GemvCase{"odd_rows_store", 3, 333, 136, true, GemvOutput::f32},
                    GemvCase{"four_rows_norm", 4, 1001, 4096, true, GemvOutput::bf16},
                    GemvCase{"two_rows_norm_add", 2, 9, 24, true, GemvOutput::f32_add},
                    GemvCase{"many_loads_a_block", 3, 40000, 64, false, GemvOutput::bf16}),
    [](const testing::TestParamInfo<GemvCase>& info) { return info.param.name; });

struct TailCase {
  std::string name;
  int32_t rows, n, k;
};

class DecodeGemvTailTest : public test::CudaTest<testing::TestWithParam<TailCase>> {};

// Three calls in a row add into y; after each, normed must be the RMSNorm of y as it then is (float64
// here, from the y the GPU holds) in every element: normed starts each call as NaN, and a counter
// not left at zero by the call before would make no block the last one.
TEST_P(DecodeGemvTailTest, NormalizesYAfterEveryBlockAdded) {
  const TailCase& c = GetParam();
  const uint64_t seed = static_cast<uint64_t>(c.rows * 131 + c.n * 7 + c.k);
  const std::vector<float> w = rounded_normal(int64_t{c.n} * c.k, 0.05, seed);
  const std::vector<float> x = rounded_normal(int64_t{c.rows} * c.k, 1.0, seed + 1);
  const std::vector<float> norm_weight = make_normal(c.n, 1.0, seed + 2);
  const std::vector<float> y_start = make_normal(int64_t{c.rows} * c.n, 3.0, seed + 3);
  const float eps = 1e-5f;
  const cuda::DeviceArray<bf16> w_device = cuda::upload_bf16(w.data(), w.size());
  const cuda::DeviceArray<bf16> x_device = cuda::upload_bf16(x.data(), x.size());
  cuda::DeviceArray<float> y = cuda::make_device_array<float>(y_start.size());
  cuda::DeviceArray<float> norm_device = cuda::make_device_array<float>(norm_weight.size());
  cuda::DeviceArray<unsigned int> arrivals = cuda::make_device_array<unsigned int>(1);
  cuda::copy_to_device(y.get(), y_start.data(), y_start.size() * sizeof(float));
  cuda::copy_to_device(norm_device.get(), norm_weight.data(), norm_weight.size() * sizeof(float));
  const unsigned int zero = 0;
  cuda::copy_to_device(arrivals.get(), &zero, sizeof(zero));
  const std::vector<float> poison(y_start.size(), std::numeric_limits<float>::quiet_NaN());
  for (int call = 0; call < 3; ++call) {
    const cuda::DeviceArray<bf16> normed = cuda::upload_bf16(poison.data(), poison.size());
    cuda::decode_gemv(c.rows, c.n, c.k, cuda::GemvInput::rows(x_device.get()), w_device.get(), y.get(),
                      GemvOutput::f32_add, nullptr, {norm_device.get(), eps, normed.get(), arrivals.get()});
    std::vector<float> y_now(y_start.size());
    cuda::copy_to_host(y_now.data(), y.get(), y_now.size() * sizeof(float));
    const std::vector<float> got = cuda::download_bf16(normed.get(), y_now.size());
    const std::vector<double> expected = ref::rms_norm(y_now.data(), c.rows, c.n, norm_weight.data(), eps);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << "call " << call << ", element " << i;
    // bf16 rounding of each element: <= 2^-9 relative.
    EXPECT_LT(relative_l2_error(got.data(), expected.data(), got.size()), 3e-3) << "call " << call;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DecodeGemvTailTest,
                         testing::Values(TailCase{"one_row_one_block", 1, 8, 64}, TailCase{"odd_rows", 3, 1000, 136},
                                         TailCase{"model_o", 1, 2048, 2048}, TailCase{"four_rows", 4, 520, 2056}),
                         [](const testing::TestParamInfo<TailCase>& info) { return info.param.name; });

class DecodeGemvRefusal : public test::CudaTest<> {};

TEST_F(DecodeGemvRefusal, NamesTheProblem) {
  const cuda::DeviceArray<bf16> w = cuda::make_device_array<bf16>(64 * 64);
  const cuda::DeviceArray<bf16> x = cuda::make_device_array<bf16>(8 * 64);
  cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(8 * 64);
  const auto input = cuda::GemvInput::rows(x.get());
  EXPECT_THROW(cuda::decode_gemv(0, 64, 64, input, w.get(), y.get(), GemvOutput::bf16, nullptr), Error);
  EXPECT_THROW(cuda::decode_gemv(5, 64, 64, input, w.get(), y.get(), GemvOutput::bf16, nullptr), Error);
  EXPECT_THROW(cuda::decode_gemv(1, 64, 60, input, w.get(), y.get(), GemvOutput::bf16, nullptr), Error);
  EXPECT_THROW(cuda::decode_gemv(1, 64, 64, cuda::GemvInput{}, w.get(), y.get(), GemvOutput::bf16, nullptr), Error);
  EXPECT_THROW(cuda::decode_gemv(1, 63, 64, cuda::GemvInput::rows(x.get() + 1), w.get(), y.get(), GemvOutput::bf16,
                                 nullptr),
               Error);
  cuda::DeviceArray<unsigned int> arrivals = cuda::make_device_array<unsigned int>(1);
  const cuda::DeviceArray<float> norm = cuda::make_device_array<float>(64);
  // The tail needs the fp32 output, N a multiple of 8, a weight and an output.
  EXPECT_THROW(cuda::decode_gemv(1, 64, 64, input, w.get(), y.get(), GemvOutput::bf16, nullptr,
                                 {norm.get(), 1e-5f, y.get(), arrivals.get()}),
               Error);
  EXPECT_THROW(cuda::decode_gemv(1, 60, 64, input, w.get(), y.get(), GemvOutput::f32_add, nullptr,
                                 {norm.get(), 1e-5f, y.get(), arrivals.get()}),
               Error);
  EXPECT_THROW(cuda::decode_gemv(1, 64, 64, input, w.get(), y.get(), GemvOutput::f32_add, nullptr,
                                 {nullptr, 1e-5f, y.get(), arrivals.get()}),
               Error);
}

}  // namespace
}  // namespace twell
