// Fast CPU kernels for the inference FFN (fp32 weights and activations, fp32 accumulation;
// TwELL values bf16 as the format defines). AVX-512, AVX2 or scalar, picked at run time;
// multi-threaded with OpenMP. The dense baseline is OpenBLAS sgemm in the same fp32 weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "twell/host_tensors.h"

namespace twell::cpu {

enum class Isa { scalar, avx2, avx512 };
std::string to_string(Isa isa);
Isa best_isa();            // what this CPU supports
Isa active_isa();          // what the kernels use now (best_isa() unless overridden)
void set_isa(Isa isa);     // throws if the CPU lacks it; tests use it to run every path
void set_num_threads(int threads);  // 0 = all cores
int num_threads();

// g = relu(x·W^T) packed into `out` (buffers reused when large enough), W = weights.relu_projection().
// x [M, D]. Overflowing tiles spill exactly; the spill grows as needed.
void gate_to_twell(const float* x, int64_t rows, const FfnWeights& weights, int32_t tile, int32_t compression,
                   TwellMatrix& out);

// y [M, D] from the packed relu projection (gated: up+down at non-zeros; non-gated: down only).
void ffn_from_twell(const float* x, const TwellMatrix& gate, const FfnWeights& weights, float* y);

// Dense baseline through OpenBLAS: the same FFN with three (two when non-gated) sgemm calls.
// `scratch` holds the [M, H] intermediates between calls.
struct DenseScratch {
  std::vector<float> gate;  // [M, H]
  std::vector<float> up;    // [M, H]
};
void ffn_dense(const float* x, int64_t rows, const FfnWeights& weights, float* y, DenseScratch& scratch);

}  // namespace twell::cpu
