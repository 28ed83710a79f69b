// bfloat16 as raw bits, shared by host and device code.
// Bit-compatible with __nv_bfloat16, so format buffers can be handed to CUDA kernels as is.
#pragma once

#include <cstdint>
#include <cstring>

#include "twell/portability.h"

namespace twell {

struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 must be exactly two bytes");

TWELL_HD float bf16_to_float(uint16_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
#else
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
#endif
}

// Round to nearest even, as __float2bfloat16_rn does; NaN stays a quiet NaN.
TWELL_HD uint16_t float_to_bf16_bits(float value) {
#if defined(__CUDA_ARCH__)
  uint32_t word = __float_as_uint(value);
#else
  uint32_t word;
  std::memcpy(&word, &value, sizeof word);
#endif
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x0040u);
  uint32_t rounding_bias = 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>((word + rounding_bias) >> 16);
}

TWELL_HD float to_float(bf16 value) { return bf16_to_float(value.bits); }
TWELL_HD bf16 to_bf16(float value) { return bf16{float_to_bf16_bits(value)}; }
// The float that a bf16 store of `value` reads back as.
TWELL_HD float round_to_bf16(float value) { return bf16_to_float(float_to_bf16_bits(value)); }

}  // namespace twell
