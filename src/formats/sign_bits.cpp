// Sign-bit packing (include/twell/formats/sign_bits.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "twell/convert.h"
#include "twell/error.h"

namespace twell {

void validate_exact_columns(const std::vector<int32_t>& columns, int32_t cols) {
  TWELL_REQUIRE(columns.size() <= static_cast<size_t>(kMaxExactColumns),
                "exact columns: at most {} (kMaxExactColumns), got {}", kMaxExactColumns, columns.size());
  TWELL_REQUIRE(columns.size() < static_cast<size_t>(std::max(cols, 0)),
                "exact columns: {} of K = {} columns leaves none to approximate", columns.size(), cols);
  for (size_t i = 0; i < columns.size(); ++i) {
    TWELL_REQUIRE(columns[i] >= 0 && columns[i] < cols, "exact columns: column {} (entry {}) lies outside [0, K = {})",
                  columns[i], i, cols);
    TWELL_REQUIRE(i == 0 || columns[i - 1] < columns[i],
                  "exact columns must be ascending and distinct: entry {} is {} after {}", i, columns[i],
                  columns[i - 1]);
  }
}

void validate_sign_bits(const SignBits& signs, int32_t rows, int32_t cols) {
  TWELL_REQUIRE(signs.rows == rows && signs.cols == cols,
                "signs must be packed from the relu projection [H={}, D={}], got [{}, {}]", rows, cols, signs.rows,
                signs.cols);
  const size_t plane_words = static_cast<size_t>(rows) * signs.words_per_row(), r = static_cast<size_t>(rows);
  TWELL_REQUIRE(signs.bits.size() == plane_words && signs.large.size() == plane_words,
                "signs must hold two planes of H·ceil(D/32) = {} words (bits, large), got {} and {}", plane_words,
                signs.bits.size(), signs.large.size());
  TWELL_REQUIRE(signs.scale.size() == r && signs.residual.size() == r && signs.small_scale.size() == r &&
                    signs.large_scale.size() == r && signs.two_bit_residual.size() == r,
                "signs must hold H = {} values of scale, residual, small_scale, large_scale and two_bit_residual "
                "(pack_sign_bits)",
                rows);
  validate_exact_columns(signs.exact_columns, cols);
  TWELL_REQUIRE(signs.exact_weights.size() == r * signs.exact_columns.size(),
                "signs.exact_weights must hold H·c = {} values, got {}", r * signs.exact_columns.size(),
                signs.exact_weights.size());
}

SignBits pack_sign_bits(const float* matrix, int32_t rows, int32_t cols, const std::vector<int32_t>& exact_columns) {
  TWELL_REQUIRE(rows >= 1, "pack_sign_bits: rows (R) must be >= 1, got {}", rows);
  TWELL_REQUIRE(cols >= 1, "pack_sign_bits: cols (K) must be >= 1, got {}", cols);
  TWELL_REQUIRE(matrix != nullptr, "pack_sign_bits: matrix must not be null");
  validate_exact_columns(exact_columns, cols);
  SignBits packed;
  packed.rows = rows;
  packed.cols = cols;
  const int32_t words = packed.words_per_row();
  const int32_t exact_count = static_cast<int32_t>(exact_columns.size());
  const int32_t approximated = cols - exact_count;  // the columns the scales and residuals cover
  packed.bits.assign(static_cast<size_t>(rows) * words, 0u);  // padding bits stay 0
  packed.scale.assign(static_cast<size_t>(rows), 0.0f);
  packed.residual.assign(static_cast<size_t>(rows), 0.0f);
  packed.large.assign(packed.bits.size(), 0u);
  packed.small_scale.assign(static_cast<size_t>(rows), 0.0f);
  packed.large_scale.assign(static_cast<size_t>(rows), 0.0f);
  packed.two_bit_residual.assign(static_cast<size_t>(rows), 0.0f);
  packed.exact_columns = exact_columns;
  packed.exact_weights.resize(static_cast<size_t>(rows) * exact_count);
  std::vector<uint8_t> is_exact(static_cast<size_t>(cols), 0);
  for (int32_t column : exact_columns) is_exact[column] = 1;
  std::vector<float> magnitudes(static_cast<size_t>(approximated));
  for (int32_t r = 0; r < rows; ++r) {
    const float* row = matrix + static_cast<size_t>(r) * cols;  // [K]
    uint32_t* row_bits = packed.bits.data() + static_cast<size_t>(r) * words;
    double abs_sum = 0.0, square_sum = 0.0;
    for (int32_t k = 0; k < cols; ++k) {
      TWELL_REQUIRE(!std::isnan(row[k]), "pack_sign_bits: element [{}, {}] is NaN; a sign bit needs a number", r, k);
      if (row[k] < 0.0f) row_bits[k / kSignBitsPerWord] |= 1u << (k % kSignBitsPerWord);  // -0.0 is not < 0
      if (is_exact[k]) continue;
      abs_sum += std::abs(static_cast<double>(row[k]));
      square_sum += static_cast<double>(row[k]) * row[k];
    }
    for (int32_t i = 0; i < exact_count; ++i)
      packed.exact_weights[static_cast<size_t>(r) * exact_count + i] = row[exact_columns[i]];
    const double scale = abs_sum / approximated;
    packed.scale[r] = static_cast<float>(scale);
    // mean (a − scale·sign a)² = mean a² − 2·scale·mean |a| + scale² = mean a² − scale²; rounding
    // can take it a hair below 0 when every |a| is equal (an exact 1-bit row).
    packed.residual[r] = static_cast<float>(std::sqrt(std::max(0.0, square_sum / approximated - scale * scale)));

    for (int32_t k = 0, i = 0; k < cols; ++k)
      if (!is_exact[k]) magnitudes[i++] = std::abs(row[k]);
    const int32_t split_index = two_bit_split_index(approximated);
    std::nth_element(magnitudes.begin(), magnitudes.begin() + split_index, magnitudes.end());
    const float split = magnitudes[split_index];
    uint32_t* large = packed.large.data() + static_cast<size_t>(r) * words;
    double large_sum = 0.0;
    int32_t large_count = 0;
    for (int32_t k = 0; k < cols; ++k) {
      if (is_exact[k] || !(std::abs(row[k]) > split)) continue;
      large[k / kSignBitsPerWord] |= 1u << (k % kSignBitsPerWord);
      large_sum += std::abs(static_cast<double>(row[k]));
      ++large_count;
    }
    // The approximated elements up to split_index are <= split, so the small set is never empty.
    const double small_scale = (abs_sum - large_sum) / (approximated - large_count);
    const double large_scale = large_count == 0 ? 0.0 : large_sum / large_count;
    double two_bit_squares = 0.0;
    for (int32_t k = 0; k < cols; ++k) {
      if (is_exact[k]) continue;
      const bool is_large = (large[k / kSignBitsPerWord] >> (k % kSignBitsPerWord)) & 1u;
      const double magnitude_error = std::abs(static_cast<double>(row[k])) - (is_large ? large_scale : small_scale);
      two_bit_squares += magnitude_error * magnitude_error;  // same sign, so |a − approx| = ||a| − scale|
    }
    packed.small_scale[r] = static_cast<float>(small_scale);
    packed.large_scale[r] = static_cast<float>(large_scale);
    packed.two_bit_residual[r] = static_cast<float>(std::sqrt(two_bit_squares / approximated));
  }
  return packed;
}

}  // namespace twell
