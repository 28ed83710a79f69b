// The decode step's projections (src/cuda/decode_gemv.cu): y [M, N] = x [M, K] · Wᵀ for the few rows
// of a decode step, W [N, K] bf16 row-major (a linear layer's weight as checkpoints store it). A
// GEMV is bound by the bytes of W; cuBLASLt's kernels for M = 1 stream them at 1.3-2.6 TB/s on an
// H200, this one at 2.4 (O, 8 MB) to 3.2 TB/s (QKV, 25 MB) (docs/perf-notes.md). Optionally the
// input is the RMSNorm of the fp32 residual stream, computed by every block for itself (one kernel
// instead of two), and the output is added into the fp32 residual stream, after which the last block
// can normalize the sum for the next layer (GemvRmsNormTail).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "twell/bf16.h"

namespace twell::cuda {

// Rows (tokens) one call takes.
constexpr int32_t kDecodeGemvMaxRows = 4;

// x: either bf16 rows [M, K], or the RMSNorm of fp32 rows: bf16(weight ⊙ h / sqrt(mean(h²) + eps)),
// rounded as model_kernels::rms_norm rounds it.
struct GemvInput {
  const bf16* x = nullptr;              // [M, K], or null when normalizing
  const float* hidden = nullptr;        // [M, K]
  const float* norm_weight = nullptr;   // [K]
  float eps = 0.0f;

  static GemvInput rows(const bf16* x) { return {x, nullptr, nullptr, 0.0f}; }
  static GemvInput rms_norm(const float* hidden, const float* weight, float eps) {
    return {nullptr, hidden, weight, eps};
  }
};

enum class GemvOutput {
  bf16,           // y: bf16 [M, N]
  f32_add,        // y: fp32 [M, N], y += x · Wᵀ
  f32,            // y: fp32 [M, N] = x · Wᵀ
};

// An f32_add call's optional last step, done by the last block to finish: normed [M, N] bf16 = the
// RMSNorm of the rows of y after the addition (rounded as GemvInput::rms_norm rounds), so the next
// layer's input needs no kernel of its own. `arrivals` is a counter that starts at zero; each call
// leaves it at zero again (a captured call replays as is); calls that share one must not overlap.
struct GemvRmsNormTail {
  const float* weight = nullptr;  // [N]
  float eps = 0.0f;
  bf16* normed = nullptr;         // [M, N]
  unsigned int* arrivals = nullptr;  // null: no tail
};

// Whether decode_gemv takes `rows` rows of K columns (K a multiple of 8, and a load of 8 rows of W
// with x fits in a block's shared memory: K up to ~11000 on an H200).
bool decode_gemv_supports(int32_t rows, int32_t k);

// 1 <= rows <= kDecodeGemvMaxRows, K a multiple of 8, W and x 16-byte aligned (hidden too when
// normalizing). Launched as a programmatic dependent launch (cuda_utils.h): its blocks start loading
// their rows of W before waiting for the previous kernel.
void decode_gemv(int32_t rows, int32_t n, int32_t k, const GemvInput& input, const bf16* w, void* y,
                 GemvOutput output, cudaStream_t stream, const GemvRmsNormTail& tail = {});

}  // namespace twell::cuda
