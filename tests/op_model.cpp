// Harness ops of the model's steps beside the FFN: the decode projection (GEMV, with its optional
// RMSNorm of the input and of the sum), RoPE + attention over the KV cache, and the FFN's residual
// add fused into the next RMSNorm. Each run_* compares
// one backend's op on one case with the float64 reference and says what differs; the TEST_Ps run
// every registered backend that has the op over the sweeps, and OpHarnessModel shows the checks
// fail on broken ops. Only the CUDA backend has these ops: the CPU model runs its projections
// through OpenBLAS and its attention through cpu::causal_attention, tested in their own files.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention_test_support.h"
#include "op_harness.h"
#include "twell/bench_record.h"
#include "twell/bf16.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell::test {
namespace {

struct ProjectionCase {
  int64_t rows;              // M <= 4
  int32_t n, k;              // W [N, K], both multiples of 8
  bool input_norm, output_norm;
  uint64_t seed;
  std::string name() const {
    return "M" + std::to_string(rows) + "_N" + std::to_string(n) + "_K" + std::to_string(k) +
           (input_norm ? "_normin" : "") + (output_norm ? "_normout" : "") + "_s" + std::to_string(seed);
  }
};

// One piece of K (8 columns) to more than one round of loads; N smaller than a block's share, odd
// multiples of 8, and the 2B model's O projection; every row count.
std::vector<ProjectionCase> projection_cases() {
  return {{1, 8, 8, false, false, 1},      {1, 8, 64, false, true, 2},       {2, 336, 136, true, false, 3},
          {3, 1000, 136, false, true, 4},  {4, 520, 2056, true, true, 5},    {1, 2048, 2048, false, true, 6},
          {2, 6144, 512, true, false, 7},  {4, 40000, 64, false, false, 8}};
}

testing::AssertionResult run_decode_projection(const FfnBackend& backend, const ProjectionCase& c) {
  const float eps = 1e-5f;
  std::vector<float> x = make_normal(c.rows * c.k, 3.0, c.seed), w = make_normal(int64_t{c.n} * c.k, 0.05, c.seed + 1);
  for (float& v : x) v = round_to_bf16(v);  // the kernel's inputs are bf16: the comparison is of its arithmetic
  for (float& v : w) v = round_to_bf16(v);
  const std::vector<float> input_norm = make_normal(c.k, 1.0, c.seed + 2), output_norm = make_normal(c.n, 1.0, c.seed + 3);
  const std::vector<float> y_start = make_normal(c.rows * c.n, 1.0, c.seed + 4);
  std::vector<float> y = y_start, normed;
  poison(normed, y.size());
  backend.decode_projection({x.data(), c.rows, w.data(), c.n, c.k, c.input_norm ? input_norm.data() : nullptr,
                             c.output_norm ? output_norm.data() : nullptr, eps, y.data(), normed.data()});

  std::vector<float> x_used = x;  // the input as the reference multiplies it
  if (c.input_norm) {
    const std::vector<double> normalized = ref::rms_norm(x.data(), c.rows, c.k, input_norm.data(), eps);
    for (size_t i = 0; i < x_used.size(); ++i) x_used[i] = static_cast<float>(normalized[i]);
  }
  std::vector<double> expected(y.size());
  for (int64_t m = 0; m < c.rows; ++m)
    for (int32_t j = 0; j < c.n; ++j) {
      double sum = y_start[m * c.n + j];
      for (int32_t k = 0; k < c.k; ++k) sum += double{x_used[m * c.k + k]} * w[int64_t{j} * c.k + k];
      expected[m * c.n + j] = sum;
    }
  // fp32 sums of exact bf16 products: ~1e-6 relative. A normalized input is rounded to bf16 by the
  // kernel (2^-9 of each element at most), which moves y by ~1e-3 of the products' part.
  const testing::AssertionResult y_check =
      near_relative_l2("y", y.data(), expected.data(), expected.size(), c.input_norm ? 2e-3 : 1e-5);
  if (!y_check || !c.output_norm) return y_check;
  // normed from the y the backend returned (its own error is checked above), rounded to bf16 once.
  const std::vector<double> normed_expected = ref::rms_norm(y.data(), c.rows, c.n, output_norm.data(), eps);
  return near_relative_l2("normed", normed.data(), normed_expected.data(), normed_expected.size(), 3e-3);
}

struct AttentionCase {
  int32_t batch, n_heads, n_kv_heads, head_dim, stride, length;  // length = positions cached before
  bool bias;
  float rope_theta;
  uint64_t seed;
  std::string name() const {
    return "B" + std::to_string(batch) + "_H" + std::to_string(n_heads) + "_KV" + std::to_string(n_kv_heads) + "_Dh" +
           std::to_string(head_dim) + "_S" + std::to_string(stride) + "_L" + std::to_string(length) +
           (bias ? "_bias" : "") + "_s" + std::to_string(seed);
  }
  ref::CachedAttentionShape shape() const { return {batch, 1, n_heads, n_kv_heads, head_dim, stride, length}; }
};

// Every supported Dh, GQA groups 1, 2 and 4, one and three sequences, empty to long caches.
std::vector<AttentionCase> attention_cases() {
  return {{1, 2, 2, 8, 3, 0, false, 1e4f, 1},    {1, 4, 2, 16, 20, 17, true, 1e4f, 2},
          {3, 8, 2, 32, 40, 33, true, 1e6f, 3},  {1, 32, 32, 64, 200, 192, false, 1e4f, 4},
          {2, 4, 1, 128, 1030, 1024, true, 1e4f, 5}, {1, 2, 2, 256, 9, 8, false, 1e4f, 6},
          {1, 4, 4, 64, 4100, 4096, false, 5e5f, 7}};
}

testing::AssertionResult run_decode_attention(const FfnBackend& backend, const AttentionCase& c) {
  const ref::CachedAttentionShape shape = c.shape();
  const int64_t width = int64_t{c.n_heads + 2 * c.n_kv_heads} * c.head_dim;
  const int64_t cache = int64_t{c.batch} * c.n_kv_heads * c.stride * c.head_dim;
  const std::vector<float> qkv = random_bf16(c.batch * width, c.seed);
  const std::vector<float> bias = c.bias ? make_normal(width, 0.5, c.seed + 1) : std::vector<float>{};
  std::vector<float> keys = random_bf16(cache, c.seed + 2), values = random_bf16(cache, c.seed + 3);
  // The new position and those after it are NaN: the op must take the new key and value from qkv.
  for (int64_t e = 0; e < cache; ++e)
    if (e / c.head_dim % c.stride >= c.length) keys[e] = values[e] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out;
  poison(out, static_cast<size_t>(int64_t{c.batch} * c.n_heads * c.head_dim));
  backend.decode_attention(qkv.data(), c.bias ? bias.data() : nullptr, keys.data(), values.data(), shape,
                           c.rope_theta, out.data());
  const std::vector<double> expected =
      ref::decode_attention_rope(qkv.data(), c.bias ? bias.data() : nullptr, keys, values, shape, c.rope_theta,
                                 1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  // The rotated query, new key and value are bf16 as a cache holds them, and so is the output: the
  // bound of tests/test_decode_attention_cuda.cpp (kReferenceTolerance).
  return near_relative_l2("out", out.data(), expected.data(), expected.size(), 1e-2);
}

struct ResidualNormCase {
  int64_t rows;
  int32_t d;
  uint64_t seed;
  std::string name() const {
    return "M" + std::to_string(rows) + "_D" + std::to_string(d) + "_s" + std::to_string(seed);
  }
};

// D under a block's width, odd, past one round of the block's unrolled loads, and the 2B model's.
std::vector<ResidualNormCase> residual_norm_cases() {
  return {{1, 8, 1}, {3, 100, 2}, {5, 1001, 3}, {17, 2048, 4}, {2, 4104, 5}, {1, 8191, 6}};
}

testing::AssertionResult run_residual_norm(const FfnBackend& backend, const ResidualNormCase& c) {
  const float eps = 1e-5f;
  const size_t count = static_cast<size_t>(c.rows) * c.d;
  const std::vector<float> hidden_start = make_normal(static_cast<int64_t>(count), 2.0, c.seed);
  std::vector<float> y = make_normal(static_cast<int64_t>(count), 1.0, c.seed + 1);
  for (float& v : y) v = round_to_bf16(v);  // the op's y is bf16
  const std::vector<float> weight = make_normal(c.d, 1.0, c.seed + 2);
  std::vector<float> hidden = hidden_start, normed;
  poison(normed, count);
  backend.residual_norm({hidden.data(), y.data(), c.rows, c.d, weight.data(), eps, normed.data()});
  // The sum is one fp32 addition per element, so its bits are known exactly.
  for (size_t i = 0; i < count; ++i) {
    const float expected = hidden_start[i] + y[i];
    if (hidden[i] != expected)
      return testing::AssertionFailure() << "hidden[" << i << "] = " << hidden[i] << ", expected " << expected
                                         << " (the fp32 sum of " << hidden_start[i] << " and " << y[i] << ")";
  }
  const std::vector<double> expected = ref::rms_norm(hidden.data(), c.rows, c.d, weight.data(), eps);
  // fp32 sums of squares, the result rounded to bf16 once (2^-9 of an element at most).
  return near_relative_l2("normed", normed.data(), expected.data(), expected.size(), 3e-3);
}

using ProjectionTest = OpTestOf<ProjectionCase>;
TEST_P(ProjectionTest, MatchesReference) { EXPECT_TRUE(run_decode_projection(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, ProjectionTest,
                         testing::ValuesIn(backend_cases(&FfnBackend::decode_projection, projection_cases())),
                         backend_case_name<ProjectionCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ProjectionTest);

using AttentionTest = OpTestOf<AttentionCase>;
TEST_P(AttentionTest, MatchesReference) { EXPECT_TRUE(run_decode_attention(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, AttentionTest,
                         testing::ValuesIn(backend_cases(&FfnBackend::decode_attention, attention_cases())),
                         backend_case_name<AttentionCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(AttentionTest);

using ResidualNormTest = OpTestOf<ResidualNormCase>;
TEST_P(ResidualNormTest, MatchesReference) { EXPECT_TRUE(run_residual_norm(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, ResidualNormTest,
                         testing::ValuesIn(backend_cases(&FfnBackend::residual_norm, residual_norm_cases())),
                         backend_case_name<ResidualNormCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ResidualNormTest);

// ---- The checks can fail: a backend built from the reference passes, broken variants do not ----

FfnBackend reference_backend() {
  FfnBackend backend;
  backend.name = "reference";
  backend.decode_projection = [](const DecodeProjectionCall& c) {
    std::vector<double> x(c.x, c.x + c.rows * c.k);
    if (c.input_norm) x = ref::rms_norm(c.x, c.rows, c.k, c.input_norm, c.eps);
    for (int64_t m = 0; m < c.rows; ++m)
      for (int32_t j = 0; j < c.n; ++j) {
        double sum = c.y[m * c.n + j];
        for (int32_t k = 0; k < c.k; ++k) sum += x[m * c.k + k] * c.w[int64_t{j} * c.k + k];
        c.y[m * c.n + j] = static_cast<float>(sum);
      }
    if (c.output_norm) copy_to_float(ref::rms_norm(c.y, c.rows, c.n, c.output_norm, c.eps), c.normed);
  };
  backend.decode_attention = [](const float* qkv, const float* bias, const float* keys, const float* values,
                                const ref::CachedAttentionShape& s, float rope_theta, float* out) {
    const size_t cache = static_cast<size_t>(s.batch) * s.n_kv_heads * s.stride * s.head_dim;
    copy_to_float(ref::decode_attention_rope(qkv, bias, std::vector<float>(keys, keys + cache),
                                             std::vector<float>(values, values + cache), s, rope_theta,
                                             1.0 / std::sqrt(static_cast<double>(s.head_dim))),
                  out);
  };
  backend.residual_norm = [](const ResidualNormCall& c) {
    for (int64_t i = 0; i < c.rows * c.d; ++i) c.hidden[i] += c.y[i];
    copy_to_float(ref::rms_norm(c.hidden, c.rows, c.d, c.weight, c.eps), c.normed);
  };
  return backend;
}

TEST(OpHarnessModel, ReferenceBackendPasses) {
  const FfnBackend backend = reference_backend();
  for (const ProjectionCase& c : projection_cases())
    EXPECT_TRUE(run_decode_projection(backend, c)) << c.name();
  for (const AttentionCase& c : attention_cases()) EXPECT_TRUE(run_decode_attention(backend, c)) << c.name();
  for (const ResidualNormCase& c : residual_norm_cases()) EXPECT_TRUE(run_residual_norm(backend, c)) << c.name();
}

TEST(OpHarnessModel, BrokenOpsFail) {
  FfnBackend backend = reference_backend();
  const auto projection = backend.decode_projection;
  const ProjectionCase both{3, 1000, 136, true, true, 4};
  backend.decode_projection = [&](const DecodeProjectionCall& c) {
    projection(c);
    c.y[5] += 0.05f;  // one element of 3000 off by 0.05 (y ~ 2): ~5e-4 relative L2, against the 1e-5 bound
  };
  EXPECT_FALSE(run_decode_projection(backend, {3, 1000, 136, false, false, 4}));
  backend.decode_projection = [&](const DecodeProjectionCall& c) {
    projection(c);
    c.normed[c.rows * c.n - 1] = std::numeric_limits<float>::quiet_NaN();  // the last element left unwritten
  };
  EXPECT_FALSE(run_decode_projection(backend, both));
  backend.decode_projection = [&](const DecodeProjectionCall& c) {  // the input not normalized
    projection({c.x, c.rows, c.w, c.n, c.k, nullptr, c.output_norm, c.eps, c.y, c.normed});
  };
  EXPECT_FALSE(run_decode_projection(backend, both));

  const auto attention = backend.decode_attention;
  const AttentionCase gqa{3, 8, 2, 32, 40, 33, true, 1e6f, 3};
  backend.decode_attention = [&](const float* qkv, const float* bias, const float* keys, const float* values,
                                 const ref::CachedAttentionShape& s, float theta, float* out) {
    attention(qkv, bias, keys, values, s, theta * 2, out);  // wrong angles
  };
  EXPECT_FALSE(run_decode_attention(backend, gqa));
  backend.decode_attention = [&](const float* qkv, const float* bias, const float* keys, const float* values,
                                 const ref::CachedAttentionShape& s, float theta, float* out) {
    attention(qkv, nullptr, keys, values, s, theta, out);  // the bias ignored
  };
  EXPECT_FALSE(run_decode_attention(backend, gqa));
  backend.decode_attention = [&](const float* qkv, const float* bias, const float* keys, const float* values,
                                 const ref::CachedAttentionShape& s, float theta, float* out) {
    ref::CachedAttentionShape earlier = s;  // the new position left out: the query sees one fewer
    earlier.start = s.start - 1;
    attention(qkv, bias, keys, values, earlier, theta, out);
  };
  EXPECT_FALSE(run_decode_attention(backend, gqa));

  const auto residual_norm = backend.residual_norm;
  const ResidualNormCase rows{5, 1001, 3};
  backend.residual_norm = [&](const ResidualNormCall& c) {  // the norm of the stream before the add
    std::vector<float> before(c.hidden, c.hidden + c.rows * c.d);
    residual_norm(c);
    copy_to_float(ref::rms_norm(before.data(), c.rows, c.d, c.weight, c.eps), c.normed);
  };
  EXPECT_FALSE(run_residual_norm(backend, rows));
  backend.residual_norm = [&](const ResidualNormCall& c) {  // y added twice to one element
    residual_norm(c);
    c.hidden[c.rows * c.d / 2] += c.y[c.rows * c.d / 2];
  };
  EXPECT_FALSE(run_residual_norm(backend, rows));
  backend.residual_norm = [&](const ResidualNormCall& c) {  // the last row's norm left unwritten
    std::vector<float> normed(c.normed, c.normed + c.rows * c.d);
    residual_norm(c);
    std::copy(normed.end() - c.d, normed.end(), c.normed + (c.rows - 1) * c.d);
  };
  EXPECT_FALSE(run_residual_norm(backend, rows));
}

}  // namespace
}  // namespace twell::test
