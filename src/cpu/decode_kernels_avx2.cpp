// Decode predictor loops for AVX2. The target attribute applies to this file's functions only,
// after the includes, so no header code is compiled for AVX2 by accident.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "decode_kernels.h"
#include "twell/decode.h"
#include "twell/formats/sign_bits.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,popcnt")

namespace twell::cpu {
namespace {

// An int16 lane takes at most 2·kFlushWords values of |x| <= kGateInputLevels (one per 16-column
// half of a word) before it is widened into the int32 totals, so it cannot overflow.
constexpr int32_t kFlushWords = 8;
static_assert(2 * kFlushWords * kGateInputLevels <= INT16_MAX, "int16 lanes must not overflow between flushes");

// Rows [0, kRows) of the group at x_quantized; sums[r] (and sums[sums_stride + r]: kTwoBit). Each
// 16-bit half of a word becomes a lane selector (lane i all ones iff bit i is set: broadcast, AND
// with 1 << i, compare), once for all rows; one-bit adds x AND selector, two-bit negates x where
// the sign selector is set ((x XOR −1) − (−1) = −x) and adds it, and its AND with the large selector.
struct Avx2Sums {
  template <int kRows, bool kTwoBit>
  static void run(const int16_t* x_quantized, int32_t x_stride, const uint32_t* bits, const uint32_t* large,
                  int32_t words, int32_t* sums, int32_t sums_stride) {
    constexpr int kSums = kTwoBit ? 2 : 1;
    const __m256i lane_bits = _mm256_setr_epi16(1 << 0, 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8,
                                                1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, INT16_MIN);
    const auto selector = [&](uint32_t word, int half) {
      const __m256i broadcast = _mm256_set1_epi16(static_cast<int16_t>(word >> (16 * half)));
      return _mm256_cmpeq_epi16(_mm256_and_si256(broadcast, lane_bits), lane_bits);
    };
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i total[kSums][kRows];  // int32 lanes
    for (auto& plane : total)
      for (__m256i& t : plane) t = _mm256_setzero_si256();
    for (int32_t first = 0; first < words; first += kFlushWords) {
      const int32_t last = std::min(words, first + kFlushWords);
      __m256i acc[kSums][kRows];  // int16 lanes
      for (auto& plane : acc)
        for (__m256i& a : plane) a = _mm256_setzero_si256();
      for (int32_t w = first; w < last; ++w)
        for (int half = 0; half < 2; ++half) {
          const __m256i sign = selector(bits[w], half);
          const __m256i is_large = kTwoBit ? selector(large[w], half) : sign;
          for (int r = 0; r < kRows; ++r) {
            const __m256i x = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(x_quantized + r * x_stride + kSignBitsPerWord * w + 16 * half));
            if constexpr (kTwoBit) {
              const __m256i signed_x = _mm256_sub_epi16(_mm256_xor_si256(x, sign), sign);
              acc[0][r] = _mm256_add_epi16(acc[0][r], signed_x);
              acc[1][r] = _mm256_add_epi16(acc[1][r], _mm256_and_si256(is_large, signed_x));
            } else {
              acc[0][r] = _mm256_add_epi16(acc[0][r], _mm256_and_si256(sign, x));
            }
          }
        }
      for (int p = 0; p < kSums; ++p)
        for (int r = 0; r < kRows; ++r) total[p][r] = _mm256_add_epi32(total[p][r], _mm256_madd_epi16(acc[p][r], ones));
    }
    for (int p = 0; p < kSums; ++p)
      for (int r = 0; r < kRows; ++r) {
        __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total[p][r]), _mm256_extracti128_si256(total[p][r], 1));
        half = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
        half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 1));
        sums[p * sums_stride + r] = _mm_cvtsi128_si32(half);
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
  // 16 ymm registers: four rows of one sum (8 accumulators), or two rows of two (8).
  static constexpr DecodeKernelTable table{&masked_sums_in_groups<Avx2Sums, 4, 2>, &negative_counts};
  return table;
}

}  // namespace twell::cpu

#pragma GCC pop_options
