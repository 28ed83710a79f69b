// Reference decode predictors and the decode FFN they drive (include/twell/decode.h): plain loops,
// float64 sums, bits read one at a time.
#include <cmath>
#include <cstddef>

#include "twell/error.h"
#include "twell/reference.h"

namespace twell::ref {
namespace {

bool sign_bit(const SignBits& signs, int64_t row, int32_t col) {
  uint32_t word = signs.bits[static_cast<size_t>(row) * signs.words_per_row() + col / kSignBitsPerWord];
  return (word >> (col % kSignBitsPerWord)) & 1u;
}

void require_packed(const SignBits& signs, const char* name) {
  TWELL_REQUIRE(signs.rows >= 0 && signs.cols >= 1, "{}: shape must be [R >= 0, K >= 1], got [{}, {}]", name,
                signs.rows, signs.cols);
  TWELL_REQUIRE(signs.bits.size() == static_cast<size_t>(signs.rows) * signs.words_per_row(),
                "{}.bits must hold R·ceil(K/32) = {} words, got {}", name,
                static_cast<size_t>(signs.rows) * signs.words_per_row(), signs.bits.size());
  TWELL_REQUIRE(signs.scale.size() == static_cast<size_t>(signs.rows), "{}.scale must hold R = {} values, got {}",
                name, signs.rows, signs.scale.size());
}

}  // namespace

std::vector<int32_t> negative_sign_products(const SignBits& x_signs, const SignBits& gate_signs) {
  require_packed(x_signs, "x_signs");
  require_packed(gate_signs, "gate_signs");
  TWELL_REQUIRE(x_signs.cols == gate_signs.cols, "x_signs has K = {} columns but gate_signs has D = {}",
                x_signs.cols, gate_signs.cols);
  const int64_t rows = x_signs.rows;
  const int32_t hidden = gate_signs.rows, cols = gate_signs.cols;
  std::vector<int32_t> counts(static_cast<size_t>(rows) * hidden);
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t j = 0; j < hidden; ++j) {
      int32_t negatives = 0;
      for (int32_t k = 0; k < cols; ++k) negatives += sign_bit(x_signs, m, k) != sign_bit(gate_signs, j, k);
      counts[static_cast<size_t>(m) * hidden + j] = negatives;
    }
  return counts;
}

std::vector<uint8_t> predict_active_sign_rule(const SignBits& x_signs, const SignBits& gate_signs, double alpha) {
  std::vector<int32_t> counts = negative_sign_products(x_signs, gate_signs);
  const int32_t cols = gate_signs.cols;
  std::vector<uint8_t> active(counts.size());
  for (size_t i = 0; i < counts.size(); ++i)
    active[i] = !(static_cast<double>(counts[i]) > alpha * static_cast<double>(cols - counts[i]));
  return active;
}

std::vector<double> one_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs) {
  require_packed(gate_signs, "gate_signs");
  TWELL_REQUIRE(rows >= 1, "rows (M) must be >= 1, got {}", rows);
  const int32_t hidden = gate_signs.rows, cols = gate_signs.cols;
  std::vector<double> scores(static_cast<size_t>(rows) * hidden);
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t j = 0; j < hidden; ++j) {
      double sum = 0;
      for (int32_t k = 0; k < cols; ++k) {
        double value = x[m * cols + k];
        sum += sign_bit(gate_signs, j, k) ? -value : value;
      }
      scores[static_cast<size_t>(m) * hidden + j] = static_cast<double>(gate_signs.scale[j]) * sum;
    }
  return scores;
}

std::vector<uint8_t> predict_active_one_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs,
                                                 double margin) {
  std::vector<double> scores = one_bit_gate(x, rows, gate_signs);
  std::vector<uint8_t> active(scores.size());
  for (size_t i = 0; i < scores.size(); ++i) active[i] = scores[i] >= -margin;
  return active;
}

std::vector<double> normalized_one_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs) {
  TWELL_REQUIRE(gate_signs.residual.size() == static_cast<size_t>(gate_signs.rows),
                "gate_signs.residual must hold R = {} values, got {}", gate_signs.rows, gate_signs.residual.size());
  std::vector<double> scores = one_bit_gate(x, rows, gate_signs);
  const int32_t hidden = gate_signs.rows, cols = gate_signs.cols;
  for (int64_t m = 0; m < rows; ++m) {
    double square_sum = 0;
    for (int32_t k = 0; k < cols; ++k) square_sum += static_cast<double>(x[m * cols + k]) * x[m * cols + k];
    for (int32_t j = 0; j < hidden; ++j) {
      double& score = scores[static_cast<size_t>(m) * hidden + j];
      const double unit = static_cast<double>(gate_signs.residual[j]) * std::sqrt(square_sum);
      score = unit > 0 ? score / unit : score > 0 ? INFINITY : score < 0 ? -INFINITY : 0.0;
    }
  }
  return scores;
}

std::vector<uint8_t> predict_active_normalized_one_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs,
                                                            double margin) {
  std::vector<double> scores = normalized_one_bit_gate(x, rows, gate_signs);
  std::vector<uint8_t> active(scores.size());
  for (size_t i = 0; i < scores.size(); ++i) active[i] = scores[i] >= -margin;
  return active;
}

std::vector<double> decode_ffn(const float* x, int64_t rows, const FfnWeights& weights,
                               const std::vector<uint8_t>& predicted_active) {
  validate(weights);
  const int32_t cols = weights.d_model, hidden = weights.d_hidden;
  TWELL_REQUIRE(predicted_active.size() == static_cast<size_t>(rows) * hidden,
                "predicted_active must hold M·H = {} flags, got {}", static_cast<size_t>(rows) * hidden,
                predicted_active.size());
  const std::vector<float>& projection = weights.relu_projection();
  auto dot = [&](const std::vector<float>& matrix, int64_t m, int32_t j) {
    double sum = 0;
    for (int32_t k = 0; k < cols; ++k)
      sum += static_cast<double>(x[m * cols + k]) * matrix[static_cast<size_t>(j) * cols + k];
    return sum;
  };
  std::vector<double> y(static_cast<size_t>(rows) * cols, 0.0);
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t j = 0; j < hidden; ++j) {
      if (!predicted_active[static_cast<size_t>(m) * hidden + j]) continue;
      double activation = dot(projection, m, j);
      if (activation <= 0) continue;
      double coefficient = weights.gated ? activation * dot(weights.up, m, j) : activation;
      for (int32_t k = 0; k < cols; ++k)
        y[static_cast<size_t>(m) * cols + k] += coefficient * weights.down[static_cast<size_t>(j) * cols + k];
    }
  return y;
}

}  // namespace twell::ref
