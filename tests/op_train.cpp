// Harness ops of the training FFN: TwELL -> hybrid (exact), hybrid forward (y, L1, L0) and
// backward (dx, d_gate, d_up, d_down), against the float64 reference. OpHarnessTrain shows the
// checks fail on broken ops.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "op_harness.h"
#include "reference/ffn_loops.h"
#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/error.h"
#include "twell/reference.h"

namespace twell::test {
namespace {

// The training gate of a case: the reference TwELL packing, converted to hybrid.
HybridMatrix reference_hybrid_gate(const Workload& work, const OpCase& c) {
  return hybrid_from_twell(ref::gate_to_twell(work.x.data(), c.rows, work.weights, c.tile, c.compression),
                           c.ell_width);
}

std::vector<float> dense_gate_values(const HybridMatrix& gate) {
  const std::vector<bf16> dense = dense_from_hybrid(gate);  // [M, H]
  std::vector<float> values(dense.size());
  for (size_t i = 0; i < dense.size(); ++i) values[i] = to_float(dense[i]);
  return values;
}

void round_to_bf16_if(bool round, std::vector<float>& values) {
  if (round)
    for (float& v : values) v = round_to_bf16(v);
}

double naive_relative_error(const std::vector<float>& naive, const std::vector<double>& reference) {
  return relative_l2_error(naive.data(), reference.data(), reference.size());
}

bool same_bits(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](bf16 x, bf16 y) { return x.bits == y.bits; });
}

// TwELL -> hybrid is data movement: the same rows in the ELL block and in the backup, the same
// values bit for bit. Backup row order is free (a GPU may hand rows out in any order).
testing::AssertionResult run_twell_to_hybrid(const FfnBackend& backend, const OpCase& c) {
  const Workload work = make_workload(c.workload_spec());
  const TwellMatrix gate = ref::gate_to_twell(work.x.data(), c.rows, work.weights, c.tile, c.compression);
  const HybridMatrix expected = hybrid_from_twell(gate, c.ell_width);
  HybridMatrix got;
  switch (c.seed % 3) {  // fresh, roomy, too small
    case 0: break;
    case 1: poison(got, expected.shape, expected.backup_used + 2); break;
    default: poison(got, expected.shape, 0); break;
  }
  backend.twell_to_hybrid(gate, c.ell_width, got);
  try {
    validate(got);
  } catch (const Error& error) {
    return testing::AssertionFailure() << "invalid hybrid: " << error.what();
  }
  if (got.shape.rows != c.rows || got.shape.cols != c.d_hidden || got.shape.ell_width != c.ell_width)
    return testing::AssertionFailure() << "shape (M, H, W) = (" << got.shape.rows << ", " << got.shape.cols << ", "
                                       << got.shape.ell_width << "), expected (" << c.rows << ", " << c.d_hidden
                                       << ", " << c.ell_width << ")";
  if (got.row_nnz != expected.row_nnz) return testing::AssertionFailure() << "row_nnz differs from the reference";
  if (got.backup_used != expected.backup_used)
    return testing::AssertionFailure() << "backup_used = " << got.backup_used << ", expected " << expected.backup_used;
  if (!same_bits(dense_from_hybrid(got), dense_from_hybrid(expected)))
    return testing::AssertionFailure() << "the unpacked values differ from the reference";
  return testing::AssertionSuccess();
}

testing::AssertionResult near_scalar(const char* what, double got, double expected, double tolerance) {
  const double error = std::abs(got - expected) / std::max(1.0, std::abs(expected));
  if (error <= tolerance) return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << " = " << got << ", reference " << expected << ": relative error "
                                     << error << " > " << tolerance;
}

testing::AssertionResult run_hybrid_forward(const FfnBackend& backend, const OpCase& c) {
  const Workload work = make_workload(c.workload_spec());
  const HybridMatrix gate = reference_hybrid_gate(work, c);
  const ref::HybridForward expected = ref::hybrid_ffn_forward(work.x.data(), gate, work.weights, c.l1_coeff);

  const ref::FfnFromGate<float> naive = ref::ffn_from_gate<float>(
      work.x.data(), c.rows, dense_gate_values(gate), work.weights, backend.precision.hidden_bf16);
  std::vector<float> naive_y = naive.y;
  round_to_bf16_if(backend.precision.output_bf16, naive_y);
  float naive_abs_h = 0;
  for (float h : naive.h) naive_abs_h += std::abs(h);
  const double naive_l1 = c.l1_coeff * naive_abs_h / static_cast<double>(c.rows);

  std::vector<float> y;
  poison(y, expected.y.size());
  double l1 = std::numeric_limits<double>::quiet_NaN(), l0 = std::numeric_limits<double>::quiet_NaN();
  backend.hybrid_forward(work.x.data(), gate, work.weights, c.l1_coeff, y.data(), l1, l0);

  testing::AssertionResult y_ok = near_relative_l2(
      "y", y.data(), expected.y.data(), expected.y.size(),
      derived_tolerance(naive_relative_error(naive_y, expected.y), 1e-6));
  if (!y_ok) return y_ok;
  const double naive_l1_error = std::abs(naive_l1 - expected.l1) / std::max(1.0, std::abs(expected.l1));
  testing::AssertionResult l1_ok = near_scalar("l1", l1, expected.l1, derived_tolerance(naive_l1_error, 1e-6));
  if (!l1_ok) return l1_ok;
  return near_scalar("l0", l0, expected.l0, 1e-6);  // a count: exact but for the division
}

testing::AssertionResult run_hybrid_backward(const FfnBackend& backend, const OpCase& c) {
  const Workload work = make_workload(c.workload_spec());
  const HybridMatrix gate = reference_hybrid_gate(work, c);
  const std::vector<float> dy = make_activations(c.rows, c.d_model, c.seed + 1000);  // [M, D]
  const ref::FfnGrads expected = ref::hybrid_ffn_backward(work.x.data(), gate, work.weights, dy.data(), c.l1_coeff);
  ref::FfnGradsOf<float> naive = ref::ffn_backward_from_gate<float>(work.x.data(), c.rows, dense_gate_values(gate),
                                                                    work.weights, dy.data(), c.l1_coeff);

  std::vector<float> dx, d_gate, d_up, d_down;
  poison(dx, expected.dx.size());
  poison(d_gate, expected.d_gate.size());
  poison(d_up, expected.d_up.size());
  poison(d_down, expected.d_down.size());
  backend.hybrid_backward(work.x.data(), gate, work.weights, dy.data(), c.l1_coeff,
                          GradOutputs{dx.data(), d_gate.data(), d_up.data(), d_down.data()});

  struct Grad {
    const char* name;
    const std::vector<float>& got;
    std::vector<float>& naive;
    const std::vector<double>& expected;
  };
  for (const Grad& grad : {Grad{"dx", dx, naive.dx, expected.dx}, Grad{"d_gate", d_gate, naive.d_gate, expected.d_gate},
                           Grad{"d_up", d_up, naive.d_up, expected.d_up},
                           Grad{"d_down", d_down, naive.d_down, expected.d_down}}) {
    round_to_bf16_if(backend.precision.output_bf16, grad.naive);
    testing::AssertionResult ok =
        near_relative_l2(grad.name, grad.got.data(), grad.expected.data(), grad.expected.size(),
                         derived_tolerance(naive_relative_error(grad.naive, grad.expected), 1e-6));
    if (!ok) return ok;
  }
  return testing::AssertionSuccess();
}

class TwellToHybrid : public OpTest {};
TEST_P(TwellToHybrid, MatchesReference) { EXPECT_TRUE(run_twell_to_hybrid(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, TwellToHybrid,
                         testing::ValuesIn(backend_cases(&FfnBackend::twell_to_hybrid, hybrid_cases())),
                         backend_case_name<OpCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TwellToHybrid);

class HybridForward : public OpTest {};
TEST_P(HybridForward, MatchesReference) { EXPECT_TRUE(run_hybrid_forward(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, HybridForward,
                         testing::ValuesIn(backend_cases(&FfnBackend::hybrid_forward, hybrid_cases())),
                         backend_case_name<OpCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(HybridForward);

class HybridBackward : public OpTest {};
TEST_P(HybridBackward, MatchesReference) { EXPECT_TRUE(run_hybrid_backward(backend(), op_case())); }
INSTANTIATE_TEST_SUITE_P(Ops, HybridBackward,
                         testing::ValuesIn(backend_cases(&FfnBackend::hybrid_backward, hybrid_cases())),
                         backend_case_name<OpCase>);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(HybridBackward);

// ---- The checks can fail: a backend built from the reference passes, broken variants do not ----

FfnBackend reference_backend() {
  FfnBackend backend;
  backend.name = "reference";
  backend.twell_to_hybrid = [](const TwellMatrix& gate, int32_t ell_width, HybridMatrix& out) {
    out = hybrid_from_twell(gate, ell_width);
  };
  backend.hybrid_forward = [](const float* x, const HybridMatrix& gate, const FfnWeights& w, double l1_coeff, float* y,
                              double& l1, double& l0) {
    const ref::HybridForward forward = ref::hybrid_ffn_forward(x, gate, w, l1_coeff);
    copy_to_float(forward.y, y);
    l1 = forward.l1;
    l0 = forward.l0;
  };
  backend.hybrid_backward = [](const float* x, const HybridMatrix& gate, const FfnWeights& w, const float* dy,
                               double l1_coeff, const GradOutputs& out) {
    const ref::FfnGrads grads = ref::hybrid_ffn_backward(x, gate, w, dy, l1_coeff);
    copy_to_float(grads.dx, out.dx);
    copy_to_float(grads.d_gate, out.d_gate);
    copy_to_float(grads.d_up, out.d_up);
    copy_to_float(grads.d_down, out.d_down);
  };
  return backend;
}

// W = 8 at 10% of H = 1000: most rows go to the backup, some stay in the ELL block.
const OpCase kSelfTestCase{.rows = 17, .d_model = 64, .d_hidden = 1000, .density = 0.01, .hot_neurons = 3,
                           .ell_width = 8, .l1_coeff = 0.3, .seed = 1};

TEST(OpHarnessTrain, ReferenceBackendPasses) {
  const FfnBackend backend = reference_backend();
  const Workload work = make_workload(kSelfTestCase.workload_spec());
  const HybridMatrix gate = reference_hybrid_gate(work, kSelfTestCase);
  ASSERT_GT(gate.backup_used, 0);
  ASSERT_LT(gate.backup_used, kSelfTestCase.rows);
  EXPECT_TRUE(run_twell_to_hybrid(backend, kSelfTestCase));
  EXPECT_TRUE(run_hybrid_forward(backend, kSelfTestCase));
  EXPECT_TRUE(run_hybrid_backward(backend, kSelfTestCase));
}

TEST(OpHarnessTrain, BrokenOpsFail) {
  FfnBackend backend = reference_backend();
  const FfnBackend correct = reference_backend();
  backend.twell_to_hybrid = [&](const TwellMatrix& gate, int32_t ell_width, HybridMatrix& out) {
    correct.twell_to_hybrid(gate, ell_width, out);
    for (size_t i = 0; i < out.backup.size(); ++i)  // one backup value changed
      if (out.backup[i].bits != 0) {
        out.backup[i].bits ^= 1;
        return;
      }
  };
  EXPECT_FALSE(run_twell_to_hybrid(backend, kSelfTestCase));

  backend.hybrid_forward = [&](const float* x, const HybridMatrix& gate, const FfnWeights& w, double, float* y,
                               double& l1, double& l0) { correct.hybrid_forward(x, gate, w, 0.0, y, l1, l0); };
  EXPECT_FALSE(run_hybrid_forward(backend, kSelfTestCase));  // the L1 term forgotten

  backend.hybrid_backward = [&](const float* x, const HybridMatrix& gate, const FfnWeights& w, const float* dy, double,
                                const GradOutputs& out) { correct.hybrid_backward(x, gate, w, dy, 0.0, out); };
  EXPECT_FALSE(run_hybrid_backward(backend, kSelfTestCase));  // the L1 gradient forgotten

  backend.hybrid_backward = [&](const float* x, const HybridMatrix& gate, const FfnWeights& w, const float* dy,
                                double l1_coeff, const GradOutputs& out) {
    correct.hybrid_backward(x, gate, w, dy, l1_coeff, out);
    out.d_down[0] = std::numeric_limits<float>::quiet_NaN();  // left unwritten
  };
  EXPECT_FALSE(run_hybrid_backward(backend, kSelfTestCase));
}

}  // namespace
}  // namespace twell::test
