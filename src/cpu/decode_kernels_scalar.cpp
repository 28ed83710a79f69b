// Decode predictor loops without SIMD: the portable fallback.
#include "decode_kernels.h"
#include "twell/formats/sign_bits.h"

namespace twell::cpu {
namespace {

// Rows [0, kRows) of the group at x_quantized; sums[r] (and sums[sums_stride + r]: kTwoBit).
struct ScalarSums {
  template <int kRows, bool kTwoBit>
  static void run(const int16_t* x_quantized, int32_t x_stride, const uint32_t* bits, const uint32_t* large,
                  int32_t words, int32_t* sums, int32_t sums_stride) {
    int32_t sum[2][kRows] = {};
    for (int32_t w = 0; w < words; ++w) {
      const int16_t* x = x_quantized + kSignBitsPerWord * w;
      if constexpr (kTwoBit) {
        for (int32_t k = 0; k < kSignBitsPerWord; ++k) {
          const bool negative = bits[w] >> k & 1u, is_large = large[w] >> k & 1u;
          for (int r = 0; r < kRows; ++r) {
            const int32_t value = negative ? -x[r * x_stride + k] : x[r * x_stride + k];
            sum[0][r] += value;
            if (is_large) sum[1][r] += value;
          }
        }
      } else {
        for (uint32_t word = bits[w]; word != 0; word &= word - 1)
          for (int r = 0; r < kRows; ++r) sum[0][r] += x[r * x_stride + __builtin_ctz(word)];
      }
    }
    for (int r = 0; r < kRows; ++r) {
      sums[r] = sum[0][r];
      if constexpr (kTwoBit) sums[sums_stride + r] = sum[1][r];
    }
  }
};

void negative_counts(const uint32_t* x_signs, int32_t rows, const uint32_t* bits, int32_t words, int32_t* counts) {
  for (int32_t r = 0; r < rows; ++r) counts[r] = 0;
  for (int32_t w = 0; w < words; ++w)
    for (int32_t r = 0; r < rows; ++r) counts[r] += __builtin_popcount(x_signs[r * words + w] ^ bits[w]);
}

}  // namespace

const DecodeKernelTable& scalar_decode_kernels() {
  static constexpr DecodeKernelTable table{&masked_sums_in_groups<ScalarSums, 4, 4>, &negative_counts};
  return table;
}

}  // namespace twell::cpu
