// Fast CPU kernels for the inference FFN (fp32 weights and activations, fp32 accumulation;
// TwELL values bf16 as the format defines). AVX-512, AVX2 or scalar, picked at run time;
// multi-threaded with OpenMP. The dense baseline is OpenBLAS sgemm in the same fp32 weights.
// Also the model's causal attention over its KV cache (fp32).
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

// For each neuron j, the rows of x [M, D] whose relu projection x·W[j] is positive (OpenBLAS, all
// threads): what sort_neurons_by_activity orders by.
std::vector<int64_t> count_active_neurons(const float* x, int64_t rows, const FfnWeights& weights);

// Causal grouped-query attention of n new tokens over the model's KV cache (one sequence), which
// already holds their keys and values at positions start .. start + n - 1: token t sees positions
// 0 ..= start + t, and query head h reads kv head h / (n_heads / n_kv_heads). The float64 oracle is
// ref::causal_attention (its layout is head-major, this one the model's position-major).
struct AttentionShape {
  int32_t tokens = 0;      // n
  int32_t n_heads = 0;     // H_q
  int32_t n_kv_heads = 0;  // H_kv, divides H_q
  int32_t head_dim = 0;    // Dh
  int32_t start = 0;       // positions cached before the new tokens
};
struct AttentionScratch {
  std::vector<std::vector<float>> scores;  // per thread
};
// out = softmax(scale·q·K^T)·V.  q and out [n, H_q, Dh]; keys and values [start + n, H_kv, Dh]
// (a longer cache's positions past start + n are never read).
void causal_attention(const float* q, const float* keys, const float* values, const AttentionShape& shape,
                      float scale, float* out, AttentionScratch& scratch);

}  // namespace twell::cpu
