// The ISA-specific inner loops of the decode predictors (include/twell/decode.h), one table per ISA.
// The exact dot products and the down axpy are the CPU backend's own (kernels.h); only the loops
// over packed sign bits live here. decode_ffn.cpp holds the blocking and threading once.
#pragma once

#include <cstdint>

namespace twell::cpu {

struct DecodeKernelTable {
  // Σ x[k] over the set bits k of bits[0:words]; x [32·words], zero past the real columns (the
  // padding bits are 0 as well, so the padded tail adds nothing either way).
  float (*negative_sum)(const float* x_padded, const uint32_t* bits, int32_t words);
  // popcount(a XOR b) over words, the sign rule's N_neg.
  int32_t (*negative_count)(const uint32_t* a, const uint32_t* b, int32_t words);
};

// Each defined in decode_kernels_<isa>.cpp, whose functions carry that ISA's target attribute.
const DecodeKernelTable& scalar_decode_kernels();
const DecodeKernelTable& avx2_decode_kernels();
const DecodeKernelTable& avx512_decode_kernels();  // VPOPCNTDQ popcounts where the CPU has them

// The table of active_isa().
const DecodeKernelTable& active_decode_kernels();

}  // namespace twell::cpu
