// Device helpers shared by the CUDA FFN kernels: bf16 pairs unpacked from 32-bit words, an
// 8-element bf16 dot product on one 16-byte load each, and a full-warp sum.
#pragma once

#include <cstdint>

namespace twell::cuda {

// A 32-bit word holds two bf16: element 2i in the low half, 2i+1 in the high half.
__device__ __forceinline__ float bf16_low(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_high(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }

__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  float sum = bf16_low(a.x) * bf16_low(b.x);
  sum = fmaf(bf16_high(a.x), bf16_high(b.x), sum);
  sum = fmaf(bf16_low(a.y), bf16_low(b.y), sum);
  sum = fmaf(bf16_high(a.y), bf16_high(b.y), sum);
  sum = fmaf(bf16_low(a.z), bf16_low(b.z), sum);
  sum = fmaf(bf16_high(a.z), bf16_high(b.z), sum);
  sum = fmaf(bf16_low(a.w), bf16_low(b.w), sum);
  return fmaf(bf16_high(a.w), bf16_high(b.w), sum);
}

// Every lane gets the sum over the 32 lanes.
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

}  // namespace twell::cuda
