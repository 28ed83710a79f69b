// The one op-test harness (in the spirit of ggml's test-backend-ops): every op of every backend is
// run over a sampled sweep of shapes, densities and format parameters, and compared with the
// float64 reference (include/twell/reference.h).
//
// A backend plugs in from its own file (tests/backend_cpu.cpp, tests/backend_cuda.cpp, ...) with a
// static registrar, without editing the harness:
//
//   namespace {
//   const bool registered = twell::test::register_backend({
//       .name = "cpu_avx2",
//       .skip_reason = [] { return cpu_has_avx2() ? "" : "this CPU has no AVX2"; },
//       .gate_to_twell = [](const float* x, int64_t rows, const twell::FfnWeights& w, int32_t tile,
//                           int32_t compression, twell::TwellMatrix& out) { ... },
//       .ffn_dense = ...,
//   });
//   }  // namespace
//
// An op left empty means "not supported": the harness instantiates no test for that pair.
// A backend that is compiled in but cannot run here (CUDA without a GPU) says why in skip_reason;
// its tests are skipped with that message.
//
// Every op takes and returns host memory; a device backend copies in and out inside its adapter.
// Every op must return a complete result: a device producer that reports an overflowing spill or
// backup (spill_used > capacity) is grown and run again by its adapter.
//
// Adding an op: (1) an `XxxOp` alias and a field in FfnBackend, (2) its cases and a TEST_P in a
// tests/op_<area>.cpp using OpTest and backend_cases(&FfnBackend::xxx, cases), (3) fill the field
// in each backend file that implements it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "twell/decode.h"
#include "twell/host_tensors.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell::test {

// ---- Ops: the signatures every backend implements (shapes as in include/twell/reference.h) ----

// g = relu(x·W^T), W = weights.relu_projection(), packed into `out`. x [M, D].
// `out` arrives poisoned (garbage arrays of the right size, or empty): every element must be written.
using GateToTwellOp = std::function<void(const float* x, int64_t rows, const FfnWeights& weights, int32_t tile,
                                         int32_t compression, TwellMatrix& out)>;
// y [M, D] from the packed relu projection (gated: up and down at non-zeros; non-gated: down only).
using FfnFromTwellOp =
    std::function<void(const float* x, const TwellMatrix& gate, const FfnWeights& weights, float* y)>;
// y [M, D], the dense FFN (the baseline every sparse op is timed against).
using FfnDenseOp = std::function<void(const float* x, int64_t rows, const FfnWeights& weights, float* y)>;
// TwELL -> hybrid with ELL width W; `out` arrives poisoned.
using TwellToHybridOp = std::function<void(const TwellMatrix& gate, int32_t ell_width, HybridMatrix& out)>;
// Training forward on the hybrid gate (gated weights): y [M, D], l1 = coeff·Σ|h|/M, l0 = mean nnz per row.
using HybridForwardOp = std::function<void(const float* x, const HybridMatrix& gate, const FfnWeights& weights,
                                           double l1_coeff, float* y, double& l1, double& l0)>;
// Training backward: gradients of <dy, y> + coeff·Σ|h|/M. dy [M, D].
struct GradOutputs {
  float* dx;      // [M, D]
  float* d_gate;  // [H, D]
  float* d_up;    // [H, D]
  float* d_down;  // [H, D]
};
using HybridBackwardOp = std::function<void(const float* x, const HybridMatrix& gate, const FfnWeights& weights,
                                            const float* dy, double l1_coeff, const GradOutputs& grads)>;
// Decode FFN (include/twell/decode.h): y [M, D] through the predictor's active set of the packed
// signs; returns the counts. `y` arrives poisoned. The cases live in tests/test_decode.cpp.
using DecodeFfnOp = std::function<DecodeStats(const float* x, int64_t rows, const FfnWeights& weights,
                                              const SignBits& signs, const PredictorConfig& predictor, float* y,
                                              const DecodeOptions& options)>;

// The decode step's projection (src/cuda/decode_gemv.h), M <= 4 rows: y [M, N] += x'·W^T with W [N, K],
// x' = x, or RMSNorm(x) with input_norm; then, with output_norm, normed = RMSNorm(y after the
// addition). RMSNorm as ref::rms_norm. `normed` arrives poisoned. The cases: tests/op_model.cpp.
struct DecodeProjectionCall {
  const float* x;            // [M, K]
  int64_t rows;
  const float* w;            // [N, K]
  int32_t n, k;
  const float* input_norm;   // [K], or null
  const float* output_norm;  // [N], or null
  float eps;
  float* y;                  // [M, N], added to
  float* normed;             // [M, N], written when output_norm is given
};
using DecodeProjectionOp = std::function<void(const DecodeProjectionCall& call)>;
// The decode step's RoPE and attention, as ref::decode_attention_rope: qkv [B, H_q·Dh + 2·H_kv·Dh],
// bias [that width] or null, caches [B, H_kv, stride, Dh] (read below shape.start only) -> out
// [B, H_q·Dh], which arrives poisoned. The cases: tests/op_model.cpp.
using DecodeAttentionOp =
    std::function<void(const float* qkv, const float* bias, const float* keys, const float* values,
                       const ref::CachedAttentionShape& shape, float rope_theta, float* out)>;

// The model's residual add fused into the next RMSNorm (cuda::model_kernels::add_rms_norm): hidden
// [M, D] fp32 += y [M, D] (bf16 values) element by element in fp32, then normed = RMSNorm(hidden
// after the addition) as ref::rms_norm. `normed` arrives poisoned. The cases: tests/op_model.cpp.
struct ResidualNormCall {
  float* hidden;  // [M, D], added to
  const float* y;  // [M, D]
  int64_t rows;
  int32_t d;
  const float* weight;  // [D]
  float eps;
  float* normed;  // [M, D]
};
using ResidualNormOp = std::function<void(const ResidualNormCall& call)>;

// What a backend rounds beyond fp32 accumulation. The harness replays a naive computation with the
// same roundings; its error against float64 sets the tolerance (derived_tolerance below).
struct BackendPrecision {
  bool hidden_bf16 = false;  // h (= g ⊙ u, or g when non-gated) rounded to bf16 before the down projection
  bool output_bf16 = false;  // y and gradients rounded to bf16 before they are returned
};

struct FfnBackend {
  std::string name;                          // appears in test names: letters, digits, '_'
  std::function<std::string()> skip_reason;  // "" when the backend can run here; empty = always runs
  BackendPrecision precision;
  GateToTwellOp gate_to_twell;
  FfnFromTwellOp ffn_from_twell;
  FfnDenseOp ffn_dense;
  TwellToHybridOp twell_to_hybrid;
  HybridForwardOp hybrid_forward;
  HybridBackwardOp hybrid_backward;
  DecodeFfnOp decode_ffn;
  DecodeProjectionOp decode_projection;
  DecodeAttentionOp decode_attention;
  ResidualNormOp residual_norm;
  int32_t decode_d_multiple = 1;  // decode_ffn takes D a multiple of this only (its signs are not padded)
  AllGatesRule decode_all_gates = kCpuAllGates;  // where decode_ffn's GateSelection::automatic takes every gate
};

// Returns true so that it can initialise a namespace-scope constant. Throws on a duplicate name.
bool register_backend(FfnBackend backend);
const std::vector<FfnBackend>& registered_backends();
const FfnBackend& find_backend(const std::string& name);  // throws when unknown

// ---- Cases ----

// One test case: the workload plus the format parameters; each op reads the fields it needs.
struct OpCase {
  int64_t rows = 1;          // M
  int32_t d_model = 64;      // D
  int32_t d_hidden = 128;    // H
  double density = 0.02;     // target fraction of active neurons of the relu projection
  int32_t hot_neurons = 0;   // skew: neurons active for almost every token
  bool gated = true;
  int32_t tile = 128;        // T (TwELL)
  int32_t compression = 4;   // C (TwELL)
  int32_t ell_width = 16;    // W (hybrid)
  double l1_coeff = 0.0;     // training ops
  uint64_t seed = 1;

  WorkloadSpec workload_spec() const;
  std::string name() const;  // unique and gtest-safe, e.g. "M17_D640_H1000_d2p0_hot0_gated_T128_C4_W16_s3"
};

// The sampled sweeps: fixed corner cases plus a seeded sample of M in {1, 3, 17, 300}, H not a
// multiple of the tile, D from 64 to 4096, densities 0 .. 100%, skew, T in {128, 256}, C in {2, 4, 8},
// bounded in M·H·D so the float64 reference keeps the suite fast.
std::vector<OpCase> twell_cases();   // gate_to_twell, ffn_from_twell (gated and non-gated)
std::vector<OpCase> dense_cases();   // ffn_dense
std::vector<OpCase> hybrid_cases();  // twell_to_hybrid, hybrid forward and backward (gated, l1 > 0)

// A backend and one case of an op; Case has name() (gtest-safe). Ops whose inputs are not an FFN
// workload (the model's decode projection and attention) have their own Case types.
template <typename Case>
struct BackendCaseOf {
  std::string backend;
  Case op_case;
};
using BackendCase = BackendCaseOf<OpCase>;
// Every (backend, case) pair whose backend implements `op`.
template <typename Op, typename Case>
std::vector<BackendCaseOf<Case>> backend_cases(Op FfnBackend::*op, const std::vector<Case>& cases) {
  std::vector<BackendCaseOf<Case>> pairs;
  for (const FfnBackend& backend : registered_backends())
    if (backend.*op)
      for (const Case& op_case : cases) pairs.push_back({backend.name, op_case});
  return pairs;
}
template <typename Case>
std::string backend_case_name(const testing::TestParamInfo<BackendCaseOf<Case>>& info) {
  return info.param.backend + "__" + info.param.op_case.name();
}
template <typename Case>
void PrintTo(const BackendCaseOf<Case>& pair, std::ostream* out) {  // how gtest shows GetParam()
  *out << pair.backend << " " << pair.op_case.name();
}
// The reason `backend` cannot run here, "" when it can.
std::string cannot_run_reason(const FfnBackend& backend);

// Fixture: skips (with the backend's reason) when the backend cannot run here.
template <typename Case>
class OpTestOf : public testing::TestWithParam<BackendCaseOf<Case>> {
 protected:
  void SetUp() override {
    if (const std::string reason = cannot_run_reason(backend()); !reason.empty())
      GTEST_SKIP() << "backend " << backend().name << " cannot run here: " << reason;
  }
  const FfnBackend& backend() const { return find_backend(this->GetParam().backend); }
  const Case& op_case() const { return this->GetParam().op_case; }
};
using OpTest = OpTestOf<OpCase>;

// ---- Checks (shared by every op test; each returns a failure that says what differs) ----

// The kernel may be a few times less accurate than a naive loop in the same precision, never more.
inline constexpr double kToleranceFactor = 4.0;
inline double derived_tolerance(double naive_error, double floor) {
  return naive_error * kToleranceFactor > floor ? naive_error * kToleranceFactor : floor;
}

// Poisoning: outputs are filled with garbage before each call, so an unwritten element shows.
void poison(std::vector<float>& buffer, size_t count);          // quiet NaN
void poison(TwellMatrix& out, const TwellShape& shape, int64_t spill_rows);  // garbage arrays of these sizes
void poison(HybridMatrix& out, const HybridShape& shape, int64_t backup_rows);

// A float64 result into a backend's fp32 output (the reference backends of the self-tests).
inline void copy_to_float(const std::vector<double>& from, float* to) { std::copy(from.begin(), from.end(), to); }

// ||got - ref|| / ||ref|| <= tolerance, every element finite (an unwritten NaN fails).
testing::AssertionResult near_relative_l2(const std::string& what, const float* got, const double* ref,
                                          size_t count, double tolerance);

}  // namespace twell::test
