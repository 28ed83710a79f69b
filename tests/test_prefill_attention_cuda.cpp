// The CUDA prefill attention (src/cuda/prefill_attention.h), the fused kernel and the GEMM path,
// against the float64 reference (ref::causal_attention) on random q, keys and values: odd n, a
// cache already holding `start` positions, GQA groups 1 and 4, batches of 3. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "attention_test_support.h"
#include "cuda/prefill_attention.h"
#include "cuda_test_support.h"
#include "twell/error.h"
#include "twell/workload.h"

namespace twell {
namespace {

using cuda::model_kernels::AttentionShape;

struct AttentionCase {
  std::string name;
  int32_t batch, tokens, n_heads, n_kv_heads, head_dim, start;
};

// Both paths round the probabilities P and the output to bf16 once (inputs are bf16 values, exact in
// the reference): about 2e-3 relative L2 expected. A position leaking across the causal mask moves
// a short row (few visible positions) by far more than the per-row bound.
constexpr double kTolerance = 1e-2;
constexpr double kRowTolerance = 5e-2;

struct AttentionInputs {
  AttentionShape shape;
  int32_t start;
  std::vector<float> q, keys, values;  // [B, H_q, n, Dh], [B, H_kv, cap, Dh] twice
  std::vector<double> expected;        // [B·n, H_q·Dh]
};

// The cache holds random keys and values at positions < start + n and `poison` after them (up to a
// capacity 11 past the end, rounded to 8): the kernels must not read or must not use those.
AttentionInputs make_inputs(const AttentionCase& c, float poison, uint64_t seed) {
  const int32_t used = c.start + c.tokens;
  const int32_t capacity = (used + 11 + 7) / 8 * 8;
  AttentionInputs in{{c.batch, c.tokens, c.n_heads, c.n_kv_heads, c.head_dim, capacity}, c.start, {}, {}, {}, {}};
  in.q = test::random_bf16(int64_t{c.batch} * c.n_heads * c.tokens * c.head_dim, seed);
  const int64_t cache_elements = int64_t{c.batch} * c.n_kv_heads * capacity * c.head_dim;
  in.keys = test::random_bf16(cache_elements, seed + 1);
  in.values = test::random_bf16(cache_elements, seed + 2);
  for (int64_t e = 0; e < cache_elements; ++e)
    if ((e / c.head_dim) % capacity >= used) in.keys[e] = in.values[e] = poison;
  const ref::CachedAttentionShape ref_shape{c.batch, c.tokens, c.n_heads, c.n_kv_heads, c.head_dim, capacity, c.start};
  in.expected = ref::causal_attention(in.q.data(), in.keys.data(), in.values.data(), ref_shape,
                                      1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  return in;
}

struct DeviceInputs {
  cuda::DeviceArray<bf16> q, keys, values, out;
};

DeviceInputs upload(const AttentionInputs& in) {
  DeviceInputs d{cuda::upload_bf16(in.q.data(), in.q.size()), cuda::upload_bf16(in.keys.data(), in.keys.size()),
                 cuda::upload_bf16(in.values.data(), in.values.size()),
                 cuda::make_device_array<bf16>(in.expected.size())};
  TWELL_CUDA_CHECK(cudaMemset(d.out.get(), 0xff, in.expected.size() * sizeof(bf16)));  // NaN until written
  return d;
}

void expect_close(const AttentionInputs& in, const cuda::DeviceArray<bf16>& out, const char* path) {
  test::expect_attention_close(cuda::download_bf16(out.get(), in.expected.size()), in.expected, in.shape.head_dim,
                               kTolerance, kRowTolerance, path);
}

class PrefillAttention : public test::CudaTest<::testing::TestWithParam<AttentionCase>> {};

// Cache positions past start + n hold NaN: the fused kernel reads none of them.
TEST_P(PrefillAttention, FusedMatchesReference) {
  const AttentionCase& c = GetParam();
  const AttentionInputs in = make_inputs(c, std::numeric_limits<float>::quiet_NaN(), 100 + c.head_dim + c.start);
  DeviceInputs d = upload(in);
  cuda::fused_prefill_attention(d.q.get(), d.keys.get(), d.values.get(), in.shape, in.start,
                                1.0f / std::sqrt(static_cast<float>(c.head_dim)), d.out.get(), nullptr);
  TWELL_CUDA_CHECK(cudaDeviceSynchronize());
  expect_close(in, d.out, "fused");
}

// Past start + n the cache holds large finite values: the GEMM path reads them (up to the next
// multiple of 8) with probability 0.
TEST_P(PrefillAttention, GemmPathMatchesReference) {
  const AttentionCase& c = GetParam();
  const AttentionInputs in = make_inputs(c, 1000.0f, 200 + c.head_dim + c.start);
  DeviceInputs d = upload(in);
  cuda::RowMajorGemm gemm;
  cuda::GemmPrefillAttention attention;
  attention.run(gemm, d.q.get(), d.keys.get(), d.values.get(), in.shape, in.start,
                1.0f / std::sqrt(static_cast<float>(c.head_dim)), d.out.get(), nullptr);
  TWELL_CUDA_CHECK(cudaDeviceSynchronize());
  expect_close(in, d.out, "gemm");
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrefillAttention,
                         ::testing::Values(AttentionCase{"dh64_group1", 3, 77, 4, 4, 64, 0},
                                           AttentionCase{"dh64_group4_start", 3, 131, 8, 2, 64, 29},
                                           AttentionCase{"dh128_group4", 3, 45, 4, 1, 128, 0},
                                           AttentionCase{"dh128_group1_start", 3, 70, 2, 2, 128, 101},
                                           AttentionCase{"dh32_group4_start", 3, 200, 4, 1, 32, 5},
                                           AttentionCase{"dh16_group2", 3, 33, 4, 2, 16, 0},
                                           AttentionCase{"one_token_start", 3, 1, 4, 1, 64, 17}),
                         [](const auto& info) { return info.param.name; });

TEST(PrefillAttentionRefusals, NameTheProblem) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device is available";
  const AttentionShape dh80{1, 4, 2, 2, 80, 8};
  EXPECT_FALSE(cuda::fused_prefill_attention_supports(80));
  EXPECT_THROW(cuda::fused_prefill_attention(nullptr, nullptr, nullptr, dh80, 0, 1.0f, nullptr, nullptr), Error);
  const AttentionShape past_cache{1, 6, 2, 2, 64, 8};  // start 3 + 6 tokens > 8 positions
  EXPECT_THROW(cuda::fused_prefill_attention(nullptr, nullptr, nullptr, past_cache, 3, 1.0f, nullptr, nullptr), Error);
  const AttentionShape bad_group{1, 4, 3, 2, 64, 8};
  EXPECT_THROW(cuda::fused_prefill_attention(nullptr, nullptr, nullptr, bad_group, 0, 1.0f, nullptr, nullptr), Error);
  const AttentionShape past_grid{1 << 23, 2048, 32, 32, 64, 2048};  // 2^32 blocks of 128 tokens
  EXPECT_THROW(cuda::fused_prefill_attention(nullptr, nullptr, nullptr, past_grid, 0, 1.0f, nullptr, nullptr), Error);
}

}  // namespace
}  // namespace twell
