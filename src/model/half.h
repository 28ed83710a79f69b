// IEEE 754 binary16 -> fp32, for F16 checkpoints (exact: every half is a float).
#pragma once

#include <cstdint>
#include <cstring>

namespace twell {

inline float half_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t word;
  if (exponent == 0x1f) {  // inf or NaN
    word = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal: rebias 15 -> 127
    word = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // signed zero
    word = sign;
  } else {  // subnormal: shift the mantissa up until it is normal
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    word = sign | ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

}  // namespace twell
