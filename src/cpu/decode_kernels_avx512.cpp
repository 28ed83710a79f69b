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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vpopcntdq,fma,popcnt")

namespace twell::cpu {
namespace {

float negative_sum(const float* x_padded, const uint32_t* bits, int32_t words) {
  // Two words per step into four accumulators: independent adds hide their latency.
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int32_t w = 0;
  for (; w + 2 <= words; w += 2)
    for (int u = 0; u < 2; ++u) {
      const uint32_t word = bits[w + u];
      const float* x = x_padded + 32 * (w + u);
      acc[2 * u] = _mm512_mask_add_ps(acc[2 * u], static_cast<__mmask16>(word), acc[2 * u], _mm512_loadu_ps(x));
      acc[2 * u + 1] = _mm512_mask_add_ps(acc[2 * u + 1], static_cast<__mmask16>(word >> 16), acc[2 * u + 1],
                                          _mm512_loadu_ps(x + 16));
    }
  if (w < words) {
    const uint32_t word = bits[w];
    acc[0] = _mm512_mask_add_ps(acc[0], static_cast<__mmask16>(word), acc[0], _mm512_loadu_ps(x_padded + 32 * w));
    acc[1] = _mm512_mask_add_ps(acc[1], static_cast<__mmask16>(word >> 16), acc[1],
                                _mm512_loadu_ps(x_padded + 32 * w + 16));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

int32_t negative_count_vpopcntdq(const uint32_t* a, const uint32_t* b, int32_t words) {
  __m512i acc = _mm512_setzero_si512();
  for (int32_t w = 0; w < words; w += 16) {
    // The tail lanes load as 0 in both operands and add nothing.
    const __mmask16 lanes = words - w >= 16 ? static_cast<__mmask16>(0xffff)
                                            : static_cast<__mmask16>((1u << (words - w)) - 1);
    __m512i diff = _mm512_xor_si512(_mm512_maskz_loadu_epi32(lanes, a + w), _mm512_maskz_loadu_epi32(lanes, b + w));
    acc = _mm512_add_epi32(acc, _mm512_popcnt_epi32(diff));
  }
  return _mm512_reduce_add_epi32(acc);
}

int32_t negative_count_popcnt(const uint32_t* a, const uint32_t* b, int32_t words) {
  int32_t count = 0;
  for (int32_t w = 0; w < words; ++w) count += _mm_popcnt_u32(a[w] ^ b[w]);
  return count;
}

}  // namespace

const DecodeKernelTable& avx512_decode_kernels() {
  static const DecodeKernelTable table{
      &negative_sum, __builtin_cpu_supports("avx512vpopcntdq") ? &negative_count_vpopcntdq : &negative_count_popcnt};
  return table;
}

}  // namespace twell::cpu

#pragma GCC pop_options
#pragma GCC diagnostic pop
