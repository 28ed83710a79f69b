// The reference ops checked against each other and against finite differences. Exact inputs
// (small multiples of 1/4) make every float64 sum exact and every gate exact in bf16, so ops that
// differ only in where the gate is rounded must agree bit for bit there.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell {
namespace {

// x in {-2..2} (x[:, 0] = 1), weights in {-2..2}/4: with D <= 32 every gate is a multiple of 1/4
// below 32 in magnitude, so 8 significant bits hold it exactly.
Workload exact_workload(int64_t rows, int32_t d_model, int32_t d_hidden, bool gated, uint64_t seed) {
  EXPECT_LE(d_model, 32) << "larger D would let gates outgrow bf16's 8 significant bits";
  std::mt19937_64 engine(seed);
  auto small = [&] { return static_cast<float>(static_cast<int>(engine() % 5) - 2); };
  Workload work;
  work.spec = WorkloadSpec{.rows = rows, .d_model = d_model, .d_hidden = d_hidden, .gated = gated, .seed = seed};
  work.x.resize(static_cast<size_t>(rows) * d_model);
  for (float& v : work.x) v = small();
  for (int64_t m = 0; m < rows; ++m) work.x[m * d_model] = 1.0f;
  FfnWeights& w = work.weights;
  w.d_model = d_model;
  w.d_hidden = d_hidden;
  w.gated = gated;
  const size_t count = static_cast<size_t>(d_hidden) * d_model;
  for (auto* matrix : {&w.gate, &w.up, &w.down}) {
    if (matrix == &w.gate && !gated) continue;
    matrix->resize(count);
    for (float& v : *matrix) v = small() / 4.0f;
  }
  return work;
}

std::vector<float> random_dy(int64_t rows, int32_t d_model, uint64_t seed) {
  std::vector<float> dy = make_activations(rows, d_model, seed);
  dy[0] = -0.75f;  // make_activations pins column 0 to 1; a cotangent need not
  return dy;
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

double l2_norm(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v * v;
  return std::sqrt(sum);
}

TEST(Reference, FfnFromTwellEqualsDenseOnExactInputs) {
  for (bool gated : {true, false})
    for (int32_t compression : {2, 8}) {
      SCOPED_TRACE(::testing::Message() << (gated ? "gated" : "non-gated") << " C=" << compression);
      // H = 300: a partial last tile; about half the gates are active, so C = 8 (16 slots) spills.
      const Workload work = exact_workload(7, 24, 300, gated, 5 + compression);
      const TwellMatrix gate = ref::gate_to_twell(work.x.data(), 7, work.weights, 128, compression);
      if (compression == 8) EXPECT_GT(gate.spill_used, 0) << "the case must exercise the spill";
      const std::vector<double> dense = ref::ffn_dense(work.x.data(), 7, work.weights);
      EXPECT_EQ(ref::ffn_from_twell(work.x.data(), gate, work.weights), dense);
      EXPECT_GT(l2_norm(dense), 0.0);
    }
}

TEST(Reference, FfnFromTwellMatchesDenseWithinBf16GateRounding) {
  for (double density : {0.02, 0.5}) {
    const Workload work = make_workload({.rows = 17, .d_model = 256, .d_hidden = 1000, .density = density, .seed = 3});
    const TwellMatrix gate = ref::gate_to_twell(work.x.data(), 17, work.weights, 256, 4);
    const std::vector<double> dense = ref::ffn_dense(work.x.data(), 17, work.weights);
    const std::vector<double> sparse = ref::ffn_from_twell(work.x.data(), gate, work.weights);
    std::vector<float> sparse_float(sparse.begin(), sparse.end());
    // Each gate moves by at most half a bf16 ulp (2^-8 relative); the output by about that much.
    EXPECT_LT(relative_l2_error(sparse_float.data(), dense.data(), dense.size()), 4e-3) << "density " << density;
  }
}

TEST(Reference, GateToTwellRoundsTheFloat64GateOnce) {
  // g = 1 + 2^-8 + 2^-30. Through float it becomes 1 + 2^-8, a bf16 tie that rounds to even (1.0);
  // rounded once it is above the tie and must give 1 + 2^-7 (bits 0x3f81).
  Workload work = exact_workload(1, 3, 1, true, 1);
  work.x = {1.0f, 1.0f, 1.0f};
  work.weights.gate = {1.0f, std::ldexp(1.0f, -8), std::ldexp(1.0f, -30)};
  const TwellMatrix gate = ref::gate_to_twell(work.x.data(), 1, work.weights, 128, 4);
  ASSERT_EQ(gate.tile_nnz[0], 1);
  EXPECT_EQ(twell_slot_value_bits(gate.slots[0]), 0x3f81);
  EXPECT_EQ(twell_slot_column(gate.slots[0]), 0u);
}

TEST(Reference, GateToTwellStoresExactlyThePositiveGates) {
  const Workload work = make_workload({.rows = 3, .d_model = 200, .d_hidden = 1000, .density = 0.1, .seed = 9});
  const std::vector<double> g = ref::relu_projection(work.x.data(), 3, work.weights);
  const std::vector<bf16> packed = dense_from_twell(ref::gate_to_twell(work.x.data(), 3, work.weights, 128, 2));
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_EQ(packed[i].bits != 0, g[i] > 0) << "element " << i;
    // Half an ulp of 8 significant bits.
    EXPECT_LE(std::abs(to_float(packed[i]) - g[i]), std::abs(g[i]) * 0x1p-8) << "element " << i;
  }
}

TEST(Reference, HybridForwardEqualsDenseOnExactInputs) {
  const double l1_coeff = 0.3;
  for (int32_t ell_width : {1, 8, 300}) {
    SCOPED_TRACE(::testing::Message() << "W=" << ell_width);
    const Workload work = exact_workload(9, 16, 300, true, 21);
    const HybridMatrix gate = hybrid_from_twell(ref::gate_to_twell(work.x.data(), 9, work.weights, 128, 4), ell_width);
    const ref::HybridForward forward = ref::hybrid_ffn_forward(work.x.data(), gate, work.weights, l1_coeff);
    EXPECT_EQ(forward.y, ref::ffn_dense(work.x.data(), 9, work.weights));
    // With dy = 0 the training loss is the L1 term alone.
    const std::vector<float> zero_dy(9 * 16, 0.0f);
    EXPECT_EQ(forward.l1, ref::ffn_train_loss(work.x.data(), 9, work.weights, zero_dy.data(), l1_coeff));
    EXPECT_GT(forward.l1, 0.0);
    EXPECT_EQ(forward.l0, measured_nnz_per_row(work.x.data(), 9, work.weights));
    int64_t nnz = 0;
    for (int32_t row_nnz : gate.row_nnz) nnz += row_nnz;
    EXPECT_EQ(forward.l0, static_cast<double>(nnz) / 9);
  }
}

TEST(Reference, HybridBackwardEqualsFloat64GradsOnExactInputs) {
  const Workload work = exact_workload(5, 12, 40, true, 33);
  const std::vector<float> dy = random_dy(5, 12, 4);
  const HybridMatrix gate = hybrid_from_twell(ref::gate_to_twell(work.x.data(), 5, work.weights, 128, 4), 4);
  ASSERT_GT(gate.backup_used, 0) << "the case must exercise the backup";
  const ref::FfnGrads hybrid = ref::hybrid_ffn_backward(work.x.data(), gate, work.weights, dy.data(), 0.2);
  const ref::FfnGrads exact = ref::ffn_train_grads(work.x.data(), 5, work.weights, dy.data(), 0.2);
  // dy is not a multiple of 1/4, so sums may round: compare to float64 precision.
  EXPECT_LT(max_abs_difference(hybrid.dx, exact.dx), 1e-12);
  EXPECT_LT(max_abs_difference(hybrid.d_gate, exact.d_gate), 1e-12);
  EXPECT_LT(max_abs_difference(hybrid.d_up, exact.d_up), 1e-12);
  EXPECT_LT(max_abs_difference(hybrid.d_down, exact.d_down), 1e-12);
  EXPECT_GT(l2_norm(exact.d_gate), 0.0);
}

// ---- Finite differences ----

struct FdReport {
  double worst = 0;  // max |fd - analytic| / (1 + |analytic|)
  std::string where;
};

// Central differences of ref::ffn_train_loss in every x and weight entry, against `grads`.
// The loss is at most quadratic in any single entry away from relu and |h| kinks, so the central
// difference is exact up to float64 rounding: a tight bound detects any wrong gradient.
FdReport finite_difference_check(const Workload& work, const std::vector<float>& dy, double l1_coeff,
                                 const ref::FfnGrads& grads) {
  Workload probe = work;  // perturbed in place, one entry at a time
  const int64_t rows = work.spec.rows;
  auto loss = [&] { return ref::ffn_train_loss(probe.x.data(), rows, probe.weights, dy.data(), l1_coeff); };
  FdReport report;
  auto check = [&](const char* name, std::vector<float>& values, const std::vector<double>& analytic) {
    ASSERT_EQ(values.size(), analytic.size()) << name;
    for (size_t i = 0; i < values.size(); ++i) {
      const float original = values[i];
      const float step = 0x1p-12f * std::max(1.0f, std::abs(original));
      values[i] = original + step;
      const double up = loss();
      const double up_delta = static_cast<double>(values[i]) - original;  // the step the float really took
      values[i] = original - step;
      const double down = loss();
      const double down_delta = original - static_cast<double>(values[i]);
      values[i] = original;
      const double fd = (up - down) / (up_delta + down_delta);
      const double error = std::abs(fd - analytic[i]) / (1.0 + std::abs(analytic[i]));
      if (error > report.worst) {
        report.worst = error;
        report.where = std::string(name) + "[" + std::to_string(i) + "]: fd " + std::to_string(fd) + ", analytic " +
                       std::to_string(analytic[i]);
      }
    }
  };
  check("dx", probe.x, grads.dx);
  check("d_gate", probe.weights.gate, grads.d_gate);
  check("d_up", probe.weights.up, grads.d_up);
  check("d_down", probe.weights.down, grads.d_down);
  return report;
}

constexpr double kFdTolerance = 1e-7;

TEST(Reference, TrainGradsMatchFiniteDifferences) {
  for (double l1_coeff : {0.0, 0.05, 1.0})
    for (double density : {0.2, 0.6}) {
      SCOPED_TRACE(::testing::Message() << "l1 " << l1_coeff << " density " << density);
      const Workload work = make_workload({.rows = 3, .d_model = 8, .d_hidden = 12, .density = density, .seed = 17});
      const std::vector<float> dy = random_dy(3, 8, 5);
      const ref::FfnGrads grads = ref::ffn_train_grads(work.x.data(), 3, work.weights, dy.data(), l1_coeff);
      const FdReport report = finite_difference_check(work, dy, l1_coeff, grads);
      EXPECT_LT(report.worst, kFdTolerance) << report.where;
    }
}

TEST(Reference, FiniteDifferenceCheckDetectsWrongGradients) {
  const Workload work = make_workload({.rows = 3, .d_model = 8, .d_hidden = 12, .density = 0.5, .seed = 17});
  const std::vector<float> dy = random_dy(3, 8, 5);
  const ref::FfnGrads right = ref::ffn_train_grads(work.x.data(), 3, work.weights, dy.data(), 0.05);
  ASSERT_LT(finite_difference_check(work, dy, 0.05, right).worst, kFdTolerance);

  // The L1 term forgotten.
  const ref::FfnGrads without_l1 = ref::ffn_train_grads(work.x.data(), 3, work.weights, dy.data(), 0.0);
  EXPECT_GT(finite_difference_check(work, dy, 0.05, without_l1).worst, 100 * kFdTolerance);
  // One entry off by one part in 10^4.
  for (std::vector<double> ref::FfnGrads::*member :
       {&ref::FfnGrads::dx, &ref::FfnGrads::d_gate, &ref::FfnGrads::d_up, &ref::FfnGrads::d_down}) {
    ref::FfnGrads wrong = right;
    auto& values = wrong.*member;
    const auto largest = std::max_element(values.begin(), values.end(),
                                          [](double a, double b) { return std::abs(a) < std::abs(b); });
    *largest *= 1.0001;
    EXPECT_GT(finite_difference_check(work, dy, 0.05, wrong).worst, 10 * kFdTolerance);
  }
}

TEST(Reference, BadInputsThrow) {
  const Workload work = make_workload({.rows = 2, .d_model = 16, .d_hidden = 40, .density = 0.5, .seed = 2});
  FfnWeights short_up = work.weights;
  short_up.up.pop_back();
  EXPECT_THROW(ref::ffn_dense(work.x.data(), 2, short_up), Error);
  EXPECT_THROW(ref::ffn_dense(work.x.data(), 0, work.weights), Error);
  EXPECT_THROW(ref::ffn_dense(nullptr, 2, work.weights), Error);

  const TwellMatrix gate = ref::gate_to_twell(work.x.data(), 2, work.weights, 128, 4);
  FfnWeights wider = make_workload({.rows = 2, .d_model = 16, .d_hidden = 41, .seed = 2}).weights;
  EXPECT_THROW(ref::ffn_from_twell(work.x.data(), gate, wider), Error);

  const HybridMatrix hybrid = hybrid_from_twell(gate, 8);
  FfnWeights plain = make_workload({.rows = 2, .d_model = 16, .d_hidden = 40, .gated = false, .seed = 2}).weights;
  try {
    ref::hybrid_ffn_forward(work.x.data(), hybrid, plain, 0.1);
    ADD_FAILURE() << "non-gated weights must be refused";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("needs gated weights"), std::string::npos) << error.what();
  }
  EXPECT_THROW(ref::hybrid_ffn_backward(work.x.data(), hybrid, work.weights, nullptr, 0.1), Error);
}

// Cases whose attention is known in closed form: token t of a sequence starting at position 0 with
// every key zero averages the values 0 ..= t; a key far above the others takes all the weight.
TEST(Reference, CausalAttentionKnownCases) {
  const ref::CachedAttentionShape shape{2, 3, 4, 2, 2, 5, 0};  // B 2, n 3, H_q 4, H_kv 2, Dh 2, cap 5
  const size_t cache = 2 * 2 * 5 * 2;
  std::vector<float> q(2 * 4 * 3 * 2, 1.0f), zeros(cache, 0.0f), values(cache);
  for (size_t e = 0; e < cache; ++e) values[e] = static_cast<float>(e);
  const std::vector<double> mean = ref::causal_attention(q.data(), zeros.data(), values.data(), shape, 1.0);
  for (int32_t b = 0; b < 2; ++b)
    for (int32_t t = 0; t < 3; ++t)
      for (int32_t h = 0; h < 4; ++h)
        for (int32_t d = 0; d < 2; ++d) {
          double sum = 0;  // query head h reads kv head h / 2
          for (int32_t j = 0; j <= t; ++j) sum += values[((b * 2 + h / 2) * 5 + j) * 2 + d];
          EXPECT_NEAR(mean[((b * 3 + t) * 4 + h) * 2 + d], sum / (t + 1), 1e-12);
        }
  // start 2: the cache's position 1 has a large key, seen by every new token (positions 2, 3, 4).
  ref::CachedAttentionShape continued = shape;
  continued.start = 2;
  std::vector<float> keys(cache, 0.0f);
  for (int32_t bk = 0; bk < 4; ++bk) keys[(bk * 5 + 1) * 2] = 100.0f;
  const std::vector<double> peaked = ref::causal_attention(q.data(), keys.data(), values.data(), continued, 1.0);
  for (int32_t b = 0; b < 2; ++b)
    for (int32_t t = 0; t < 3; ++t)
      for (int32_t h = 0; h < 4; ++h)
        for (int32_t d = 0; d < 2; ++d)
          EXPECT_NEAR(peaked[((b * 3 + t) * 4 + h) * 2 + d], values[((b * 2 + h / 2) * 5 + 1) * 2 + d], 1e-9);
  continued.start = 3;  // 3 + 3 positions > cap 5
  EXPECT_THROW(ref::causal_attention(q.data(), keys.data(), values.data(), continued, 1.0), Error);
}

// Pair i turns by position·theta^(-2i/Dh) radians: pair 0 by the position itself, pair 1 of a Dh 4
// head at theta 100 by a tenth of it; position 0 leaves the head as it is.
TEST(Reference, RopeKnownCases) {
  std::vector<double> head{1.0, 2.0, 0.0, 0.5};  // pairs (1, 0) and (2, 0.5)
  ref::rope(head.data(), 4, 0, 100.0f);
  EXPECT_EQ(head, (std::vector<double>{1.0, 2.0, 0.0, 0.5}));
  ref::rope(head.data(), 4, 3, 100.0f);
  const double pair1 = 3 * 0.1;  // 3 / 100^(2/4), which the fp32 angle holds to within 2e-8
  EXPECT_NEAR(head[0], std::cos(3.0), 1e-12);
  EXPECT_NEAR(head[2], std::sin(3.0), 1e-12);
  EXPECT_NEAR(head[1], 2 * std::cos(pair1) - 0.5 * std::sin(pair1), 1e-7);
  EXPECT_NEAR(head[3], 0.5 * std::cos(pair1) + 2 * std::sin(pair1), 1e-7);
  EXPECT_THROW(ref::rope(head.data(), 3, 1, 100.0f), Error);
}

// At position 0 RoPE is the identity and the query sees only the new position, so each query head's
// output is its kv head's new value row plus bias, whatever the cache holds (NaN here: never read).
TEST(Reference, DecodeAttentionRopeAtPositionZeroIsTheNewValue) {
  const ref::CachedAttentionShape shape{2, 1, 4, 2, 4, 3, 0};  // B 2, H_q 4 over H_kv 2, Dh 4, stride 3
  const int64_t width = (4 + 2 * 2) * 4, cache = int64_t{2} * 2 * 3 * 4;
  std::vector<float> qkv(2 * width), bias(width);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>(i % 7) - 3.0f;
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = 0.25f * static_cast<float>(i % 5);
  const std::vector<float> nan_cache(cache, std::numeric_limits<float>::quiet_NaN());
  const std::vector<double> out =
      ref::decode_attention_rope(qkv.data(), bias.data(), nan_cache, nan_cache, shape, 1e4f, 0.5);
  ASSERT_EQ(out.size(), size_t{2 * 4 * 4});
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 4; ++h)
      for (int d = 0; d < 4; ++d) {
        const int64_t v = (4 + 2) * 4 + (h / 2) * 4 + d;  // the value row of kv head h / 2
        EXPECT_DOUBLE_EQ(out[(b * 4 + h) * 4 + d], double{qkv[b * width + v]} + bias[v]) << b << " " << h << " " << d;
      }
  EXPECT_THROW(ref::decode_attention_rope(qkv.data(), nullptr, nan_cache, std::vector<float>(5), shape, 1e4f, 0.5),
               Error);
}

}  // namespace
}  // namespace twell
