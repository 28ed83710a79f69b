// Decode predictor loops without SIMD: the portable fallback.
#include "decode_kernels.h"

namespace twell::cpu {
namespace {

// Rows [0, kRows) of the group at x_quantized; sums[p·sums_stride + r] for plane p.
struct ScalarSums {
  template <int kRows, int kPlanes>
  static void run(const int16_t* x_quantized, int32_t x_stride, const uint32_t* bits, const uint32_t* large,
                  int32_t words, int32_t* sums, int32_t sums_stride) {
    int32_t sum[kPlanes][kRows] = {};
    for (int32_t w = 0; w < words; ++w)
      for (int p = 0; p < kPlanes; ++p)
        for (uint32_t word = plane_word(p, bits, large, w); word != 0; word &= word - 1) {
          const int16_t* x = x_quantized + 32 * w + __builtin_ctz(word);
          for (int r = 0; r < kRows; ++r) sum[p][r] += x[r * x_stride];
        }
    for (int p = 0; p < kPlanes; ++p)
      for (int r = 0; r < kRows; ++r) sums[p * sums_stride + r] = sum[p][r];
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
