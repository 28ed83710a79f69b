// The CPU causal attention (cpu::causal_attention, the model's attention over its KV cache) against
// the float64 reference (ref::causal_attention) on random q, keys and values: odd n, a cache already
// holding `start` positions, GQA groups 1, 2 and 4, Dh 8, 16, 64, 128 and an odd 13. The cache's
// positions past start + n hold NaN (they must not be read) and the output starts as NaN (every
// element must be written). One sequence: the CPU forward has no batch dimension.
//
// Not a case of the op harness (tests/op_harness.h): its ops, cases and workloads are the FFN's
// (x [M, D] and FfnWeights); attention shares only its checks (poison, near_relative_l2).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "op_harness.h"
#include "twell/cpu.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell {
namespace {

// fp32 against float64: the scores' dot products over Dh and the softmax sums over <= a few hundred
// positions, each a few ulps (6e-8) times sqrt(terms); measured <= 5e-7 over the cases below.
constexpr double kTolerance = 1e-5;
constexpr int32_t kPoisonedPositions = 5;  // cache positions past start + n, all NaN

struct AttentionCase {
  int32_t tokens, n_heads, n_kv_heads, head_dim, start;
  uint64_t seed;

  std::string name() const {
    return "n" + std::to_string(tokens) + "_Hq" + std::to_string(n_heads) + "_Hkv" + std::to_string(n_kv_heads) +
           "_dh" + std::to_string(head_dim) + "_start" + std::to_string(start);
  }
  cpu::AttentionShape shape() const { return {tokens, n_heads, n_kv_heads, head_dim, start}; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }
};

// q [n, H_q, Dh] and the cache [start + n + kPoisonedPositions, H_kv, Dh] in the model's layout, and
// the reference output [n, H_q·Dh]. Standard deviation 1.2: scores q·k/sqrt(Dh) of about 1.4, so the
// softmax rows are neither flat nor one-hot.
struct AttentionInputs {
  std::vector<float> q, keys, values;
  std::vector<double> expected;
};

std::vector<double> reference(const AttentionCase& c, const AttentionInputs& in) {
  const int32_t dh = c.head_dim, capacity = c.start + c.tokens + kPoisonedPositions;
  // The reference's layout is head-major: q [1, H_q, n, Dh], keys and values [1, H_kv, capacity, Dh].
  std::vector<float> q(in.q.size()), keys(in.keys.size()), values(in.values.size());
  for (int32_t t = 0; t < c.tokens; ++t)
    for (int32_t h = 0; h < c.n_heads; ++h)
      for (int32_t d = 0; d < dh; ++d)
        q[(int64_t{h} * c.tokens + t) * dh + d] = in.q[(int64_t{t} * c.n_heads + h) * dh + d];
  for (int32_t p = 0; p < capacity; ++p)
    for (int32_t h = 0; h < c.n_kv_heads; ++h)
      for (int32_t d = 0; d < dh; ++d) {
        const int64_t from = (int64_t{p} * c.n_kv_heads + h) * dh + d, to = (int64_t{h} * capacity + p) * dh + d;
        keys[to] = in.keys[from];
        values[to] = in.values[from];
      }
  const ref::CachedAttentionShape shape{1, c.tokens, c.n_heads, c.n_kv_heads, c.head_dim, capacity, c.start};
  return ref::causal_attention(q.data(), keys.data(), values.data(), shape, c.scale());
}

AttentionInputs make_inputs(const AttentionCase& c) {
  const int32_t used = c.start + c.tokens;
  const int64_t kv_row = int64_t{c.n_kv_heads} * c.head_dim;
  const size_t cache_elements = static_cast<size_t>((used + kPoisonedPositions) * kv_row);
  AttentionInputs in{make_normal(size_t{1} * c.tokens * c.n_heads * c.head_dim, 1.2, c.seed),
                     make_normal(cache_elements, 1.2, c.seed + 1), make_normal(cache_elements, 1.2, c.seed + 2), {}};
  for (size_t e = used * kv_row; e < cache_elements; ++e) in.keys[e] = in.values[e] = NAN;
  in.expected = reference(c, in);
  return in;
}

std::vector<float> run_cpu(const AttentionCase& c, const AttentionInputs& in, int threads) {
  std::vector<float> out;
  test::poison(out, in.expected.size());
  cpu::set_num_threads(threads);
  cpu::AttentionScratch scratch;
  cpu::causal_attention(in.q.data(), in.keys.data(), in.values.data(), c.shape(), c.scale(), out.data(), scratch);
  cpu::set_num_threads(0);
  return out;
}

// Fixed corners, then every (Dh, group) pair once with n and start sampled from odd lengths and
// continuations (seeded: the same cases every run, fresh inputs per case).
std::vector<AttentionCase> attention_cases() {
  std::vector<AttentionCase> cases = {
      {1, 4, 2, 64, 0, 1},     // the first token alone
      {1, 8, 2, 64, 255, 2},   // a decode step deep into the cache
      {257, 4, 4, 64, 0, 3},   // prefill, more than one block of queries
      {65, 8, 2, 128, 190, 4}, // a long continued prefill
  };
  const int32_t head_dims[] = {8, 16, 64, 128, 13};
  const int32_t groups[] = {1, 2, 4};
  const int32_t tokens[] = {1, 3, 7, 33, 97};
  const int32_t starts[] = {0, 1, 29, 150};
  uint64_t state = 12345;
  auto pick = [&state](int32_t count) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int32_t>((state >> 33) % count);
  };
  for (int32_t dh : head_dims)
    for (int32_t group : groups) {
      const int32_t n_kv_heads = 1 + pick(3);
      cases.push_back({tokens[pick(5)], n_kv_heads * group, n_kv_heads, dh, starts[pick(4)], 100 + cases.size()});
    }
  return cases;
}

class CpuCausalAttention : public testing::TestWithParam<AttentionCase> {};

TEST_P(CpuCausalAttention, MatchesReference) {
  const AttentionCase& c = GetParam();
  const AttentionInputs in = make_inputs(c);
  const std::vector<float> one_thread = run_cpu(c, in, 1);
  EXPECT_TRUE(test::near_relative_l2("out", one_thread.data(), in.expected.data(), in.expected.size(), kTolerance));
  // The split over threads changes no result: each output row is computed whole by one thread.
  const std::vector<float> three_threads = run_cpu(c, in, 3);
  EXPECT_EQ(0, std::memcmp(one_thread.data(), three_threads.data(), one_thread.size() * sizeof(float)))
      << "1 and 3 threads give different bits";
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuCausalAttention, testing::ValuesIn(attention_cases()),
                         [](const testing::TestParamInfo<AttentionCase>& info) { return info.param.name(); });

// The check can fail: an attention that lets every token see one position past its own (a causal
// mask off by one) is caught, even in long rows where the extra position is one of ~190.
TEST(CpuCausalAttentionCheck, CatchesAMaskOffByOne) {
  const AttentionCase c{9, 4, 2, 64, 190, 7};
  AttentionCase leaky = c;
  leaky.start += 1;  // token t sees positions 0 ..= start + t + 1
  AttentionInputs in = make_inputs(leaky);
  in.expected = reference(c, in);
  const std::vector<float> out = run_cpu(leaky, in, 1);
  EXPECT_FALSE(test::near_relative_l2("out", out.data(), in.expected.data(), in.expected.size(), kTolerance));
}

TEST(CpuCausalAttentionCheck, RefusesBadShapes) {
  const std::vector<float> buffer(64, 0.0f);
  std::vector<float> out(64);
  cpu::AttentionScratch scratch;
  auto run = [&](const cpu::AttentionShape& shape) {
    cpu::causal_attention(buffer.data(), buffer.data(), buffer.data(), shape, 1.0f, out.data(), scratch);
  };
  EXPECT_THROW(run({0, 2, 2, 8, 0}), Error);   // no tokens
  EXPECT_THROW(run({1, 3, 2, 8, 0}), Error);   // 3 query heads over 2 kv heads
  EXPECT_THROW(run({1, 2, 2, 0, 0}), Error);   // Dh 0
  EXPECT_THROW(run({1, 2, 2, 8, -1}), Error);  // negative start
}

}  // namespace
}  // namespace twell
