// Decode predictor loops for AVX2. The target attribute applies to this file's functions only,
// after the includes, so no header code is compiled for AVX2 by accident.
#include <immintrin.h>

#include "decode_kernels.h"
#include "twell/decode.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,popcnt")

namespace twell::cpu {
namespace {

// Rows [0, kRows) of the group at x_padded; sums[p·sums_stride + r] for plane p. Lane i of byte b's
// vector holds bit 8b+i of the word in its sign position (shift left by 31-(8b+i)); the selectors are
// made once per word for all rows.
struct Avx2Sums {
  template <int kRows, int kPlanes>
  static void run(const float* x_padded, int32_t x_stride, const uint32_t* bits, const uint32_t* large,
                  int32_t words, float* sums, int32_t sums_stride) {
    const __m256i shifts[4] = {_mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24),
                               _mm256_setr_epi32(23, 22, 21, 20, 19, 18, 17, 16),
                               _mm256_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8),
                               _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0)};
    __m256 acc[kPlanes][kRows][4];
    for (auto& plane : acc)
      for (auto& row : plane)
        for (__m256& a : row) a = _mm256_setzero_ps();
    for (int32_t w = 0; w < words; ++w) {
      __m256i word[kPlanes];
      for (int p = 0; p < kPlanes; ++p) word[p] = _mm256_set1_epi32(static_cast<int>(plane_word(p, bits, large, w)));
      for (int b = 0; b < 4; ++b) {
        // blendv reads only the sign bit of each lane of the selector.
        __m256 selector[kPlanes];
        for (int p = 0; p < kPlanes; ++p) selector[p] = _mm256_castsi256_ps(_mm256_sllv_epi32(word[p], shifts[b]));
        for (int r = 0; r < kRows; ++r) {
          const __m256 x = _mm256_loadu_ps(x_padded + r * x_stride + 32 * w + 8 * b);
          for (int p = 0; p < kPlanes; ++p)
            acc[p][r][b] = _mm256_add_ps(acc[p][r][b], _mm256_blendv_ps(_mm256_setzero_ps(), x, selector[p]));
        }
      }
    }
    for (int p = 0; p < kPlanes; ++p)
      for (int r = 0; r < kRows; ++r) {
        const __m256* a = acc[p][r];
        const __m256 total = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        __m128 half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
        half = _mm_add_ps(half, _mm_movehl_ps(half, half));
        half = _mm_add_ss(half, _mm_movehdup_ps(half));
        sums[p * sums_stride + r] = _mm_cvtss_f32(half);
      }
  }
};

void negative_counts(const uint32_t* x_signs, int32_t rows, const uint32_t* bits, int32_t words, int32_t* counts) {
  int64_t count[kDecodeMaxRows] = {};
  int32_t w = 0;
  for (; w + 2 <= words; w += 2) {
    uint64_t neuron;
    __builtin_memcpy(&neuron, bits + w, sizeof neuron);
    for (int32_t r = 0; r < rows; ++r) {
      uint64_t token;
      __builtin_memcpy(&token, x_signs + r * words + w, sizeof token);
      count[r] += _mm_popcnt_u64(token ^ neuron);
    }
  }
  for (; w < words; ++w)
    for (int32_t r = 0; r < rows; ++r) count[r] += _mm_popcnt_u32(x_signs[r * words + w] ^ bits[w]);
  for (int32_t r = 0; r < rows; ++r) counts[r] = static_cast<int32_t>(count[r]);
}

}  // namespace

const DecodeKernelTable& avx2_decode_kernels() {
  // 16 ymm registers: two rows of one plane (8 accumulators), or one row of three (12).
  static constexpr DecodeKernelTable table{&masked_sums_in_groups<Avx2Sums, 2, 1>, &negative_counts};
  return table;
}

}  // namespace twell::cpu

#pragma GCC pop_options
