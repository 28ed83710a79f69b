// The up GEMM of a relu-gated FFN with the gate applied in its epilogue:
//   h [M, H] = relu(g) ⊙ (x [M, D] · Wu [H, D]^T)
// bf16 operands and output, fp32 accumulation, g (the gate GEMM's bf16 output) read by the epilogue
// as the GEMM's source matrix. It replaces cuBLASLt's up GEMM plus the elementwise pass that reads
// g and u and writes h: cuBLASLt has no epilogue that multiplies by a second matrix. That unfused
// form's pass is declared here too (DenseFfn runs it below its fused threshold; the lab times both).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "twell/bf16.h"
#include "twell/cuda.h"

namespace twell::cuda {

// TMA needs 16-byte rows: H and D multiples of 8 elements.
bool relu_gated_up_supported(int64_t hidden, int64_t d_model);
void relu_gated_up_gemm(const bf16* x, int64_t rows, const bf16* w_up, int64_t hidden, int64_t d_model,
                        const bf16* gate, bf16* h, cudaStream_t stream);

// The unfused form's elementwise pass after cuBLASLt's up GEMM (any activation; src/cuda/dense_ffn.cu):
// u = act(g) ⊙ u in place, count elements.
void activate_multiply(const bf16* gate, bf16* up, int64_t count, GateActivation activation, cudaStream_t stream);

}  // namespace twell::cuda
