// Harness ops of the inference FFN: gate -> TwELL, FFN from TwELL (gated and non-gated), dense FFN.
// Each run_* compares one backend's op on one case with the float64 reference and says what differs;
// the TEST_Ps run every registered backend over the sweeps, and OpHarnessFfn shows the checks fail
// on broken ops.
#include <algorithm>
#include <cmath>
#include <functional>

#include "op_harness.h"
#include "reference/ffn_loops.h"
#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/error.h"
#include "twell/reference.h"

namespace twell::test {
namespace {

// The error of a naive loop in the backend's precision against float64: what sets the tolerance.
std::vector<float> naive_ffn_from_gate(const float* x, int64_t rows, const std::vector<float>& gate,
                                       const FfnWeights& weights, const BackendPrecision& precision) {
  std::vector<float> y = ref::ffn_from_gate<float>(x, rows, gate, weights, precision.hidden_bf16).y;
  if (precision.output_bf16)
    for (float& v : y) v = round_to_bf16(v);
  return y;
}

double naive_relative_error(const std::vector<float>& naive, const std::vector<double>& reference) {
  return relative_l2_error(naive.data(), reference.data(), reference.size());
}

std::vector<float> dense_gate_values(const TwellMatrix& gate) {
  const std::vector<bf16> dense = dense_from_twell(gate);  // [M, H]
  std::vector<float> values(dense.size());
  for (size_t i = 0; i < dense.size(); ++i) values[i] = to_float(dense[i]);
  return values;
}

// bf16 spacing at |v|: 8 significant bits.
float bf16_ulp(float v) {
  if (v == 0.0f) return 0.0f;
  int exponent;
  std::frexp(v, &exponent);
  return std::ldexp(1.0f, exponent - 8);
}

// gate -> TwELL. The kernel accumulates in fp32 (any order) and rounds to bf16; the reference rounds
// the float64 gate. The two bf16 values can straddle a rounding boundary, and a gate within the
// fp32 error of 0 can be packed by one and not the other (measured on the CPU kernels, D = 2048,
// M = 300: 12 of 29619 stored values differ by one ulp). So each unpacked element must lie within
// one bf16 ulp plus the derived fp32 accumulation error of the reference: exact data movement,
// exact structure (validate, and a tile spills iff it holds more than S non-zeros), near values.
testing::AssertionResult run_gate_to_twell(const FfnBackend& backend, const OpCase& c) {
  const Workload work = make_workload(c.workload_spec());
  const FfnWeights& w = work.weights;
  const TwellMatrix expected = ref::gate_to_twell(work.x.data(), c.rows, w, c.tile, c.compression);
  const std::vector<double> gate64 = ref::relu_projection(work.x.data(), c.rows, w);      // [M, H]
  const std::vector<float> gate32 = ref::relu_gate<float>(work.x.data(), c.rows, w);      // [M, H] naive
  double naive_error = 0, largest = 0;
  for (size_t i = 0; i < gate64.size(); ++i) {
    naive_error = std::max(naive_error, std::abs(gate32[i] - gate64[i]));
    largest = std::max(largest, gate64[i]);
  }
  const double abs_tolerance = derived_tolerance(naive_error, 0x1p-22 * largest);

  TwellMatrix got;
  switch (c.seed % 4) {  // every way a caller may hand over `out`: fresh, exact, roomy, too small
    case 0: break;
    case 1: poison(got, expected.shape, expected.spill_used); break;
    case 2: poison(got, expected.shape, expected.spill_used + 3); break;
    default: poison(got, expected.shape, 0); break;
  }
  backend.gate_to_twell(work.x.data(), c.rows, w, c.tile, c.compression, got);

  try {
    validate(got);
  } catch (const Error& error) {
    return testing::AssertionFailure() << "invalid TwELL: " << error.what();
  }
  const TwellShape& shape = got.shape;
  if (shape.rows != c.rows || shape.cols != c.d_hidden || shape.tile != c.tile || shape.compression != c.compression)
    return testing::AssertionFailure() << "shape (M, H, T, C) = (" << shape.rows << ", " << shape.cols << ", "
                                       << shape.tile << ", " << shape.compression << "), expected (" << c.rows << ", "
                                       << c.d_hidden << ", " << c.tile << ", " << c.compression << ")";
  const std::vector<float> got_dense = dense_gate_values(got);        // [M, H]
  const std::vector<float> expected_dense = dense_gate_values(expected);
  int64_t pattern_differences = 0;
  for (int64_t m = 0; m < c.rows; ++m)
    for (int32_t t = 0; t < shape.n_tiles(); ++t) {
      int32_t nnz = 0;
      for (int32_t col = t * c.tile; col < std::min(c.d_hidden, (t + 1) * c.tile); ++col) {
        const size_t i = static_cast<size_t>(m) * c.d_hidden + col;
        const float a = got_dense[i], b = expected_dense[i];
        nnz += a != 0.0f;
        pattern_differences += (a != 0.0f) != (b != 0.0f);
        const double bound = bf16_ulp(std::max(std::abs(a), std::abs(b))) + abs_tolerance;
        if (!(std::abs(a - b) <= bound))
          return testing::AssertionFailure() << "g[" << m << ", " << col << "] = " << a << ", reference " << b
                                             << " (float64 " << gate64[i] << "): off by more than 1 bf16 ulp + "
                                             << abs_tolerance << " (4 x the naive fp32 error " << naive_error << ")";
      }
      const bool spilled = twell_tile_spilled(got.tile_nnz[shape.tile_index(m, t)]);
      if (spilled != (nnz > shape.slots()))
        return testing::AssertionFailure() << "tile [" << m << ", " << t << "] holds " << nnz << " non-zeros for "
                                           << shape.slots() << " slots but is " << (spilled ? "" : "not ")
                                           << "spilled";
    }
  // Near-zero gates may be packed differently, never many.
  if (pattern_differences > std::max<int64_t>(2, static_cast<int64_t>(gate64.size()) / 1000))
    return testing::AssertionFailure() << pattern_differences << " elements are packed by only one of kernel and reference";
  return testing::AssertionSuccess();
}

// y from TwELL; the gate is the reference packing, so only this op is under test.
testing::AssertionResult run_ffn_from_twell(const FfnBackend& backend, const OpCase& c) {
  const Workload work = make_workload(c.workload_spec());
  const TwellMatrix gate = ref::gate_to_twell(work.x.data(), c.rows, work.weights, c.tile, c.compression);
  const std::vector<double> expected = ref::ffn_from_twell(work.x.data(), gate, work.weights);  // [M, D]
  const double naive_error = naive_relative_error(
      naive_ffn_from_gate(work.x.data(), c.rows, dense_gate_values(gate), work.weights, backend.precision), expected);
  std::vector<float> y;
  poison(y, expected.size());
  backend.ffn_from_twell(work.x.data(), gate, work.weights, y.data());
  return near_relative_l2("y", y.data(), expected.data(), expected.size(), derived_tolerance(naive_error, 1e-6));
}

testing::AssertionResult run_ffn_dense(const FfnBackend& backend, const OpCase& c) {
  const Workload work = make_workload(c.workload_spec());
  const std::vector<double> expected = ref::ffn_dense(work.x.data(), c.rows, work.weights);  // [M, D]
  const std::vector<float> gate32 = ref::relu_gate<float>(work.x.data(), c.rows, work.weights);
  const double naive_error =
      naive_relative_error(naive_ffn_from_gate(work.x.data(), c.rows, gate32, work.weights, backend.precision), expected);
  std::vector<float> y;
  poison(y, expected.size());
  backend.ffn_dense(work.x.data(), c.rows, work.weights, y.data());
  return near_relative_l2("y", y.data(), expected.data(), expected.size(), derived_tolerance(naive_error, 1e-6));
}

class GateToTwell : public OpTest {};
TEST_P(GateToTwell, MatchesReference) { EXPECT_TRUE(run_gate_to_twell(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, GateToTwell, testing::ValuesIn(backend_cases(&FfnBackend::gate_to_twell, twell_cases())),
                         backend_case_name<OpCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GateToTwell);

class FfnFromTwell : public OpTest {};
TEST_P(FfnFromTwell, MatchesReference) { EXPECT_TRUE(run_ffn_from_twell(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, FfnFromTwell,
                         testing::ValuesIn(backend_cases(&FfnBackend::ffn_from_twell, twell_cases())),
                         backend_case_name<OpCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(FfnFromTwell);

class FfnDense : public OpTest {};
TEST_P(FfnDense, MatchesReference) { EXPECT_TRUE(run_ffn_dense(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, FfnDense, testing::ValuesIn(backend_cases(&FfnBackend::ffn_dense, dense_cases())),
                         backend_case_name<OpCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(FfnDense);

// ---- The checks can fail: a backend built from the reference passes, broken variants do not ----

FfnBackend reference_backend() {
  FfnBackend backend;
  backend.name = "reference";
  backend.gate_to_twell = [](const float* x, int64_t rows, const FfnWeights& w, int32_t tile, int32_t compression,
                             TwellMatrix& out) { out = ref::gate_to_twell(x, rows, w, tile, compression); };
  backend.ffn_from_twell = [](const float* x, const TwellMatrix& gate, const FfnWeights& w, float* y) {
    copy_to_float(ref::ffn_from_twell(x, gate, w), y);
  };
  backend.ffn_dense = [](const float* x, int64_t rows, const FfnWeights& w, float* y) {
    copy_to_float(ref::ffn_dense(x, rows, w), y);
  };
  return backend;
}

// Spills at C = 2 and has a partial last tile; seed 1 hands the op a poisoned `out`.
const OpCase kSelfTestCase{.rows = 17, .d_model = 96, .d_hidden = 1000, .density = 0.5, .tile = 128,
                           .compression = 2, .seed = 1};

TEST(OpHarnessFfn, ReferenceBackendPasses) {
  const FfnBackend backend = reference_backend();
  EXPECT_TRUE(run_gate_to_twell(backend, kSelfTestCase));
  EXPECT_TRUE(run_ffn_from_twell(backend, kSelfTestCase));
  EXPECT_TRUE(run_ffn_dense(backend, kSelfTestCase));
}

TEST(OpHarnessFfn, BrokenGateToTwellFails) {
  FfnBackend backend = reference_backend();
  const auto correct = backend.gate_to_twell;
  auto broken = [&](std::function<void(TwellMatrix&)> damage) {
    backend.gate_to_twell = [&, damage](const float* x, int64_t rows, const FfnWeights& w, int32_t tile,
                                        int32_t compression, TwellMatrix& out) {
      correct(x, rows, w, tile, compression, out);
      damage(out);
    };
    return run_gate_to_twell(backend, kSelfTestCase);
  };
  EXPECT_FALSE(broken([](TwellMatrix& out) {  // one stored value off by 2 ulps
    for (size_t t = 0; t < out.tile_nnz.size(); ++t)
      if (out.tile_nnz[t] > 0) {
        out.slots[t * out.shape.slots()] += 2;
        return;
      }
  }));
  EXPECT_FALSE(broken([](TwellMatrix& out) {  // the last non-zero of a slot tile dropped
    for (size_t t = 0; t < out.tile_nnz.size(); ++t)
      if (out.tile_nnz[t] > 0) {
        out.slots[t * out.shape.slots() + --out.tile_nnz[t]] = 0;
        return;
      }
  }));
  EXPECT_FALSE(broken([](TwellMatrix& out) {  // a spilled tile zeroed
    for (auto& value : out.spill) value = bf16{0};
  }));
  EXPECT_FALSE(broken([](TwellMatrix& out) { out.spill_used += 1; }));  // incomplete
}

TEST(OpHarnessFfn, BrokenFfnFails) {
  FfnBackend backend = reference_backend();
  const auto correct_from_twell = backend.ffn_from_twell;
  backend.ffn_from_twell = [&](const float* x, const TwellMatrix& gate, const FfnWeights& w, float* y) {
    correct_from_twell(x, gate, w, y);
    y[gate.shape.rows * w.d_model - 1] = std::numeric_limits<float>::quiet_NaN();  // last element left unwritten
  };
  EXPECT_FALSE(run_ffn_from_twell(backend, kSelfTestCase));
  backend.ffn_from_twell = [&](const float* x, const TwellMatrix& gate, const FfnWeights& w, float* y) {
    correct_from_twell(x, gate, w, y);
    y[3] *= 1.001f;  // one element of thousands off by 0.1%
  };
  EXPECT_FALSE(run_ffn_from_twell(backend, kSelfTestCase));
  backend.ffn_dense = [](const float* x, int64_t rows, const FfnWeights& w, float* y) {
    FfnWeights without_gate = w;  // forgets the gate: y = relu(x·Wu^T)·Wd
    without_gate.gated = false;
    without_gate.gate.clear();
    copy_to_float(ref::ffn_dense(x, rows, without_gate), y);
  };
  EXPECT_FALSE(run_ffn_dense(backend, kSelfTestCase));
}

}  // namespace
}  // namespace twell::test
