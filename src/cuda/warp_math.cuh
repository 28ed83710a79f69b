// Device helpers shared by the CUDA kernels: bf16 pairs unpacked from 32-bit words, an 8-element
// bf16 dot product on one 16-byte load each, a full-warp sum, the bf16 tensor-core product, and
// asynchronous 16-byte copies into shared memory (cp.async), the two sides of a programmatic
// dependent launch.
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

// d [16, 8] += a [16, 16] · b [16, 8]: mma.sync m16n8k16, bf16 in (a row-major, b column-major
// fragments in registers), fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared, asynchronously; zeros when !valid (global is then not read).
__device__ __forceinline__ void copy_16_async(void* shared, const void* global, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Waits for every copy, committed or not.
__device__ __forceinline__ void wait_all_copies() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Programmatic dependent launch: waits until the grid this one was launched after has finished and its
// writes are visible (a no-op for a plain launch) ...
__device__ __forceinline__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// ... and lets the grid launched after this one start before this one ends.
__device__ __forceinline__ void allow_dependent_grids() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace twell::cuda
