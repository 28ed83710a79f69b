// Reference decode predictors and the decode FFN they drive (include/twell/decode.h): plain loops,
// float64 sums, bits read one at a time.
#include <cmath>
#include <cstddef>

#include "twell/convert.h"
#include "twell/error.h"
#include "twell/reference.h"

namespace twell::ref {
namespace {

bool plane_bit(const std::vector<uint32_t>& plane, const SignBits& signs, int64_t row, int32_t col) {
  uint32_t word = plane[static_cast<size_t>(row) * signs.words_per_row() + col / kSignBitsPerWord];
  return (word >> (col % kSignBitsPerWord)) & 1u;
}

bool sign_bit(const SignBits& signs, int64_t row, int32_t col) { return plane_bit(signs.bits, signs, row, col); }

// s / (residual · ||x||), ±inf or 0 where the denominator is 0.
double normalized(double score, double residual, double norm) {
  const double unit = residual * norm;
  return unit > 0 ? score / unit : score > 0 ? INFINITY : score < 0 ? -INFINITY : 0.0;
}

bool is_exact_column(const SignBits& signs, int32_t col) {
  for (int32_t column : signs.exact_columns)
    if (column == col) return true;
  return false;
}

// ||x_row|| over the approximated columns: the estimate's error involves those only.
double row_norm(const float* x_row, const SignBits& signs) {
  double square_sum = 0;
  for (int32_t k = 0; k < signs.cols; ++k)
    if (!is_exact_column(signs, k)) square_sum += static_cast<double>(x_row[k]) * x_row[k];
  return std::sqrt(square_sum);
}

// Σ_c x_row[exact_columns[c]]·exact_weights[j, c]: the exact part of every gate's score.
double exact_part(const float* x_row, const SignBits& signs, int32_t j) {
  const size_t count = signs.exact_columns.size();
  double sum = 0;
  for (size_t c = 0; c < count; ++c)
    sum += static_cast<double>(x_row[signs.exact_columns[c]]) * signs.exact_weights[j * count + c];
  return sum;
}

void require_packed(const SignBits& signs, const char* name) {
  TWELL_REQUIRE(signs.rows >= 0 && signs.cols >= 1, "{}: shape must be [R >= 0, K >= 1], got [{}, {}]", name,
                signs.rows, signs.cols);
  TWELL_REQUIRE(signs.bits.size() == static_cast<size_t>(signs.rows) * signs.words_per_row(),
                "{}.bits must hold R·ceil(K/32) = {} words, got {}", name,
                static_cast<size_t>(signs.rows) * signs.words_per_row(), signs.bits.size());
  TWELL_REQUIRE(signs.scale.size() == static_cast<size_t>(signs.rows), "{}.scale must hold R = {} values, got {}",
                name, signs.rows, signs.scale.size());
  validate_exact_columns(signs.exact_columns, signs.cols);
  TWELL_REQUIRE(signs.exact_weights.size() == static_cast<size_t>(signs.rows) * signs.exact_columns.size(),
                "{}.exact_weights must hold R·c = {} values, got {}", name,
                static_cast<size_t>(signs.rows) * signs.exact_columns.size(), signs.exact_weights.size());
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
        if (is_exact_column(gate_signs, k)) continue;
        double value = x[m * cols + k];
        sum += sign_bit(gate_signs, j, k) ? -value : value;
      }
      scores[static_cast<size_t>(m) * hidden + j] =
          static_cast<double>(gate_signs.scale[j]) * sum + exact_part(x + m * cols, gate_signs, j);
    }
  return scores;
}

std::vector<double> normalized_one_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs) {
  TWELL_REQUIRE(gate_signs.residual.size() == static_cast<size_t>(gate_signs.rows),
                "gate_signs.residual must hold R = {} values, got {}", gate_signs.rows, gate_signs.residual.size());
  std::vector<double> scores = one_bit_gate(x, rows, gate_signs);
  const int32_t hidden = gate_signs.rows, cols = gate_signs.cols;
  for (int64_t m = 0; m < rows; ++m) {
    const double norm = row_norm(x + m * cols, gate_signs);
    for (int32_t j = 0; j < hidden; ++j) {
      double& score = scores[static_cast<size_t>(m) * hidden + j];
      score = normalized(score, gate_signs.residual[j], norm);
    }
  }
  return scores;
}

std::vector<double> two_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs) {
  require_packed(gate_signs, "gate_signs");
  TWELL_REQUIRE(rows >= 1, "rows (M) must be >= 1, got {}", rows);
  const int32_t hidden = gate_signs.rows, cols = gate_signs.cols;
  TWELL_REQUIRE(gate_signs.large.size() == gate_signs.bits.size() &&
                    gate_signs.two_bit_residual.size() == static_cast<size_t>(hidden),
                "gate_signs must carry the two-bit plane and scales of pack_sign_bits");
  std::vector<double> scores(static_cast<size_t>(rows) * hidden);
  for (int64_t m = 0; m < rows; ++m) {
    const double norm = row_norm(x + m * cols, gate_signs);
    for (int32_t j = 0; j < hidden; ++j) {
      const double large_scale = gate_signs.large_scale[j], small_scale = gate_signs.small_scale[j];
      double sum = 0;
      for (int32_t k = 0; k < cols; ++k) {
        if (is_exact_column(gate_signs, k)) continue;
        const double magnitude = plane_bit(gate_signs.large, gate_signs, j, k) ? large_scale : small_scale;
        sum += (sign_bit(gate_signs, j, k) ? -magnitude : magnitude) * x[m * cols + k];
      }
      sum += exact_part(x + m * cols, gate_signs, j);
      scores[static_cast<size_t>(m) * hidden + j] = normalized(sum, gate_signs.two_bit_residual[j], norm);
    }
  }
  return scores;
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
