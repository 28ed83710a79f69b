// The CUDA decode FFN (include/twell/decode_cuda.h). One block of kParts warps per tile of 16 neurons:
//   1. score the tile for all M <= 16 tokens on the tensor cores: mma.m16n8k16 with A = the tile's 16
//      weight rows as bf16 ±1 built in registers from the sign bits (the two-bit gate adds a second A,
//      ±1 where the large bit is set and 0 elsewhere) and B = x [16 k, 8 tokens] (two token tiles
//      for M > 8). Each warp takes 1/kParts of D; the partial sums meet in shared memory. The sign
//      rule takes B = sign(x) as ±1, so the sum is D − 2·N_neg, exact in fp32. For the gates, B is
//      zero at the exact columns (their terms are added exactly afterwards) and ||x|| over the other
//      columns is summed from the same B fragments;
//   2. one thread per (neuron, token) applies the predictor's rule (decode.h);
//   3. the predicted neurons are dealt to the warps: one read of the gate row gives the exact gate of
//      the predicted tokens; for the tokens with gate > 0 one read of the up and down rows together,
//      u = x·up[j], and accumulator[m] += relu(g)·u·down[j] by red.global.add.v4.f32;
//   4. the last block to finish copies the accumulator into y and zeroes it for the next call, so y
//      needs no memset (one graph node per call).
// Bytes: the sign planes of every neuron + gate rows of predicted neurons + up/down rows of active ones.
#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "cuda_utils.h"
#include "cuda/warp_math.cuh"
#include "twell/convert.h"
#include "twell/decode_cuda.h"

namespace twell::cuda {
namespace {

constexpr int kTileNeurons = 16;  // mma M: the neurons of one block
constexpr int kTokenTile = 8;     // mma N: tokens per token tile
constexpr int kParts = 8;         // warps per block, each scoring 1/kParts of D
constexpr int kThreads = kParts * 32;
// Blocks per SM the registers are sized for (launch bounds): with three, every tile of H = 5632
// (352 blocks on 132 SMs) is resident at once.
constexpr int kMinBlocksPerSm = 3;
constexpr int kChunk = 8;         // bf16 per 16-byte load

// What a kind reads: the two-bit gate both planes, the others the sign plane; the normalized gates
// also divide by ||x||.
__host__ __device__ constexpr int planes_of(PredictorKind kind) { return kind == PredictorKind::two_bit_gate ? 2 : 1; }
__host__ __device__ constexpr bool is_normalized(PredictorKind kind) {
  return kind == PredictorKind::normalized_one_bit_gate || kind == PredictorKind::two_bit_gate;
}

struct Counters {
  unsigned long long predicted;
  unsigned long long active;
  unsigned long long missed;
};

struct DecodeParams {
  const bf16* x;              // [M, D]
  const bf16* projection;     // [H, D] gate (gated) or up
  const bf16* up;             // [H, D] (null when non-gated)
  const bf16* down;           // [H, D]
  const uint2* sign_tiles;    // [tiles, words, 8]: sign words of rows (g, g + 8) of the tile, unzipped
  const uint2* large_tiles;   // [tiles, words, 8]: the same for the large plane
  const float* scale;         // [H] one-bit gates: scale; two-bit gate: small_scale
  const float* large_scale;   // [H] two-bit gate
  const float* residual;      // [H] normalized gates: residual or two_bit_residual
  const float* exact_weights;  // [H, exact_count]
  int32_t exact_columns[kMaxExactColumns];  // ascending
  int32_t exact_count;
  float* accumulator;         // [M, D], zero between calls
  float* y;                   // [M, D]
  unsigned int* finished_blocks;  // zero between calls
  Counters* counters;         // [tiles], summed over runs until stats()
  int32_t rows, cols, hidden, words;
  int32_t max_negatives;      // sign rule
  float min_score;            // gates
  bool count_missed;
};

// The tiles' sign words are unzipped: bit 2i of a packed word moves to bit i, bit 2i + 1 to bit
// 16 + i. Columns 2i and 2i + 1, which one A register holds, then sit 16 bits apart, and one shift
// puts both under the bf16 sign bits (bits 15 and 31).
uint32_t unzip_bits(uint32_t word) {
  uint32_t t = (word ^ (word >> 1)) & 0x22222222u;
  word ^= t ^ (t << 1);
  t = (word ^ (word >> 2)) & 0x0c0c0c0cu;
  word ^= t ^ (t << 2);
  t = (word ^ (word >> 4)) & 0x00f000f0u;
  word ^= t ^ (t << 4);
  t = (word ^ (word >> 8)) & 0x0000ff00u;
  word ^= t ^ (t << 8);
  return word;
}

// plane [H, words] -> [tiles, words, 8 groups, 2]: the words of rows g and g + 8 of a tile side by
// side (one 8-byte load per mma lane), unzipped; rows past H are zero.
std::vector<uint32_t> tiled_plane(const std::vector<uint32_t>& plane, int32_t hidden, int32_t words) {
  const int32_t tiles = (hidden + kTileNeurons - 1) / kTileNeurons;
  std::vector<uint32_t> tiled(static_cast<size_t>(tiles) * words * kTileNeurons, 0u);
  for (int32_t tile = 0; tile < tiles; ++tile)
    for (int32_t w = 0; w < words; ++w)
      for (int32_t n = 0; n < kTileNeurons; ++n) {
        const int32_t row = tile * kTileNeurons + n;
        if (row >= hidden) continue;
        const size_t at = ((static_cast<size_t>(tile) * words + w) * 8 + n % 8) * 2 + n / 8;
        tiled[at] = unzip_bits(plane[static_cast<size_t>(row) * words + w]);
      }
  return tiled;
}

__device__ __forceinline__ uint4 load_chunk(const bf16* row, int chunk) {
  return __ldg(reinterpret_cast<const uint4*>(row) + chunk);
}

__device__ __forceinline__ void red_add_v4(float* address, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

__device__ __forceinline__ void copy_async_16(void* shared, const void* global) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global) : "memory");
}

// bf16 pair ±1 from the bits at positions 15 and 31 of `shifted` (set: −1).
__device__ __forceinline__ uint32_t sign_pair(uint32_t shifted) { return (shifted & 0x80008000u) | 0x3f803f80u; }

// 0xffff in each half whose bit 15 / 31 of `shifted` is set, else 0 (prmt replicating sign bits).
__device__ __forceinline__ uint32_t half_masks(uint32_t shifted) {
  uint32_t mask;
  asm("prmt.b32 %0, %1, 0, 0xBB99;" : "=r"(mask) : "r"(shifted));
  return mask;
}

// The sign rule's B: ±1 per bf16 of x, −1 where x < 0 (−0.0 is not negative, as pack_sign_bits).
__device__ __forceinline__ uint32_t x_sign_pair(uint32_t x) {
  const uint32_t nonzero = (x & 0x7fff7fffu) + 0x7fff7fffu;  // bit 15 / 31 set iff that half's magnitude > 0
  return (x & nonzero & 0x80008000u) | 0x3f803f80u;
}

// out[m] = x[m]·row for every token in `tokens` (bit m = token m); out is this warp's shared array,
// written by lane 0 and visible to the whole warp on return. [D] rows. The row is read in batches of
// kBatch 16-byte loads per lane, all issued before the first use (8 would need ~110 registers with
// the x loads beside them, over the 80 that let three blocks share an SM; the rows are prefetched
// to L2, so the second batch waits on L2, not DRAM).
constexpr int kBatch = 4;
// A lane's kBatch 16-byte pieces of a row (pieces first, first + 32, ...), all issued before any is
// used; zeros past the row's `chunks` pieces.
__device__ __forceinline__ void load_batch(const bf16* row, int first, int chunks, uint4 (&pieces)[kBatch]) {
#pragma unroll
  for (int b = 0; b < kBatch; ++b)
    pieces[b] = first + 32 * b < chunks ? load_chunk(row, first + 32 * b) : make_uint4(0u, 0u, 0u, 0u);
}
template <int kTokens>
__device__ __forceinline__ void dots(const DecodeParams& p, const bf16* row, uint32_t tokens, int lane, float* out) {
  float sums[kTokens];
#pragma unroll
  for (int m = 0; m < kTokens; ++m) sums[m] = 0.0f;
  const int chunks = p.cols / kChunk;
  for (int first = lane; first < chunks; first += 32 * kBatch) {
    uint4 w[kBatch];
    load_batch(row, first, chunks, w);
#pragma unroll
    for (int m = 0; m < kTokens; ++m) {
      if (!(tokens & (1u << m))) continue;
      const bf16* x_row = p.x + static_cast<int64_t>(m) * p.cols;
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (first + 32 * b < chunks) sums[m] += dot8(load_chunk(x_row, first + 32 * b), w[b]);
    }
  }
  __syncwarp();  // every lane is done reading out's previous values
#pragma unroll
  for (int m = 0; m < kTokens; ++m)
    if (tokens & (1u << m)) {
      const float sum = warp_sum(sums[m]);
      if (lane == 0) out[m] = sum;
    }
  __syncwarp();
}

// Asks L2 for a row that is read soon.
__device__ __forceinline__ void prefetch_row(const bf16* row, int cols, int lane) {
  for (int byte = lane * 128; byte < cols * 2; byte += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(row) + byte));
}

// Step 1 for one warp: the tile's planes summed over this warp's words against every token.
// Writes partial[part][plane][neuron][token] and, for the normalized gates, the partial Σ x² of
// each token over the approximated columns to squares[part][token].
template <PredictorKind kKind, int kTokenTiles>
__device__ __forceinline__ void score_part(const DecodeParams& p, const uint2* plane_words, int part, int lane,
                                           float* partial, float* squares) {
  constexpr int kPlanes = planes_of(kKind);
  constexpr bool kSignRule = kKind == PredictorKind::sign_rule;
  constexpr bool kNormalized = is_normalized(kKind);
  constexpr int kTokens = kTokenTiles * kTokenTile;
  const int group = lane >> 2, quad = lane & 3;  // mma fragment coordinates
  const int words_per_part = (p.words + kParts - 1) / kParts;
  const int first_word = part * words_per_part;
  const int end_word = min(p.words, first_word + words_per_part);
  // B rows: token group + 8·tile, zero past M.
  const uint32_t* x_rows[kTokenTiles];
  bool token_used[kTokenTiles];
#pragma unroll
  for (int tile = 0; tile < kTokenTiles; ++tile) {
    const int token = group + kTokenTile * tile;
    token_used[tile] = token < p.rows;
    x_rows[tile] = reinterpret_cast<const uint32_t*>(p.x + static_cast<int64_t>(token_used[tile] ? token : 0) * p.cols);
  }
  int next_exact = 0;  // the first exact column not behind this warp's columns
  if (!kSignRule)
    while (next_exact < p.exact_count && p.exact_columns[next_exact] < first_word * 32) ++next_exact;

  float acc[kTokenTiles][kPlanes][4] = {};
  float square_sum[kTokenTiles] = {};
  for (int w = first_word; w < end_word; ++w) {
    const uint2 signs = plane_words[w * 8 + group];
    const uint2 large = kPlanes == 2 ? plane_words[(p.words + w) * 8 + group] : make_uint2(0u, 0u);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int first_col = w * 32 + half * 16;
      if (first_col >= p.cols) break;  // the word's second half lies past D
      const int k = first_col + quad * 2;  // this lane's first column; pairs never straddle D (D even)
      // A: rows group / group + 8, columns k, k + 1 (registers 0, 1) and k + 8, k + 9 (2, 3).
      const int low_shift = 15 - 8 * half - quad, high_shift = low_shift - 4;
      const uint32_t shifted[4] = {signs.x << low_shift, signs.y << low_shift, signs.x << high_shift,
                                   signs.y << high_shift};
      uint32_t a[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = sign_pair(shifted[i]);
      uint32_t b[kTokenTiles][2];
#pragma unroll
      for (int tile = 0; tile < kTokenTiles; ++tile) {
        b[tile][0] = token_used[tile] && k < p.cols ? __ldg(x_rows[tile] + k / 2) : 0u;
        b[tile][1] = token_used[tile] && k + 8 < p.cols ? __ldg(x_rows[tile] + k / 2 + 4) : 0u;
      }
      if (kSignRule) {
#pragma unroll
        for (int tile = 0; tile < kTokenTiles; ++tile) {
          b[tile][0] = token_used[tile] && k < p.cols ? x_sign_pair(b[tile][0]) : 0u;
          b[tile][1] = token_used[tile] && k + 8 < p.cols ? x_sign_pair(b[tile][1]) : 0u;
        }
      } else {
        // Exact columns in these 16: zero in B, so neither the sums nor ||x|| see them.
        for (; next_exact < p.exact_count && p.exact_columns[next_exact] < first_col + 16; ++next_exact) {
          const int within = p.exact_columns[next_exact] - first_col;
          if (((within & 7) >> 1) != quad) continue;
          const uint32_t keep = within & 1 ? 0x0000ffffu : 0xffff0000u;
          const uint32_t keep_low = within < 8 ? keep : ~0u, keep_high = within < 8 ? ~0u : keep;
#pragma unroll
          for (int tile = 0; tile < kTokenTiles; ++tile) {
            b[tile][0] &= keep_low;
            b[tile][1] &= keep_high;
          }
        }
      }
      if (kNormalized) {
#pragma unroll
        for (int tile = 0; tile < kTokenTiles; ++tile)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float low = bf16_low(b[tile][r]), high = bf16_high(b[tile][r]);
            square_sum[tile] = fmaf(low, low, fmaf(high, high, square_sum[tile]));
          }
      }
#pragma unroll
      for (int tile = 0; tile < kTokenTiles; ++tile) mma_bf16(acc[tile][0], a, b[tile][0], b[tile][1]);
      if (kPlanes == 2) {
        const uint32_t large_shifted[4] = {large.x << low_shift, large.y << low_shift, large.x << high_shift,
                                           large.y << high_shift};
        uint32_t a_large[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a_large[i] = a[i] & half_masks(large_shifted[i]);
#pragma unroll
        for (int tile = 0; tile < kTokenTiles; ++tile) mma_bf16(acc[tile][kPlanes - 1], a_large, b[tile][0], b[tile][1]);
      }
    }
  }
  // C fragment: acc[0..1] = neuron group, tokens quad*2 + {0, 1}; acc[2..3] = neuron group + 8.
#pragma unroll
  for (int tile = 0; tile < kTokenTiles; ++tile) {
#pragma unroll
    for (int plane = 0; plane < kPlanes; ++plane)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int neuron = group + (i >= 2 ? 8 : 0), token = kTokenTile * tile + quad * 2 + (i & 1);
        partial[((part * kPlanes + plane) * kTileNeurons + neuron) * kTokens + token] = acc[tile][plane][i];
      }
    if (kNormalized) {
      // The quad's four lanes hold the four column pairs of one token.
      float sum = square_sum[tile];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (quad == 0) squares[part * kTokens + kTokenTile * tile + group] = sum;
    }
  }
}

template <PredictorKind kKind, int kTokenTiles>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) decode_ffn_kernel(DecodeParams p) {
  constexpr int kPlanes = planes_of(kKind);
  constexpr bool kNormalized = is_normalized(kKind);
  constexpr bool kGate = kKind != PredictorKind::sign_rule;
  constexpr int kTokens = kTokenTiles * kTokenTile;
  extern __shared__ __align__(16) uint2 plane_words[];  // [kPlanes, words, 8]: this tile's planes (cp.async: 16-byte aligned)
  __shared__ float partial[kParts * kPlanes * kTileNeurons * kTokens];  // [part][plane][neuron][token]
  __shared__ float squares[kParts * kTokens];                          // [part][token]
  __shared__ float exact_x[kDecodeMaxRows][kMaxExactColumns];
  __shared__ uint32_t predicted[kTileNeurons];  // bit m: token m predicted active
  // Per warp, step 3's exact gates and then the coefficients relu(g)·u of the neuron in hand: in
  // shared memory, not registers, so that the row loads of dots() have the registers.
  __shared__ float gates[kParts][kDecodeMaxRows], coefficients[kParts][kDecodeMaxRows];
  __shared__ Counters block_counts;
  __shared__ bool last_block;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first_neuron = blockIdx.x * kTileNeurons;

  // The tile's planes into shared memory, all in flight at once.
  const int plane_chunks = p.words * 4;  // 16-byte chunks per plane (8 uint2 per word)
#pragma unroll
  for (int plane = 0; plane < kPlanes; ++plane) {
    const uint2* source = (plane == 0 ? p.sign_tiles : p.large_tiles) + static_cast<int64_t>(blockIdx.x) * p.words * 8;
    for (int chunk = threadIdx.x; chunk < plane_chunks; chunk += kThreads)
      copy_async_16(plane_words + (plane * p.words * 8 + chunk * 2), source + chunk * 2);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  if (threadIdx.x < kTileNeurons) predicted[threadIdx.x] = 0u;
  if (threadIdx.x == 0) block_counts = Counters{};
  if (kGate && threadIdx.x < p.rows * p.exact_count) {
    const int m = threadIdx.x / p.exact_count, c = threadIdx.x % p.exact_count;
    const unsigned short bits =
        reinterpret_cast<const unsigned short*>(p.x)[static_cast<int64_t>(m) * p.cols + p.exact_columns[c]];
    exact_x[m][c] = __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
  // This thread's (token, neuron) of step 2, and that neuron's constants, loaded while the planes arrive.
  const int own_neuron = threadIdx.x % kTileNeurons, own_token = threadIdx.x / kTileNeurons;
  const int own_j = first_neuron + own_neuron;
  const bool owns_pair = own_token < p.rows && own_j < p.hidden;
  float scale = 0.0f, large_scale = 0.0f, residual = 0.0f, exact_weights[kMaxExactColumns] = {};
  if (kGate && owns_pair) {
    scale = __ldg(p.scale + own_j);
    if (kPlanes == 2) large_scale = __ldg(p.large_scale + own_j);
    if (kNormalized) residual = __ldg(p.residual + own_j);
#pragma unroll
    for (int c = 0; c < kMaxExactColumns; ++c)
      if (c < p.exact_count) exact_weights[c] = __ldg(p.exact_weights + static_cast<int64_t>(own_j) * p.exact_count + c);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  score_part<kKind, kTokenTiles>(p, plane_words, warp, lane, partial, squares);
  __syncthreads();

  // Step 2: each thread decides its (token, neuron).
  if (owns_pair) {
    float sums[kPlanes];
#pragma unroll
    for (int plane = 0; plane < kPlanes; ++plane) {
      sums[plane] = 0.0f;
#pragma unroll
      for (int part = 0; part < kParts; ++part)
        sums[plane] += partial[((part * kPlanes + plane) * kTileNeurons + own_neuron) * kTokens + own_token];
    }
    bool active;
    if (!kGate) {
      active = (p.cols - __float2int_rn(sums[0])) / 2 <= p.max_negatives;  // Σ = D − 2·N_neg
    } else {
      // The CPU's order: the approximation, then the exact columns, then the normalization.
      float score = kPlanes == 2 ? scale * sums[0] + (large_scale - scale) * sums[kPlanes - 1] : scale * sums[0];
#pragma unroll
      for (int c = 0; c < kMaxExactColumns; ++c)
        if (c < p.exact_count) score += exact_x[own_token][c] * exact_weights[c];
      if (kNormalized) {
        float square_sum = 0.0f;
#pragma unroll
        for (int part = 0; part < kParts; ++part) square_sum += squares[part * kTokens + own_token];
        score = normalized_score(score, residual, sqrtf(square_sum));
      }
      active = score >= p.min_score;
    }
    if (active) atomicOr(&predicted[own_neuron], 1u << own_token);
  }
  __syncthreads();

  // Step 3: the neurons with tokens to gate, dealt to the warps in order.
  const uint32_t all_rows = (1u << p.rows) - 1u;
  const bool neuron_exists = lane < kTileNeurons && first_neuron + lane < p.hidden;
  const uint32_t lane_predicted = neuron_exists ? predicted[lane] : 0u;
  const uint32_t lane_gated = p.count_missed && neuron_exists ? all_rows : lane_predicted;
  const uint32_t neurons = __ballot_sync(0xffffffffu, lane_gated != 0u);
  if (warp == 0) {
    const unsigned long long count = __reduce_add_sync(0xffffffffu, __popc(lane_predicted));
    if (lane == 0) block_counts.predicted = count;
  }
  // Ask L2 for every row this warp will read first, so the loop below waits on L2, not DRAM.
  {
    int rank = 0;
    for (uint32_t rest = neurons; rest != 0u; rest &= rest - 1u, ++rank) {
      if (rank % kParts != warp) continue;
      const int64_t j = first_neuron + __ffs(rest) - 1;
      prefetch_row(p.projection + j * p.cols, p.cols, lane);
    }
  }
  unsigned long long active_count = 0, missed_count = 0;
  {
    int rank = 0;
    for (uint32_t rest = neurons; rest != 0u; rest &= rest - 1u, ++rank) {
      if (rank % kParts != warp) continue;
      const int n = __ffs(rest) - 1;
      const int64_t j = first_neuron + n;
      const uint32_t predicted_rows = __shfl_sync(0xffffffffu, lane_predicted, n);
      const uint32_t gate_rows = __shfl_sync(0xffffffffu, lane_gated, n);
      float* gate = gates[warp];
      dots<kTokens>(p, p.projection + j * p.cols, gate_rows, lane, gate);
      uint32_t active_rows = 0;
#pragma unroll
      for (int m = 0; m < kTokens; ++m)
        if ((gate_rows & (1u << m)) && gate[m] > 0.0f) active_rows |= 1u << m;
      missed_count += __popc(active_rows & ~predicted_rows);
      active_rows &= predicted_rows;
      active_count += __popc(active_rows);
      if (active_rows == 0) continue;

      // Coefficients relu(g)·u of the active tokens; the down row is read in the same pass as the up row.
      const bf16* down_row = p.down + j * p.cols;
      prefetch_row(down_row, p.cols, lane);
      float* coefficient = coefficients[warp];
      if (p.up != nullptr) {
        dots<kTokens>(p, p.up + j * p.cols, active_rows, lane, coefficient);
        if (lane < kDecodeMaxRows && (active_rows & (1u << lane))) coefficient[lane] *= gate[lane];
      } else if (lane < kDecodeMaxRows && (active_rows & (1u << lane))) {
        coefficient[lane] = gate[lane];
      }
      __syncwarp();
      const int chunks = p.cols / kChunk;
      for (int first = lane; first < chunks; first += 32 * kBatch) {
        uint4 d[kBatch];
        load_batch(down_row, first, chunks, d);
#pragma unroll
        for (int m = 0; m < kTokens; ++m) {
          if (!(active_rows & (1u << m))) continue;
          const float s = coefficient[m];
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            if (first + 32 * b >= chunks) continue;
            float* out = p.accumulator + static_cast<int64_t>(m) * p.cols + (first + 32 * b) * kChunk;
            red_add_v4(out, s * bf16_low(d[b].x), s * bf16_high(d[b].x), s * bf16_low(d[b].y), s * bf16_high(d[b].y));
            red_add_v4(out + 4, s * bf16_low(d[b].z), s * bf16_high(d[b].z), s * bf16_low(d[b].w),
                       s * bf16_high(d[b].w));
          }
        }
      }
    }
  }
  if (lane == 0 && (active_count | missed_count) != 0) {
    atomicAdd(&block_counts.active, active_count);
    atomicAdd(&block_counts.missed, missed_count);
  }

  // Step 4: every thread's reductions are visible before its block's ticket is taken.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    Counters& slot = p.counters[blockIdx.x];  // this block's own: plain read-modify-write
    slot.predicted += block_counts.predicted;
    slot.active += block_counts.active;
    slot.missed += block_counts.missed;
    last_block = atomicAdd(p.finished_blocks, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  float4* sums = reinterpret_cast<float4*>(p.accumulator);
  float4* y = reinterpret_cast<float4*>(p.y);
  const int vectors = p.rows * p.cols / 4;
  // kCopyBatch loads in flight per thread: one block moves up to 128 KB (M = 16, D = 2048), and one
  // L2 round trip per float4 would make this tail longer than the rest of the kernel.
  constexpr int kCopyBatch = 8;
  for (int first = threadIdx.x; first < vectors; first += kThreads * kCopyBatch) {
    float4 values[kCopyBatch];
#pragma unroll
    for (int b = 0; b < kCopyBatch; ++b)
      if (first + b * kThreads < vectors) values[b] = __ldcg(sums + first + b * kThreads);
#pragma unroll
    for (int b = 0; b < kCopyBatch; ++b)
      if (first + b * kThreads < vectors) {
        y[first + b * kThreads] = values[b];
        __stcg(sums + first + b * kThreads, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
      }
  }
  if (threadIdx.x == 0) *p.finished_blocks = 0u;
}

template <PredictorKind kKind>
void launch(const DecodeParams& p, int tiles, size_t shared, cudaStream_t stream) {
  if (p.rows > kTokenTile)
    decode_ffn_kernel<kKind, 2><<<tiles, kThreads, shared, stream>>>(p);
  else
    decode_ffn_kernel<kKind, 1><<<tiles, kThreads, shared, stream>>>(p);
}

// Lets both kernels of a kind take `shared` bytes of dynamic shared memory (beyond the default 48 KiB
// when needed).
template <PredictorKind kKind>
void allow_shared(size_t shared) {
  TWELL_CUDA_CHECK(cudaFuncSetAttribute(decode_ffn_kernel<kKind, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared)));
  TWELL_CUDA_CHECK(cudaFuncSetAttribute(decode_ffn_kernel<kKind, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared)));
}

}  // namespace

struct DecodeLayer::Impl {
  const DeviceFfnWeights* weights;
  int32_t words = 0;
  int32_t tiles = 0;
  DeviceBuffer<uint32_t> sign_tiles, large_tiles;  // tiled_plane of bits and large
  DeviceBuffer<float> scale, residual, small_scale, large_scale, two_bit_residual;  // [H] each
  DeviceBuffer<float> exact_weights;  // [H, c]
  std::vector<int32_t> exact_columns;
  DeviceBuffer<float> accumulator;    // [kDecodeMaxRows, D]
  DeviceBuffer<unsigned int> finished_blocks;
  DeviceBuffer<Counters> counters;    // [tiles]
  mutable bool all_counted_missed = true;  // every run since the last stats() counted misses
};

DecodeLayer::DecodeLayer(const DeviceFfnWeights& weights, const SignBits& signs) : impl_(std::make_unique<Impl>()) {
  const int32_t hidden = weights.d_hidden, cols = weights.d_model;
  TWELL_REQUIRE(cols >= 8 && cols % 8 == 0, "decode on CUDA needs D a multiple of 8 (16-byte weight rows), got {}",
                cols);
  TWELL_REQUIRE(hidden >= 1, "decode on CUDA needs H >= 1, got {}", hidden);
  validate_sign_bits(signs, hidden, cols);
  const size_t h = static_cast<size_t>(hidden), exact_count = signs.exact_columns.size();
  // The kernel takes the large plane as given: a large bit at an exact column would count that
  // column twice (its exact term and the plane's).
  for (int32_t j = 0; j < hidden; ++j)
    for (int32_t column : signs.exact_columns)
      TWELL_REQUIRE(!((signs.large[static_cast<size_t>(j) * signs.words_per_row() + column / kSignBitsPerWord] >>
                       (column % kSignBitsPerWord)) & 1u),
                    "signs: the large bit of exact column {} is set in row {} (pack_sign_bits leaves it 0)", column, j);
  Impl& s = *impl_;
  s.weights = &weights;
  s.words = signs.words_per_row();
  s.tiles = (hidden + kTileNeurons - 1) / kTileNeurons;
  const size_t shared = static_cast<size_t>(2) * s.words * 8 * sizeof(uint2);
  TWELL_REQUIRE(shared <= static_cast<size_t>(device_facts().max_smem_per_block_optin) - 24 * 1024,
                "decode on CUDA: D = {} needs {} bytes of shared memory for the sign planes of 16 neurons, more than "
                "this GPU gives a block",
                cols, shared);
  const std::vector<uint32_t> sign_tiles = tiled_plane(signs.bits, hidden, s.words);
  const std::vector<uint32_t> large_tiles = tiled_plane(signs.large, hidden, s.words);
  s.sign_tiles.upload(sign_tiles.data(), sign_tiles.size());
  s.large_tiles.upload(large_tiles.data(), large_tiles.size());
  s.scale.upload(signs.scale.data(), h);
  s.residual.upload(signs.residual.data(), h);
  s.small_scale.upload(signs.small_scale.data(), h);
  s.large_scale.upload(signs.large_scale.data(), h);
  s.two_bit_residual.upload(signs.two_bit_residual.data(), h);
  s.exact_columns = signs.exact_columns;
  if (exact_count > 0) s.exact_weights.upload(signs.exact_weights.data(), signs.exact_weights.size());
  s.accumulator.resize(static_cast<size_t>(kDecodeMaxRows) * cols);
  TWELL_CUDA_CHECK(cudaMemset(s.accumulator.data(), 0, s.accumulator.bytes()));
  s.finished_blocks.resize(1);
  TWELL_CUDA_CHECK(cudaMemset(s.finished_blocks.data(), 0, sizeof(unsigned int)));
  s.counters.resize(s.tiles);
  TWELL_CUDA_CHECK(cudaMemset(s.counters.data(), 0, s.counters.bytes()));
  allow_shared<PredictorKind::sign_rule>(shared);
  allow_shared<PredictorKind::one_bit_gate>(shared);
  allow_shared<PredictorKind::normalized_one_bit_gate>(shared);
  allow_shared<PredictorKind::two_bit_gate>(shared);
  TWELL_CUDA_CHECK(cudaDeviceSynchronize());
}

DecodeLayer::~DecodeLayer() = default;

void DecodeLayer::run(const bf16* x, int64_t rows, const PredictorConfig& predictor, float* y, cudaStream_t stream,
                      const DecodeOptions& options) const {
  const DeviceFfnWeights& w = *impl_->weights;
  Impl& s = *impl_;
  TWELL_REQUIRE(rows >= 1 && rows <= kDecodeMaxRows, "rows (M) must lie in [1, {}], got {}", kDecodeMaxRows, rows);
  TWELL_REQUIRE(reinterpret_cast<uintptr_t>(y) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0,
                "decode on CUDA: x and y must be 16-byte aligned");
  const bool two_bit = predictor.kind == PredictorKind::two_bit_gate;
  DecodeParams p{};
  p.x = x;
  p.projection = w.relu_projection();
  p.up = w.gated ? w.up.get() : nullptr;
  p.down = w.down.get();
  p.sign_tiles = reinterpret_cast<const uint2*>(s.sign_tiles.data());
  p.large_tiles = reinterpret_cast<const uint2*>(s.large_tiles.data());
  p.scale = two_bit ? s.small_scale.data() : s.scale.data();
  p.large_scale = s.large_scale.data();
  p.residual = two_bit ? s.two_bit_residual.data() : s.residual.data();
  p.exact_weights = s.exact_weights.data();
  p.exact_count = static_cast<int32_t>(s.exact_columns.size());
  for (int32_t c = 0; c < p.exact_count; ++c) p.exact_columns[c] = s.exact_columns[c];
  p.accumulator = s.accumulator.data();
  p.y = y;
  p.finished_blocks = s.finished_blocks.data();
  p.counters = s.counters.data();
  p.rows = static_cast<int32_t>(rows);
  p.cols = w.d_model;
  p.hidden = w.d_hidden;
  p.words = s.words;
  p.max_negatives =
      predictor.kind == PredictorKind::sign_rule ? sign_rule_max_negatives(predictor.alpha, w.d_model) : 0;
  p.min_score = static_cast<float>(-predictor.margin);
  p.count_missed = options.count_missed;
  impl_->all_counted_missed = impl_->all_counted_missed && options.count_missed;

  const size_t shared = static_cast<size_t>(planes_of(predictor.kind)) * s.words * 8 * sizeof(uint2);
  switch (predictor.kind) {
    case PredictorKind::sign_rule: launch<PredictorKind::sign_rule>(p, s.tiles, shared, stream); break;
    case PredictorKind::one_bit_gate: launch<PredictorKind::one_bit_gate>(p, s.tiles, shared, stream); break;
    case PredictorKind::normalized_one_bit_gate:
      launch<PredictorKind::normalized_one_bit_gate>(p, s.tiles, shared, stream);
      break;
    case PredictorKind::two_bit_gate: launch<PredictorKind::two_bit_gate>(p, s.tiles, shared, stream); break;
  }
  TWELL_CUDA_CHECK_LAUNCH();
}

DecodeStats DecodeLayer::stats(cudaStream_t stream) const {
  std::vector<Counters> counters(impl_->tiles);
  impl_->counters.download(counters.data(), counters.size(), stream);
  TWELL_CUDA_CHECK(cudaMemsetAsync(impl_->counters.data(), 0, impl_->counters.bytes(), stream));
  DecodeStats stats{0, 0, 0};
  for (const Counters& block : counters) {
    stats.predicted += static_cast<int64_t>(block.predicted);
    stats.active += static_cast<int64_t>(block.active);
    stats.missed += static_cast<int64_t>(block.missed);
  }
  if (!impl_->all_counted_missed) stats.missed = -1;
  impl_->all_counted_missed = true;
  return stats;
}

}  // namespace twell::cuda
