// Causal prefill attention of the model runtime (src/cuda/prefill_attention.cu): n new tokens per
// sequence, at positions start .. start + n - 1, over a KV cache that already holds their keys and
// values. Token t sees positions 0 ..= start + t; query head h reads kv head h / (H_q / H_kv).
//   q             [B, H_q, n, Dh]   bf16 (qkv_rope's output)
//   keys, values  [B, H_kv, cap, Dh] bf16 (one layer of the cache; cap = shape.cache_stride)
//   out           [B·n, H_q·Dh]     bf16, token-major: the O projection's input
// Two implementations; the runtime takes the fused one wherever it supports the head dim.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/cuda_utils.h"
#include "cuda/gemm.h"
#include "cuda/model_kernels.h"
#include "twell/bf16.h"

namespace twell::cuda {

// Flash-style: one block per (sequence, query head, 128 query tokens; 64 at Dh 128) streams the
// visible keys and values through shared memory, tensor-core products, online softmax in fp32. No
// scores buffer; reads no cache position at or past start + n.
bool fused_prefill_attention_supports(int32_t head_dim);  // 16, 32, 64, 128
void fused_prefill_attention(const bf16* q, const bf16* keys, const bf16* values,
                             const model_kernels::AttentionShape& shape, int32_t start, float scale, bf16* out,
                             cudaStream_t stream);

// Any head dim: per (sequence, kv head) a batched cuBLASLt Q·K^T into fp32 scores [group·n, Lp],
// a causal softmax to bf16 probabilities, P·V, then heads -> tokens; as many sequences at a time as
// their scores fit in 1 GiB. Reads positions up to Lp = start + n rounded up to 8, which must lie
// inside the cache (cap a multiple of 8) and be finite (their probability is 0, and 0·NaN is not).
// The cache stride (cap) the GEMM path needs to be a multiple of: its K and V rows start 16-byte aligned.
constexpr int32_t kGemmAttentionPositionAlign = 8;

class GemmPrefillAttention {
 public:
  void run(RowMajorGemm& gemm, const bf16* q, const bf16* keys, const bf16* values,
           const model_kernels::AttentionShape& shape, int32_t start, float scale, bf16* out, cudaStream_t stream);

 private:
  DeviceBuffer<float> scores_;  // [chunk, H_q, n, Lp]
  DeviceBuffer<bf16> probs_;    // [chunk, H_q, n, Lp]
  DeviceBuffer<bf16> heads_;    // [chunk, H_q, n, Dh]
};

}  // namespace twell::cuda
