// The model runtime's elementwise, normalization, RoPE, softmax and decode-attention kernels.
// Simple on purpose: each is memory-bound and small next to the GEMMs and FFNs of a step; the
// one exception, decode attention over a long cache, reads each cached key and value once.
#include "cuda/model_kernels.h"

#include <algorithm>
#include <cfloat>
#include <mutex>

#include "cuda/cuda_utils.h"
#include "cuda/warp_math.cuh"

namespace twell::cuda::model_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kDecodeThreads = 256;
constexpr int kRopeThreads = 128;
// decode_attention's shared memory besides the scores: [256 / (Dh/8), Dh] partial sums = 2048 floats.
constexpr int kDecodePartialFloats = 2048;

// Sum (or max) over the block; every thread gets the result. `scratch` holds 32 floats.
template <bool kMax>
__device__ float block_reduce(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = kMax ? fmaxf(value, other) : value + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < warps ? scratch[lane] : (kMax ? -FLT_MAX : 0.0f);
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = kMax ? fmaxf(value, other) : value + other;
  }
  return value;
}

// Every kernel here but decode attention is a programmatic dependent launch (launch_programmatic,
// cuda_utils.h) that reads only activations: it waits for the previous kernel before anything else
// and then lets the next launch begin (whose blocks wait in turn), so a launch's start overlaps the
// end of the kernel before it. A decode step is a chain of such small kernels.
__device__ __forceinline__ void begin_programmatic() {
  wait_for_previous_grid();
  allow_dependent_grids();
}

unsigned grid_for(int64_t count) {
  return static_cast<unsigned>(std::min<int64_t>((count + kThreads - 1) / kThreads, int64_t{device_facts().sm_count} * 32));
}

__global__ void embed_kernel(const int32_t* tokens, const bf16* table, int32_t d_model, float* hidden) {
  begin_programmatic();
  const bf16* row = table + static_cast<int64_t>(tokens[blockIdx.x]) * d_model;
  float* out = hidden + static_cast<int64_t>(blockIdx.x) * d_model;
  for (int32_t k = threadIdx.x; k < d_model; k += blockDim.x) out[k] = to_float(row[k]);
}

__global__ void rms_norm_kernel(const float* x, int64_t first, int64_t step, int32_t d_model, const float* weight,
                                float eps, bf16* y) {
  begin_programmatic();
  __shared__ float scratch[32];
  const float* row = x + (first + blockIdx.x * step) * d_model;
  float sum_squares = 0;
  for (int32_t k = threadIdx.x; k < d_model; k += blockDim.x) sum_squares += row[k] * row[k];
  sum_squares = block_reduce<false>(sum_squares, scratch);
  const float inv_rms = 1.0f / sqrtf(sum_squares / d_model + eps);
  bf16* out = y + static_cast<int64_t>(blockIdx.x) * d_model;
  for (int32_t k = threadIdx.x; k < d_model; k += blockDim.x) out[k] = to_bf16(weight[k] * (row[k] * inv_rms));
}

// One thread per rotated (q or k head, i) pair or per value element of one row: grid (rows, pieces
// of the row). At one decode row a single block looping over the row spent ~17 us on the angles.
__global__ void qkv_rope_kernel(const bf16* qkv, const float* bias, AttentionShape s, const int32_t* length,
                                float rope_theta, bf16* q, bf16* k_cache, bf16* v_cache) {
  begin_programmatic();
  const int32_t r = blockIdx.x, b = r / s.tokens, t = r % s.tokens;
  const int32_t position = *length + t;
  const int32_t dh = s.head_dim, half = dh / 2;
  const int64_t q_width = int64_t{s.n_heads} * dh, kv_width = int64_t{s.n_kv_heads} * dh;
  const int64_t width = q_width + 2 * kv_width;
  const bf16* in = qkv + r * width;
  auto value = [&](int64_t column) { return to_float(in[column]) + (bias ? bias[column] : 0.0f); };
  const int32_t pairs = (s.n_heads + s.n_kv_heads) * half;
  const int32_t index = static_cast<int32_t>(blockIdx.y * blockDim.x + threadIdx.x);
  if (index < pairs) {
    const int32_t head = index / half, i = index % half;
    const bool is_query = head < s.n_heads;
    const int64_t column = int64_t{head} * dh;  // q heads, then k heads, in the qkv row
    bf16* out = is_query ? q + ((int64_t{b} * s.n_heads + head) * s.tokens + t) * dh
                         : k_cache + ((int64_t{b} * s.n_kv_heads + (head - s.n_heads)) * s.cache_stride + position) * dh;
    const float inv_freq = 1.0f / powf(rope_theta, static_cast<float>(2 * i) / static_cast<float>(dh));
    const float angle = static_cast<float>(position) * inv_freq;
    // Accurate cosf/sinf as HF's fp32 RoPE (their large-angle reduction is this kernel's 32-byte stack frame).
    const float c = cosf(angle), sn = sinf(angle);
    const float x0 = value(column + i), x1 = value(column + i + half);
    out[i] = to_bf16(x0 * c - x1 * sn);
    out[i + half] = to_bf16(x1 * c + x0 * sn);
  } else if (const int32_t element = index - pairs; element < kv_width) {  // of the values
    const int32_t head = element / dh, d = element % dh;
    v_cache[((int64_t{b} * s.n_kv_heads + head) * s.cache_stride + position) * dh + d] =
        to_bf16(value(q_width + kv_width + element));
  }
}

__global__ void causal_softmax_kernel(const float* scores, int32_t tokens, int32_t start, int32_t ld, float scale,
                                      bf16* probs) {
  begin_programmatic();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int32_t visible = start + static_cast<int32_t>(row % tokens) + 1;
  const float* in = scores + row * ld;
  bf16* out = probs + row * ld;
  float max_score = -FLT_MAX;
  for (int32_t j = threadIdx.x; j < visible; j += blockDim.x) max_score = fmaxf(max_score, in[j] * scale);
  max_score = block_reduce<true>(max_score, scratch);
  float total = 0;
  for (int32_t j = threadIdx.x; j < visible; j += blockDim.x) total += expf(in[j] * scale - max_score);
  total = block_reduce<false>(total, scratch);
  const float inv_total = 1.0f / total;
  for (int32_t j = threadIdx.x; j < ld; j += blockDim.x)
    out[j] = to_bf16(j < visible ? expf(in[j] * scale - max_score) * inv_total : 0.0f);
}

__global__ void heads_to_tokens_kernel(const bf16* in, AttentionShape s, int64_t count, bf16* out) {
  begin_programmatic();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < count; e += int64_t{gridDim.x} * blockDim.x) {
    // in [B, H, n, Dh]
    const int64_t d = e % s.head_dim, t = (e / s.head_dim) % s.tokens;
    const int64_t h = (e / (int64_t{s.head_dim} * s.tokens)) % s.n_heads;
    const int64_t b = e / (int64_t{s.head_dim} * s.tokens * s.n_heads);
    out[((b * s.tokens + t) * s.n_heads + h) * s.head_dim + d] = in[e];
  }
}

// One block per (sequence, query head), scores in shared memory. A key or value row is read as
// Dh/8 16-byte pieces by as many neighbouring lanes, so one pass of the block covers
// 256 / (Dh/8) positions with every load independent of the others: the kernel is bound by load
// latency (a step reads only a few hundred KB), and this keeps many loads in flight.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_kernel(const bf16* q, const bf16* k_cache, const bf16* v_cache, AttentionShape s,
                            const int32_t* length, float scale, bf16* out) {
  extern __shared__ float shared[];
  __shared__ float scratch[32];
  const int32_t dh = s.head_dim;
  const int32_t pieces = dh / 8;  // lanes per row: a power of two <= 32 (checked by the launcher)
  const int32_t rows_per_pass = kDecodeThreads / pieces;
  float* weights = shared;                   // [cache_stride] scores, then exp(score - max)
  float* partial = shared + s.cache_stride;  // [rows_per_pass, Dh] per-lane-group output sums
  const int32_t b = blockIdx.x / s.n_heads, h = blockIdx.x % s.n_heads;
  const int32_t kv_head = h / (s.n_heads / s.n_kv_heads);
  const int32_t visible = *length + 1;
  const int64_t cache_base = (int64_t{b} * s.n_kv_heads + kv_head) * s.cache_stride * dh;
  const auto* keys = reinterpret_cast<const uint4*>(k_cache + cache_base);    // [cap, pieces]
  const auto* values = reinterpret_cast<const uint4*>(v_cache + cache_base);  // [cap, pieces]
  const int32_t piece = threadIdx.x % pieces, row_in_pass = threadIdx.x / pieces;
  const uint4 query = reinterpret_cast<const uint4*>(q + (int64_t{b} * s.n_heads + h) * dh)[piece];

  float max_score = -FLT_MAX;
#pragma unroll 4
  for (int32_t first = 0; first < visible; first += rows_per_pass) {  // the same trip count in every lane
    const int32_t j = first + row_in_pass;
    float dot = j < visible ? dot8(keys[int64_t{j} * pieces + piece], query) : 0.0f;
    for (int32_t offset = pieces / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (j < visible) {
      dot *= scale;
      if (piece == 0) weights[j] = dot;
      max_score = fmaxf(max_score, dot);
    }
  }
  max_score = block_reduce<true>(max_score, scratch);  // its barriers also publish weights[]
  float total = 0;
  for (int32_t j = threadIdx.x; j < visible; j += blockDim.x) {
    const float weight = expf(weights[j] - max_score);
    weights[j] = weight;
    total += weight;
  }
  total = block_reduce<false>(total, scratch);

  float sums[8] = {};
#pragma unroll 4
  for (int32_t j = row_in_pass; j < visible; j += rows_per_pass) {
    const uint4 v = values[int64_t{j} * pieces + piece];
    const float weight = weights[j];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      sums[2 * w] = fmaf(weight, bf16_low(words[w]), sums[2 * w]);
      sums[2 * w + 1] = fmaf(weight, bf16_high(words[w]), sums[2 * w + 1]);
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) partial[row_in_pass * dh + piece * 8 + e] = sums[e];
  __syncthreads();
  const float inv_total = 1.0f / total;
  for (int32_t d = threadIdx.x; d < dh; d += blockDim.x) {
    float sum = 0;
    for (int32_t r = 0; r < rows_per_pass; ++r) sum += partial[r * dh + d];
    out[(int64_t{b} * s.n_heads + h) * dh + d] = to_bf16(sum * inv_total);
  }
}

template <typename T>
__global__ void add_residual_kernel(float* hidden, const T* y, int64_t count) {
  begin_programmatic();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    if constexpr (sizeof(T) == 2)
      hidden[i] += to_float(y[i]);
    else
      hidden[i] += y[i];
  }
}

__global__ void argmax_kernel(const float* logits, int32_t vocab, const int32_t* length, int32_t* next, int32_t* history,
                              int32_t history_stride) {
  begin_programmatic();
  __shared__ float best_values[kThreads];
  __shared__ int32_t best_ids[kThreads];
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  float best = -FLT_MAX;
  int32_t best_id = 0x7fffffff;
  for (int32_t v = threadIdx.x; v < vocab; v += blockDim.x)
    if (row[v] > best) {  // ascending v per thread: the first maximum is kept
      best = row[v];
      best_id = v;
    }
  best_values[threadIdx.x] = best;
  best_ids[threadIdx.x] = best_id;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float other = best_values[threadIdx.x + stride];
      const int32_t other_id = best_ids[threadIdx.x + stride];
      if (other > best_values[threadIdx.x] || (other == best_values[threadIdx.x] && other_id < best_ids[threadIdx.x])) {
        best_values[threadIdx.x] = other;
        best_ids[threadIdx.x] = other_id;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int32_t token = best_ids[0] == 0x7fffffff ? 0 : best_ids[0];
    next[blockIdx.x] = token;
    history[static_cast<int64_t>(blockIdx.x) * history_stride + *length - 1] = token;
  }
}

__global__ void advance_length_kernel(int32_t* length, int32_t n) {
  begin_programmatic();
  *length += n;
}

}  // namespace

void embed(const int32_t* tokens, int64_t rows, const bf16* table, int32_t d_model, float* hidden, cudaStream_t stream) {
  launch_programmatic(embed_kernel, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, stream, tokens, table, d_model,
                      hidden);
  TWELL_CUDA_CHECK_LAUNCH();
}

void rms_norm(const float* x, int64_t rows, int64_t first, int64_t step, int32_t d_model, const float* weight, float eps,
              bf16* y, cudaStream_t stream) {
  launch_programmatic(rms_norm_kernel, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, stream, x, first, step,
                      d_model, weight, eps, y);
  TWELL_CUDA_CHECK_LAUNCH();
}

void qkv_rope(const bf16* qkv, const float* bias, const AttentionShape& shape, const int32_t* length, float rope_theta,
              bf16* q, bf16* k_cache, bf16* v_cache, cudaStream_t stream) {
  const auto rows = static_cast<unsigned>(int64_t{shape.batch} * shape.tokens);
  const int32_t items = (shape.n_heads + shape.n_kv_heads) * (shape.head_dim / 2) + shape.n_kv_heads * shape.head_dim;
  const dim3 grid(rows, static_cast<unsigned>((items + kRopeThreads - 1) / kRopeThreads));
  launch_programmatic(qkv_rope_kernel, grid, dim3(kRopeThreads), 0, stream, qkv, bias, shape, length, rope_theta, q,
                      k_cache, v_cache);
  TWELL_CUDA_CHECK_LAUNCH();
}

void causal_softmax(const float* scores, int64_t rows_total, int32_t tokens, int32_t start, int32_t ld, float scale,
                    bf16* probs, cudaStream_t stream) {
  launch_programmatic(causal_softmax_kernel, dim3(static_cast<unsigned>(rows_total)), dim3(kThreads), 0, stream, scores,
                      tokens, start, ld, scale, probs);
  TWELL_CUDA_CHECK_LAUNCH();
}

void heads_to_tokens(const bf16* in, const AttentionShape& shape, bf16* out, cudaStream_t stream) {
  const int64_t count = int64_t{shape.batch} * shape.n_heads * shape.tokens * shape.head_dim;
  launch_programmatic(heads_to_tokens_kernel, dim3(grid_for(count)), dim3(kThreads), 0, stream, in, shape, count, out);
  TWELL_CUDA_CHECK_LAUNCH();
}

int32_t decode_attention_max_positions() {
  return device_facts().max_smem_per_block_optin / static_cast<int32_t>(sizeof(float)) - kDecodePartialFloats - 64;
}

bool decode_attention_supports(int32_t head_dim) {
  const int32_t pieces = head_dim / 8;
  return head_dim % 8 == 0 && pieces >= 1 && pieces <= 32 && (pieces & (pieces - 1)) == 0;
}

void decode_attention(const bf16* q, const bf16* k_cache, const bf16* v_cache, const AttentionShape& shape,
                      const int32_t* length, float scale, bf16* out, cudaStream_t stream) {
  static std::once_flag once;
  std::call_once(once, [] {
    TWELL_CUDA_CHECK(cudaFuncSetAttribute(decode_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          device_facts().max_smem_per_block_optin - 32 * static_cast<int>(sizeof(float))));
  });
  const size_t shared = (static_cast<size_t>(shape.cache_stride) + kDecodePartialFloats) * sizeof(float);
  decode_attention_kernel<<<static_cast<unsigned>(shape.batch * shape.n_heads), kDecodeThreads, shared, stream>>>(
      q, k_cache, v_cache, shape, length, scale, out);
  TWELL_CUDA_CHECK_LAUNCH();
}

void add_residual(float* hidden, const bf16* y, int64_t count, cudaStream_t stream) {
  launch_programmatic(add_residual_kernel<bf16>, dim3(grid_for(count)), dim3(kThreads), 0, stream, hidden, y, count);
  TWELL_CUDA_CHECK_LAUNCH();
}

void add_residual(float* hidden, const float* y, int64_t count, cudaStream_t stream) {
  launch_programmatic(add_residual_kernel<float>, dim3(grid_for(count)), dim3(kThreads), 0, stream, hidden, y,
                      count);
  TWELL_CUDA_CHECK_LAUNCH();
}

void argmax_tokens(const float* logits, int32_t batch, int32_t vocab, const int32_t* length, int32_t* next,
                   int32_t* history, int32_t history_stride, cudaStream_t stream) {
  launch_programmatic(argmax_kernel, dim3(static_cast<unsigned>(batch)), dim3(kThreads), 0, stream, logits, vocab, length,
                      next, history, history_stride);
  TWELL_CUDA_CHECK_LAUNCH();
}

void advance_length(int32_t* length, int32_t n, cudaStream_t stream) {
  launch_programmatic(advance_length_kernel, dim3(1), dim3(1), 0, stream, length, n);
  TWELL_CUDA_CHECK_LAUNCH();
}

}  // namespace twell::cuda::model_kernels
