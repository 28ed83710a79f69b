// The float64 reference FFN ops (include/twell/reference.h), on the loops of ffn_loops.h.
#include <cmath>
#include <cstring>

#include "reference/ffn_loops.h"
#include "twell/convert.h"
#include "twell/error.h"
#include "twell/reference.h"

namespace twell::ref {
namespace {

void require_inputs(const float* x, int64_t rows, const FfnWeights& weights) {
  validate(weights);
  TWELL_REQUIRE(rows >= 1, "rows (M) must be >= 1, got {}", rows);
  TWELL_REQUIRE(x != nullptr, "x must not be null");
}

void require_gated(const FfnWeights& weights, const char* op) {
  TWELL_REQUIRE(weights.gated, "{} needs gated weights (gate, up, down); got non-gated ones", op);
}

// Round to nearest even straight from double. Going through float first can round twice: when the
// float lands exactly halfway between two bf16 values although the double was not.
uint16_t bf16_bits_from_double(double value) {
  const float as_float = static_cast<float>(value);
  uint32_t word;
  std::memcpy(&word, &as_float, sizeof word);
  if ((word & 0xffffu) != 0x8000u || static_cast<double>(as_float) == value) return float_to_bf16_bits(as_float);
  const uint16_t truncated = static_cast<uint16_t>(word >> 16);  // the bf16 neighbour nearer zero
  return std::abs(value) > std::abs(static_cast<double>(as_float)) ? static_cast<uint16_t>(truncated + 1) : truncated;
}

template <typename Bf16Vector>
std::vector<double> to_double(const Bf16Vector& values) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = to_float(values[i]);
  return out;
}

// The hybrid gate's values as dense float64 [M, H], checked against x's rows and the weights.
std::vector<double> hybrid_gate_values(const HybridMatrix& gate, const FfnWeights& weights) {
  TWELL_REQUIRE(gate.shape.cols == weights.d_hidden, "hybrid gate has H = {} columns but the weights have H = {}",
                gate.shape.cols, weights.d_hidden);
  return to_double(dense_from_hybrid(gate));
}

double l1_term(const std::vector<double>& h, int64_t rows, double l1_coeff) {
  double abs_sum = 0.0;
  for (double value : h) abs_sum += std::abs(value);
  return l1_coeff * abs_sum / static_cast<double>(rows);
}

FfnGrads to_grads(FfnGradsOf<double>&& grads) {
  return FfnGrads{std::move(grads.dx), std::move(grads.d_gate), std::move(grads.d_up), std::move(grads.d_down)};
}

}  // namespace

std::vector<double> ffn_dense(const float* x, int64_t rows, const FfnWeights& weights) {
  require_inputs(x, rows, weights);
  return ffn_from_gate<double>(x, rows, relu_gate<double>(x, rows, weights), weights).y;
}

std::vector<double> relu_projection(const float* x, int64_t rows, const FfnWeights& weights) {
  require_inputs(x, rows, weights);
  return relu_gate<double>(x, rows, weights);
}

TwellMatrix gate_to_twell(const float* x, int64_t rows, const FfnWeights& weights, int32_t tile, int32_t compression) {
  const std::vector<double> g = relu_projection(x, rows, weights);  // [M, H]
  std::vector<bf16> g_bf16(g.size());
  for (size_t i = 0; i < g.size(); ++i) g_bf16[i] = bf16{bf16_bits_from_double(g[i])};
  return twell_from_dense(g_bf16.data(), rows, weights.d_hidden, tile, compression);
}

std::vector<double> ffn_from_twell(const float* x, const TwellMatrix& gate, const FfnWeights& weights) {
  require_inputs(x, gate.shape.rows, weights);
  TWELL_REQUIRE(gate.shape.cols == weights.d_hidden, "TwELL gate has H = {} columns but the weights have H = {}",
                gate.shape.cols, weights.d_hidden);
  const std::vector<double> g = to_double(dense_from_twell(gate));  // [M, H]
  return ffn_from_gate<double>(x, gate.shape.rows, g, weights).y;
}

HybridForward hybrid_ffn_forward(const float* x, const HybridMatrix& gate, const FfnWeights& weights, double l1_coeff) {
  require_inputs(x, gate.shape.rows, weights);
  require_gated(weights, "hybrid_ffn_forward");
  const int64_t rows = gate.shape.rows;
  const std::vector<double> g = hybrid_gate_values(gate, weights);  // [M, H]
  FfnFromGate<double> forward = ffn_from_gate<double>(x, rows, g, weights);
  HybridForward out;
  out.l1 = l1_term(forward.h, rows, l1_coeff);
  int64_t nnz = 0;
  for (double value : g) nnz += value != 0.0;
  out.l0 = static_cast<double>(nnz) / static_cast<double>(rows);
  out.y = std::move(forward.y);
  out.h = std::move(forward.h);
  return out;
}

FfnGrads hybrid_ffn_backward(const float* x, const HybridMatrix& gate, const FfnWeights& weights, const float* dy,
                             double l1_coeff) {
  require_inputs(x, gate.shape.rows, weights);
  require_gated(weights, "hybrid_ffn_backward");
  TWELL_REQUIRE(dy != nullptr, "dy must not be null");
  const std::vector<double> g = hybrid_gate_values(gate, weights);  // [M, H]
  return to_grads(ffn_backward_from_gate<double>(x, gate.shape.rows, g, weights, dy, l1_coeff));
}

double ffn_train_loss(const float* x, int64_t rows, const FfnWeights& weights, const float* dy, double l1_coeff) {
  require_inputs(x, rows, weights);
  require_gated(weights, "ffn_train_loss");
  TWELL_REQUIRE(dy != nullptr, "dy must not be null");
  const FfnFromGate<double> forward = ffn_from_gate<double>(x, rows, relu_gate<double>(x, rows, weights), weights);
  double dot = 0.0;
  for (size_t i = 0; i < forward.y.size(); ++i) dot += static_cast<double>(dy[i]) * forward.y[i];
  return dot + l1_term(forward.h, rows, l1_coeff);
}

FfnGrads ffn_train_grads(const float* x, int64_t rows, const FfnWeights& weights, const float* dy, double l1_coeff) {
  require_inputs(x, rows, weights);
  require_gated(weights, "ffn_train_grads");
  TWELL_REQUIRE(dy != nullptr, "dy must not be null");
  return to_grads(ffn_backward_from_gate<double>(x, rows, relu_gate<double>(x, rows, weights), weights, dy, l1_coeff));
}

}  // namespace twell::ref
