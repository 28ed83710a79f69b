// The decode path (include/twell/decode.h) on every op-harness backend with a decode_ffn
// (tests/backend_*.cpp): the sign-bit packing it reads, the predictor scores against the reference
// predictors, and the decode FFN against the float64 reference (ref::ffn_dense when nothing is
// skipped, ref::decode_ffn with the same prediction when the predictor drops neurons). CPU: every
// ISA this machine has. CUDA: skipped without a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <tuple>

#include <gtest/gtest.h>

#include "op_harness.h"
#include "twell/convert.h"
#include "twell/cpu.h"
#include "twell/decode.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell {
namespace {

// fp32 accumulation over D <= 4096 terms of unit-scale products, against float64.
constexpr double kFp32Tolerance = 2e-5;
constexpr double kHugeSetting = 1e30;  // alpha or margin so large that every neuron is predicted active

// ---- Cases --------------------------------------------------------------------------------------

std::vector<test::BackendCase> decode_cases() {
  // Odd D and H (partial sign words, D not a multiple of 16), M from 1 to the fused limit, both FFN
  // kinds, a skewed case, and the benchmark's shape at M = 1. For CUDA (D a multiple of 8): D = 40,
  // 200 and 1000 end inside a sign word and inside a 16-column mma step; M = 3, 7, 9 and 16 cover
  // one and two token tiles; every odd H leaves the last 16-neuron tile partial.
  std::vector<test::OpCase> shapes;
  auto add = [&](int64_t rows, int32_t d, int32_t h, double density, bool gated, int32_t hot, uint64_t seed) {
    test::OpCase c;
    c.rows = rows;
    c.d_model = d;
    c.d_hidden = h;
    c.density = density;
    c.gated = gated;
    c.hot_neurons = hot;
    c.seed = seed;
    shapes.push_back(c);
  };
  add(1, 64, 96, 0.1, true, 0, 1);
  add(3, 100, 257, 0.05, true, 0, 2);
  add(16, 640, 1000, 0.02, true, 3, 3);
  add(7, 1000, 333, 0.2, false, 0, 4);
  add(16, 37, 50, 0.5, true, 0, 5);
  add(2, 4096, 300, 0.05, false, 2, 6);
  add(1, 2048, 5632, 0.005, true, 0, 7);
  add(5, 192, 333, 0.1, false, 0, 8);
  add(9, 128, 1001, 0.03, true, 1, 9);
  add(3, 200, 131, 0.05, true, 0, 10);
  add(16, 40, 77, 0.2, true, 0, 11);
  std::vector<test::BackendCase> cases;
  for (const test::BackendCase& pair : test::backend_cases(&test::FfnBackend::decode_ffn, shapes))
    if (pair.op_case.d_model % test::find_backend(pair.backend).decode_d_multiple == 0) cases.push_back(pair);
  return cases;
}

// The harness's backends (tests/backend_*.cpp) that implement decode_ffn.
class DecodeTest : public test::OpTest {
 protected:
  void SetUp() override {
    test::OpTest::SetUp();
    if (IsSkipped()) return;
    work_ = make_workload(op_case().workload_spec());
    signs_ = pack_sign_bits(work_.weights.relu_projection().data(), work_.weights.d_hidden, work_.weights.d_model);
  }
  int64_t rows() const { return work_.spec.rows; }
  size_t output_count() const { return static_cast<size_t>(rows()) * work_.weights.d_model; }

  // Runs the backend into a NaN-poisoned y. The predictor's tests ask for GateSelection::predicted: the
  // automatic choice takes every gate where the backend finds that faster (on CUDA from M = 4 on).
  DecodeStats decode(const PredictorConfig& predictor, std::vector<float>& y, const DecodeOptions& options = {}) {
    test::poison(y, output_count());
    return backend().decode_ffn(work_.x.data(), rows(), work_.weights, signs_, predictor, y.data(), options);
  }

  int64_t reference_active_count() const {
    std::vector<double> projection = ref::relu_projection(work_.x.data(), rows(), work_.weights);
    return std::count_if(projection.begin(), projection.end(), [](double v) { return v > 0; });
  }

  void expect_reference_prediction_at_a_gap(PredictorKind kind);

  Workload work_;
  SignBits signs_;
};

// Every neuron predicted active: the decode FFN is the exact FFN.
TEST_P(DecodeTest, NothingSkippedEqualsDenseFfn) {
  const std::vector<double> expected = ref::ffn_dense(work_.x.data(), rows(), work_.weights);
  const int64_t active = reference_active_count();
  ASSERT_GT(active, 0) << "the case must have active neurons";
  for (PredictorConfig predictor : {PredictorConfig{PredictorKind::sign_rule, kHugeSetting, 0.0},
                                    PredictorConfig{PredictorKind::one_bit_gate, 1.0, kHugeSetting},
                                    PredictorConfig{PredictorKind::normalized_one_bit_gate, 1.0, kHugeSetting},
                                    PredictorConfig{PredictorKind::two_bit_gate, 1.0, kHugeSetting}}) {
    SCOPED_TRACE(to_string(predictor.kind));
    std::vector<float> y;
    DecodeStats stats = decode(predictor, y, {.count_missed = true, .gates = GateSelection::predicted});
    EXPECT_TRUE(test::near_relative_l2("y", y.data(), expected.data(), expected.size(), kFp32Tolerance));
    EXPECT_EQ(stats.predicted, rows() * work_.weights.d_hidden);
    // fp32 and float64 gates may disagree on a value within rounding of zero.
    EXPECT_NEAR(static_cast<double>(stats.active), static_cast<double>(active), 1.0 + 1e-3 * active);
    EXPECT_EQ(stats.missed, 0);
  }
}

// GateSelection: all_neurons computes every gate whatever the predictor says (here one that keeps
// nothing), so the output is the exact FFN, by either AllGatesKernel (CUDA; the CPU has one way);
// automatic takes that path exactly where the backend's rule says so (by M, or by the calibrated
// predicted_fraction), and the predictor's otherwise (which here drops everything).
TEST_P(DecodeTest, AllGatesEqualsDenseFfnWhateverThePredictor) {
  const std::vector<double> expected = ref::ffn_dense(work_.x.data(), rows(), work_.weights);
  const int64_t active = reference_active_count();
  ASSERT_GT(active, 0) << "the case must have active neurons";
  const int64_t pairs = rows() * work_.weights.d_hidden;
  const AllGatesRule& rule = backend().decode_all_gates;
  const bool all_by_rows = rows() >= rule.min_rows;
  PredictorConfig keeps_nothing{PredictorKind::one_bit_gate, 1.0, -kHugeSetting};
  for (auto [gates, fraction, all, kernel] :
       {std::tuple{GateSelection::all_neurons, 0.0, true, AllGatesKernel::product},
        std::tuple{GateSelection::all_neurons, 0.0, true, AllGatesKernel::streamed},
        std::tuple{GateSelection::automatic, 1.0, true, AllGatesKernel::streamed},
        std::tuple{GateSelection::automatic, 0.0, all_by_rows, AllGatesKernel::product},
        std::tuple{GateSelection::predicted, 1.0, false, AllGatesKernel::streamed}}) {
    SCOPED_TRACE(testing::Message() << "gates " << static_cast<int>(gates) << ", predicted_fraction " << fraction
                                    << ", kernel " << static_cast<int>(kernel));
    keeps_nothing.predicted_fraction = fraction;
    ASSERT_EQ(computes_all_gates({.gates = gates}, keeps_nothing, rows(), rule), all);
    std::vector<float> y;
    const DecodeStats stats =
        decode(keeps_nothing, y, {.count_missed = true, .gates = gates, .all_gates_kernel = kernel});
    if (all) {
      EXPECT_TRUE(test::near_relative_l2("y", y.data(), expected.data(), expected.size(), kFp32Tolerance));
      EXPECT_EQ(stats.predicted, pairs);
      EXPECT_NEAR(static_cast<double>(stats.active), static_cast<double>(active), 1.0 + 1e-3 * active);
      EXPECT_EQ(stats.missed, 0);
    } else {
      EXPECT_TRUE(std::all_of(y.begin(), y.begin() + output_count(), [](float v) { return v == 0.0f; }));
      EXPECT_EQ(stats.predicted, 0);
      EXPECT_NEAR(static_cast<double>(stats.missed), static_cast<double>(active), 1.0 + 1e-3 * active);
    }
  }
}

// The automatic rule: every gate from min_rows tokens on, or once the predicted neurons of M
// independent tokens would cover the rule's share of H.
TEST(DecodeGateSelection, AllGatesByRowsOrOnceThePredictedNeuronsCoverEnoughOfH) {
  const AllGatesRule coverage_only{kDecodeMaxRows + 1, 0.75};
  PredictorConfig predictor;
  EXPECT_FALSE(gates_all_neurons(predictor, 16, coverage_only)) << "unknown fraction: the predictor";
  EXPECT_TRUE(gates_all_neurons(predictor, 16, {16, 0.75})) << "by rows, whatever the fraction";
  EXPECT_FALSE(gates_all_neurons(predictor, 15, {16, 0.75}));
  predictor.predicted_fraction = 0.36;  // one-bit on the synthetic workload, no exact columns
  EXPECT_FALSE(gates_all_neurons(predictor, 2, coverage_only));  // 1 - 0.64^2 = 0.59
  EXPECT_TRUE(gates_all_neurons(predictor, 2, {4, 0.5}));
  EXPECT_TRUE(gates_all_neurons(predictor, 4, coverage_only));   // 0.83
  predictor.predicted_fraction = 0.026;  // two-bit-norm on a real L1-trained model
  EXPECT_FALSE(gates_all_neurons(predictor, 16, coverage_only));  // 0.34
  predictor.predicted_fraction = 0.62;  // the sign rule on the synthetic workload
  EXPECT_FALSE(gates_all_neurons(predictor, 1, coverage_only));
  EXPECT_TRUE(gates_all_neurons(predictor, 1, {4, 0.5}));
  predictor.predicted_fraction = 1.0;
  EXPECT_TRUE(gates_all_neurons(predictor, 1, coverage_only));
  EXPECT_EQ(computes_all_gates({.gates = GateSelection::predicted}, predictor, 16, {1, 0.0}), false);
  EXPECT_EQ(computes_all_gates({.gates = GateSelection::all_neurons}, PredictorConfig{}, 1, coverage_only), true);
}

// accumulate: y += the FFN, on top of what y held (a residual stream), for every kind and with every gate.
TEST_P(DecodeTest, AccumulateAddsTheFfnToY) {
  const std::vector<double> ffn = ref::ffn_dense(work_.x.data(), rows(), work_.weights);
  const std::vector<float> residual = make_normal(output_count(), 1.0, work_.spec.seed + 99);
  std::vector<double> expected(ffn.size());
  for (size_t i = 0; i < ffn.size(); ++i) expected[i] = ffn[i] + residual[i];
  for (auto [gates, kernel] : {std::pair{GateSelection::predicted, AllGatesKernel::product},
                               std::pair{GateSelection::all_neurons, AllGatesKernel::product},
                               std::pair{GateSelection::all_neurons, AllGatesKernel::streamed}})
    for (PredictorConfig predictor : {PredictorConfig{PredictorKind::sign_rule, kHugeSetting, 0.0},
                                      PredictorConfig{PredictorKind::two_bit_gate, 1.0, kHugeSetting}}) {
      SCOPED_TRACE(testing::Message() << to_string(predictor.kind) << ", gates " << static_cast<int>(gates)
                                      << ", kernel " << static_cast<int>(kernel));
      std::vector<float> y = residual;
      backend().decode_ffn(work_.x.data(), rows(), work_.weights, signs_, predictor, y.data(),
                           {.accumulate = true, .gates = gates, .all_gates_kernel = kernel});
      EXPECT_TRUE(test::near_relative_l2("y", y.data(), expected.data(), expected.size(), kFp32Tolerance));
    }
}

// The sign rule at a lossy alpha: its prediction is exact integer arithmetic, so the output must
// equal the reference decode FFN with the reference's own prediction, and the counters must match.
TEST_P(DecodeTest, SignRuleMatchesReferencePrediction) {
  const SignBits x_signs = pack_sign_bits(work_.x.data(), static_cast<int32_t>(rows()), work_.weights.d_model);
  const std::vector<double> projection = ref::relu_projection(work_.x.data(), rows(), work_.weights);
  for (double alpha : {0.9, 1.0, 1.1}) {
    SCOPED_TRACE(fmt::format("alpha {}", alpha));
    const std::vector<uint8_t> mask = ref::predict_active_sign_rule(x_signs, signs_, alpha);
    int64_t predicted = 0, missed = 0;
    for (size_t i = 0; i < mask.size(); ++i) {
      predicted += mask[i];
      missed += !mask[i] && projection[i] > 0;
    }
    const std::vector<double> expected = ref::decode_ffn(work_.x.data(), rows(), work_.weights, mask);
    std::vector<float> y;
    DecodeStats stats = decode(PredictorConfig{PredictorKind::sign_rule, alpha, 0.0}, y,
                               {.count_missed = true, .gates = GateSelection::predicted});
    EXPECT_EQ(stats.predicted, predicted);
    EXPECT_NEAR(static_cast<double>(stats.missed), static_cast<double>(missed), 1.0 + 1e-3 * missed);
    double norm = 0;
    for (double v : expected) norm += v * v;
    if (norm > 0) EXPECT_TRUE(test::near_relative_l2("y", y.data(), expected.data(), expected.size(), kFp32Tolerance));
  }
}

// The gates at a lossy margin placed in a gap between reference scores, so that rounding of the fp32
// score cannot move a neuron across it.
TEST_P(DecodeTest, GatesMatchReferencePrediction) {
  for (PredictorKind kind :
       {PredictorKind::one_bit_gate, PredictorKind::normalized_one_bit_gate, PredictorKind::two_bit_gate}) {
    SCOPED_TRACE(to_string(kind));
    expect_reference_prediction_at_a_gap(kind);
  }
}

// A gate's reference scores [M, H].
std::vector<double> reference_scores(PredictorKind kind, const float* x, int64_t rows, const SignBits& signs) {
  return kind == PredictorKind::two_bit_gate            ? ref::two_bit_gate(x, rows, signs)
         : kind == PredictorKind::normalized_one_bit_gate ? ref::normalized_one_bit_gate(x, rows, signs)
                                                          : ref::one_bit_gate(x, rows, signs);
}

// A margin in the widest gap among the upper half of the reference scores, so that rounding of the
// fp32 score cannot move a pair across it; NaN when there is no gap wide enough.
double margin_at_a_gap(const std::vector<double>& scores) {
  std::vector<double> sorted = scores;
  std::sort(sorted.begin(), sorted.end());
  const double spread = sorted.back() - sorted.front();
  size_t best = sorted.size() / 2;
  for (size_t i = sorted.size() / 2; i + 1 < sorted.size(); ++i)
    if (sorted[i + 1] - sorted[i] > sorted[best + 1] - sorted[best]) best = i;
  if (!(sorted[best + 1] - sorted[best] > 1e-4 * spread)) return std::nan("");
  return -0.5 * (sorted[best] + sorted[best + 1]);
}

void DecodeTest::expect_reference_prediction_at_a_gap(PredictorKind kind) {
  const std::vector<double> scores = reference_scores(kind, work_.x.data(), rows(), signs_);
  const double margin = margin_at_a_gap(scores);
  ASSERT_FALSE(std::isnan(margin)) << "no gap wide enough for an unambiguous margin";
  std::vector<uint8_t> mask(scores.size());
  for (size_t i = 0; i < scores.size(); ++i) mask[i] = scores[i] >= -margin;  // the rule of every gate
  const int64_t predicted = std::count(mask.begin(), mask.end(), 1);
  const std::vector<double> expected = ref::decode_ffn(work_.x.data(), rows(), work_.weights, mask);
  std::vector<float> y;
  DecodeStats stats = decode(PredictorConfig{kind, 1.0, margin}, y, {.gates = GateSelection::predicted});
  EXPECT_EQ(stats.predicted, predicted);
  EXPECT_EQ(stats.missed, -1);
  double norm = 0;
  for (double v : expected) norm += v * v;
  if (norm > 0) EXPECT_TRUE(test::near_relative_l2("y", y.data(), expected.data(), expected.size(), kFp32Tolerance));
}

// The gates with exact columns (the standard workload's threshold column 0, alone and with two
// more): at a conservative margin nothing active is dropped and y is the exact FFN, while on the
// sparse cases most neurons are skipped; at a lossy margin in a gap of the reference scores the
// prediction and y are the reference's.
TEST_P(DecodeTest, GatesWithExactColumnsMatchReference) {
  const int32_t cols = work_.weights.d_model, hidden = work_.weights.d_hidden;
  const std::vector<double> exact_ffn = ref::ffn_dense(work_.x.data(), rows(), work_.weights);
  const std::vector<double> projection = ref::relu_projection(work_.x.data(), rows(), work_.weights);
  for (const std::vector<int32_t>& exact_columns : {std::vector<int32_t>{0}, std::vector<int32_t>{0, 5, cols - 1}}) {
    SCOPED_TRACE(fmt::format("exact columns [{}]", fmt::join(exact_columns, ", ")));
    signs_ = pack_sign_bits(work_.weights.relu_projection().data(), hidden, cols, exact_columns);
    for (PredictorKind kind :
         {PredictorKind::one_bit_gate, PredictorKind::normalized_one_bit_gate, PredictorKind::two_bit_gate}) {
      SCOPED_TRACE(to_string(kind));
      const std::vector<double> scores = reference_scores(kind, work_.x.data(), rows(), signs_);
      double lowest_active = std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < scores.size(); ++i)
        if (projection[i] > 0) lowest_active = std::min(lowest_active, scores[i]);
      ASSERT_TRUE(std::isfinite(lowest_active)) << "the case must have active neurons";
      // Conservative: every active pair's score clears it with room for fp32 rounding.
      const double conservative = -lowest_active + 0.1 * std::abs(lowest_active) + 1e-3;
      std::vector<float> y;
      DecodeStats stats =
          decode(PredictorConfig{kind, 1.0, conservative}, y, {.count_missed = true, .gates = GateSelection::predicted});
      EXPECT_EQ(stats.missed, 0);
      if (work_.spec.density <= 0.02)
        EXPECT_LT(stats.predicted, rows() * hidden / 2) << "the exact threshold column must let the gate skip neurons";
      EXPECT_TRUE(test::near_relative_l2("y", y.data(), exact_ffn.data(), exact_ffn.size(), kFp32Tolerance));
      expect_reference_prediction_at_a_gap(kind);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, DecodeTest, testing::ValuesIn(decode_cases()), test::backend_case_name<test::OpCase>);

// ---- CPU predictor scores against the reference (every ISA) ----------------------------------------

class PredictorScoresTest : public testing::TestWithParam<cpu::Isa> {
 protected:
  void SetUp() override {
    try {
      previous_ = cpu::active_isa();
      cpu::set_isa(GetParam());
    } catch (const Error& error) {
      GTEST_SKIP() << error.what();
    }
  }
  void TearDown() override { cpu::set_isa(previous_); }
  cpu::Isa previous_ = cpu::Isa::scalar;
};

// Column sets for the exact-column cases of a K-column matrix (K >= 33): none, the first, the last,
// and kMaxExactColumns spread over the row, first and last included.
std::vector<std::vector<int32_t>> exact_column_sets(int32_t cols) {
  return {{}, {0}, {cols - 1}, {0, 7, 12, 20, 25, 30, cols - 2, cols - 1}};
}

// x [rows, cols] row m's sum of |x| and norm over the columns not in `exact_columns`, and the sum of
// |x·exact weight| of neuron j: the scales of the fp32 rounding error of its scores.
struct RowScales {
  double abs_sum = 0, norm = 0;
};
RowScales approximated_row_scales(const float* x_row, int32_t cols, const std::vector<int32_t>& exact_columns) {
  RowScales scales;
  for (int32_t k = 0; k < cols; ++k) {
    if (std::find(exact_columns.begin(), exact_columns.end(), k) != exact_columns.end()) continue;
    scales.abs_sum += std::abs(x_row[k]);
    scales.norm += static_cast<double>(x_row[k]) * x_row[k];
  }
  scales.norm = std::sqrt(scales.norm);
  return scales;
}
double exact_part_magnitude(const float* x_row, const SignBits& signs, int32_t j) {
  const size_t count = signs.exact_columns.size();
  double sum = 0;
  for (size_t c = 0; c < count; ++c)
    sum += std::abs(static_cast<double>(x_row[signs.exact_columns[c]]) * signs.exact_weights[j * count + c]);
  return sum;
}

TEST_P(PredictorScoresTest, CountsAndScoresMatchReference) {
  for (auto [rows, cols, hidden] : {std::tuple{1, 64, 40}, std::tuple{3, 33, 17}, std::tuple{16, 1000, 123},
                                    std::tuple{5, 2048, 64}, std::tuple{2, 4099, 9}, std::tuple{9, 97, 31}})
    for (const std::vector<int32_t>& exact_columns : exact_column_sets(cols)) {
      SCOPED_TRACE(
          fmt::format("M {} D {} H {} exact columns [{}]", rows, cols, hidden, fmt::join(exact_columns, ", ")));
      WorkloadSpec spec{.rows = rows, .d_model = cols, .d_hidden = hidden, .density = 0.3, .seed = 11u + cols};
      Workload work = make_workload(spec);
      // Exact zeros and negative zeros in x: both must count as positive signs.
      for (int i = 1; i < cols * rows; i += 7) work.x[i] = (i % 2) ? -0.0f : 0.0f;
      const SignBits signs = pack_sign_bits(work.weights.gate.data(), hidden, cols, exact_columns);
      const SignBits x_signs = pack_sign_bits(work.x.data(), rows, cols);

      std::vector<int32_t> counts(static_cast<size_t>(rows) * hidden, -7);
      cpu::negative_sign_products(work.x.data(), rows, signs, counts.data());
      EXPECT_EQ(counts, ref::negative_sign_products(x_signs, signs)) << "the sign rule reads every column";

      // The gates sum x quantized (cpu::gate_inputs): the reference gets the same inputs.
      const std::vector<float> seen = cpu::gate_inputs(work.x.data(), rows, signs);
      std::vector<float> scores(counts.size(), std::numeric_limits<float>::quiet_NaN());
      cpu::one_bit_gate(work.x.data(), rows, signs, scores.data());
      const std::vector<double> expected = ref::one_bit_gate(seen.data(), rows, signs);
      for (int m = 0; m < rows; ++m) {
        // Σ|x| is the natural scale of the rounding error of Σ ±x.
        const RowScales row = approximated_row_scales(work.x.data() + m * cols, cols, exact_columns);
        for (int j = 0; j < hidden; ++j) {
          const size_t i = static_cast<size_t>(m) * hidden + j;
          ASSERT_NEAR(scores[i], expected[i],
                      1e-6 * (signs.scale[j] * row.abs_sum + exact_part_magnitude(work.x.data() + m * cols, signs, j)) +
                          1e-30)
              << "row " << m << " neuron " << j;
        }
      }

      // The normalized gates: z = score / (residual_j·||x||). The fp32 masked sums are off by ~1e-7 of
      // Σ|x| each, times the scale that weighs them (one sum for the one-bit gate, three for two-bit).
      using Scores = void (*)(const float*, int64_t, const SignBits&, float*);
      using ReferenceScores = std::vector<double> (*)(const float*, int64_t, const SignBits&);
      const auto expect_normalized = [&](const char* name, Scores scores_of, ReferenceScores reference,
                                         const std::vector<float>& residual, const std::function<double(int)>& weight) {
        SCOPED_TRACE(name);
        std::vector<float> z(counts.size(), std::numeric_limits<float>::quiet_NaN());
        scores_of(work.x.data(), rows, signs, z.data());
        const std::vector<double> expected_z = reference(seen.data(), rows, signs);
        for (int m = 0; m < rows; ++m) {
          const RowScales row = approximated_row_scales(work.x.data() + m * cols, cols, exact_columns);
          for (int j = 0; j < hidden; ++j) {
            const size_t i = static_cast<size_t>(m) * hidden + j;
            const double unit = residual[j] * row.norm;
            ASSERT_GT(unit, 0) << "random rows are not exactly their approximation";
            ASSERT_NEAR(z[i], expected_z[i],
                        1e-6 * (weight(j) * row.abs_sum + exact_part_magnitude(work.x.data() + m * cols, signs, j)) /
                                unit +
                            1e-5 * std::abs(expected_z[i]))
                << "row " << m << " neuron " << j;
          }
        }
      };
      expect_normalized("one-bit-norm", cpu::normalized_one_bit_gate, ref::normalized_one_bit_gate, signs.residual,
                        [&](int j) { return signs.scale[j]; });
      expect_normalized("two-bit-norm", cpu::two_bit_gate, ref::two_bit_gate, signs.two_bit_residual,
                        [&](int j) { return signs.small_scale[j] + 3 * signs.large_scale[j]; });
    }
}

// What the CPU gates see (decode.h): per token, x over the approximated columns rounded to the
// nearest multiple of a power-of-two step with at most kGateInputLevels steps in the largest |x|, the
// exact columns untouched; a zero token stays zero, a non-finite one is refused.
TEST(DecodeGateInputs, AreXQuantizedPerToken) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (auto [rows, cols] : {std::pair{1, 1}, std::pair{3, 100}, std::pair{4, 2048}})
    for (const std::vector<int32_t>& exact_columns : {std::vector<int32_t>{}, std::vector<int32_t>{0}}) {
      if (static_cast<int32_t>(exact_columns.size()) >= cols) continue;
      SCOPED_TRACE(testing::Message() << "M " << rows << " D " << cols << " exact columns " << exact_columns.size());
      std::vector<float> x(static_cast<size_t>(rows) * cols);
      for (float& v : x) v = normal(rng);
      for (float& v : x) v *= 1e-3f;
      // Row scales from tiny to large, an outlier in an exact column, a zero row.
      for (int32_t k = 0; k < cols; ++k) {
        x[k] *= 1e-39f;  // subnormal: the smallest step
        if (rows > 1) x[cols + k] *= 1e6f;
        if (rows > 3) x[3 * cols + k] = 0.0f;
      }
      if (!exact_columns.empty() && rows > 2) x[2 * cols] = 1e4f;
      SignBits signs;
      signs.rows = 0;
      signs.cols = cols;
      signs.exact_columns = exact_columns;
      const std::vector<float> seen = cpu::gate_inputs(x.data(), rows, signs);
      ASSERT_EQ(seen.size(), x.size());
      for (int m = 0; m < rows; ++m) {
        const float* x_row = x.data() + static_cast<size_t>(m) * cols;
        const float* seen_row = seen.data() + static_cast<size_t>(m) * cols;
        const auto exact = [&](int32_t k) {
          return std::find(exact_columns.begin(), exact_columns.end(), k) != exact_columns.end();
        };
        double largest = 0, largest_seen = 0;
        for (int32_t k = 0; k < cols; ++k)
          if (!exact(k)) {
            largest = std::max(largest, std::abs(static_cast<double>(x_row[k])));
            largest_seen = std::max(largest_seen, std::abs(static_cast<double>(seen_row[k])));
          }
        for (int32_t k = 0; k < cols; ++k) {
          if (exact(k)) {
            EXPECT_EQ(seen_row[k], x_row[k]) << "exact columns are not quantized";
            continue;
          }
          EXPECT_LE(std::abs(static_cast<double>(seen_row[k]) - x_row[k]), largest / cpu::kGateInputLevels)
              << "row " << m << " column " << k;
        }
        if (largest_seen == 0) continue;  // a zero row (checked by the bound above)
        // seen = step·q with 1024 <= max |q| <= 2047 (the smallest power-of-two step allowing
        // kGateInputLevels): the step is 2^(e − 11) for the exponent e of the largest seen value;
        // only the smallest float step may leave fewer levels.
        int exponent;
        std::frexp(largest_seen, &exponent);
        const double step = std::ldexp(1.0, std::max(exponent - 11, -149));
        for (int32_t k = 0; k < cols; ++k)
          if (!exact(k)) {
            const double q = seen_row[k] / step;
            EXPECT_EQ(q, std::round(q)) << "row " << m << " column " << k << ": not a multiple of the step";
            EXPECT_LE(std::abs(q), cpu::kGateInputLevels);
          }
        if (step > std::ldexp(1.0, -149)) EXPECT_GE(largest_seen / step, 1024.0);
      }
    }
  SignBits signs;
  signs.cols = 3;
  const float bad[3] = {1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  EXPECT_THROW(cpu::gate_inputs(bad, 1, signs), Error);
  const float infinite[3] = {1.0f, -std::numeric_limits<float>::infinity(), 2.0f};
  EXPECT_THROW(cpu::gate_inputs(infinite, 1, signs), Error);
}

// The predictors score a block of up to kDecodeMaxRows tokens in one pass over each neuron's bit
// words (src/cpu/decode_kernels.h); a token's score must not depend on the block it is scored in.
// Bitwise equality of floats (NaN never appears: the inputs are finite and the residuals non-zero).
template <typename Value>
void expect_same_bits(const std::vector<Value>& block, const std::vector<Value>& alone, const char* name) {
  ASSERT_EQ(block.size(), alone.size());
  for (size_t i = 0; i < block.size(); ++i)
    ASSERT_EQ(std::memcmp(&block[i], &alone[i], sizeof(Value)), 0)
        << name << " index " << i << ": " << block[i] << " in the block, " << alone[i] << " alone";
}

TEST_P(PredictorScoresTest, BlockScoresEqualOneTokenScores) {
  // M across the row-group sizes of every ISA (4, 2, 1) and past one block (17, 40 > kDecodeMaxRows).
  for (auto [rows, cols, hidden] : {std::tuple{2, 64, 19}, std::tuple{3, 33, 17}, std::tuple{5, 1000, 23},
                                    std::tuple{7, 97, 31}, std::tuple{16, 2048, 29}, std::tuple{17, 130, 11},
                                    std::tuple{40, 257, 13}})
    for (const std::vector<int32_t>& exact_columns : {std::vector<int32_t>{}, std::vector<int32_t>{0, 5, cols - 1}}) {
      SCOPED_TRACE(testing::Message() << "M " << rows << " D " << cols << " H " << hidden << " exact columns "
                                      << exact_columns.size());
      std::mt19937 rng(rows * 131 + cols + hidden);
      std::normal_distribution<float> normal;
      std::vector<float> x(static_cast<size_t>(rows) * cols), weights(static_cast<size_t>(hidden) * cols);
      for (float& v : x) v = normal(rng);
      for (float& v : weights) v = normal(rng);
      for (size_t i = 3; i < x.size(); i += 11) x[i] = (i % 2) ? -0.0f : 0.0f;
      const SignBits signs = pack_sign_bits(weights.data(), hidden, cols, exact_columns);
      const size_t pairs = static_cast<size_t>(rows) * hidden;

      std::vector<int32_t> counts(pairs, -7), counts_alone(pairs, -7);
      cpu::negative_sign_products(x.data(), rows, signs, counts.data());
      for (int m = 0; m < rows; ++m)
        cpu::negative_sign_products(x.data() + static_cast<size_t>(m) * cols, 1, signs,
                                    counts_alone.data() + static_cast<size_t>(m) * hidden);
      EXPECT_EQ(counts, counts_alone);

      using Scores = void (*)(const float*, int64_t, const SignBits&, float*);
      for (auto [name, scores_of] : {std::pair<const char*, Scores>{"one-bit", cpu::one_bit_gate},
                                     std::pair<const char*, Scores>{"one-bit-norm", cpu::normalized_one_bit_gate},
                                     std::pair<const char*, Scores>{"two-bit-norm", cpu::two_bit_gate}}) {
        std::vector<float> block(pairs, std::numeric_limits<float>::quiet_NaN()), alone = block;
        scores_of(x.data(), rows, signs, block.data());
        for (int m = 0; m < rows; ++m)
          scores_of(x.data() + static_cast<size_t>(m) * cols, 1, signs, alone.data() + static_cast<size_t>(m) * hidden);
        expect_same_bits(block, alone, name);
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Isas, PredictorScoresTest,
                         testing::Values(cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512),
                         [](const testing::TestParamInfo<cpu::Isa>& info) { return cpu::to_string(info.param); });

// ---- Sign bits, thresholds, calibration, bad input -------------------------------------------------

// The planes and scales from their definitions, with and without exact columns: bits over every
// column, the rest over the approximated (non-exact) columns only.
TEST(DecodeSignBits, PackingIsBitExact) {
  for (auto [rows, cols] : {std::pair{1, 1}, std::pair{3, 31}, std::pair{2, 32}, std::pair{4, 33}, std::pair{5, 100}}) {
    std::vector<std::vector<int32_t>> column_sets = {{}};
    if (cols >= 2) column_sets.insert(column_sets.end(), {{0}, {cols - 1}});
    if (cols >= 33) column_sets.push_back(exact_column_sets(cols).back());
    for (const std::vector<int32_t>& exact_columns : column_sets) {
      SCOPED_TRACE(fmt::format("R {} K {} exact columns [{}]", rows, cols, fmt::join(exact_columns, ", ")));
      std::mt19937 rng(rows * 1000 + cols);
      std::normal_distribution<float> normal;
      std::vector<float> matrix(static_cast<size_t>(rows) * cols);
      for (float& v : matrix) v = normal(rng);
      matrix[0] = -0.0f;
      if (matrix.size() > 2) matrix[2] = 0.0f;
      const SignBits packed = pack_sign_bits(matrix.data(), rows, cols, exact_columns);
      const int32_t words = sign_words_per_row(cols);
      const auto is_exact = [&](int k) {
        return std::find(exact_columns.begin(), exact_columns.end(), k) != exact_columns.end();
      };
      const int approximated = cols - static_cast<int>(exact_columns.size());
      ASSERT_EQ(packed.bits.size(), static_cast<size_t>(rows) * words);
      ASSERT_EQ(packed.exact_columns, exact_columns);
      ASSERT_EQ(packed.exact_weights.size(), static_cast<size_t>(rows) * exact_columns.size());
      for (int r = 0; r < rows; ++r) {
        for (size_t c = 0; c < exact_columns.size(); ++c)
          ASSERT_EQ(packed.exact_weights[r * exact_columns.size() + c], matrix[r * cols + exact_columns[c]]);
        double abs_sum = 0;
        for (int k = 0; k < words * 32; ++k) {
          const bool bit = (packed.bits[r * words + k / 32] >> (k % 32)) & 1u;
          const bool negative = k < cols && matrix[r * cols + k] < 0.0f;  // -0.0 is not negative
          ASSERT_EQ(bit, negative) << "row " << r << " column " << k;
          if (k < cols && !is_exact(k)) abs_sum += std::abs(matrix[r * cols + k]);
        }
        const double scale = abs_sum / approximated;
        EXPECT_EQ(packed.scale[r], static_cast<float>(scale));
        double residual_squares = 0;  // straight from the definition: A − scale·sign(A)
        for (int k = 0; k < cols; ++k) {
          if (is_exact(k)) continue;
          const double a = matrix[r * cols + k];
          residual_squares += std::pow(a - (a < 0 ? -1.0 : 1.0) * scale, 2);
        }
        EXPECT_NEAR(packed.residual[r], std::sqrt(residual_squares / approximated), 1e-6 * scale + 1e-7);

        // The two-bit planes, from the definition: large iff approximated and |a| > the element at
        // index ⌊3(K − c)/5⌋ of the approximated columns' sorted |a|.
        std::vector<double> magnitudes, sorted;
        for (int k = 0; k < cols; ++k) {
          magnitudes.push_back(std::abs(matrix[r * cols + k]));
          if (!is_exact(k)) sorted.push_back(magnitudes.back());
        }
        std::sort(sorted.begin(), sorted.end());
        const double split = sorted[approximated * 3 / 5];
        double large_sum = 0, small_sum = 0;
        int large_count = 0;
        for (int k = 0; k < words * 32; ++k) {
          const bool large = (packed.large[r * words + k / 32] >> (k % 32)) & 1u;
          const bool expected_large = k < cols && !is_exact(k) && magnitudes[k] > split;
          ASSERT_EQ(large, expected_large) << "row " << r << " column " << k;
          if (k >= cols || is_exact(k)) continue;
          (large ? large_sum : small_sum) += magnitudes[k];
          large_count += large;
        }
        const double large_scale = large_count == 0 ? 0.0 : large_sum / large_count;
        const double small_scale = small_sum / (approximated - large_count);
        EXPECT_NEAR(packed.large_scale[r], large_scale, 1e-6 * large_scale);
        EXPECT_NEAR(packed.small_scale[r], small_scale, 1e-6 * small_scale);
        double two_bit_squares = 0;
        for (int k = 0; k < cols; ++k) {
          if (is_exact(k)) continue;
          const double a = matrix[r * cols + k];
          const double approximation = (a < 0 ? -1.0 : 1.0) * (magnitudes[k] > split ? large_scale : small_scale);
          two_bit_squares += (a - approximation) * (a - approximation);
        }
        EXPECT_NEAR(packed.two_bit_residual[r], std::sqrt(two_bit_squares / approximated), 1e-6 * scale + 1e-7);
      }
    }
  }
}

TEST(DecodeSignBits, PackedSizeIsTheFormats) {
  for (auto [rows, cols] : {std::pair{1, 1}, std::pair{3, 31}, std::pair{2, 32}, std::pair{5, 33}, std::pair{7, 2048},
                            std::pair{4, 4099}}) {
    std::mt19937 rng(rows * 7919 + cols);
    std::normal_distribution<float> normal;
    std::vector<float> matrix(static_cast<size_t>(rows) * cols);
    for (float& v : matrix) v = normal(rng);
    const SignBits packed = pack_sign_bits(matrix.data(), rows, cols);
    const size_t plane_words = static_cast<size_t>(rows) * ((cols + 31) / 32);
    EXPECT_EQ(packed.bits.size(), plane_words);
    EXPECT_EQ(packed.large.size(), plane_words);
    EXPECT_EQ(packed.bytes(), static_cast<int64_t>(plane_words) * 2 * 4 + static_cast<int64_t>(rows) * 5 * 4)
        << "R " << rows << " K " << cols;
    EXPECT_EQ(packed.bytes(), sign_bits_bytes(rows, cols));
    if (cols < 2) continue;
    // With exact columns: a float per row and an index per column more.
    const std::vector<int32_t> exact_columns = cols >= 33 ? exact_column_sets(cols).back() : std::vector<int32_t>{0};
    const int32_t count = static_cast<int32_t>(exact_columns.size());
    const SignBits exact = pack_sign_bits(matrix.data(), rows, cols, exact_columns);
    EXPECT_EQ(exact.bytes(), packed.bytes() + static_cast<int64_t>(rows) * count * 4 + count * 4)
        << "R " << rows << " K " << cols;
    EXPECT_EQ(exact.bytes(), sign_bits_bytes(rows, cols, count));
  }
}

TEST(DecodeSignRule, IntegerThresholdIsTheRule) {
  for (int32_t d : {1, 7, 64, 2048, 4099})
    for (double alpha : {-1.0, 0.0, 1e-9, 0.5, 0.9, 1.0, 1.2, 3.0, 1e30, std::numeric_limits<double>::infinity()}) {
      const int32_t max_negatives = sign_rule_max_negatives(alpha, d);
      for (int32_t n = 0; n <= d; ++n)
        ASSERT_EQ(n <= max_negatives, !(static_cast<double>(n) > alpha * (d - n))) << "D " << d << " alpha " << alpha
                                                                                    << " n " << n;
    }
  EXPECT_THROW(sign_rule_max_negatives(std::nan(""), 10), Error);
}

TEST(DecodeCalibration, ReachesTargetRecall) {
  WorkloadSpec spec{.rows = 64, .d_model = 512, .d_hidden = 1024, .density = 0.02, .seed = 21};
  Workload work = make_workload(spec);
  const SignBits signs = pack_sign_bits(work.weights.gate.data(), spec.d_hidden, spec.d_model);
  for (PredictorKind kind : {PredictorKind::sign_rule, PredictorKind::one_bit_gate,
                             PredictorKind::normalized_one_bit_gate, PredictorKind::two_bit_gate})
    for (double target : {0.9, 0.99, 1.0}) {
      SCOPED_TRACE(fmt::format("{} recall {}", to_string(kind), target));
      Calibration calibration = calibrate_predictor(work.x.data(), spec.rows, work.weights, signs, kind, target);
      EXPECT_GT(calibration.quality.active, 0);
      EXPECT_GE(calibration.quality.recall(), target);
      EXPECT_EQ(calibration.config.kind, kind);
      EXPECT_EQ(calibration.config.predicted_fraction, calibration.quality.predicted_fraction());
      // Same samples, measured again through the public function: the same quality.
      PredictorQuality again = measure_predictor(work.x.data(), spec.rows, work.weights, signs, calibration.config);
      EXPECT_EQ(again.kept, calibration.quality.kept);
      EXPECT_EQ(again.predicted, calibration.quality.predicted);
      // The CPU decode FFN counts the same misses on the same samples (16 rows at a time).
      int64_t missed = 0;
      std::vector<float> y(static_cast<size_t>(16) * spec.d_model);
      cpu::DecodeScratch scratch;
      for (int64_t m = 0; m < spec.rows; m += 16)
        missed += cpu::decode_ffn(work.x.data() + m * spec.d_model, 16, work.weights, signs, calibration.config,
                                  y.data(), scratch, {.count_missed = true, .gates = GateSelection::predicted})
                      .missed;
      EXPECT_EQ(missed, calibration.quality.active - calibration.quality.kept);
    }
}

// ---- Exact columns: which to keep, and what they buy --------------------------------------------------

// The standard workload's threshold column (x[:, 0] = 1 against W[j, 0] = −t_j) is chosen, alone.
TEST(DecodeExactColumns, ChoosesTheThresholdColumn) {
  for (auto [cols, hidden, density] : {std::tuple{256, 512, 0.005}, std::tuple{333, 301, 0.05}}) {
    const Workload work = make_workload({.rows = 64, .d_model = cols, .d_hidden = hidden, .density = density});
    EXPECT_EQ(choose_exact_columns(work.x.data(), 64, work.weights.gate.data(), hidden, cols),
              std::vector<int32_t>{0})
        << "D " << cols;
    EXPECT_TRUE(choose_exact_columns(work.x.data(), 64, work.weights.gate.data(), hidden, cols, 0).empty());
  }
}

// Without an outlier column nothing is chosen; a planted outlier input channel is.
TEST(DecodeExactColumns, ChoosesOnlyOutliers) {
  const int32_t rows = 64, cols = 300, hidden = 400;
  Workload work = make_workload({.rows = rows, .d_model = cols, .d_hidden = hidden, .density = 0.02, .seed = 5});
  // No threshold column: x[:, 0] random like the others, W[:, 0] like the other columns.
  const std::vector<float> fresh = make_normal(static_cast<size_t>(rows) + hidden, 1.0, 99);
  for (int32_t m = 0; m < rows; ++m) work.x[m * cols] = fresh[m];
  for (int32_t j = 0; j < hidden; ++j) work.weights.gate[static_cast<size_t>(j) * cols] = fresh[rows + j] / std::sqrt(cols);
  EXPECT_TRUE(choose_exact_columns(work.x.data(), rows, work.weights.gate.data(), hidden, cols).empty());
  // Massive activations in two channels (x 30 times the typical size): those two, ascending.
  for (int32_t m = 0; m < rows; ++m) {
    work.x[m * cols + 211] *= 30.0f;
    work.x[m * cols + 17] *= 30.0f;
  }
  EXPECT_EQ(choose_exact_columns(work.x.data(), rows, work.weights.gate.data(), hidden, cols),
            (std::vector<int32_t>{17, 211}));
  const std::vector<int32_t> one = choose_exact_columns(work.x.data(), rows, work.weights.gate.data(), hidden, cols, 1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_TRUE(one[0] == 17 || one[0] == 211) << one[0];
  EXPECT_THROW(choose_exact_columns(work.x.data(), rows, work.weights.gate.data(), hidden, cols, kMaxExactColumns + 1),
               Error);
  EXPECT_THROW(choose_exact_columns(work.x.data(), 0, work.weights.gate.data(), hidden, cols), Error);
}

// The point of exact columns: on the standard workload, calibrated for 99% recall, the gates with the
// threshold column exact keep far fewer neurons than without it (measured on sample tokens apart
// from the calibration ones). The bound per gate sits above what this seed measures (0.40, 0.47,
// 0.60 of the neurons kept without): the two-bit gate gains least, as its large plane already sees
// part of the threshold column.
TEST(DecodeExactColumns, KeepFarFewerNeuronsAtTheSameRecall) {
  const int32_t cols = 384, hidden = 2048;
  const WorkloadSpec spec{.rows = 1, .d_model = cols, .d_hidden = hidden, .density = 0.005, .seed = 3};
  const FfnWeights weights = make_workload(spec).weights;
  const std::vector<float> calibration = make_activations(512, cols, 77), evaluation = make_activations(512, cols, 78);
  const std::vector<int32_t> chosen = choose_exact_columns(calibration.data(), 512, weights.gate.data(), hidden, cols);
  ASSERT_EQ(chosen, std::vector<int32_t>{0});
  const SignBits plain = pack_sign_bits(weights.gate.data(), hidden, cols);
  const SignBits exact = pack_sign_bits(weights.gate.data(), hidden, cols, chosen);
  for (auto [kind, bound] : {std::pair{PredictorKind::one_bit_gate, 0.5},
                             std::pair{PredictorKind::normalized_one_bit_gate, 0.55},
                             std::pair{PredictorKind::two_bit_gate, 0.7}}) {
    SCOPED_TRACE(to_string(kind));
    const Calibration without = calibrate_predictor(calibration.data(), 512, weights, plain, kind, 0.99);
    const Calibration with = calibrate_predictor(calibration.data(), 512, weights, exact, kind, 0.99);
    EXPECT_EQ(with.exact_columns, chosen);
    EXPECT_TRUE(without.exact_columns.empty());
    const PredictorQuality before = measure_predictor(evaluation.data(), 512, weights, plain, without.config);
    const PredictorQuality after = measure_predictor(evaluation.data(), 512, weights, exact, with.config);
    std::printf("[ %s D=%d H=%d 0.5%% ] kept %.2f%% of neurons without exact columns, %.2f%% with column 0 exact; "
                "recall %.4f / %.4f\n",
                to_string(kind).c_str(), cols, hidden, 100 * before.predicted_fraction(),
                100 * after.predicted_fraction(), before.recall(), after.recall());
    EXPECT_GT(after.recall(), 0.97);
    EXPECT_LT(after.predicted_fraction(), bound * before.predicted_fraction());
  }
}

TEST(DecodeBadInput, RejectsWithAMessage) {
  WorkloadSpec spec{.rows = 17, .d_model = 64, .d_hidden = 32, .density = 0.1};
  Workload work = make_workload(spec);
  const SignBits signs = pack_sign_bits(work.weights.gate.data(), spec.d_hidden, spec.d_model);
  std::vector<float> y(static_cast<size_t>(spec.rows) * spec.d_model);
  cpu::DecodeScratch scratch;
  EXPECT_THROW(cpu::decode_ffn(work.x.data(), 17, work.weights, signs, {}, y.data(), scratch), Error);
  EXPECT_THROW(cpu::decode_ffn(work.x.data(), 0, work.weights, signs, {}, y.data(), scratch), Error);
  const SignBits wrong = pack_sign_bits(work.weights.gate.data(), spec.d_hidden / 2, spec.d_model);
  EXPECT_THROW(cpu::decode_ffn(work.x.data(), 1, work.weights, wrong, {}, y.data(), scratch), Error);
  EXPECT_THROW(parse_predictor_kind("popcount"), Error);
  for (PredictorKind kind : {PredictorKind::sign_rule, PredictorKind::one_bit_gate,
                             PredictorKind::normalized_one_bit_gate, PredictorKind::two_bit_gate})
    EXPECT_EQ(parse_predictor_kind(to_string(kind)), kind);
  SignBits no_two_bit = signs;
  no_two_bit.large.clear();
  EXPECT_THROW(cpu::decode_ffn(work.x.data(), 1, work.weights, no_two_bit, {}, y.data(), scratch), Error);
  SignBits no_residual = signs;
  no_residual.residual.clear();
  EXPECT_THROW(cpu::decode_ffn(work.x.data(), 1, work.weights, no_residual, {}, y.data(), scratch), Error);
  EXPECT_THROW(calibrate_predictor(work.x.data(), 1, work.weights, signs, PredictorKind::sign_rule, 1.5), Error);
}

}  // namespace
}  // namespace twell
