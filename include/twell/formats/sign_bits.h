// Sign bits of a bf16 or fp32 matrix, for the decode predictor.
// Shared by CPU and CUDA code; docs/formats.md carries the same text.
//
// A matrix A [R, K] packs to
//   bits   uint32 [R, words_per_row], words_per_row = ceil(K / 32)
//          bit j of word c of row r is 1 iff A[r, 32c + j] < 0, for EVERY column (exact ones too).
//          -0.0 packs as 0 (it is not negative); NaN is refused at packing.
//          Padding bits (32c + j >= K) are 0, so XOR + popcount over whole words counts only real
//          elements when both operands follow this rule.
//   exact_columns  int32 [c], 0 <= c <= kMaxExactColumns, c < K: ascending, distinct column indices
//                  whose weights are kept exactly (empty: none). The gates use A[r, col]·x[col] there
//                  and approximate only the other K − c columns ("the approximated columns").
//   exact_weights  float [R, c]: exact_weights[r, i] = A[r, exact_columns[i]]
//   scale  float  [R]  mean |A[r, k]| over the approximated columns (used by the 1-bit gate predictor).
//   residual float [R] rms over the approximated columns of A[r, k] − scale[r]·sign(A[r, k]) (sign +1
//                      where the bit is 0), = sqrt(mean A[r, k]² − scale[r]²): how far the 1-bit
//                      approximation is from the row (used by the normalized 1-bit gate).
// The two-bit approximation (two-bit gate): A[r, k] ≈ sign(A[r, k])·(large ? large_scale : small_scale)[r]
//   large            uint32 [R, words_per_row]  bit set iff k is approximated and |A[r, k]| > split,
//                                               split = the element at index two_bit_split_index(K − c)
//                                               of the approximated columns' |A| sorted ascending (so at
//                                               most 40% of them are large); exact columns and padding 0
//   small_scale      float  [R]  mean |A[r, k]| over the approximated columns whose large bit is 0
//   large_scale      float  [R]  mean |A[r, k]| over the columns whose large bit is 1 (0 when none)
//   two_bit_residual float  [R]  rms over the approximated columns of A[r, k] − that approximation
// Two bit planes, five floats and c exact weights per row, and the c column indices (sign_bits_bytes):
// the two-bit gate's third mask, large AND bits, is formed from the two planes where it is used,
// never stored. With c = 0 every "approximated columns" above is all K columns.
// The same packing applies to the gate weights Wg [H, D] (once, at load) and to a token x [D]
// (per call).
#pragma once

#include <cstdint>

#include "twell/portability.h"

namespace twell {

inline constexpr int kSignBitsPerWord = 32;
// At most this many exact columns: a handful of outlier input channels carry what the bits cannot
// (the synthetic workload's threshold column, an LLM's "massive activation" channels), and each one
// costs a float per row and a multiply-add per (token, neuron).
inline constexpr int kMaxExactColumns = 8;

TWELL_HD constexpr int32_t sign_words_per_row(int32_t cols) {
  return (cols + kSignBitsPerWord - 1) / kSignBitsPerWord;
}

// ⌊3K/5⌋: the 60% quantile. On a real L1-trained model it beat the median (3.7x against 4.3x the
// active set at 99% recall, scripts/predictor_study.py), and 0.7 / 0.8 did no better.
TWELL_HD constexpr int32_t two_bit_split_index(int32_t cols) {
  return static_cast<int32_t>(static_cast<int64_t>(cols) * 3 / 5);
}

// Bytes of a packed [R, K] matrix with `exact_columns` exact columns: the planes bits and large,
// scale, residual, small_scale, large_scale, two_bit_residual and exact_weights per row, and the
// column indices.
TWELL_HD constexpr int64_t sign_bits_bytes(int32_t rows, int32_t cols, int32_t exact_columns = 0) {
  return static_cast<int64_t>(rows) * (2 * sign_words_per_row(cols) * 4 + 5 * 4 + exact_columns * 4) +
         exact_columns * 4;
}

static_assert(sign_words_per_row(1) == 1 && sign_words_per_row(32) == 1 && sign_words_per_row(33) == 2,
              "words per row is ceil(K / 32)");

}  // namespace twell
