// The CUDA decode FFN (sm_90a): the decode path of include/twell/decode.h on the GPU, for bf16
// weights and activations with fp32 accumulation and an fp32 output.
//
// With a predictor, one launch per call, one block per 16 neurons: it scores them for all M tokens
// on the tensor cores (a bf16 product of x with ±1, and for the two-bit gate ±1-or-0, built from
// the sign bits; the sign rule as the same product with sign(x)), then, D split over its warps,
// reads the gate rows of the neurons with predicted tokens (and, when they are few, their up and
// down rows in the same round trip) into shared memory and computes the exact gates of all tokens
// as one mma per 16 columns and 8 neurons; for the truly active (token, neuron) pairs u = x·up[j]
// the same way, and y += relu(g)·u·down[j] by vector atomics. The first block to start zeroes y and
// the others wait for it before their first atomic. When every gate is computed
// (DecodeOptions::gates) there is nothing to score: the gates of all M tokens as a plain product
// (decode_gemv at M = 1, cuBLASLt above) into the layer's own buffer, then a kernel that computes
// up and down for the active pairs only (y zeroed by a memset before); or, with
// AllGatesKernel::streamed where every block fits on the GPU at once, one kernel whose blocks copy their
// 16 gate rows into shared memory while the previous kernel ends and then do their own pairs. With
// DecodeOptions::accumulate, y is added to as it is. Nothing allocates and nothing waits on the
// host, so run() can be captured in a CUDA graph; the kernels are programmatic dependent launches
// (they start while the stream's previous kernel ends). The sum order of y depends on timing:
// results agree with the reference to fp32 rounding, not bit for bit between runs.
#pragma once

#include <cuda_runtime.h>

#include "twell/cuda.h"
#include "twell/decode.h"

namespace twell::cuda {

class DecodeLayer {
 public:
  // Keeps a pointer to `weights` (which must outlive the layer) and uploads the sign planes, scales
  // and exact columns of its relu projection (signs = pack_sign_bits(relu projection) on the host),
  // the planes regrouped for the kernel's mma fragments. Synchronous.
  // D must be a multiple of 8 (16-byte weight rows), H <= 2^31 - 1.
  DecodeLayer(const DeviceFfnWeights& weights, const SignBits& signs);
  ~DecodeLayer();
  DecodeLayer(const DecodeLayer&) = delete;
  DecodeLayer& operator=(const DecodeLayer&) = delete;

  // y [M, D] fp32 (device) from x [M, D] bf16 (device), 1 <= M <= kDecodeMaxRows, every predictor
  // kind; x and y 16-byte aligned. Asynchronous. The runs of one layer share its call counter (which
  // block zeroes y, and when): order them on one stream (or chain their streams).
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
