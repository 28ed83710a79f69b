// Decode predictor loops without SIMD: the portable fallback.
#include "decode_kernels.h"

namespace twell::cpu {
namespace {

float negative_sum(const float* x_padded, const uint32_t* bits, int32_t words) {
  float sum = 0.0f;
  for (int32_t w = 0; w < words; ++w)
    for (uint32_t word = bits[w]; word != 0; word &= word - 1) sum += x_padded[32 * w + __builtin_ctz(word)];
  return sum;
}

int32_t negative_count(const uint32_t* a, const uint32_t* b, int32_t words) {
  int32_t count = 0;
  for (int32_t w = 0; w < words; ++w) count += __builtin_popcount(a[w] ^ b[w]);
  return count;
}

}  // namespace

const DecodeKernelTable& scalar_decode_kernels() {
  static constexpr DecodeKernelTable table{&negative_sum, &negative_count};
  return table;
}

}  // namespace twell::cpu
