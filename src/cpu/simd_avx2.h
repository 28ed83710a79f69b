// 8-lane fp32 vectors (AVX2 + FMA). Included only by kernels_avx2.cpp, which is compiled with the
// AVX2 flags; nothing here may be used from a file compiled without them.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace twell::cpu {
namespace {

struct Avx2 {
  using Vec = __m256;
  static constexpr int kLanes = 8;
  // 16 registers: 2x4 accumulators + 1 weight + 2 activations leave room for the address math.
  static constexpr int kRowBlock = 2;
  static constexpr int kNeuronBlock = 4;
  static constexpr int kWideNeuronBlock = 8;

  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec broadcast(float value) { return _mm256_set1_ps(value); }
  static Vec load(const float* from) { return _mm256_loadu_ps(from); }
  static void store(float* to, Vec value) { _mm256_storeu_ps(to, value); }
  static Vec fma(Vec a, Vec b, Vec acc) { return _mm256_fmadd_ps(a, b, acc); }
  static float sum(Vec value) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(value), _mm256_extractf128_ps(value, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
  }
  static uint32_t positive_mask(Vec value) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(value, _mm256_setzero_ps(), _CMP_GT_OQ)));
  }
  static uint32_t nan_mask(Vec value) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(value, value, _CMP_UNORD_Q)));
  }
};

}  // namespace
}  // namespace twell::cpu
