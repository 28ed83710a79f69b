// Decode predictor loops for AVX2. The target attribute applies to this file's functions only,
// after the includes, so no header code is compiled for AVX2 by accident.
#include <immintrin.h>

#include "decode_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,popcnt")

namespace twell::cpu {
namespace {

// Lane i of byte b's vector holds bit 8b+i of the word in its sign position: shift left by 31-(8b+i).
float negative_sum(const float* x_padded, const uint32_t* bits, int32_t words) {
  const __m256i shifts[4] = {_mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24),
                             _mm256_setr_epi32(23, 22, 21, 20, 19, 18, 17, 16),
                             _mm256_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8),
                             _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0)};
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int32_t w = 0; w < words; ++w) {
    const __m256i word = _mm256_set1_epi32(static_cast<int>(bits[w]));
    for (int b = 0; b < 4; ++b) {
      // blendv reads only the sign bit of each lane of the selector.
      __m256 selector = _mm256_castsi256_ps(_mm256_sllv_epi32(word, shifts[b]));
      acc[b] = _mm256_add_ps(acc[b], _mm256_blendv_ps(_mm256_setzero_ps(), _mm256_loadu_ps(x_padded + 32 * w + 8 * b),
                                                      selector));
    }
  }
  __m256 total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

int32_t negative_count(const uint32_t* a, const uint32_t* b, int32_t words) {
  int64_t count = 0;
  int32_t w = 0;
  for (; w + 2 <= words; w += 2) {
    uint64_t a_pair, b_pair;
    __builtin_memcpy(&a_pair, a + w, sizeof a_pair);
    __builtin_memcpy(&b_pair, b + w, sizeof b_pair);
    count += _mm_popcnt_u64(a_pair ^ b_pair);
  }
  for (; w < words; ++w) count += _mm_popcnt_u32(a[w] ^ b[w]);
  return static_cast<int32_t>(count);
}

}  // namespace

const DecodeKernelTable& avx2_decode_kernels() {
  static constexpr DecodeKernelTable table{&negative_sum, &negative_count};
  return table;
}

}  // namespace twell::cpu

#pragma GCC pop_options
