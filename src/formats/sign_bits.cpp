// Sign-bit packing (include/twell/formats/sign_bits.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "twell/convert.h"
#include "twell/error.h"

namespace twell {

SignBits pack_sign_bits(const float* matrix, int32_t rows, int32_t cols) {
  TWELL_REQUIRE(rows >= 1, "pack_sign_bits: rows (R) must be >= 1, got {}", rows);
  TWELL_REQUIRE(cols >= 1, "pack_sign_bits: cols (K) must be >= 1, got {}", cols);
  TWELL_REQUIRE(matrix != nullptr, "pack_sign_bits: matrix must not be null");
  SignBits packed;
  packed.rows = rows;
  packed.cols = cols;
  const int32_t words = packed.words_per_row();
  packed.bits.assign(static_cast<size_t>(rows) * words, 0u);  // padding bits stay 0
  packed.scale.assign(static_cast<size_t>(rows), 0.0f);
  packed.residual.assign(static_cast<size_t>(rows), 0.0f);
  packed.large.assign(packed.bits.size(), 0u);
  packed.small_scale.assign(static_cast<size_t>(rows), 0.0f);
  packed.large_scale.assign(static_cast<size_t>(rows), 0.0f);
  packed.two_bit_residual.assign(static_cast<size_t>(rows), 0.0f);
  std::vector<float> magnitudes(static_cast<size_t>(cols));
  for (int32_t r = 0; r < rows; ++r) {
    const float* row = matrix + static_cast<size_t>(r) * cols;  // [K]
    uint32_t* row_bits = packed.bits.data() + static_cast<size_t>(r) * words;
    double abs_sum = 0.0, square_sum = 0.0;
    for (int32_t k = 0; k < cols; ++k) {
      TWELL_REQUIRE(!std::isnan(row[k]), "pack_sign_bits: element [{}, {}] is NaN; a sign bit needs a number", r, k);
      if (row[k] < 0.0f) row_bits[k / kSignBitsPerWord] |= 1u << (k % kSignBitsPerWord);  // -0.0 is not < 0
      abs_sum += std::abs(static_cast<double>(row[k]));
      square_sum += static_cast<double>(row[k]) * row[k];
    }
    const double scale = abs_sum / cols;
    packed.scale[r] = static_cast<float>(scale);
    // mean (a − scale·sign a)² = mean a² − 2·scale·mean |a| + scale² = mean a² − scale²; rounding
    // can take it a hair below 0 when every |a| is equal (an exact 1-bit row).
    packed.residual[r] = static_cast<float>(std::sqrt(std::max(0.0, square_sum / cols - scale * scale)));

    for (int32_t k = 0; k < cols; ++k) magnitudes[k] = std::abs(row[k]);
    const int32_t split_index = two_bit_split_index(cols);
    std::nth_element(magnitudes.begin(), magnitudes.begin() + split_index, magnitudes.end());
    const float split = magnitudes[split_index];
    uint32_t* large = packed.large.data() + static_cast<size_t>(r) * words;
    double large_sum = 0.0;
    int32_t large_count = 0;
    for (int32_t k = 0; k < cols; ++k) {
      if (!(std::abs(row[k]) > split)) continue;
      const uint32_t bit = 1u << (k % kSignBitsPerWord);
      large[k / kSignBitsPerWord] |= bit;
      large_sum += std::abs(static_cast<double>(row[k]));
      ++large_count;
    }
    // The elements up to split_index are <= split, so the small set is never empty.
    const double small_scale = (abs_sum - large_sum) / (cols - large_count);
    const double large_scale = large_count == 0 ? 0.0 : large_sum / large_count;
    double two_bit_squares = 0.0;
    for (int32_t k = 0; k < cols; ++k) {
      const bool is_large = (large[k / kSignBitsPerWord] >> (k % kSignBitsPerWord)) & 1u;
      const double magnitude_error = std::abs(static_cast<double>(row[k])) - (is_large ? large_scale : small_scale);
      two_bit_squares += magnitude_error * magnitude_error;  // same sign, so |a − approx| = ||a| − scale|
    }
    packed.small_scale[r] = static_cast<float>(small_scale);
    packed.large_scale[r] = static_cast<float>(large_scale);
    packed.two_bit_residual[r] = static_cast<float>(std::sqrt(two_bit_squares / cols));
  }
  return packed;
}

}  // namespace twell
