// The CUDA decode FFN (sm_90a): the decode path of include/twell/decode.h on the GPU, for bf16
// weights and activations with fp32 accumulation and an fp32 output.
//
// One launch after a memset of y: each warp owns 8 neurons; it scores them for all M tokens (the
// one-bit gate on the tensor cores as a bf16 product with ±1 built from the sign bits, or the sign
// rule as XOR + popcount), computes the exact gate of the predicted (token, neuron) pairs from one
// read of the gate row, and for the truly active ones reads the up and down rows together and adds
// relu(g)·u·down[j] into y with vector atomics. Nothing allocates and nothing waits on the host, so
// run() can be captured in a CUDA graph. The sum order of y depends on timing: results agree with
// the reference to fp32 rounding, not bit for bit between runs.
#pragma once

#include <cuda_runtime.h>

#include "twell/cuda.h"
#include "twell/decode.h"

namespace twell::cuda {

class DecodeLayer {
 public:
  // Keeps a pointer to `weights` (which must outlive the layer) and uploads the sign bits and scales
  // of its relu projection (signs = pack_sign_bits(relu projection) on the host). Synchronous.
  // D must be a multiple of 8 (16-byte weight rows), H <= 2^31 - 1.
  DecodeLayer(const DeviceFfnWeights& weights, const SignBits& signs);
  ~DecodeLayer();
  DecodeLayer(const DecodeLayer&) = delete;
  // The predictors run() has kernels for (the sign rule and the one-bit gate); the normalized
  // gates are CPU only.
  static bool supports(PredictorKind kind);
  DecodeLayer& operator=(const DecodeLayer&) = delete;

  // y [M, D] fp32 (device) from x [M, D] bf16 (device), 1 <= M <= kDecodeMaxRows. Asynchronous.
  // The sign rule and the one-bit gate; the normalized one-bit and two-bit gates are refused (CPU only so far).
  void run(const bf16* x, int64_t rows, const PredictorConfig& predictor, float* y, cudaStream_t stream,
           const DecodeOptions& options = {}) const;
  // Counters summed over every run since the last stats() call (then reset). Synchronizes `stream`.
  // missed is -1 unless every one of those runs counted it.
  DecodeStats stats(cudaStream_t stream) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace twell::cuda
