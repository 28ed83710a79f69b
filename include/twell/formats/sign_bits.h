// Sign bits of a bf16 or fp32 matrix, for the decode predictor.
// Shared by CPU and CUDA code; docs/formats.md carries the same text.
//
// A matrix A [R, K] packs to
//   bits   uint32 [R, words_per_row], words_per_row = ceil(K / 32)
//          bit j of word c of row r is 1 iff A[r, 32c + j] < 0.
//          -0.0 packs as 0 (it is not negative); NaN is refused at packing.
//          Padding bits (32c + j >= K) are 0, so XOR + popcount over whole words counts only real
//          elements when both operands follow this rule.
//   scale  float  [R]  mean |A[r, :]| over the K elements (used by the 1-bit gate predictor).
//   residual float [R] rms over the K elements of A[r, k] − scale[r]·sign(A[r, k]) (sign +1 where
//                      the bit is 0), = sqrt(mean A[r, :]² − scale[r]²): how far the 1-bit
//                      approximation is from the row (used by the normalized 1-bit gate).
// The same packing applies to the gate weights Wg [H, D] (once, at load) and to a token x [D]
// (per call).
#pragma once

#include <cstdint>

#include "twell/portability.h"

namespace twell {

inline constexpr int kSignBitsPerWord = 32;

TWELL_HD constexpr int32_t sign_words_per_row(int32_t cols) {
  return (cols + kSignBitsPerWord - 1) / kSignBitsPerWord;
}

static_assert(sign_words_per_row(1) == 1 && sign_words_per_row(32) == 1 && sign_words_per_row(33) == 2,
              "words per row is ceil(K / 32)");

}  // namespace twell
