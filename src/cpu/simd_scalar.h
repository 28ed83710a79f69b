// One-lane "vectors": the portable fallback, and the plain loop the SIMD paths are tested against.
#pragma once

#include <cstdint>

namespace twell::cpu {
namespace {

struct Scalar {
  using Vec = float;
  static constexpr int kLanes = 1;
  static constexpr int kRowBlock = 2;
  static constexpr int kNeuronBlock = 4;
  static constexpr int kWideNeuronBlock = 4;

  static Vec zero() { return 0.0f; }
  static Vec broadcast(float value) { return value; }
  static Vec load(const float* from) { return *from; }
  static void store(float* to, Vec value) { *to = value; }
  static Vec fma(Vec a, Vec b, Vec acc) { return a * b + acc; }
  static float sum(Vec value) { return value; }
  static uint32_t positive_mask(Vec value) { return value > 0.0f ? 1u : 0u; }
  static uint32_t nan_mask(Vec value) { return value != value ? 1u : 0u; }
};

}  // namespace
}  // namespace twell::cpu
