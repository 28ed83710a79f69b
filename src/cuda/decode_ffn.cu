// The CUDA decode FFN (include/twell/decode_cuda.h). One warp per group of 8 neurons:
//   1. score the group for all M <= 16 tokens:
//        one-bit gate  mma.m16n8k16 with A = x [16 tokens, 16 k] bf16 (rows >= M are zero) and
//                      B = ±1 [16 k, 8 neurons] built in registers from the sign bits; fp32 sums
//                      are exact sums of ±x, times scale_j afterwards;
//        sign rule     popcount(x signs XOR W signs) per (token, neuron); the x signs are packed once
//                      per block into shared memory with ballots;
//      and record, per neuron, the mask of tokens predicted active;
//   2. for each neuron with a predicted token: one read of the gate row (16-byte loads), exact dots
//      for the predicted tokens; for the tokens with gate > 0, one read of the up and down rows
//      together, u = x·up[j], and y[m] += relu(g)·u·down[j] by red.global.add.v4.f32.
// Bytes: sign bits of every neuron + gate rows of predicted neurons + up/down rows of active ones.
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda_utils.h"
#include "cuda/warp_math.cuh"
#include "twell/decode_cuda.h"

namespace twell::cuda {
namespace {

// Neurons per warp: 4 of the 8 columns of mma.m16n8k16 (the other 4 are zero). Fewer neurons per
// warp means more warps in flight for the latency-bound gather of gate rows that follows; the
// tensor-core work wasted on the empty columns is negligible.
constexpr int kNeuronsPerWarp = 4;
constexpr int kWarpsPerBlock = 4;
constexpr int kChunk = 8;           // bf16 per 16-byte load

struct Counters {
  unsigned long long predicted;
  unsigned long long active;
  unsigned long long missed;
};

struct DecodeParams {
  const bf16* x;           // [M, D]
  const bf16* projection;  // [H, D] gate (gated) or up
  const bf16* up;          // [H, D] (null when non-gated)
  const bf16* down;        // [H, D]
  const uint32_t* signs;   // [H, words]
  const float* scale;      // [H]
  float* y;                // [M, D], zeroed
  Counters* counters;
  int32_t rows, cols, hidden, words;
  int32_t max_negatives;   // sign rule
  float min_score;         // one-bit gate
  bool count_missed;
};


__device__ __forceinline__ uint4 load_chunk(const bf16* row, int chunk) {
  return __ldg(reinterpret_cast<const uint4*>(row) + chunk);
}

__device__ __forceinline__ void red_add_v4(float* address, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

// x·row for every token in `tokens` (bit m = token m), each result in every lane. [D] rows.
// The row is read in batches of kBatch 16-byte loads per lane, all issued before the first use.
constexpr int kBatch = 8;
__device__ __forceinline__ void dots(const DecodeParams& p, const bf16* row, uint32_t tokens, int lane,
                                     float (&out)[kDecodeMaxRows]) {
#pragma unroll
  for (int m = 0; m < kDecodeMaxRows; ++m) out[m] = 0.0f;
  const int chunks = p.cols / kChunk;
  for (int first = lane; first < chunks; first += 32 * kBatch) {
    uint4 w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      w[b] = first + 32 * b < chunks ? load_chunk(row, first + 32 * b) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int m = 0; m < kDecodeMaxRows; ++m) {
      if (!(tokens & (1u << m))) continue;
      const bf16* x_row = p.x + static_cast<int64_t>(m) * p.cols;
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (first + 32 * b < chunks) out[m] += dot8(load_chunk(x_row, first + 32 * b), w[b]);
    }
  }
#pragma unroll
  for (int m = 0; m < kDecodeMaxRows; ++m)
    if (tokens & (1u << m)) out[m] = warp_sum(out[m]);
}

// Asks L2 for a row that is read soon (the down row while the up row's dots run).
__device__ __forceinline__ void prefetch_row(const bf16* row, int cols, int lane) {
  for (int byte = lane * 128; byte < cols * 2; byte += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(row) + byte));
}

// One-bit gate of the warp's neurons for 16 token rows on the tensor cores; sets bit m of
// predicted[n] when scale·Σ x[m]·sign(W[n]) >= min_score. bits [kNeuronsPerWarp, stride] in shared memory.
__device__ void score_one_bit(const DecodeParams& p, const uint32_t* bits, int stride, int first_neuron, int lane,
                              uint32_t* predicted) {
  const int group = lane >> 2, quad = lane & 3;  // mma fragment coordinates
  const bool column_used = group < kNeuronsPerWarp;  // B column this lane feeds
  const uint32_t* neuron_bits = bits + (column_used ? group : 0) * stride;
  const bool row_lo = group < p.rows, row_hi = group + 8 < p.rows;
  const uint32_t* x_lo = reinterpret_cast<const uint32_t*>(p.x + static_cast<int64_t>(group) * p.cols);
  const uint32_t* x_hi = reinterpret_cast<const uint32_t*>(p.x + static_cast<int64_t>(group + 8) * p.cols);
  // Four independent accumulator sets, so consecutive mma instructions do not wait on each other.
  constexpr int kStreams = 8;
  float acc[kStreams][4] = {};
  const int steps = (p.cols + 15) / 16;
  for (int first = 0; first < steps; first += kStreams) {
#pragma unroll
    for (int s = 0; s < kStreams; ++s) {
      const int step = first + s;
      if (step >= steps) break;
      const int k = step * 16 + quad * 2;  // this lane's first column; pairs never straddle D (D even)
      const bool in_lo = k < p.cols, in_hi = k + 8 < p.cols;
      const uint32_t a0 = row_lo && in_lo ? __ldg(x_lo + k / 2) : 0u;
      const uint32_t a1 = row_hi && in_lo ? __ldg(x_hi + k / 2) : 0u;
      const uint32_t a2 = row_lo && in_hi ? __ldg(x_lo + k / 2 + 4) : 0u;
      const uint32_t a3 = row_hi && in_hi ? __ldg(x_hi + k / 2 + 4) : 0u;
      const uint32_t half = column_used ? neuron_bits[step / 2] >> ((step & 1) * 16) : 0u;
      // bf16 +1 = 0x3f80; the sign bit (bit 15 of each half) set where the weight is negative.
      const uint32_t b0 = 0x3f803f80u | ((half >> (quad * 2)) & 1u) << 15 | ((half >> (quad * 2 + 1)) & 1u) << 31;
      const uint32_t b1 =
          0x3f803f80u | ((half >> (quad * 2 + 8)) & 1u) << 15 | ((half >> (quad * 2 + 9)) & 1u) << 31;
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};"
          : "+f"(acc[s][0]), "+f"(acc[s][1]), "+f"(acc[s][2]), "+f"(acc[s][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
#pragma unroll
  for (int s = 1; s < kStreams; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[0][i] += acc[s][i];
  // C fragment: acc[0..1] = rows group, columns quad*2 + {0, 1}; acc[2..3] = row group + 8.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = group + (i >= 2 ? 8 : 0);
    const int n = quad * 2 + (i & 1);
    const int j = first_neuron + n;
    if (m < p.rows && n < kNeuronsPerWarp && j < p.hidden && p.scale[j] * acc[0][i] >= p.min_score) atomicOr(&predicted[n], 1u << m);
  }
}

// The one-bit gate for M <= kCudaCoreScoreRows on the CUDA cores: for so few rows the mma loop
// above (16 rows, half of its columns empty) issues several times more instructions than adding ±x
// directly. Each lane takes whole sign words; x·sign is x with its sign bit XORed with the weight's.
constexpr int kCudaCoreScoreRows = 2;
__device__ void score_one_bit_few_rows(const DecodeParams& p, const uint32_t* bits, int stride, int first_neuron,
                                       int lane, uint32_t* predicted) {
  float sums[kNeuronsPerWarp][kCudaCoreScoreRows] = {};
  for (int w = lane; w < p.words; w += 32) {
    for (int m = 0; m < p.rows; ++m) {
      // x[m, 32w : 32w + 32] as 16 bf16 pairs; columns past D are 0 (D is a multiple of 8).
      uint32_t pairs[16];
      const uint4* x_chunks = reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(m) * p.cols + w * 32);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint4 chunk = w * 32 + c * 8 < p.cols ? __ldg(x_chunks + c) : make_uint4(0u, 0u, 0u, 0u);
        pairs[4 * c] = chunk.x;
        pairs[4 * c + 1] = chunk.y;
        pairs[4 * c + 2] = chunk.z;
        pairs[4 * c + 3] = chunk.w;
      }
#pragma unroll
      for (int n = 0; n < kNeuronsPerWarp; ++n) {
        const uint32_t word = bits[n * stride + w];
        float sum = 0.0f;
#pragma unroll
        for (int b = 0; b < 32; ++b) {
          const uint32_t x_bits = b % 2 == 0 ? pairs[b / 2] << 16 : pairs[b / 2] & 0xffff0000u;
          sum += __uint_as_float(x_bits ^ ((word << (31 - b)) & 0x80000000u));
        }
#pragma unroll
        for (int r = 0; r < kCudaCoreScoreRows; ++r)
          if (r == m) sums[n][r] += sum;
      }
    }
  }
#pragma unroll
  for (int n = 0; n < kNeuronsPerWarp; ++n) {
    const int j = first_neuron + n;
    uint32_t mask = 0;
#pragma unroll
    for (int m = 0; m < kCudaCoreScoreRows; ++m) {
      const float total = warp_sum(sums[n][m]);
      if (m < p.rows && j < p.hidden && p.scale[j] * total >= p.min_score) mask |= 1u << m;
    }
    if (lane == 0) predicted[n] = mask;
  }
}

// Sign rule of the warp's neurons: N_neg = popcount(x signs XOR W signs) over the words.
// x_signs [M, words], bits [kNeuronsPerWarp, stride], both in shared memory.
__device__ void score_sign_rule(const DecodeParams& p, const uint32_t* x_signs, const uint32_t* bits, int stride,
                                int first_neuron, int lane, uint32_t* predicted) {
  for (int n = 0; n < kNeuronsPerWarp; ++n) {
    if (first_neuron + n >= p.hidden) break;
    int counts[kDecodeMaxRows] = {};
    for (int w = lane; w < p.words; w += 32) {
      const uint32_t word = bits[n * stride + w];
#pragma unroll
      for (int m = 0; m < kDecodeMaxRows; ++m)
        if (m < p.rows) counts[m] += __popc(word ^ x_signs[m * p.words + w]);
    }
    uint32_t mask = 0;
#pragma unroll
    for (int m = 0; m < kDecodeMaxRows; ++m)
      if (m < p.rows && __reduce_add_sync(0xffffffffu, counts[m]) <= p.max_negatives) mask |= 1u << m;
    if (lane == 0) predicted[n] = mask;
  }
}

template <bool kSignRule>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 2) decode_ffn_kernel(DecodeParams p) {
  // Shared memory: the sign rows of every warp's neurons [kWarpsPerBlock, kNeuronsPerWarp, stride]
  // (stride = words + 1: the rows of one warp fall in different banks), then, for the sign rule,
  // the x signs [M, words].
  extern __shared__ uint32_t shared_words[];
  __shared__ uint32_t predicted[kWarpsPerBlock][kNeuronsPerWarp];  // bit m: token m predicted active
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first_neuron = (blockIdx.x * kWarpsPerBlock + warp) * kNeuronsPerWarp;
  const int stride = p.words + 1;
  uint32_t* bits = shared_words + warp * kNeuronsPerWarp * stride;
  uint32_t* x_signs = shared_words + kWarpsPerBlock * kNeuronsPerWarp * stride;

  // Every load below is independent of the others, so each warp waits for one memory latency.
  for (int first = lane; first < kNeuronsPerWarp * p.words; first += 32 * 8) {
    uint32_t word[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = first + 32 * u, n = i / p.words, j = first_neuron + n;
      word[u] = i < kNeuronsPerWarp * p.words && j < p.hidden ? __ldg(p.signs + static_cast<int64_t>(j) * p.words + i % p.words) : 0u;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = first + 32 * u;
      if (i < kNeuronsPerWarp * p.words) bits[(i / p.words) * stride + i % p.words] = word[u];
    }
  }
  if (kSignRule) {
    // Pack the x signs with ballots (bit set iff x < 0; -0.0 is not negative), as pack_sign_bits does.
    const int items = p.rows * p.words;
    const unsigned short* x_bits = reinterpret_cast<const unsigned short*>(p.x);
    for (int first = warp; first < items; first += kWarpsPerBlock * 8) {
      unsigned short value[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int item = first + kWarpsPerBlock * u, k = (item % p.words) * 32 + lane;
        value[u] = item < items && k < p.cols ? __ldg(x_bits + (item / p.words) * p.cols + k) : 0;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int item = first + kWarpsPerBlock * u;
        const uint32_t word = __ballot_sync(0xffffffffu, (value[u] & 0x8000u) && (value[u] & 0x7fffu));
        if (lane == 0 && item < items) x_signs[item] = word;
      }
    }
  }
  __syncthreads();
  if (first_neuron >= p.hidden) return;
  if (lane < kNeuronsPerWarp) predicted[warp][lane] = 0u;
  __syncwarp();
  if (kSignRule)
    score_sign_rule(p, x_signs, bits, stride, first_neuron, lane, predicted[warp]);
  else if (p.rows <= kCudaCoreScoreRows)
    score_one_bit_few_rows(p, bits, stride, first_neuron, lane, predicted[warp]);
  else
    score_one_bit(p, bits, stride, first_neuron, lane, predicted[warp]);
  __syncwarp();
  // Ask L2 for every gate row this warp will read, so the sequential loop below waits on L2, not DRAM.
  for (int n = 0; n < kNeuronsPerWarp; ++n)
    if (first_neuron + n < p.hidden && (predicted[warp][n] != 0u || p.count_missed))
      prefetch_row(p.projection + static_cast<int64_t>(first_neuron + n) * p.cols, p.cols, lane);

  const uint32_t all_rows = (1u << p.rows) - 1u;
  unsigned long long predicted_count = 0, active_count = 0, missed_count = 0;
  for (int n = 0; n < kNeuronsPerWarp; ++n) {
    const int j = first_neuron + n;
    if (j >= p.hidden) break;
    const uint32_t predicted_rows = predicted[warp][n];
    const uint32_t gate_rows = p.count_missed ? all_rows : predicted_rows;
    if (gate_rows == 0) continue;
    float gate[kDecodeMaxRows];
    dots(p, p.projection + static_cast<int64_t>(j) * p.cols, gate_rows, lane, gate);
    uint32_t active_rows = 0;
#pragma unroll
    for (int m = 0; m < kDecodeMaxRows; ++m)
      if ((gate_rows & (1u << m)) && gate[m] > 0.0f) active_rows |= 1u << m;
    predicted_count += __popc(predicted_rows);
    missed_count += __popc(active_rows & ~predicted_rows);
    active_rows &= predicted_rows;
    active_count += __popc(active_rows);
    if (active_rows == 0) continue;

    // Coefficients relu(g)·u of the active tokens; the down row is read in the same pass as the up row.
    const bf16* down_row = p.down + static_cast<int64_t>(j) * p.cols;
    prefetch_row(down_row, p.cols, lane);
    float coefficient[kDecodeMaxRows];
    if (p.up != nullptr) {
      dots(p, p.up + static_cast<int64_t>(j) * p.cols, active_rows, lane, coefficient);
#pragma unroll
      for (int m = 0; m < kDecodeMaxRows; ++m) coefficient[m] *= gate[m];
    } else {
#pragma unroll
      for (int m = 0; m < kDecodeMaxRows; ++m) coefficient[m] = gate[m];
    }
    const int chunks = p.cols / kChunk;
    for (int first = lane; first < chunks; first += 32 * kBatch) {
      uint4 d[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        d[b] = first + 32 * b < chunks ? load_chunk(down_row, first + 32 * b) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int m = 0; m < kDecodeMaxRows; ++m) {
        if (!(active_rows & (1u << m))) continue;
        const float s = coefficient[m];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (first + 32 * b >= chunks) continue;
          float* out = p.y + static_cast<int64_t>(m) * p.cols + (first + 32 * b) * kChunk;
          red_add_v4(out, s * bf16_low(d[b].x), s * bf16_high(d[b].x), s * bf16_low(d[b].y), s * bf16_high(d[b].y));
          red_add_v4(out + 4, s * bf16_low(d[b].z), s * bf16_high(d[b].z), s * bf16_low(d[b].w),
                     s * bf16_high(d[b].w));
        }
      }
    }
  }
  if (lane == 0) {
    atomicAdd(&p.counters->predicted, predicted_count);
    atomicAdd(&p.counters->active, active_count);
    if (p.count_missed) atomicAdd(&p.counters->missed, missed_count);
  }
}

}  // namespace

struct DecodeLayer::Impl {
  const DeviceFfnWeights* weights;
  DeviceBuffer<uint32_t> signs;  // [H, words]
  DeviceBuffer<float> scale;     // [H]
  DeviceBuffer<Counters> counters;
  int32_t words = 0;
  mutable bool all_counted_missed = true;  // every run since the last stats() counted misses
};

DecodeLayer::DecodeLayer(const DeviceFfnWeights& weights, const SignBits& signs) : impl_(std::make_unique<Impl>()) {
  TWELL_REQUIRE(weights.d_model >= 8 && weights.d_model % 8 == 0,
                "decode on CUDA needs D a multiple of 8 (16-byte weight rows), got {}", weights.d_model);
  TWELL_REQUIRE(signs.rows == weights.d_hidden && signs.cols == weights.d_model,
                "signs must be packed from the relu projection [H={}, D={}], got [{}, {}]", weights.d_hidden,
                weights.d_model, signs.rows, signs.cols);
  TWELL_REQUIRE(signs.bits.size() == static_cast<size_t>(signs.rows) * signs.words_per_row() &&
                    signs.scale.size() == static_cast<size_t>(signs.rows),
                "signs arrays must hold H·words = {} words and H = {} scales, got {} and {}",
                static_cast<size_t>(signs.rows) * signs.words_per_row(), signs.rows, signs.bits.size(),
                signs.scale.size());
  impl_->weights = &weights;
  impl_->words = signs.words_per_row();
  impl_->signs.upload(signs.bits.data(), signs.bits.size());
  impl_->scale.upload(signs.scale.data(), signs.scale.size());
  impl_->counters.resize(1);
  TWELL_CUDA_CHECK(cudaMemset(impl_->counters.data(), 0, sizeof(Counters)));
  TWELL_CUDA_CHECK(cudaDeviceSynchronize());
}

DecodeLayer::~DecodeLayer() = default;

bool DecodeLayer::supports(PredictorKind kind) {
  return kind == PredictorKind::sign_rule || kind == PredictorKind::one_bit_gate;
}

void DecodeLayer::run(const bf16* x, int64_t rows, const PredictorConfig& predictor, float* y, cudaStream_t stream,
                      const DecodeOptions& options) const {
  const DeviceFfnWeights& w = *impl_->weights;
  TWELL_REQUIRE(rows >= 1 && rows <= kDecodeMaxRows, "rows (M) must lie in [1, {}], got {}", kDecodeMaxRows, rows);
  TWELL_REQUIRE(supports(predictor.kind),
                "the CUDA decode FFN has no kernel for the {} predictor yet (CPU only); calibrate with one-bit or sign",
                to_string(predictor.kind));
  const bool sign_rule = predictor.kind == PredictorKind::sign_rule;
  DecodeParams p{};
  p.x = x;
  p.projection = w.relu_projection();
  p.up = w.gated ? w.up.get() : nullptr;
  p.down = w.down.get();
  p.signs = impl_->signs.data();
  p.scale = impl_->scale.data();
  p.y = y;
  p.counters = impl_->counters.data();
  p.rows = static_cast<int32_t>(rows);
  p.cols = w.d_model;
  p.hidden = w.d_hidden;
  p.words = impl_->words;
  p.max_negatives = sign_rule ? sign_rule_max_negatives(predictor.alpha, w.d_model) : 0;
  p.min_score = static_cast<float>(-predictor.margin);
  p.count_missed = options.count_missed;
  impl_->all_counted_missed = impl_->all_counted_missed && options.count_missed;

  TWELL_CUDA_CHECK(cudaMemsetAsync(y, 0, static_cast<size_t>(rows) * w.d_model * sizeof(float), stream));
  const int groups = (w.d_hidden + kNeuronsPerWarp - 1) / kNeuronsPerWarp;
  const int blocks = (groups + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const size_t shared = (static_cast<size_t>(kWarpsPerBlock) * kNeuronsPerWarp * (impl_->words + 1) +
                         (sign_rule ? static_cast<size_t>(rows) * impl_->words : 0)) *
                        sizeof(uint32_t);
  TWELL_REQUIRE(shared <= 48 * 1024, "decode: {} bytes of shared memory for D = {}, over 48 KiB", shared, w.d_model);
  if (sign_rule)
    decode_ffn_kernel<true><<<blocks, kWarpsPerBlock * 32, shared, stream>>>(p);
  else
    decode_ffn_kernel<false><<<blocks, kWarpsPerBlock * 32, shared, stream>>>(p);
  TWELL_CUDA_CHECK_LAUNCH();
}

DecodeStats DecodeLayer::stats(cudaStream_t stream) const {
  Counters counters{};
  impl_->counters.download(&counters, 1, stream);
  TWELL_CUDA_CHECK(cudaMemsetAsync(impl_->counters.data(), 0, sizeof(Counters), stream));
  DecodeStats stats;
  stats.predicted = static_cast<int64_t>(counters.predicted);
  stats.active = static_cast<int64_t>(counters.active);
  stats.missed = impl_->all_counted_missed ? static_cast<int64_t>(counters.missed) : -1;
  impl_->all_counted_missed = true;
  return stats;
}

}  // namespace twell::cuda
