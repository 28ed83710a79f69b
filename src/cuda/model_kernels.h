// The model runtime's own CUDA kernels (src/cuda/model_kernels.cu), as host launchers. Everything
// else the runtime runs is a cuBLASLt GEMM (cuda/gemm.h) or an FFN op of twell/cuda.h, decode_cuda.h.
// Shapes: B sequences of n tokens each, rows = B·n; heads H_q (query) and H_kv (key/value) of Dh;
// the KV cache of one layer is [B, H_kv, cap, Dh] bf16. `length` points to the device copy of the
// number of cached positions before this step, so a captured decode step reads it at replay.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "twell/bf16.h"

namespace twell::cuda::model_kernels {

// hidden [rows, D] fp32 = table[tokens[r]] (bf16 [V, D]).
void embed(const int32_t* tokens, int64_t rows, const bf16* table, int32_t d_model, float* hidden, cudaStream_t stream);

// y [rows, D] bf16 = x / sqrt(mean(x²) + eps) ⊙ weight, x row i = x + (first + i·step)·D.
void rms_norm(const float* x, int64_t rows, int64_t first, int64_t step, int32_t d_model, const float* weight, float eps,
              bf16* y, cudaStream_t stream);
// hidden [rows, D] += addend [rows, D] bf16, then y = rms_norm of the sum as above (the same bits as
// add_residual followed by rms_norm; one pass over hidden fewer).
void add_rms_norm(float* hidden, const bf16* addend, int64_t rows, int32_t d_model, const float* weight, float eps,
                  bf16* y, cudaStream_t stream);

struct AttentionShape {
  int32_t batch = 0;         // B
  int32_t tokens = 0;        // n per sequence
  int32_t n_heads = 0;       // H_q
  int32_t n_kv_heads = 0;    // H_kv
  int32_t head_dim = 0;      // Dh (a multiple of 8)
  int32_t cache_stride = 0;  // cap: positions per (sequence, kv head) in the cache
};

// qkv [B, n, H_q·Dh + 2·H_kv·Dh] bf16 (+ bias [same], fp32, or null) -> RoPE (HF rotate_half, fp32
// angles) -> q [B, H_q, n, Dh] bf16 and keys, values at positions *length + t of the caches; Dh a
// multiple of 8. A decode step (n = 1) has it inside decode_attention_rope instead.
void qkv_rope(const bf16* qkv, const float* bias, const AttentionShape& shape, const int32_t* length, float rope_theta,
              bf16* q, bf16* k_cache, bf16* v_cache, cudaStream_t stream);

// scores [rows_total, ld] fp32 (rows = (sequence, head, t), t fastest) -> probs bf16 [same]:
// softmax(scale·scores) over the positions query t sees (0 ..= start + t), zeros after them up to ld.
void causal_softmax(const float* scores, int64_t rows_total, int32_t tokens, int32_t start, int32_t ld, float scale,
                    bf16* probs, cudaStream_t stream);

// in [B, H, n, Dh] -> out [B·n, H·Dh] (bf16).
void heads_to_tokens(const bf16* in, const AttentionShape& shape, bf16* out, cudaStream_t stream);

// One decode step's (n = 1) RoPE and attention in one kernel, in place of qkv_rope + attention:
// from qkv [B, H_q·Dh + 2·H_kv·Dh] bf16 (+ bias [same], fp32, or null) it rotates the query and the
// new key as qkv_rope does (the same bf16 values), stores the new key and value into the caches at
// position *length, and writes out [B, H_q·Dh] bf16 = softmax(scale·q·K^T)·V over positions
// 0 ..= *length of each sequence, any *length < cache_stride. The caches are read below *length
// only. Dh must pass decode_attention_supports, H_q be a multiple of H_kv. `workspace` holds at
// least decode_attention_workspace_bytes(shape) bytes, zeroed once when allocated: it holds the
// per-split results and per-head arrival counters, which each call leaves zero again (a captured
// call replays as is).
void decode_attention_rope(const bf16* qkv, const float* bias, const AttentionShape& shape, const int32_t* length,
                           float rope_theta, bf16* k_cache, bf16* v_cache, float scale, bf16* out, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);
// Dh = 8·2^i, up to 256 (rows are read in 16-byte pieces by a power-of-two group of lanes).
bool decode_attention_supports(int32_t head_dim);
// Blocks per (sequence, query head) over the positions (from the shape and this device's SM count).
int32_t decode_attention_splits(const AttentionShape& shape);
size_t decode_attention_workspace_bytes(const AttentionShape& shape);

// hidden [count] fp32 += y [count] bf16.
void add_residual(float* hidden, const bf16* y, int64_t count, cudaStream_t stream);

// next[b] = argmax of logits [B, V] (lowest id on ties); also history[b·history_stride + *length - 1].
void argmax_tokens(const float* logits, int32_t batch, int32_t vocab, const int32_t* length, int32_t* next,
                   int32_t* history, int32_t history_stride, cudaStream_t stream);

// *length += n, on the stream (so a captured step advances its own position).
void advance_length(int32_t* length, int32_t n, cudaStream_t stream);

}  // namespace twell::cuda::model_kernels
