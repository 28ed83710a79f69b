// The CUDA model runtime's row kernels (src/cuda/model_kernels.h):
// - add_rms_norm must leave the same bits as add_residual followed by rms_norm (the runtime swaps
//   one for the other between layers); against float64 it is the harness op Ops/ResidualNormTest
//   (tests/op_model.cpp);
// - add_residual must add every element once, including a count not a multiple of its 4-element
//   pieces and one past a single pass of its grid;
// - a prefill's qkv_rope against float64 RoPE, over several sequences of several tokens, touching
//   no cache position outside the step's. (At one token per
//   sequence its bits are also checked against decode_attention_rope's: DecodeAttentionRope.)
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_utils.h"
#include "cuda/model_kernels.h"
#include "cuda_test_support.h"
#include "op_harness.h"
#include "twell/bf16.h"
#include "twell/reference.h"
#include "twell/cuda.h"
#include "twell/workload.h"

namespace twell {
namespace {

namespace mk = cuda::model_kernels;

class ModelRowKernels : public test::CudaTest<> {};

std::vector<float> download_floats(const cuda::DeviceArray<float>& device, size_t count) {
  std::vector<float> host(count);
  cuda::copy_to_host(host.data(), device.get(), count * sizeof(float));
  return host;
}

cuda::DeviceArray<float> upload_floats(const std::vector<float>& host) {
  cuda::DeviceArray<float> device = cuda::make_device_array<float>(host.size());
  cuda::copy_to_device(device.get(), host.data(), host.size() * sizeof(float));
  return device;
}

TEST_F(ModelRowKernels, FusedNormEqualsAddThenNorm) {
  for (const auto [rows, d] : {std::pair<int64_t, int32_t>{37, 2048}, {5, 1001}, {1, 8}}) {
    SCOPED_TRACE(testing::Message() << "rows " << rows << ", D " << d);
    const size_t count = static_cast<size_t>(rows) * d;
    const std::vector<float> hidden = make_normal(static_cast<int64_t>(count), 2.0, 7 + d);
    const std::vector<float> y = make_normal(static_cast<int64_t>(count), 1.0, 8 + d);
    const std::vector<float> weight = make_normal(d, 1.0, 9 + d);
    const cuda::DeviceArray<bf16> y_device = cuda::upload_bf16(y.data(), count);
    const cuda::DeviceArray<float> weight_device = upload_floats(weight);
    const std::vector<float> poison(count, std::numeric_limits<float>::quiet_NaN());

    const cuda::DeviceArray<float> plain = upload_floats(hidden), fused = upload_floats(hidden);
    const cuda::DeviceArray<bf16> plain_normed = cuda::upload_bf16(poison.data(), count);
    const cuda::DeviceArray<bf16> fused_normed = cuda::upload_bf16(poison.data(), count);
    mk::add_residual(plain.get(), y_device.get(), static_cast<int64_t>(count), nullptr);
    mk::rms_norm(plain.get(), rows, 0, 1, d, weight_device.get(), 1e-6f, plain_normed.get(), nullptr);
    mk::add_rms_norm(fused.get(), y_device.get(), rows, d, weight_device.get(), 1e-6f, fused_normed.get(), nullptr);

    const std::vector<float> plain_sum = download_floats(plain, count), fused_sum = download_floats(fused, count);
    const std::vector<float> plain_out = cuda::download_bf16(plain_normed.get(), count);
    const std::vector<float> fused_out = cuda::download_bf16(fused_normed.get(), count);
    int64_t sums_differ = 0, norms_differ = 0;
    for (size_t i = 0; i < count; ++i) {
      sums_differ += plain_sum[i] != fused_sum[i];
      norms_differ += !(plain_out[i] == fused_out[i]);  // a NaN left in either counts
    }
    EXPECT_EQ(sums_differ, 0) << "elements of the summed stream that differ";
    EXPECT_EQ(norms_differ, 0) << "normalized elements that differ";
  }
}

TEST_F(ModelRowKernels, AddResidualAddsEveryElementOnce) {
  // 4·k + 3 elements: pieces and a tail; the larger one needs more than one pass of the grid
  // (at most 32 blocks of 256 threads per SM, 4 elements each).
  const int64_t one_pass = int64_t{cuda::device_facts().sm_count} * 32 * 256 * 4;
  for (const int64_t count : {int64_t{4003}, one_pass * 2 + 3}) {
    SCOPED_TRACE(testing::Message() << count << " elements");
    const std::vector<float> hidden = make_normal(count, 2.0, 21);
    std::vector<float> y = make_normal(count, 1.0, 22);
    for (float& v : y) v = round_to_bf16(v);
    const cuda::DeviceArray<float> device = upload_floats(hidden);
    const cuda::DeviceArray<bf16> y_device = cuda::upload_bf16(y.data(), static_cast<size_t>(count));
    mk::add_residual(device.get(), y_device.get(), count, nullptr);
    const std::vector<float> got = download_floats(device, static_cast<size_t>(count));
    int64_t wrong = 0, first_wrong = -1;
    for (int64_t i = 0; i < count; ++i)
      if (got[i] != hidden[i] + y[i] && wrong++ == 0) first_wrong = i;
    EXPECT_EQ(wrong, 0) << "elements not equal to hidden + y; the first at " << first_wrong;
  }
}

struct RopeCase {
  int32_t batch, tokens, n_heads, n_kv_heads, head_dim, start;
  bool bias;
  float rope_theta;
};

TEST_F(ModelRowKernels, QkvRopeMatchesReference) {
  // Dh 8 to 128, GQA, with and without a bias, starts from 0 to 100.
  for (const RopeCase& c : {RopeCase{3, 37, 4, 2, 16, 5, true, 1e4f}, RopeCase{2, 19, 8, 8, 64, 0, false, 5e5f},
                            RopeCase{1, 9, 2, 1, 128, 100, true, 1e6f}, RopeCase{2, 3, 4, 4, 8, 1, false, 1e4f}}) {
    const std::string name = "B" + std::to_string(c.batch) + " n" + std::to_string(c.tokens) + " Dh" +
                             std::to_string(c.head_dim) + " start " + std::to_string(c.start);
    SCOPED_TRACE(name);
    const int32_t stride = c.start + c.tokens + 3, dh = c.head_dim;
    const mk::AttentionShape shape{c.batch, c.tokens, c.n_heads, c.n_kv_heads, dh, stride};
    const int64_t rows = int64_t{c.batch} * c.tokens, width = int64_t{c.n_heads + 2 * c.n_kv_heads} * dh;
    const size_t cache_count = static_cast<size_t>(c.batch) * c.n_kv_heads * stride * dh;
    std::vector<float> qkv = make_normal(rows * width, 1.0, 31 + dh);
    for (float& v : qkv) v = round_to_bf16(v);
    const std::vector<float> bias = c.bias ? make_normal(width, 0.5, 32 + dh) : std::vector<float>(width, 0.0f);
    const float sentinel = 7.0f;  // every cache position outside the step's must keep it
    const std::vector<float> cache_start(cache_count, sentinel);
    const std::vector<float> poison(static_cast<size_t>(rows) * c.n_heads * dh, std::numeric_limits<float>::quiet_NaN());

    const cuda::DeviceArray<bf16> qkv_device = cuda::upload_bf16(qkv.data(), qkv.size());
    const cuda::DeviceArray<float> bias_device = upload_floats(bias);
    const int32_t start = c.start;
    cuda::DeviceArray<int32_t> length = cuda::make_device_array<int32_t>(1);
    cuda::copy_to_device(length.get(), &start, sizeof start);
    const cuda::DeviceArray<bf16> q = cuda::upload_bf16(poison.data(), poison.size());
    const cuda::DeviceArray<bf16> keys = cuda::upload_bf16(cache_start.data(), cache_count);
    const cuda::DeviceArray<bf16> values = cuda::upload_bf16(cache_start.data(), cache_count);
    mk::qkv_rope(qkv_device.get(), c.bias ? bias_device.get() : nullptr, shape, length.get(), c.rope_theta, q.get(),
                 keys.get(), values.get(), nullptr);
    const std::vector<float> q_got = cuda::download_bf16(q.get(), poison.size());
    const std::vector<float> keys_got = cuda::download_bf16(keys.get(), cache_count);
    const std::vector<float> values_got = cuda::download_bf16(values.get(), cache_count);

    std::vector<double> q_expected(q_got.size()), k_expected, k_got;
    int64_t values_wrong = 0, outside_touched = 0;
    for (int32_t b = 0; b < c.batch; ++b)
      for (int32_t t = 0; t < c.tokens; ++t) {
        const int64_t row = int64_t{b} * c.tokens + t;
        for (int32_t head = 0; head < c.n_heads + 2 * c.n_kv_heads; ++head) {
          std::vector<double> x(dh);
          for (int32_t d = 0; d < dh; ++d) {
            const int64_t column = int64_t{head} * dh + d;
            x[d] = double{static_cast<float>(qkv[row * width + column] + bias[column])};  // summed in fp32
          }
          if (head < c.n_heads) {
            ref::rope(x.data(), dh, c.start + t, c.rope_theta);
            for (int32_t d = 0; d < dh; ++d) q_expected[((int64_t{b} * c.n_heads + head) * c.tokens + t) * dh + d] = x[d];
            continue;
          }
          const bool is_key = head < c.n_heads + c.n_kv_heads;
          const int32_t kv_head = head - c.n_heads - (is_key ? 0 : c.n_kv_heads);
          const int64_t at = ((int64_t{b} * c.n_kv_heads + kv_head) * stride + c.start + t) * dh;
          if (is_key) {
            ref::rope(x.data(), dh, c.start + t, c.rope_theta);
            for (int32_t d = 0; d < dh; ++d) {
              k_expected.push_back(x[d]);
              k_got.push_back(keys_got[at + d]);
            }
          } else {
            for (int32_t d = 0; d < dh; ++d) values_wrong += values_got[at + d] != round_to_bf16(static_cast<float>(x[d]));
          }
        }
      }
    for (size_t e = 0; e < cache_count; ++e) {
      const int64_t position = static_cast<int64_t>(e) / dh % stride;
      if (position < c.start || position >= c.start + c.tokens)
        outside_touched += keys_got[e] != sentinel || values_got[e] != sentinel;
    }
    // One bf16 rounding of each element (2^-9 of it at most) over fp32 angles and products.
    EXPECT_TRUE(test::near_relative_l2("q", q_got.data(), q_expected.data(), q_expected.size(), 4e-3));
    const std::vector<float> k_got_floats(k_got.begin(), k_got.end());
    EXPECT_TRUE(test::near_relative_l2("keys", k_got_floats.data(), k_expected.data(), k_expected.size(), 4e-3));
    EXPECT_EQ(values_wrong, 0) << "cached values that are not the bf16 of qkv + bias";
    EXPECT_EQ(outside_touched, 0) << "cache elements outside the step's positions that changed";
  }
}

}  // namespace
}  // namespace twell
