// The model runtime's elementwise, normalization, RoPE, softmax and decode-attention kernels.
// Simple on purpose: each is memory-bound and small next to the GEMMs and FFNs of a step; the
// one exception, decode attention over a long cache, reads each cached key and value once.
#include "cuda/model_kernels.h"

#include <algorithm>
#include <cfloat>

#include "cuda/cuda_utils.h"
#include "cuda/warp_math.cuh"
#include "twell/error.h"

namespace twell::cuda::model_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRopeThreads = 256;
constexpr int kDecodeThreads = 128;
// Rows (key and value) a decode-attention thread loads before it waits for any of them.
constexpr int kDecodeRowsPerLoad = 4;
// The block that merges a head's splits weighs one split per thread.
constexpr int kDecodeMaxSplits = kDecodeThreads;
// A row is read by at most a warp of lanes, 16 bytes (8 bf16) each.
constexpr int kDecodeMaxHeadDim = 32 * 8;

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

// Every kernel here is a programmatic dependent launch (launch_programmatic,
// cuda_utils.h) that reads only activations: it waits for the previous kernel before anything else
// and then lets the next launch begin (whose blocks wait in turn), so a launch's start overlaps the
// end of the kernel before it. A decode step is a chain of such small kernels.
__device__ __forceinline__ void begin_programmatic() {
  wait_for_previous_grid();
  allow_dependent_grids();
}

// Positions per split of decode attention: the visible positions shared by the splits, in whole
// passes of the block (rows_per_pass rows each).
__host__ __device__ inline int32_t decode_split_positions(int32_t visible, int32_t splits, int32_t rows_per_pass) {
  const int32_t share = (visible + splits - 1) / splits;
  return (share + rows_per_pass - 1) / rows_per_pass * rows_per_pass;
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

// y = x / sqrt(mean(x²) + eps) ⊙ weight per row. With kAddFirst the row is first summed in place
// with addend's (x += addend, the FFN's output into the residual stream): one pass over the fp32
// stream instead of add_residual's read and write followed by this kernel's read.
template <bool kAddFirst>
__global__ void rms_norm_kernel(float* x, const bf16* addend, int64_t first, int64_t step, int32_t d_model,
                                const float* weight, float eps, bf16* y) {
  begin_programmatic();
  __shared__ float scratch[32];
  float* row = x + (first + blockIdx.x * step) * d_model;
  const bf16* add_row = kAddFirst ? addend + (first + blockIdx.x * step) * d_model : nullptr;
  float sum_squares = 0;
  // Unrolled so that a thread's loads are in flight together (ncu, 2B prefill rows on an H100:
  // one load per round trip held the kernel at 1.8 TB/s, 31 cycles per issued instruction).
#pragma unroll 8
  for (int32_t k = threadIdx.x; k < d_model; k += blockDim.x) {
    float value = row[k];
    if constexpr (kAddFirst) {
      value += to_float(add_row[k]);
      row[k] = value;  // read back below by this same thread
    }
    sum_squares += value * value;
  }
  sum_squares = block_reduce<false>(sum_squares, scratch);
  const float inv_rms = 1.0f / sqrtf(sum_squares / d_model + eps);
  bf16* out = y + static_cast<int64_t>(blockIdx.x) * d_model;
#pragma unroll 8
  for (int32_t k = threadIdx.x; k < d_model; k += blockDim.x) out[k] = to_bf16(weight[k] * (row[k] * inv_rms));
}

// `value`, element `column` of a qkv row [H_q·Dh + 2·H_kv·Dh], plus its bias (fp32, null when the
// model has none).
__device__ __forceinline__ float with_bias(bf16 value, const float* bias, int64_t column) {
  return to_float(value) + (bias ? bias[column] : 0.0f);
}
__device__ __forceinline__ float qkv_element(const bf16* row, const float* bias, int64_t column) {
  return with_bias(row[column], bias, column);
}

struct RotatedPair {
  bf16 low, high;  // elements i and i + Dh/2 of the head
};

struct RopeAngle {
  float cosine, sine;
};

// The model's RoPE (HF rotate_half, fp32 as HF computes it): the angle of pair i at `position`, and
// the rotation of pair i of the head that starts at `head_column` of a qkv row, the bias added
// first, rounded to bf16. The only copy of this arithmetic: qkv_rope and decode_attention_rope must
// produce the same bits.
__device__ __forceinline__ RopeAngle rope_angle(int32_t i, int32_t dh, int32_t position, float rope_theta) {
  const float inv_freq = 1.0f / powf(rope_theta, static_cast<float>(2 * i) / static_cast<float>(dh));
  const float angle = __fmul_rn(static_cast<float>(position), inv_freq);
  // Accurate cosf/sinf as HF's fp32 RoPE (their large-angle reduction costs a 32-byte stack frame).
  return {cosf(angle), sinf(angle)};
}

// The rotation of pair (x0, x1) = elements (i, i + Dh/2) of a head, the bias added.
__device__ __forceinline__ RotatedPair rotate(float x0, float x1, RopeAngle a) {
  // x0·c − x1·s and x1·c + x0·s with the roundings spelled out: left to the compiler, the products
  // may be contracted into FMAs differently in each kernel this is inlined into. These are the
  // contractions nvcc had chosen for qkv_rope.
  return {to_bf16(__fmaf_rn(x0, a.cosine, -__fmul_rn(x1, a.sine))),
          to_bf16(__fmaf_rn(x0, a.sine, __fmul_rn(x1, a.cosine)))};
}

__device__ __forceinline__ RotatedPair rotate_pair(const bf16* row, const float* bias, int64_t head_column, int32_t i,
                                                   int32_t dh, RopeAngle a) {
  return rotate(qkv_element(row, bias, head_column + i), qkv_element(row, bias, head_column + i + dh / 2), a);
}

// Pairs a qkv_rope thread rotates together: 4 adjacent elements of each half of a head, one 8-byte
// load and store each (Dh a multiple of 8 keeps them aligned).
constexpr int kRopePairs = 4;
union Bf16Quad {  // 4 bf16 as one 8-byte load or store
  uint2 bits;
  bf16 values[4];
};

// One block per row [q heads | k heads | v heads]. The row's Dh/2 angles are computed once into
// shared memory (powf and accurate cosf/sinf were most of the kernel's arithmetic when each thread
// computed its own); while they are, the values are copied to the cache by 16-byte pieces. Then each
// thread rotates kRopePairs adjacent pairs of a q or k head (neighbouring threads, neighbouring
// pieces of a head). Per element, index divisions were most of the instructions (ncu found the
// kernel instruction-bound), hence the pieces.
__global__ void qkv_rope_kernel(const bf16* qkv, const float* bias, AttentionShape s, const int32_t* length,
                                float rope_theta, bf16* q, bf16* k_cache, bf16* v_cache) {
  extern __shared__ RopeAngle angles[];  // [Dh/2]
  begin_programmatic();
  const int32_t r = blockIdx.x, b = r / s.tokens, t = r % s.tokens;
  const int32_t position = *length + t;
  const int32_t dh = s.head_dim, half = dh / 2, heads = s.n_heads + s.n_kv_heads;
  const int64_t q_width = int64_t{s.n_heads} * dh, kv_width = int64_t{s.n_kv_heads} * dh;
  const bf16* in = qkv + r * (q_width + 2 * kv_width);
  for (int32_t i = threadIdx.x; i < half; i += blockDim.x) angles[i] = rope_angle(i, dh, position, rope_theta);

  for (int32_t element = threadIdx.x * 8; element < kv_width; element += blockDim.x * 8) {
    const int32_t head = element / dh, d = element % dh;
    bf16* out = v_cache + ((int64_t{b} * s.n_kv_heads + head) * s.cache_stride + position) * dh + d;
    const int64_t column = q_width + kv_width + element;
    uint4 values = *reinterpret_cast<const uint4*>(in + column);
    if (bias) {
      bf16* v = reinterpret_cast<bf16*>(&values);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = to_bf16(with_bias(v[j], bias, column + j));
    }
    *reinterpret_cast<uint4*>(out) = values;
  }
  __syncthreads();  // the angles

  const int32_t quads = half / kRopePairs;  // per head
  for (int32_t slot = threadIdx.x; slot < heads * quads; slot += blockDim.x) {
    const int32_t head = slot / quads, i = slot % quads * kRopePairs;  // q heads, then k heads
    bf16* out = head < s.n_heads
                    ? q + ((int64_t{b} * s.n_heads + head) * s.tokens + t) * dh
                    : k_cache + ((int64_t{b} * s.n_kv_heads + (head - s.n_heads)) * s.cache_stride + position) * dh;
    const int64_t column = int64_t{head} * dh + i;
    Bf16Quad low, high, low_out, high_out;
    low.bits = *reinterpret_cast<const uint2*>(in + column);
    high.bits = *reinterpret_cast<const uint2*>(in + column + half);
#pragma unroll
    for (int j = 0; j < kRopePairs; ++j) {
      const RotatedPair rotated = rotate(with_bias(low.values[j], bias, column + j),
                                         with_bias(high.values[j], bias, column + half + j), angles[i + j]);
      low_out.values[j] = rotated.low;
      high_out.values[j] = rotated.high;
    }
    *reinterpret_cast<uint2*>(out + i) = low_out.bits;
    *reinterpret_cast<uint2*>(out + i + half) = high_out.bits;
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

// Flash decoding, with the step's RoPE. Block (head = b·H_q + h, split) of the grid (B·H_q, splits)
// takes a contiguous chunk of the visible positions. The chunk is sized on the device from *length,
// so that every split gets work whatever the length (the host sizes the grid from the cache stride
// and the SM count: a captured step cannot know the length). A key row and its value row are read as
// Dh/8 16-byte pieces by as many neighbouring lanes, kDecodeRowsPerLoad rows per thread at once,
// value rows with the key rows: one round trip to memory covers the chunk of a short cache. Each
// thread keeps a running softmax (max, sum, unnormalized P·V, fp32) over its rows; the block merges
// them, writes its split's (max, sum, P·V) and the last block of the head to arrive merges the
// splits (log-sum-exp rescaling) and resets the head's arrival counter for the next call or replay.
//
// The new token's query, key and value come from its qkv row, as qkv_rope would write them (the same
// rope_angle and rotate_pair, the same bf16 values): each block rotates its head's query, and the
// last split, whose chunk ends at the new position *length, rotates the new key and takes the new
// value too. Its block for the first query head of the kv head's group stores them into the caches
// for the later steps; no block reads position *length from the cache, so none waits for that store
// or races with it.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_rope_kernel(const bf16* qkv, const float* bias, AttentionShape s, const int32_t* length,
                                 float rope_theta, bf16* k_cache, bf16* v_cache, float scale, float* split_results,
                                 uint32_t* arrivals, bf16* out) {
  __shared__ float scratch[32];
  __shared__ float group_sums[kDecodeThreads * 8];   // [rows_per_pass, Dh] P·V of each lane group
  __shared__ float split_weights[kDecodeMaxSplits];  // exp(split max - max over the splits)
  __shared__ __align__(16) bf16 query[kDecodeMaxHeadDim];      // [Dh] rotated
  __shared__ __align__(16) bf16 new_key[kDecodeMaxHeadDim];    // [Dh] rotated, at *length (last split only)
  __shared__ __align__(16) bf16 new_value[kDecodeMaxHeadDim];  // [Dh] at *length (last split only)
  __shared__ bool is_last;
  const int32_t dh = s.head_dim, half = dh / 2;
  const int32_t pieces = dh / 8;  // lanes per row: a power of two <= 32 (checked by the launcher)
  const int32_t rows_per_pass = kDecodeThreads / pieces;
  const int32_t head = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int32_t b = head / s.n_heads, h = head % s.n_heads;
  const int32_t group = s.n_heads / s.n_kv_heads, kv_head = h / group;
  wait_for_previous_grid();
  const int32_t position = *length;  // the new token's
  const int32_t visible = position + 1;
  const int32_t chunk = decode_split_positions(visible, splits, rows_per_pass);
  const int32_t active_splits = (visible + chunk - 1) / chunk;
  if (split >= active_splits) return;
  const int32_t begin = split * chunk, end = min(begin + chunk, visible);
  const int64_t cache_base = (int64_t{b} * s.n_kv_heads + kv_head) * s.cache_stride * dh;

  const int64_t q_width = int64_t{s.n_heads} * dh, kv_width = int64_t{s.n_kv_heads} * dh;
  const bf16* row = qkv + b * (q_width + 2 * kv_width);  // [H_q·Dh + 2·H_kv·Dh]
  const bool has_new = end == visible;
  const bool stores_new = has_new && h % group == 0;
  bf16* key_store = k_cache + cache_base + int64_t{position} * dh;    // [Dh]
  bf16* value_store = v_cache + cache_base + int64_t{position} * dh;  // [Dh]
  // Query pairs, then (last split) key pairs and value elements.
  const int32_t items = has_new ? 2 * dh : half;
  for (int32_t item = threadIdx.x; item < items; item += blockDim.x) {
    if (item < half) {
      const RotatedPair rotated =
          rotate_pair(row, bias, int64_t{h} * dh, item, dh, rope_angle(item, dh, position, rope_theta));
      query[item] = rotated.low;
      query[item + half] = rotated.high;
    } else if (item < dh) {
      const int32_t i = item - half;
      const RotatedPair rotated =
          rotate_pair(row, bias, q_width + int64_t{kv_head} * dh, i, dh, rope_angle(i, dh, position, rope_theta));
      new_key[i] = rotated.low;
      new_key[i + half] = rotated.high;
      if (stores_new) {
        key_store[i] = rotated.low;
        key_store[i + half] = rotated.high;
      }
    } else {
      const int32_t d = item - dh;
      const bf16 value = to_bf16(qkv_element(row, bias, q_width + kv_width + int64_t{kv_head} * dh + d));
      new_value[d] = value;
      if (stores_new) value_store[d] = value;
    }
  }
  __syncthreads();

  const auto* keys = reinterpret_cast<const uint4*>(k_cache + cache_base);    // [cap, pieces]
  const auto* values = reinterpret_cast<const uint4*>(v_cache + cache_base);  // [cap, pieces]
  const int32_t piece = threadIdx.x % pieces, row_in_pass = threadIdx.x / pieces;
  const uint4 query_piece = reinterpret_cast<const uint4*>(query)[piece];

  float running_max = -FLT_MAX, running_sum = 0, sums[8] = {};
  // The same trip count in every lane: the shuffles need the whole warp.
  for (int32_t first = begin; first < end; first += rows_per_pass * kDecodeRowsPerLoad) {
    uint4 key[kDecodeRowsPerLoad], value[kDecodeRowsPerLoad];
    bool valid[kDecodeRowsPerLoad];
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerLoad; ++r) {
      const int32_t j = first + r * rows_per_pass + row_in_pass;
      valid[r] = j < end;
      key[r] = value[r] = make_uint4(0, 0, 0, 0);
      if (valid[r] && j == position) {
        key[r] = reinterpret_cast<const uint4*>(new_key)[piece];
        value[r] = reinterpret_cast<const uint4*>(new_value)[piece];
      } else if (valid[r]) {  // j < position
        key[r] = keys[int64_t{j} * pieces + piece];
        value[r] = values[int64_t{j} * pieces + piece];
      }
    }
    float score[kDecodeRowsPerLoad];
    float round_max = running_max;
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerLoad; ++r) {
      float dot = dot8(key[r], query_piece);
      for (int32_t offset = pieces / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      score[r] = dot * scale;
      if (valid[r]) round_max = fmaxf(round_max, score[r]);
    }
    const float correction = expf(running_max - round_max);  // 0 on the first row seen
    running_sum *= correction;
#pragma unroll
    for (int e = 0; e < 8; ++e) sums[e] *= correction;
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerLoad; ++r) {
      const float weight = valid[r] ? expf(score[r] - round_max) : 0.0f;
      running_sum += weight;
      const uint32_t words[4] = {value[r].x, value[r].y, value[r].z, value[r].w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        sums[2 * w] = fmaf(weight, bf16_low(words[w]), sums[2 * w]);
        sums[2 * w + 1] = fmaf(weight, bf16_high(words[w]), sums[2 * w + 1]);
      }
    }
    running_max = round_max;
  }
  allow_dependent_grids();  // every input is read

  // Lane groups that saw no row keep max -FLT_MAX and sums 0: their rescale is 0.
  const float block_max = block_reduce<true>(running_max, scratch);
  const float rescale = expf(running_max - block_max);
  const float block_sum = block_reduce<false>(piece == 0 ? running_sum * rescale : 0.0f, scratch);
#pragma unroll
  for (int e = 0; e < 8; ++e) group_sums[row_in_pass * dh + piece * 8 + e] = sums[e] * rescale;
  __syncthreads();
  bf16* head_out = out + int64_t{head} * dh;  // out [B, H_q, Dh]
  const int32_t result_floats = dh + 2;
  float* result = split_results + (int64_t{head} * splits + split) * result_floats;  // [max, sum, P·V [Dh]]
  for (int32_t d = threadIdx.x; d < dh; d += blockDim.x) {
    float sum = 0;
    for (int32_t r = 0; r < rows_per_pass; ++r) sum += group_sums[r * dh + d];
    if (active_splits == 1)
      head_out[d] = to_bf16(sum / block_sum);
    else
      result[2 + d] = sum;
  }
  if (active_splits == 1) return;
  if (threadIdx.x == 0) {
    result[0] = block_max;
    result[1] = block_sum;
  }
  __threadfence();  // this split's result is visible to the block that sees the last arrival
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&arrivals[head], 1u) == static_cast<uint32_t>(active_splits - 1);
  __syncthreads();
  if (!is_last) return;

  if (threadIdx.x == 0) arrivals[head] = 0;
  // __ldcg: the other splits' results come from L2, never from a stale L1 line.
  const float* head_results = split_results + int64_t{head} * splits * result_floats;  // [splits, Dh + 2]
  const int32_t i = threadIdx.x;  // one split per thread (splits <= kDecodeMaxSplits = blockDim.x)
  const float split_max = i < active_splits ? __ldcg(head_results + i * result_floats) : -FLT_MAX;
  const float max_all = block_reduce<true>(split_max, scratch);
  const float weight = i < active_splits ? expf(split_max - max_all) : 0.0f;
  split_weights[i] = weight;
  const float total =  // its barriers also publish split_weights[]
      block_reduce<false>(i < active_splits ? weight * __ldcg(head_results + i * result_floats + 1) : 0.0f, scratch);
  for (int32_t d = threadIdx.x; d < dh; d += blockDim.x) {
    float sum = 0;
    for (int32_t k = 0; k < active_splits; ++k)
      sum += split_weights[k] * __ldcg(head_results + k * result_floats + 2 + d);
    head_out[d] = to_bf16(sum / total);
  }
}

// By 16-byte pieces of the fp32 stream (4 elements); the tail of a count not a multiple of 4 by one.
__global__ void add_residual_kernel(float* hidden, const bf16* y, int64_t count) {
  begin_programmatic();
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x, stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t quads = count / 4;
  for (int64_t i = first; i < quads; i += stride) {
    float4 sum = reinterpret_cast<const float4*>(hidden)[i];
    Bf16Quad add;
    add.bits = reinterpret_cast<const uint2*>(y)[i];
    sum.x += to_float(add.values[0]);
    sum.y += to_float(add.values[1]);
    sum.z += to_float(add.values[2]);
    sum.w += to_float(add.values[3]);
    reinterpret_cast<float4*>(hidden)[i] = sum;
  }
  for (int64_t i = quads * 4 + first; i < count; i += stride) hidden[i] += to_float(y[i]);
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
}

void rms_norm(const float* x, int64_t rows, int64_t first, int64_t step, int32_t d_model, const float* weight, float eps,
              bf16* y, cudaStream_t stream) {
  // rms_norm_kernel<false> never writes x: one kernel serves both ops.
  launch_programmatic(rms_norm_kernel<false>, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, stream,
                      const_cast<float*>(x), static_cast<const bf16*>(nullptr), first, step, d_model, weight, eps, y);
}

void add_rms_norm(float* hidden, const bf16* addend, int64_t rows, int32_t d_model, const float* weight, float eps,
                  bf16* y, cudaStream_t stream) {
  launch_programmatic(rms_norm_kernel<true>, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, stream, hidden,
                      addend, int64_t{0}, int64_t{1}, d_model, weight, eps, y);
}

void qkv_rope(const bf16* qkv, const float* bias, const AttentionShape& shape, const int32_t* length, float rope_theta,
              bf16* q, bf16* k_cache, bf16* v_cache, cudaStream_t stream) {
  TWELL_REQUIRE(shape.head_dim > 0 && shape.head_dim % 8 == 0,
                "qkv_rope: head_dim must be a positive multiple of 8 (rows are rotated by 8-byte pieces), got {}",
                shape.head_dim);
  const auto rows = static_cast<unsigned>(int64_t{shape.batch} * shape.tokens);
  const size_t angle_bytes = static_cast<size_t>(shape.head_dim / 2) * sizeof(RopeAngle);
  launch_programmatic(qkv_rope_kernel, dim3(rows), dim3(kRopeThreads), angle_bytes, stream, qkv, bias, shape, length,
                      rope_theta, q, k_cache, v_cache);
}

void causal_softmax(const float* scores, int64_t rows_total, int32_t tokens, int32_t start, int32_t ld, float scale,
                    bf16* probs, cudaStream_t stream) {
  launch_programmatic(causal_softmax_kernel, dim3(static_cast<unsigned>(rows_total)), dim3(kThreads), 0, stream, scores,
                      tokens, start, ld, scale, probs);
}

void heads_to_tokens(const bf16* in, const AttentionShape& shape, bf16* out, cudaStream_t stream) {
  const int64_t count = int64_t{shape.batch} * shape.n_heads * shape.tokens * shape.head_dim;
  launch_programmatic(heads_to_tokens_kernel, dim3(grid_for(count)), dim3(kThreads), 0, stream, in, shape, count, out);
}

bool decode_attention_supports(int32_t head_dim) {
  const int32_t pieces = head_dim / 8;
  return head_dim % 8 == 0 && pieces >= 1 && pieces <= 32 && (pieces & (pieces - 1)) == 0;
}

int32_t decode_attention_splits(const AttentionShape& shape) {
  // As many blocks as the GPU holds at once: more would queue behind the first wave, fewer leave
  // SMs idle; never more splits than a cache of cache_stride positions can fill, a pass each.
  static const int64_t resident_blocks = [] {
    int per_sm = 0;
    TWELL_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_attention_rope_kernel, kDecodeThreads, 0));
    return int64_t{per_sm} * device_facts().sm_count;
  }();
  const int64_t heads = int64_t{shape.batch} * shape.n_heads;
  const int32_t rows_per_pass = kDecodeThreads / (shape.head_dim / 8);
  const int64_t fill = (resident_blocks + heads - 1) / heads;
  const int64_t fillable = (shape.cache_stride + rows_per_pass - 1) / rows_per_pass;
  return static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>({fill, fillable, kDecodeMaxSplits})));
}

size_t decode_attention_workspace_bytes(const AttentionShape& shape) {
  const auto heads = static_cast<size_t>(shape.batch) * shape.n_heads;
  const auto splits = static_cast<size_t>(decode_attention_splits(shape));
  return heads * splits * (shape.head_dim + 2) * sizeof(float) + heads * sizeof(uint32_t);
}

void decode_attention_rope(const bf16* qkv, const float* bias, const AttentionShape& shape, const int32_t* length,
                           float rope_theta, bf16* k_cache, bf16* v_cache, float scale, bf16* out, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  TWELL_REQUIRE(decode_attention_supports(shape.head_dim),
                "decode_attention_rope: head_dim must be 8·2^i up to 256, got {}", shape.head_dim);
  TWELL_REQUIRE(shape.tokens == 1, "decode_attention_rope: one token per sequence, got {}", shape.tokens);
  TWELL_REQUIRE(shape.n_kv_heads > 0 && shape.n_heads % shape.n_kv_heads == 0,
                "decode_attention_rope: n_heads ({}) must be a multiple of n_kv_heads ({})", shape.n_heads,
                shape.n_kv_heads);
  TWELL_REQUIRE(shape.batch > 0 && shape.n_heads > 0,
                "decode_attention_rope: batch ({}) and n_heads ({}) must be positive", shape.batch, shape.n_heads);
  TWELL_REQUIRE(shape.cache_stride > 0,
                "decode_attention_rope: cache_stride must be positive (the new position is stored in the cache), got {}",
                shape.cache_stride);
  TWELL_REQUIRE(rope_theta > 0, "decode_attention_rope: rope_theta must be positive, got {}", rope_theta);
  const size_t needed = decode_attention_workspace_bytes(shape);
  TWELL_REQUIRE(workspace_bytes >= needed, "decode_attention_rope: workspace of {} bytes, {} needed", workspace_bytes,
                needed);
  const int32_t splits = decode_attention_splits(shape);
  const auto heads = static_cast<unsigned>(shape.batch * shape.n_heads);
  auto* split_results = static_cast<float*>(workspace);  // [B·H_q, splits, Dh + 2]
  auto* arrivals =                                       // [B·H_q]
      reinterpret_cast<uint32_t*>(split_results + size_t{heads} * splits * (shape.head_dim + 2));
  launch_programmatic(decode_attention_rope_kernel, dim3(heads, static_cast<unsigned>(splits)), dim3(kDecodeThreads), 0,
                      stream, qkv, bias, shape, length, rope_theta, k_cache, v_cache, scale, split_results, arrivals,
                      out);
}

void add_residual(float* hidden, const bf16* y, int64_t count, cudaStream_t stream) {
  launch_programmatic(add_residual_kernel, dim3(grid_for((count + 3) / 4)), dim3(kThreads), 0, stream, hidden, y, count);
}

void argmax_tokens(const float* logits, int32_t batch, int32_t vocab, const int32_t* length, int32_t* next,
                   int32_t* history, int32_t history_stride, cudaStream_t stream) {
  launch_programmatic(argmax_kernel, dim3(static_cast<unsigned>(batch)), dim3(kThreads), 0, stream, logits, vocab, length,
                      next, history, history_stride);
}

void advance_length(int32_t* length, int32_t n, cudaStream_t stream) {
  launch_programmatic(advance_length_kernel, dim3(1), dim3(1), 0, stream, length, n);
}

}  // namespace twell::cuda::model_kernels
