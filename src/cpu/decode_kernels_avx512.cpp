// Decode predictor loops for AVX-512: the sign bits are used directly as lane masks (one masked add
// per 16 columns) and XOR + VPOPCNTDQ counts 512 columns per instruction. The target attributes
// apply to this file's functions only, after the includes.
// GCC 12 warns inside its own AVX-512 headers when they are used under a target pragma
// (_mm512_undefined_* is a self-initialised variable, GCC bug 105593); the pragma must come
// before the include, where those header lines are.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "decode_kernels.h"
#include "twell/decode.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vpopcntdq,fma,popcnt")

namespace twell::cpu {
namespace {

// Rows [0, kRows) of the group at x_padded; sums[p·sums_stride + r] for plane p. Two words per step
// into four accumulators per row and plane: independent adds hide their latency even at one row.
struct Avx512Sums {
  template <int kRows, int kPlanes>
  static void run(const float* x_padded, int32_t x_stride, const uint32_t* bits, const uint32_t* large,
                  int32_t words, float* sums, int32_t sums_stride) {
    __m512 acc[kPlanes][kRows][4];
    for (auto& plane : acc)
      for (auto& row : plane)
        for (__m512& a : row) a = _mm512_setzero_ps();
    // Word w into accumulators 2u and 2u + 1 of every row and plane.
    const auto add_word = [&](int32_t w, int u) {
      uint32_t word[kPlanes];
      for (int p = 0; p < kPlanes; ++p) word[p] = plane_word(p, bits, large, w);
      for (int r = 0; r < kRows; ++r) {
        const __m512 low = _mm512_loadu_ps(x_padded + r * x_stride + 32 * w);
        const __m512 high = _mm512_loadu_ps(x_padded + r * x_stride + 32 * w + 16);
        for (int p = 0; p < kPlanes; ++p) {
          __m512* a = acc[p][r];
          a[2 * u] = _mm512_mask_add_ps(a[2 * u], static_cast<__mmask16>(word[p]), a[2 * u], low);
          a[2 * u + 1] = _mm512_mask_add_ps(a[2 * u + 1], static_cast<__mmask16>(word[p] >> 16), a[2 * u + 1], high);
        }
      }
    };
    int32_t w = 0;
    for (; w + 2 <= words; w += 2) {
      add_word(w, 0);
      add_word(w + 1, 1);
    }
    if (w < words) add_word(w, 0);
    for (int p = 0; p < kPlanes; ++p)
      for (int r = 0; r < kRows; ++r) {
        const __m512* a = acc[p][r];
        sums[p * sums_stride + r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
      }
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
  // 32 zmm registers: four rows of one plane (16 accumulators), or two rows of three (24).
  // Without VPOPCNTDQ the AVX2 table's 64-bit POPCNT loop is the best there is.
  static const DecodeKernelTable table{
      &masked_sums_in_groups<Avx512Sums, 4, 2>,
      __builtin_cpu_supports("avx512vpopcntdq") ? &negative_counts_vpopcntdq : avx2_decode_kernels().negative_counts};
  return table;
}

}  // namespace twell::cpu

#pragma GCC pop_options
#pragma GCC diagnostic pop
