// 16-lane fp32 vectors (AVX-512F). Included only by kernels_avx512.cpp, which is compiled with the
// AVX-512 flags; nothing here may be used from a file compiled without them.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace twell::cpu {
namespace {

struct Avx512 {
  using Vec = __m512;
  static constexpr int kLanes = 16;
  // Register blocking of dot_block: rows x neurons accumulators (32 registers: 16 acc + 4 w + 4 x).
  static constexpr int kRowBlock = 4;
  static constexpr int kNeuronBlock = 4;
  // Single-row blocking: 8 weight rows in flight keep enough loads outstanding to stream DRAM.
  static constexpr int kWideNeuronBlock = 8;

  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec broadcast(float value) { return _mm512_set1_ps(value); }
  static Vec load(const float* from) { return _mm512_loadu_ps(from); }
  static void store(float* to, Vec value) { _mm512_storeu_ps(to, value); }
  static Vec fma(Vec a, Vec b, Vec acc) { return _mm512_fmadd_ps(a, b, acc); }
  // Through memory: GCC 12's reduce, extract and shuffle intrinsics all trip -Wuninitialized on
  // their internal _mm512_undefined_ps(). Only the end of a dot product pays for it.
  static float sum(Vec value) {
    alignas(64) float lanes[kLanes];
    _mm512_store_ps(lanes, value);
    float pairs[kLanes / 2];
    for (int i = 0; i < kLanes / 2; ++i) pairs[i] = lanes[i] + lanes[i + kLanes / 2];
    return ((pairs[0] + pairs[4]) + (pairs[1] + pairs[5])) + ((pairs[2] + pairs[6]) + (pairs[3] + pairs[7]));
  }
  // Bit i set iff lane i is > 0 (NaN compares false).
  static uint32_t positive_mask(Vec value) {
    return _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_GT_OQ);
  }
  static uint32_t nan_mask(Vec value) { return _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q); }
};

}  // namespace
}  // namespace twell::cpu
