// Decode predictor loops for AVX-512: the sign bits are used directly as lane masks (one masked
// 16-bit add per 32 columns) and XOR + VPOPCNTDQ counts 512 columns per instruction. The target attributes
// apply to this file's functions only, after the includes.
// GCC 12 warns inside its own AVX-512 headers when they are used under a target pragma
// (_mm512_undefined_* is a self-initialised variable, GCC bug 105593); the pragma must come
// before the include, where those header lines are.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "decode_kernels.h"
#include "twell/decode.h"
#include "twell/formats/sign_bits.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vpopcntdq,fma,popcnt")

namespace twell::cpu {
namespace {

// An int16 lane takes at most kFlushWords values of |x| <= kGateInputLevels (one per word) before it
// is widened into the int32 totals, so it cannot overflow.
constexpr int32_t kFlushWords = 16;
static_assert(kFlushWords * kGateInputLevels <= INT16_MAX, "int16 lanes must not overflow between flushes");

// Rows [0, kRows) of the group at x_quantized; sums[r] (and sums[sums_stride + r]: kTwoBit). A bit
// word is the lane mask of one masked 16-bit add of 32 columns (one-bit), or of the negation of x
// and of the add over the large columns (two-bit). With few accumulators, consecutive words go to
// kUnroll sets of them, so that the adds of one row do not wait on each other.
struct Avx512Sums {
  template <int kRows, bool kTwoBit>
  static void run(const int16_t* x_quantized, int32_t x_stride, const uint32_t* bits, const uint32_t* large,
                  int32_t words, int32_t* sums, int32_t sums_stride) {
    constexpr int kSums = kTwoBit ? 2 : 1;
    constexpr int kUnroll = kRows * kSums <= 2 ? 2 : 1;
    const __m512i ones = _mm512_set1_epi16(1);
    __m512i total[kSums][kRows];  // int32 lanes
    for (auto& plane : total)
      for (__m512i& t : plane) t = _mm512_setzero_si512();
    for (int32_t first = 0; first < words; first += kFlushWords) {
      const int32_t last = std::min(words, first + kFlushWords);
      __m512i acc[kUnroll][kSums][kRows];  // int16 lanes
      for (auto& set : acc)
        for (auto& plane : set)
          for (__m512i& a : plane) a = _mm512_setzero_si512();
      const auto add_word = [&](int32_t w, int u) {
        const __mmask32 sign = static_cast<__mmask32>(bits[w]);
        for (int r = 0; r < kRows; ++r) {
          const __m512i x = _mm512_loadu_si512(x_quantized + r * x_stride + kSignBitsPerWord * w);
          if constexpr (kTwoBit) {
            const __m512i signed_x = _mm512_mask_sub_epi16(x, sign, _mm512_setzero_si512(), x);
            acc[u][0][r] = _mm512_add_epi16(acc[u][0][r], signed_x);
            acc[u][1][r] =
                _mm512_mask_add_epi16(acc[u][1][r], static_cast<__mmask32>(large[w]), acc[u][1][r], signed_x);
          } else {
            acc[u][0][r] = _mm512_add_epi16(acc[u][0][r], _mm512_maskz_mov_epi16(sign, x));
          }
        }
      };
      int32_t w = first;
      for (; w + kUnroll <= last; w += kUnroll)
        for (int u = 0; u < kUnroll; ++u) add_word(w + u, u);
      for (; w < last; ++w) add_word(w, 0);
      // The sets together hold at most kFlushWords values per lane.
      for (int p = 0; p < kSums; ++p)
        for (int r = 0; r < kRows; ++r) {
          __m512i sum = acc[0][p][r];
          for (int u = 1; u < kUnroll; ++u) sum = _mm512_add_epi16(sum, acc[u][p][r]);
          total[p][r] = _mm512_add_epi32(total[p][r], _mm512_madd_epi16(sum, ones));
        }
    }
    for (int p = 0; p < kSums; ++p)
      for (int r = 0; r < kRows; ++r) sums[p * sums_stride + r] = _mm512_reduce_add_epi32(total[p][r]);
  }
};

void negative_counts_vpopcntdq(const uint32_t* x_signs, int32_t rows, const uint32_t* bits, int32_t words,
                               int32_t* counts) {
  __m512i acc[kDecodeMaxRows];
  for (int32_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_si512();
  for (int32_t w = 0; w < words; w += 16) {
    // The tail lanes load as 0 in both operands and add nothing.
    const __mmask16 lanes = words - w >= 16 ? static_cast<__mmask16>(0xffff)
                                            : static_cast<__mmask16>((1u << (words - w)) - 1);
    const __m512i neuron = _mm512_maskz_loadu_epi32(lanes, bits + w);
    for (int32_t r = 0; r < rows; ++r)
      acc[r] = _mm512_add_epi32(
          acc[r], _mm512_popcnt_epi32(_mm512_xor_si512(_mm512_maskz_loadu_epi32(lanes, x_signs + r * words + w), neuron)));
  }
  for (int32_t r = 0; r < rows; ++r) counts[r] = _mm512_reduce_add_epi32(acc[r]);
}

}  // namespace

const DecodeKernelTable& avx512_decode_kernels() {
  // Four rows a group (8 accumulators for one sum, 16 for two, of 32 zmm registers): eight rows of
  // one sum scored M = 16 13% slower (p10 of 60 calls, one thread), two rows as fast as four.
  // Without VPOPCNTDQ the AVX2 table's 64-bit POPCNT loop is the best there is.
  static const DecodeKernelTable table{
      &masked_sums_in_groups<Avx512Sums, 4, 4>,
      __builtin_cpu_supports("avx512vpopcntdq") ? &negative_counts_vpopcntdq : avx2_decode_kernels().negative_counts};
  return table;
}

}  // namespace twell::cpu

#pragma GCC pop_options
#pragma GCC diagnostic pop
