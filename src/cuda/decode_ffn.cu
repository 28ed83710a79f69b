// The CUDA decode FFN (include/twell/decode_cuda.h). One block of kParts warps per tile of 16 neurons;
// every step splits D over the warps (warp w owns sign words [w·words_per_part, (w + 1)·words_per_part),
// 32 columns each), so that each warp reads its slice of every row it needs with all loads in flight
// at once, and the warps meet only in shared-memory sums:
//   1. score the tile for all M <= 16 tokens on the tensor cores: mma.m16n8k16 with A = the tile's 16
//      weight rows as bf16 ±1 built in registers from the sign bits (the two-bit gate adds a second A,
//      ±1 where the large bit is set and 0 elsewhere) and B = x [16 k, 8 tokens] (two token tiles
//      for M > 8). The mma's k index is permuted (the planes are regrouped on the host to match) so
//      that lane quad q's B registers of one sign word are x's columns 8q .. 8q + 7: one 16-byte load
//      per lane, word and token tile. The sign rule takes B = sign(x) as ±1, so the sum is D − 2·N_neg,
//      exact in fp32. The normalized gates get ||x||² from the same registers (x·xᵀ on the tensor cores,
//      whose diagonal is what they need). Exact columns are not special here: step 2 takes their sign
//      terms out (folded into the exact weights on the host) and their squares out of ||x||²;
//   2. one thread per (neuron, token) applies the predictor's rule (decode.h);
//   3. the neurons with predicted tokens, up to `slots` at a time: each warp copies its slices of their
//      gate rows into shared memory (cp.async, one round trip), then computes the exact gates of all
//      tokens as one mma per 16 columns and 8 neurons (A = x, B = the rows); the warps' partial sums
//      meet in shared memory. With few such neurons their up and down rows come in the same round
//      trip (most blocks then need no second one);
//   4. for the truly active neurons, u = x·up[j] the same way, and y[m] += relu(g)·u·down[j] with vector
//      atomics, each warp for its own columns.
// y needs no memset (one graph node per call): the first block to start (a ticket, so that it is
// surely running) zeroes y and publishes the call's epoch; blocks wait for it before their first
// atomic add, by which time it is long done (an accumulating call adds to y as it is).
// Launched as a programmatic dependent launch: the planes and per-neuron constants load while the
// stream's previous kernel ends, x and y are touched only after griddepcontrol.wait, and once every
// block has its ticket the next call may start the same way.
// Bytes: the sign planes of every neuron + gate rows of predicted neurons + up/down rows of active ones.
// When every gate is computed (DecodeOptions::gates), there is nothing to predict and the gates are a
// plain product: decode_gemv (M = 1) or cuBLASLt (M > 1) writes them [M, H] fp32 into the layer's
// buffer, streaming all of the projection near the copy rate, and given_gates_kernel does steps 3-4
// from them (y zeroed by a memset first). The fused kernel with every pair predicted was slower at
// every M (H200, M = 16: 23.5 us against 13.2; its 16-token dot products re-read x from the L2 for
// every round of rows). AllGatesKernel::streamed (the default, wherever its blocks fit) does it in
// one kernel instead (streamed_gates_kernel): each block's 16 gate rows all in flight into shared
// memory from before the programmatic wait, the gates on the tensor cores, then the pairs as
// given_gates_kernel does them.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda_utils.h"
#include "cuda/decode_gemv.h"
#include "cuda/gemm.h"
#include "cuda/warp_math.cuh"
#include "twell/convert.h"
#include "twell/decode_cuda.h"

namespace twell::cuda {
namespace {

constexpr int kTileNeurons = 16;  // mma M of step 1: the neurons of one block
constexpr int kTokenTile = 8;     // mma N of step 1: tokens per token tile
constexpr int kParts = 8;         // warps per block, each owning 1/kParts of D
constexpr int kThreads = kParts * 32;
// Blocks per SM the registers are sized for (launch bounds): with three, every tile of H = 5632
// (352 blocks on 132 SMs) is resident at once.
constexpr int kMinBlocksPerSm = 3;
constexpr int kChunk = 8;          // bf16 per 16-byte piece of a row
constexpr int kPiecesPerWord = 4;  // a sign word spans 32 columns: one piece per mma quad
constexpr int kMaxSlots = 16;      // rows a warp holds at once in steps 3 and 4 (two mma n-tiles)
// Shared memory a block aims at (the row slots take what steps 1-2 leave), by token tiles. Two
// (M > 8): three blocks per SM then leave ~90 KB of L1 for x (64 KB at M = 16), which every block
// reads twice; on the H200, 32 KB (5 slots at D = 2048) made M = 16 3-4 us slower (more rounds of
// rows), 64 KB was within 0.4 us. One: x is at most 32 KB, and more slots let more blocks fetch
// their gated neurons' up and down rows in the same round trip as the gate rows (15 slots at D =
// 2048, five neurons, against ten and three at 48 KB): the sign rule 13.3 -> 12.0 us at M = 1,
// two-bit-norm 12.1 -> 11.5 us at M = 4, the rest unchanged (docs/perf-notes.md).
constexpr int kSharedTarget[2] = {68 * 1024, 48 * 1024};
// cuBLASLt's workspace for the gates GEMM (M <= 16; a split over K keeps [M, H] fp32 partials, 360 KB
// each at H = 5632), held by every layer.
constexpr size_t kGatesGemmWorkspace = 4u << 20;

// What a kind reads: the two-bit gate both planes, the others the sign plane; the normalized gates
// also divide by ||x||.
__host__ __device__ constexpr int planes_of(PredictorKind kind) { return kind == PredictorKind::two_bit_gate ? 2 : 1; }
__host__ __device__ constexpr bool is_normalized(PredictorKind kind) {
  return kind == PredictorKind::normalized_one_bit_gate || kind == PredictorKind::two_bit_gate;
}
// Words of x loaded at once in step 1: 32 registers (16 for the two-bit gate at M > 8, whose
// accumulators take the rest).
__host__ __device__ constexpr int word_batch(PredictorKind kind, int token_tiles) {
  return token_tiles == 1 ? 8 : kind == PredictorKind::two_bit_gate ? 2 : 4;
}

struct Counters {
  unsigned long long predicted;
  unsigned long long active;
  unsigned long long missed;
};

// Grid-wide state of a layer's calls, never reset: `started` hands out tickets (call = ticket / grid
// size, since calls are stream-ordered), `zeroed` is the number of calls whose y has been zeroed.
struct CallSync {
  unsigned long long started;
  unsigned long long zeroed;
};

// Shared-memory layout of one launch, in bytes of the dynamic area. Steps 1-2: the tile's planes,
// the warps' partial scores and squares. Steps 3-4 reuse it: each warp's row slots, then the warps'
// partial dot products.
struct SharedLayout {
  int32_t partial_scores, squares, step_one_end;  // offsets
  int32_t slot_stride, slots, partial_dots, step_three_end;
  int32_t bytes() const { return std::max(step_one_end, step_three_end); }
};

struct DecodeParams {
  const bf16* x;              // [M, D]
  const bf16* projection;     // [H, D] gate (gated) or up
  const bf16* up;             // [H, D] (null when non-gated)
  const bf16* down;           // [H, D]
  const uint32_t* sign_tiles;   // [tiles, words, 8 groups, 2]: tiled_plane of bits
  const uint32_t* large_tiles;  // the same for the large plane
  const float* scale;         // [H] one-bit gates: scale; two-bit gate: small_scale
  const float* large_scale;   // [H] two-bit gate
  const float* residual;      // [H] normalized gates: residual or two_bit_residual
  const float* exact_weights;  // [H, exact_count]: W[j, c] − scale·sign term (exact_weights_without_sign_term)
  int32_t exact_columns[kMaxExactColumns];  // ascending
  int32_t exact_count;
  float* y;                   // [M, D]
  CallSync* sync;
  Counters* counters;         // [tiles], summed over runs until stats()
  SharedLayout shared;
  int32_t rows, cols, hidden, words, words_per_part;
  int32_t max_negatives;      // sign rule
  float min_score;            // gates
  bool count_missed;
  bool accumulate;  // y += (nobody zeroes y, nobody waits)
  const float* gates;  // [M, H]: every exact gate, for given_gates_kernel
};

// plane [H, words] -> [tiles, words, 8 groups, 2]: for lane (group g, quad q) of step 1's mma, word
// 2·(w·8 + g) + q/2 holds, at bits 8·(q % 2) + r and 8·(q % 2) + r + 16, the signs of the columns that
// its A register r (0..7, two mma steps of 4) takes: row g + 8·(r % 2), columns 32w + 8q + 2·(r / 2)
// and that + 1. Rows past H are zero.
std::vector<uint32_t> tiled_plane(const std::vector<uint32_t>& plane, int32_t hidden, int32_t words) {
  const int32_t tiles = (hidden + kTileNeurons - 1) / kTileNeurons;
  std::vector<uint32_t> tiled(static_cast<size_t>(tiles) * words * kTileNeurons, 0u);
  for (int32_t tile = 0; tile < tiles; ++tile)
    for (int32_t w = 0; w < words; ++w)
      for (int32_t n = 0; n < kTileNeurons; ++n) {
        const int32_t row = tile * kTileNeurons + n;
        if (row >= hidden) continue;
        const uint32_t word = plane[static_cast<size_t>(row) * words + w];
        for (int c = 0; c < 32; ++c) {
          if (!((word >> c) & 1u)) continue;
          const int quad = c / 8, reg = (c % 8) / 2 * 2 + n / 8;
          const int bit = (quad % 2) * 8 + reg + (c % 2) * 16;
          tiled[((static_cast<size_t>(tile) * words + w) * 8 + n % 8) * 2 + quad / 2] |= 1u << bit;
        }
      }
  return tiled;
}

__device__ __forceinline__ void red_add_v4(float* address, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* address) {
  unsigned long long value;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}
__device__ __forceinline__ void store_release(unsigned long long* address, unsigned long long value) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

// How many calls have had their y zeroed; for an accumulating call, as good as all.
__device__ __forceinline__ unsigned long long zeroed_count(const DecodeParams& p) {
  return p.accumulate ? ~0ull : load_acquire(&p.sync->zeroed);
}

// The zeroing of y by the call's first block (a ticket: it is surely running), which the other blocks
// wait for before their first atomic add. All of that block's threads zero ...
__device__ __forceinline__ void zero_y(const DecodeParams& p) {
  float4* y = reinterpret_cast<float4*>(p.y);
  for (int i = threadIdx.x; i < p.rows * p.cols / 4; i += kThreads) y[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}
// ... then, after a barrier, one of them publishes that call `call`'s y is zeroed ...
__device__ __forceinline__ void publish_zeroed_y(const DecodeParams& p, unsigned long long call) {
  __threadfence();
  store_release(&p.sync->zeroed, call + 1);
}
// ... and a waiting thread spins from its earlier read `zeroed` (zeroed_count) until it is.
__device__ __forceinline__ void wait_for_zeroed_y(const DecodeParams& p, unsigned long long call,
                                                  unsigned long long& zeroed) {
  while (zeroed <= call) zeroed = load_acquire(&p.sync->zeroed);
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

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Lane (group, quad)'s sign bits of word w (tiled_plane), moved to bits 8..15 and 24..31: A register r
// is then sign_pair(bits << (7 − r)).
__device__ __forceinline__ uint32_t lane_bits(const uint32_t* plane, int w, int group, int quad) {
  const uint32_t packed = plane[(w * 8 + group) * 2 + (quad >> 1)];
  return quad & 1 ? packed : packed << 8;
}

// The lane's piece of x for words [w0, w0 + batch) and tokens group + 8·tile: columns 32w + 8·quad ..
// + 7, zero past M, D or end_word.
template <int kBatch, int kTokenTiles>
__device__ __forceinline__ void load_x_words(const DecodeParams& p, int w0, int end_word, int group, int quad,
                                             uint4 (&x)[kBatch][kTokenTiles]) {
  const int pieces = p.cols / kChunk;
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const int piece = (w0 + b) * kPiecesPerWord + quad;
#pragma unroll
    for (int tile = 0; tile < kTokenTiles; ++tile) {
      const int token = group + kTokenTile * tile;
      x[b][tile] = w0 + b < end_word && piece < pieces && token < p.rows
                       ? __ldg(reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(token) * p.cols) + piece)
                       : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// body(b, w) for each of this warp's words w in [first_word, end_word), with w's piece of x in x[b]:
// x is loaded a batch of words at a time, the first batch being in x on entry, over the words before
// batches_end (end_word, or first_word + p.words_per_part for the same number of batches in every
// warp); after_load(batch) runs once each later batch's x is asked for (it may hold a block barrier
// where every warp takes the same batches).
template <int kBatch, int kTokenTiles, typename AfterLoad, typename Body>
__device__ __forceinline__ void for_each_word(const DecodeParams& p, int first_word, int end_word, int batches_end,
                                              int group, int quad, uint4 (&x)[kBatch][kTokenTiles],
                                              AfterLoad after_load, Body body) {
  for (int w0 = first_word; w0 < batches_end; w0 += kBatch) {
    if (w0 != first_word) {
      load_x_words(p, w0, end_word, group, quad, x);
      after_load((w0 - first_word) / kBatch);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (w0 + b >= end_word) break;
      body(b, w0 + b);
    }
  }
}

// Writes a warp's [16 neurons, tokens] accumulators as out[neuron][token]: value(tile, i) is C register
// i of token tile `tile` (C fragment: registers 0-1 = neuron group, tokens quad·2 + {0, 1}; 2-3 =
// neuron group + 8).
template <int kTokenTiles, typename Value>
__device__ __forceinline__ void store_tile_sums(float* out, int group, int quad, Value value) {
#pragma unroll
  for (int tile = 0; tile < kTokenTiles; ++tile)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int neuron = group + (i >= 2 ? 8 : 0), token = kTokenTile * tile + quad * 2 + (i & 1);
      out[neuron * kTokenTiles * kTokenTile + token] = value(tile, i);
    }
}

// Step 1 for one warp: the tile's planes over this warp's words against every token. Writes
// partial[part][plane][neuron][token] and, for the normalized gates, the partial Σ x² of each token
// (every column) to squares[part][token]. `x` holds the first batch of words on entry.
template <PredictorKind kKind, int kTokenTiles>
__device__ __forceinline__ void score_part(const DecodeParams& p, const uint32_t* planes, int first_word, int end_word,
                                           int part, int lane, uint4 (&x)[word_batch(kKind, kTokenTiles)][kTokenTiles],
                                           float* partial, float* squares) {
  constexpr int kPlanes = planes_of(kKind);
  constexpr bool kSignRule = kKind == PredictorKind::sign_rule;
  constexpr bool kNormalized = is_normalized(kKind);
  constexpr int kTokens = kTokenTiles * kTokenTile;
  const int group = lane >> 2, quad = lane & 3;
  const int pieces = p.cols / kChunk;
  // At one token tile, one accumulator set per mma step: two chains of dependent mma instead of one
  // twice as long (at two, the registers are not there: the normalized kinds would spill).
  constexpr int kChains = kTokenTiles == 1 ? 2 : 1;
  float acc[kChains][kTokenTiles][kPlanes][4] = {};
  float gram[kTokenTiles][4] = {};
  for_each_word(p, first_word, end_word, end_word, group, quad, x, [](int) {}, [&](int b, int w) {
    const uint32_t bits = lane_bits(planes, w, group, quad);
    const uint32_t large = kPlanes == 2 ? lane_bits(planes + p.words * 16, w, group, quad) : 0u;
    uint32_t operand[kTokenTiles][4];
#pragma unroll
    for (int tile = 0; tile < kTokenTiles; ++tile) {
      const bool used = group + kTokenTile * tile < p.rows && w * kPiecesPerWord + quad < pieces;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        operand[tile][i] = kSignRule ? (used ? x_sign_pair(word_of(x[b][tile], i)) : 0u) : word_of(x[b][tile], i);
    }
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      uint32_t a[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = sign_pair(bits << (7 - (4 * step + i)));
#pragma unroll
      for (int tile = 0; tile < kTokenTiles; ++tile)
        mma_bf16(acc[step % kChains][tile][0], a, operand[tile][2 * step], operand[tile][2 * step + 1]);
      if (kPlanes == 2) {
        uint32_t a_large[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a_large[i] = a[i] & half_masks(large << (7 - (4 * step + i)));
#pragma unroll
        for (int tile = 0; tile < kTokenTiles; ++tile)
          mma_bf16(acc[step % kChains][tile][kPlanes - 1], a_large, operand[tile][2 * step],
                   operand[tile][2 * step + 1]);
      }
      if (kNormalized) {
        // A = x [16 tokens, k]: rows group and group + 8.
        const uint4 second = kTokenTiles == 2 ? x[b][kTokenTiles - 1] : make_uint4(0u, 0u, 0u, 0u);
        const uint32_t rows_of_x[4] = {word_of(x[b][0], 2 * step), word_of(second, 2 * step),
                                       word_of(x[b][0], 2 * step + 1), word_of(second, 2 * step + 1)};
#pragma unroll
        for (int tile = 0; tile < kTokenTiles; ++tile)
          mma_bf16(gram[tile], rows_of_x, operand[tile][2 * step], operand[tile][2 * step + 1]);
      }
    }
  });
#pragma unroll
  for (int plane = 0; plane < kPlanes; ++plane)
    store_tile_sums<kTokenTiles>(partial + (part * kPlanes + plane) * kTileNeurons * kTokens, group, quad,
                                 [&](int tile, int i) {
                                   float sum = 0.0f;
#pragma unroll
                                   for (int chain = 0; chain < kChains; ++chain) sum += acc[chain][tile][plane][i];
                                   return sum;
                                 });
  // x·xᵀ's diagonal: token 8·tile + group sits at row 8·tile + group, column group of token tile `tile`.
#pragma unroll
  for (int tile = 0; tile < kTokenTiles; ++tile)
    if (kNormalized && quad == group >> 1)
      squares[part * kTokens + kTokenTile * tile + group] = group & 1 ? gram[tile][2 * tile + 1] : gram[tile][2 * tile];
}

// Copies this warp's slices of the rows of `neurons` (bit n: neuron first_neuron + n) of `matrix` into
// its slots first_slot, first_slot + 1, ... (zeros past D). The caller waits (cp.async.wait_all) and
// syncs the warp before reading them. A lane's pieces sit at the same columns of every row, so their
// offsets are computed once and each row costs a handful of instructions around its copy (neurons
// inside, pieces outside: the other order cost ~60 instructions a copy, 20% of a warp's at M = 16).
__device__ __forceinline__ void stage_rows(const DecodeParams& p, const bf16* matrix, uint32_t neurons, int first_slot,
                                           unsigned char* slots, int first_neuron, int first_word, int lane) {
  const int pieces = p.cols / kChunk, slice_pieces = p.words_per_part * kPiecesPerWord;
  const int first_piece = first_word * kPiecesPerWord;
  const int64_t stride = p.cols;
  const bf16* rows = matrix + static_cast<int64_t>(first_neuron) * stride;
  for (int piece = lane; piece < slice_pieces; piece += 32) {
    const bool inside = first_piece + piece < pieces;
    const bf16* column = rows + (inside ? (first_piece + piece) * kChunk : 0);
    unsigned char* target = slots + first_slot * p.shared.slot_stride + piece * 16;
    for (uint32_t rest = neurons; rest != 0u; rest &= rest - 1u, target += p.shared.slot_stride)
      copy_16_async(target, column + (__ffs(rest) - 1) * stride, inside);
  }
  commit_copies();
}

// out[slot][token] = x[token] · (slot's row) over this warp's columns, for slots [0, count): one mma
// per 16 columns and 8 slots with A = x [16 tokens, k] and B = the slots' rows.
template <int kTokenTiles>
__device__ __forceinline__ void slot_dots(const DecodeParams& p, const unsigned char* slots, int count, int first_word,
                                          int end_word, int lane, float* out) {
  constexpr int kTokens = kTokenTiles * kTokenTile;
  const int group = lane >> 2, quad = lane & 3;
  const int pieces = p.cols / kChunk;
  const bool second_tile = count > 8;
  const uint4* x_rows[kTokenTiles];
  bool token_used[kTokenTiles];
#pragma unroll
  for (int tile = 0; tile < kTokenTiles; ++tile) {
    const int token = group + kTokenTile * tile;
    token_used[tile] = token < p.rows;
    x_rows[tile] = reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(token_used[tile] ? token : 0) * p.cols);
  }
  float acc[2][4] = {};
#pragma unroll 2
  for (int w = first_word; w < end_word; ++w) {
    const int piece = w * kPiecesPerWord + quad;
    uint4 x[2];
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
      x[tile] = tile < kTokenTiles && token_used[tile % kTokenTiles] && piece < pieces
                    ? __ldg(x_rows[tile % kTokenTiles] + piece)
                    : make_uint4(0u, 0u, 0u, 0u);
    const int offset = ((w - first_word) * kPiecesPerWord + quad) * 16;
#pragma unroll
    for (int n_tile = 0; n_tile < 2; ++n_tile) {
      if (n_tile == 1 && !second_tile) break;
      const int slot = n_tile * 8 + group;
      const uint4 row = slot < count ? *reinterpret_cast<const uint4*>(slots + slot * p.shared.slot_stride + offset)
                                     : make_uint4(0u, 0u, 0u, 0u);
      const uint32_t a_low[4] = {x[0].x, x[1].x, x[0].y, x[1].y}, a_high[4] = {x[0].z, x[1].z, x[0].w, x[1].w};
      mma_bf16(acc[n_tile], a_low, row.x, row.y);
      mma_bf16(acc[n_tile], a_high, row.z, row.w);
    }
  }
  // C fragment: acc[0..1] = token group, slots quad*2 + {0, 1}; acc[2..3] = token group + 8.
#pragma unroll
  for (int n_tile = 0; n_tile < 2; ++n_tile)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int token = group + (i >= 2 ? 8 : 0), slot = n_tile * 8 + quad * 2 + (i & 1);
      if (token < kTokens) out[slot * kTokens + token] = acc[n_tile][i];
    }
}

// y[m] += Σ coefficient[n][m] · down row of n over this warp's columns, for the neurons n of `neurons`
// (their down rows in slots first_slot, ...) and the tokens m where active[n] has bit m.
template <int kTokens>
__device__ __forceinline__ void add_down_rows(const DecodeParams& p, const unsigned char* slots, int first_slot,
                                              uint32_t neurons, const uint32_t* active,
                                              const float (*coefficient)[kTokens], int first_word, int lane) {
  const int pieces = p.cols / kChunk, slice_pieces = p.words_per_part * kPiecesPerWord;
  const int first_piece = first_word * kPiecesPerWord;
  uint32_t tokens = 0u;
  for (uint32_t rest = neurons; rest != 0u; rest &= rest - 1u) tokens |= active[__ffs(rest) - 1];
  for (int piece = lane; piece < slice_pieces && first_piece + piece < pieces; piece += 32) {
    for (uint32_t rest_tokens = tokens; rest_tokens != 0u; rest_tokens &= rest_tokens - 1u) {
      const int m = __ffs(rest_tokens) - 1;
      float sum[kChunk] = {};
      int slot = first_slot;
      for (uint32_t rest = neurons; rest != 0u; rest &= rest - 1u, ++slot) {
        const int n = __ffs(rest) - 1;
        if (!((active[n] >> m) & 1u)) continue;
        const float c = coefficient[n][m];
        const uint4 d = *reinterpret_cast<const uint4*>(slots + slot * p.shared.slot_stride + piece * 16);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          sum[2 * i] = fmaf(c, bf16_low(word_of(d, i)), sum[2 * i]);
          sum[2 * i + 1] = fmaf(c, bf16_high(word_of(d, i)), sum[2 * i + 1]);
        }
      }
      float* out = p.y + static_cast<int64_t>(m) * p.cols + (first_piece + piece) * kChunk;
      red_add_v4(out, sum[0], sum[1], sum[2], sum[3]);
      red_add_v4(out + 4, sum[4], sum[5], sum[6], sum[7]);
    }
  }
}

// The lowest `count` set bits of `mask`.
__device__ __forceinline__ uint32_t lowest_bits(uint32_t mask, int count) {
  uint32_t bits = 0u;
  for (int i = 0; i < count && mask != 0u; ++i) {
    const uint32_t low = mask & (0u - mask);
    bits |= low;
    mask ^= low;
  }
  return bits;
}
// The position of the set bit of rank `rank` (0: the lowest) of `mask`.
__device__ __forceinline__ int nth_bit(uint32_t mask, int rank) {
  for (int i = 0; i < rank; ++i) mask &= mask - 1u;
  return __ffs(mask) - 1;
}

template <PredictorKind kKind, int kTokenTiles>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) decode_ffn_kernel(DecodeParams p) {
  constexpr int kPlanes = planes_of(kKind);
  constexpr bool kNormalized = is_normalized(kKind);
  constexpr bool kGate = kKind != PredictorKind::sign_rule;
  constexpr int kTokens = kTokenTiles * kTokenTile;
  extern __shared__ __align__(16) unsigned char shared[];  // SharedLayout
  __shared__ float exact_x[kDecodeMaxRows][kMaxExactColumns];
  __shared__ uint32_t predicted[kTileNeurons], active[kTileNeurons];  // bit m: token m
  __shared__ float gate_value[kTileNeurons][kTokens], coefficient[kTileNeurons][kTokens];
  __shared__ unsigned int active_count, missed_count;
  __shared__ unsigned long long call;  // this call's number (ticket / grid size)
  __shared__ bool zeroes_y;
  __shared__ float neuron_scale[kTileNeurons], neuron_large_scale[kTileNeurons], neuron_residual[kTileNeurons];
  __shared__ float neuron_exact_weights[kTileNeurons][kMaxExactColumns];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first_neuron = blockIdx.x * kTileNeurons;
  const int first_word = warp * p.words_per_part, end_word = min(p.words, first_word + p.words_per_part);
  const uint32_t* planes = reinterpret_cast<const uint32_t*>(shared);
  float* partial_scores = reinterpret_cast<float*>(shared + p.shared.partial_scores);  // [part][plane][neuron][token]
  float* squares = reinterpret_cast<float*>(shared + p.shared.squares);                // [part][token]
  unsigned char* slots = shared + warp * p.shared.slots * p.shared.slot_stride;        // this warp's
  float* partial_dots = reinterpret_cast<float*>(shared + p.shared.partial_dots);       // [part][slot][token]
  float* warp_dots = partial_dots + warp * kMaxSlots * kTokens;
  // Σ over the warps of partial_dots[.][slot][token].
  auto dot_of = [&](int slot, int token) {
    float sum = 0.0f;
#pragma unroll
    for (int part = 0; part < kParts; ++part) sum += partial_dots[(part * kMaxSlots + slot) * kTokens + token];
    return sum;
  };

  unsigned long long ticket = 0;
  if (threadIdx.x == 0) ticket = atomicAdd(&p.sync->started, 1ull);
  // The tile's planes into shared memory, all in flight at once, and this warp's first words of x.
  const int plane_chunks = p.words * 4;  // 16-byte chunks per plane
#pragma unroll
  for (int plane = 0; plane < kPlanes; ++plane) {
    const uint32_t* source =
        (plane == 0 ? p.sign_tiles : p.large_tiles) + static_cast<int64_t>(blockIdx.x) * p.words * 16;
    for (int chunk = threadIdx.x; chunk < plane_chunks; chunk += kThreads)
      copy_16_async(shared + (plane * plane_chunks + chunk) * 16, source + chunk * 4);
  }
  commit_copies();
  if (threadIdx.x < kTileNeurons) {
    predicted[threadIdx.x] = 0u;
    active[threadIdx.x] = 0u;
  }
  // The tile's per-neuron constants of step 2, loaded while the planes arrive (in shared memory: the
  // registers are step 1's).
  if (kGate && threadIdx.x < kTileNeurons && first_neuron + threadIdx.x < p.hidden) {
    const int j = first_neuron + threadIdx.x;
    neuron_scale[threadIdx.x] = __ldg(p.scale + j);
    if (kPlanes == 2) neuron_large_scale[threadIdx.x] = __ldg(p.large_scale + j);
    if (kNormalized) neuron_residual[threadIdx.x] = __ldg(p.residual + j);
  }
  if (kGate && threadIdx.x < kTileNeurons * p.exact_count) {
    const int n = threadIdx.x / p.exact_count, c = threadIdx.x % p.exact_count;
    if (first_neuron + n < p.hidden)
      neuron_exact_weights[n][c] =
          __ldg(p.exact_weights + static_cast<int64_t>(first_neuron) * p.exact_count + threadIdx.x);
  }
  if (threadIdx.x == 0) {
    active_count = 0u;
    missed_count = 0u;
    call = ticket / gridDim.x;
    zeroes_y = !p.accumulate && ticket % gridDim.x == 0;
  }
  // Everything above reads only the layer's own constants, so under a programmatic launch it overlaps
  // the previous kernel; x and y belong to the stream's order from here on.
  wait_for_previous_grid();
  uint4 x[word_batch(kKind, kTokenTiles)][kTokenTiles];
  load_x_words(p, first_word, end_word, lane >> 2, lane & 3, x);
  if (kGate && threadIdx.x < p.rows * p.exact_count) {
    const int m = threadIdx.x / p.exact_count, c = threadIdx.x % p.exact_count;
    const unsigned short bits =
        reinterpret_cast<const unsigned short*>(p.x)[static_cast<int64_t>(m) * p.cols + p.exact_columns[c]];
    exact_x[m][c] = __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
  wait_all_copies();
  __syncthreads();
  // Every block has its ticket, so the next call's blocks (a programmatic launch) may start taking theirs.
  allow_dependent_grids();

  if (zeroes_y) zero_y(p);  // its release below follows the next barrier
  score_part<kKind, kTokenTiles>(p, planes, first_word, end_word, warp, lane, x, partial_scores, squares);
  __syncthreads();
  if (zeroes_y && threadIdx.x == kThreads - 1) publish_zeroed_y(p, call);

  // Step 2: each thread decides its (token, neuron).
  const int own_neuron = threadIdx.x % kTileNeurons, own_token = threadIdx.x / kTileNeurons;
  bool pair_predicted = false;
  if (own_token < p.rows && first_neuron + own_neuron < p.hidden) {
    float sums[kPlanes];
#pragma unroll
    for (int plane = 0; plane < kPlanes; ++plane) {
      sums[plane] = 0.0f;
#pragma unroll
      for (int part = 0; part < kParts; ++part)
        sums[plane] += partial_scores[((part * kPlanes + plane) * kTileNeurons + own_neuron) * kTokens + own_token];
    }
    if (!kGate) {
      pair_predicted = (p.cols - __float2int_rn(sums[0])) / 2 <= p.max_negatives;  // Σ = D − 2·N_neg
    } else {
      // The CPU's order: the approximation, then the exact columns, then the normalization. The planes
      // covered the exact columns too; their exact weights take that term back out.
      const float scale = neuron_scale[own_neuron];
      float score = kPlanes == 2 ? scale * sums[0] + (neuron_large_scale[own_neuron] - scale) * sums[kPlanes - 1]
                                 : scale * sums[0];
#pragma unroll
      for (int c = 0; c < kMaxExactColumns; ++c)
        if (c < p.exact_count) score += exact_x[own_token][c] * neuron_exact_weights[own_neuron][c];
      if (kNormalized) {
        float square_sum = 0.0f;
#pragma unroll
        for (int part = 0; part < kParts; ++part) square_sum += squares[part * kTokens + own_token];
#pragma unroll
        for (int c = 0; c < kMaxExactColumns; ++c)
          if (c < p.exact_count) square_sum -= exact_x[own_token][c] * exact_x[own_token][c];
        score = normalized_score(score, neuron_residual[own_neuron], sqrtf(fmaxf(square_sum, 0.0f)));
      }
      pair_predicted = score >= p.min_score;
    }
  }
  if (pair_predicted) atomicOr(&predicted[own_neuron], 1u << own_token);
  const int predicted_pairs = __syncthreads_count(pair_predicted);

  // Steps 3 and 4. One thread per (slot, token) where the warps' partial dot products meet.
  const int pair_slot = threadIdx.x % kMaxSlots, pair_token = threadIdx.x / kMaxSlots;
  const bool lane_neuron_exists = lane < kTileNeurons && first_neuron + lane < p.hidden;
  const uint32_t lane_predicted = lane < kTileNeurons ? predicted[lane] : 0u;
  const uint32_t gated = __ballot_sync(0xffffffffu, lane_predicted != 0u || (p.count_missed && lane_neuron_exists));
  const bool gated_ffn = p.up != nullptr;
  // For a gated FFN with few gated neurons, their up and down rows come with the gate rows: one round
  // trip instead of two for the blocks with active neurons, at the price of rows of neurons whose gate
  // turns out <= 0. That price depends on the predictor's precision: about 15% of the two-bit gate's
  // neurons are active on the standard workload, 3% of the one-bit gates' and under 1% of the sign
  // rule's, so those speculate only for a single gated neuron (H200: one-bit 12.3 -> 11.3 us at M = 4,
  // 9.3 -> 9.1 at M = 1; the two-bit gate limited the same way lost 1.0-1.3 us).
  constexpr int kMaxSpeculated = kPlanes == 2 ? kTileNeurons : 1;
  const int gated_count = __popc(gated);
  unsigned long long zeroed = 0;
  if (gated != 0u && gated_ffn && !p.count_missed && 3 * gated_count <= p.shared.slots &&
      gated_count <= kMaxSpeculated) {
    if (threadIdx.x == 0) zeroed = zeroed_count(p);  // read early, spun on below
    stage_rows(p, p.projection, gated, 0, slots, first_neuron, first_word, lane);
    stage_rows(p, p.up, gated, gated_count, slots, first_neuron, first_word, lane);
    stage_rows(p, p.down, gated, 2 * gated_count, slots, first_neuron, first_word, lane);
    wait_all_copies();
    __syncwarp();
    slot_dots<kTokenTiles>(p, slots, 2 * gated_count, first_word, end_word, lane, warp_dots);
    __syncthreads();
    if (pair_slot < gated_count && pair_token < p.rows) {
      const int n = nth_bit(gated, pair_slot);
      if ((predicted[n] >> pair_token) & 1u) {
        const float g = dot_of(pair_slot, pair_token);
        if (g > 0.0f) {
          coefficient[n][pair_token] = g * dot_of(gated_count + pair_slot, pair_token);
          atomicOr(&active[n], 1u << pair_token);
          atomicAdd(&active_count, 1u);
        }
      }
    }
    if (threadIdx.x == 0) wait_for_zeroed_y(p, call, zeroed);
    __syncthreads();
    add_down_rows<kTokens>(p, slots, 2 * gated_count, gated, active, coefficient, first_word, lane);
  } else if (gated != 0u) {
    for (uint32_t rest = gated; rest != 0u;) {
      const uint32_t batch = lowest_bits(rest, p.shared.slots);
      rest &= ~batch;
      const int count = __popc(batch);
      stage_rows(p, p.projection, batch, 0, slots, first_neuron, first_word, lane);
      wait_all_copies();
      __syncwarp();
      slot_dots<kTokenTiles>(p, slots, count, first_word, end_word, lane, warp_dots);
      __syncthreads();
      if (pair_slot < count && pair_token < p.rows) {
        const int n = nth_bit(batch, pair_slot);
        const bool pair_is_predicted = (predicted[n] >> pair_token) & 1u;
        if (pair_is_predicted || p.count_missed) {
          const float g = dot_of(pair_slot, pair_token);
          gate_value[n][pair_token] = g;
          if (g > 0.0f && pair_is_predicted) {
            atomicOr(&active[n], 1u << pair_token);
            atomicAdd(&active_count, 1u);
          } else if (g > 0.0f) {
            atomicAdd(&missed_count, 1u);
          }
        }
      }
      __syncthreads();
    }
    const uint32_t active_neurons = __ballot_sync(0xffffffffu, lane < kTileNeurons && active[lane] != 0u);
    if (active_neurons != 0u && threadIdx.x == 0) zeroed = zeroed_count(p);
    const int per_round = gated_ffn ? p.shared.slots / 2 : p.shared.slots;
    for (uint32_t rest = active_neurons; rest != 0u;) {
      const uint32_t batch = lowest_bits(rest, per_round);
      rest &= ~batch;
      const int count = __popc(batch);
      if (gated_ffn) stage_rows(p, p.up, batch, 0, slots, first_neuron, first_word, lane);
      stage_rows(p, p.down, batch, gated_ffn ? count : 0, slots, first_neuron, first_word, lane);
      wait_all_copies();
      __syncwarp();
      if (gated_ffn) {
        slot_dots<kTokenTiles>(p, slots, count, first_word, end_word, lane, warp_dots);
        __syncthreads();
      }
      if (pair_slot < count && pair_token < p.rows) {
        const int n = nth_bit(batch, pair_slot);
        if ((active[n] >> pair_token) & 1u) {
          // Non-gated: the coefficient is relu(x·up[j]) itself.
          const float u = gated_ffn ? dot_of(pair_slot, pair_token) : 1.0f;
          coefficient[n][pair_token] = gate_value[n][pair_token] * u;
        }
      }
      if (threadIdx.x == 0) wait_for_zeroed_y(p, call, zeroed);
      __syncthreads();
      add_down_rows<kTokens>(p, slots, gated_ffn ? count : 0, batch, active, coefficient, first_word, lane);
      if (rest != 0u) __syncthreads();  // the next round rewrites partial_dots and coefficient
    }
  }

  // Reductions (no value comes back), so the block need not wait for a load of its counters to exit:
  // a read-modify-write here stood in every block's path at the end (ncu, M = 1: 3.5% of the stalls).
  if (threadIdx.x == 0 && (predicted_pairs | active_count | missed_count) != 0) {
    Counters& slot = p.counters[blockIdx.x];
    atomicAdd(&slot.predicted, static_cast<unsigned long long>(predicted_pairs));
    atomicAdd(&slot.active, static_cast<unsigned long long>(active_count));
    atomicAdd(&slot.missed, static_cast<unsigned long long>(missed_count));
  }
}

// Steps 3-4 when every gate is known, for one tile of 16 neurons: its active (token, neuron) pairs
// are listed, then worked through kPairBatch at a time, thread v owning the 16-byte pieces v,
// v + kThreads, ... of every row: the pieces of x[m], up[j] and down[j] of the whole batch are loaded
// at once (down does not depend on u), so a batch costs one round trip; u's partial sums meet in
// shared memory; y[m] += g·u·down[j] by vector atomics. Only the x rows of active pairs are read (the
// fused kernel's 16-token products read all of x for every round of rows).
constexpr int kPairBatch = 4;
static_assert(kTileNeurons * kDecodeMaxRows <= kThreads, "one thread per (token, neuron) of a tile lists the pairs");

struct PairList {
  uint32_t token_neuron[kTileNeurons * kDecodeMaxRows];  // token << 16 | neuron of the tile
  float gate[kTileNeurons * kDecodeMaxRows];
  float partial_dots[kParts][kPairBatch];
  unsigned int count;
};

// Adds the calling thread's (token, neuron) pair to the list when its gate g is positive.
__device__ __forceinline__ void list_pair(PairList& list, int token, int neuron, float g) {
  if (g > 0.0f) {
    const unsigned int at = atomicAdd(&list.count, 1u);
    list.token_neuron[at] = static_cast<uint32_t>(token) << 16 | static_cast<uint32_t>(neuron);
    list.gate[at] = g;
  }
}

template <bool kGated>
__device__ __forceinline__ void add_listed_pairs(const DecodeParams& p, int first_neuron, PairList& list) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int count = static_cast<int>(list.count);
  const int pieces = p.cols / kChunk;
  for (int first = 0; first < count; first += kPairBatch) {
    const int batch = min(kPairBatch, count - first);
    const uint4* x_row[kPairBatch];
    const uint4 *up_row[kPairBatch], *down_row[kPairBatch];
    float* y_row[kPairBatch];
    float coefficient[kPairBatch];
#pragma unroll
    for (int b = 0; b < kPairBatch; ++b) {
      const uint32_t pair = list.token_neuron[first + min(b, batch - 1)];
      const int64_t m = pair >> 16, j = first_neuron + (pair & 0xffffu);
      x_row[b] = reinterpret_cast<const uint4*>(p.x + m * p.cols);
      up_row[b] = kGated ? reinterpret_cast<const uint4*>(p.up + j * p.cols) : nullptr;
      down_row[b] = reinterpret_cast<const uint4*>(p.down + j * p.cols);
      y_row[b] = p.y + m * p.cols;
      coefficient[b] = list.gate[first + min(b, batch - 1)];
    }
    // This thread's first piece of every down row comes with the up product's loads.
    uint4 first_down[kPairBatch];
#pragma unroll
    for (int b = 0; b < kPairBatch; ++b)
      first_down[b] = b < batch && threadIdx.x < pieces ? __ldg(down_row[b] + threadIdx.x) : make_uint4(0u, 0u, 0u, 0u);
    if (kGated) {
      float dots[kPairBatch] = {};
      for (int piece = threadIdx.x; piece < pieces; piece += kThreads) {
        uint4 x[kPairBatch], up[kPairBatch];
#pragma unroll
        for (int b = 0; b < kPairBatch; ++b) {
          if (b >= batch) break;
          x[b] = __ldg(x_row[b] + piece);
          up[b] = __ldg(up_row[b] + piece);
        }
#pragma unroll
        for (int b = 0; b < kPairBatch; ++b)
          if (b < batch) dots[b] += dot8(x[b], up[b]);
      }
#pragma unroll
      for (int b = 0; b < kPairBatch; ++b) {
        const float sum = warp_sum(dots[b]);
        if (lane == 0) list.partial_dots[warp][b] = sum;
      }
      __syncthreads();
#pragma unroll
      for (int b = 0; b < kPairBatch; ++b) {
        float u = 0.0f;
#pragma unroll
        for (int part = 0; part < kParts; ++part) u += list.partial_dots[part][b];
        coefficient[b] *= u;  // non-gated: relu(x·up[j]) is the gate itself
      }
      __syncthreads();  // partial_dots is the next batch's
    }
    for (int piece = threadIdx.x; piece < pieces; piece += kThreads) {
#pragma unroll
      for (int b = 0; b < kPairBatch; ++b) {
        if (b >= batch) break;
        const uint4 d = piece == threadIdx.x ? first_down[b] : __ldg(down_row[b] + piece);
        const float c = coefficient[b];
        float* out = y_row[b] + piece * kChunk;
        red_add_v4(out, c * bf16_low(d.x), c * bf16_high(d.x), c * bf16_low(d.y), c * bf16_high(d.y));
        red_add_v4(out + 4, c * bf16_low(d.z), c * bf16_high(d.z), c * bf16_low(d.w), c * bf16_high(d.w));
      }
    }
  }
  if (threadIdx.x == 0) {
    Counters& slot = p.counters[blockIdx.x];
    const int neurons = min(kTileNeurons, p.hidden - first_neuron);
    atomicAdd(&slot.predicted, static_cast<unsigned long long>(p.rows * neurons));
    if (count != 0) atomicAdd(&slot.active, static_cast<unsigned long long>(count));
  }
}

// Every gate given (p.gates [M, H], computed just before by decode_gemv or cuBLASLt): steps 3-4 above.
// y is zeroed by the caller (a memset) unless the call accumulates: no tickets, no waiting for a
// zeroing block. The fused kernel's way (the first block zeroes, the others spin on a counter beside
// the tickets) cost 1.9 us here at M = 16 on the H200 (15.1 -> 13.2 us a call), 0.2 at M = 4; the
// memset node costs 0.9 us at M = 1 (8.8 -> 9.7), where only the sign rule takes every gate.
template <bool kGated>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) given_gates_kernel(DecodeParams p) {
  __shared__ PairList list;
  const int first_neuron = blockIdx.x * kTileNeurons;
  if (threadIdx.x == 0) list.count = 0u;
  wait_for_previous_grid();
  allow_dependent_grids();  // the next kernel reads only its own constants before it waits
  __syncthreads();
  const int own_neuron = threadIdx.x % kTileNeurons, own_token = threadIdx.x / kTileNeurons;
  if (own_token < p.rows && first_neuron + own_neuron < p.hidden)
    list_pair(list, own_token, own_neuron,
              p.gates[static_cast<int64_t>(own_token) * p.hidden + first_neuron + own_neuron]);
  __syncthreads();
  add_listed_pairs<kGated>(p, first_neuron, list);
}

// Bytes of one gate row in a streamed-gates block's shared memory: every word's 4 pieces (zeros past
// D), then padding that makes the row stride an odd multiple of 64 bytes, so that the 8 lanes of a
// quarter warp (rows g and g + 1, quads 0-3) read their 16-byte pieces from 8 distinct bank groups.
__host__ __device__ constexpr int32_t streamed_row_stride(int32_t words) {
  return (words * kPiecesPerWord + (words % 2 == 0 ? 4 : 0)) * 16;
}
// The block's dynamic shared memory: its 16 gate rows, later the warps' partial gates.
int32_t streamed_shared_bytes(int32_t words, int tokens) {
  return std::max(kTileNeurons * streamed_row_stride(words), kParts * kTileNeurons * tokens * 4);
}

// Copies (cp.async, not committed) the pieces of the tile's gate rows that lie in words [lo, hi) of
// every warp's slice (words part·words_per_part + [lo, hi)) into the block's row buffer; zeros past
// H and D.
__device__ __forceinline__ void copy_gate_rows(const DecodeParams& p, int first_neuron, int lo, int hi,
                                               unsigned char* rows, int32_t row_stride) {
  const int pieces = p.cols / kChunk, span = (hi - lo) * kPiecesPerWord;
  for (int i = threadIdx.x; i < kTileNeurons * kParts * span; i += kThreads) {
    const int n = i / (kParts * span), part = i / span % kParts, within = i % span;
    const int word = part * p.words_per_part + lo + within / kPiecesPerWord;
    const int piece = word * kPiecesPerWord + within % kPiecesPerWord;
    if (word >= p.words) continue;
    const bool inside = first_neuron + n < p.hidden && piece < pieces;
    const bf16* source = p.projection + (inside ? static_cast<int64_t>(first_neuron + n) * p.cols + piece * kChunk : 0);
    copy_16_async(rows + n * row_stride + piece * 16, source, inside);
  }
}

// Every gate in one kernel (AllGatesKernel::streamed), one block per tile of 16 neurons, every block
// of the call resident at once:
//   - the tile's gate rows are copied into shared memory (cp.async, all in flight, in two groups: the
//     words of each warp's first batch of x, then the rest) before the programmatic wait, so the
//     projection streams while the stream's previous kernel ends;
//   - each warp computes the gates of its words (D split as in the fused kernel) for every token on
//     the tensor cores: mma.m16n8k16 with A = the 16 rows (row g and g + 8 of a lane's quad pieces, the
//     k order of the fused kernel's sign planes, so x loads as there) and B = x; partial sums meet in
//     shared memory;
//   - the tile's positive gates become its pair list, worked through as given_gates_kernel does.
// y is zeroed by the call's first block (a ticket) while the rows arrive; the others wait for it
// only before their first atomic, by when the whole projection has streamed.
template <int kTokenTiles, bool kGated>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) streamed_gates_kernel(DecodeParams p) {
  constexpr int kTokens = kTokenTiles * kTokenTile;
  constexpr int kBatch = word_batch(PredictorKind::one_bit_gate, kTokenTiles);
  extern __shared__ __align__(16) unsigned char shared[];
  __shared__ PairList list;
  __shared__ unsigned long long call;
  __shared__ bool zeroes_y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane >> 2, quad = lane & 3;
  const int first_neuron = blockIdx.x * kTileNeurons;
  const int first_word = warp * p.words_per_part, end_word = min(p.words, first_word + p.words_per_part);
  const int32_t row_stride = streamed_row_stride(p.words);

  unsigned long long ticket = 0;
  if (threadIdx.x == 0) ticket = atomicAdd(&p.sync->started, 1ull);
  // Two groups of copies: the words every warp takes in its first batch of x, then the rest, so that
  // a warp with a second batch (two token tiles) asks for its x while the rest of the rows arrive.
  const int first_batch = min(kBatch, p.words_per_part);
  copy_gate_rows(p, first_neuron, 0, first_batch, shared, row_stride);
  commit_copies();
  copy_gate_rows(p, first_neuron, first_batch, p.words_per_part, shared, row_stride);
  commit_copies();
  if (threadIdx.x == 0) {
    list.count = 0u;
    call = ticket / gridDim.x;
    zeroes_y = !p.accumulate && ticket % gridDim.x == 0;
  }
  wait_for_previous_grid();  // x and y belong to the stream's order from here on
  uint4 x[kBatch][kTokenTiles];
  load_x_words(p, first_word, end_word, group, quad, x);
  wait_copies<1>();
  __syncthreads();
  allow_dependent_grids();  // every block has its ticket
  if (zeroes_y) zero_y(p);

  // At one token tile, two chains of dependent mma (one per mma step), as score_part.
  constexpr int kChains = kTokenTiles == 1 ? 2 : 1;
  float acc[kChains][kTokenTiles][4] = {};
  const unsigned char* row_low = shared + group * row_stride + quad * 16;  // rows g and g + 8
  const unsigned char* row_high = row_low + 8 * row_stride;
  const auto rest_of_rows = [](int batch) {  // the second batch's x is on its way: wait for the other rows
    if (batch == 1) {
      wait_copies<0>();
      __syncthreads();
    }
  };
  for_each_word(p, first_word, end_word, first_word + p.words_per_part, group, quad, x, rest_of_rows,
                [&](int b, int w) {
    const uint4 low = *reinterpret_cast<const uint4*>(row_low + w * kPiecesPerWord * 16);
    const uint4 high = *reinterpret_cast<const uint4*>(row_high + w * kPiecesPerWord * 16);
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const uint32_t a[4] = {word_of(low, 2 * step), word_of(high, 2 * step), word_of(low, 2 * step + 1),
                             word_of(high, 2 * step + 1)};
#pragma unroll
      for (int tile = 0; tile < kTokenTiles; ++tile)
        mma_bf16(acc[step % kChains][tile], a, word_of(x[b][tile], 2 * step), word_of(x[b][tile], 2 * step + 1));
    }
  });
  __syncthreads();  // the rows are read: their space takes the partial gates [part][neuron][token]
  float* partial = reinterpret_cast<float*>(shared);
  store_tile_sums<kTokenTiles>(partial + warp * kTileNeurons * kTokens, group, quad, [&](int tile, int i) {
    float sum = 0.0f;
#pragma unroll
    for (int chain = 0; chain < kChains; ++chain) sum += acc[chain][tile][i];
    return sum;
  });
  __syncthreads();
  if (zeroes_y && threadIdx.x == 0) publish_zeroed_y(p, call);  // every thread's zeroing is behind the barrier above
  const int own_neuron = threadIdx.x % kTileNeurons, own_token = threadIdx.x / kTileNeurons;
  if (own_token < p.rows && first_neuron + own_neuron < p.hidden) {
    float g = 0.0f;
#pragma unroll
    for (int part = 0; part < kParts; ++part) g += partial[(part * kTileNeurons + own_neuron) * kTokens + own_token];
    list_pair(list, own_token, own_neuron, g);
  }
  if (threadIdx.x == 0) {
    unsigned long long zeroed = zeroed_count(p);
    wait_for_zeroed_y(p, call, zeroed);
  }
  __syncthreads();
  add_listed_pairs<kGated>(p, first_neuron, list);
}

// A programmatic launch (PDL): the kernel may start while the stream's previous kernel finishes, and
// waits for it (griddepcontrol.wait) only before it touches x and y. Measured on the H200 (bench
// decode, graph of 20 calls): 1.0 us off M = 1 (10.6 -> 9.5 us, two-bit-norm), 0.7-1.2 us off M = 4
// and 16; without the early trigger in the kernel, 0.2-0.3 us.
template <PredictorKind kKind>
void launch(const DecodeParams& p, int tiles, cudaStream_t stream) {
  const auto shared = static_cast<size_t>(p.shared.bytes());
  if (p.rows > kTokenTile)
    launch_programmatic(decode_ffn_kernel<kKind, 2>, dim3(tiles), dim3(kThreads), shared, stream, p);
  else
    launch_programmatic(decode_ffn_kernel<kKind, 1>, dim3(tiles), dim3(kThreads), shared, stream, p);
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

auto streamed_gates_kernel_for(int token_tiles, bool gated) {
  return token_tiles == 1 ? (gated ? streamed_gates_kernel<1, true> : streamed_gates_kernel<1, false>)
                          : (gated ? streamed_gates_kernel<2, true> : streamed_gates_kernel<2, false>);
}

// Whether the streamed-gates kernel of `token_tiles` can run `tiles` blocks all resident at once on
// this GPU (it then sets the kernel's shared-memory limit); the blocks per SM come from the occupancy
// calculator, never from a table.
bool prepare_streamed_gates(int token_tiles, bool gated, int32_t words, int tiles) {
  auto kernel = streamed_gates_kernel_for(token_tiles, gated);
  const int shared = streamed_shared_bytes(words, token_tiles * kTokenTile);
  if (shared > device_facts().max_smem_per_block_optin) return false;
  TWELL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  int per_sm = 0;
  TWELL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared));
  return static_cast<int64_t>(per_sm) * device_facts().sm_count >= tiles;
}

// The layout for `planes` planes and `tokens` tokens per token tile set, D split in words_per_part
// words per warp.
SharedLayout shared_layout(int planes, int tokens, int32_t words, int32_t words_per_part) {
  SharedLayout s{};
  s.partial_scores = planes * words * 64;
  s.squares = s.partial_scores + kParts * planes * kTileNeurons * tokens * 4;
  s.step_one_end = s.squares + kParts * tokens * 4;
  s.slot_stride = words_per_part * kPiecesPerWord * 16 + 16;  // + 16: the 8 slots an mma reads hit distinct banks
  const int dots_bytes = kParts * kMaxSlots * tokens * 4;
  s.slots = std::clamp((kSharedTarget[tokens / kTokenTile - 1] - dots_bytes) / (kParts * s.slot_stride), 2, kMaxSlots);
  s.partial_dots = kParts * s.slots * s.slot_stride;
  s.step_three_end = s.partial_dots + dots_bytes;
  return s;
}

// The exact weights minus the term the planes already count at that column: W[j, c] − scale_j·sign,
// sign = −1 where the sign bit is set, else +1 (scale: the one-bit gates' scale or the two-bit gate's
// small_scale, whose plane takes the sign bit of every column).
std::vector<float> exact_weights_without_sign_term(const SignBits& signs, const std::vector<float>& scale) {
  const size_t count = signs.exact_columns.size();
  const int32_t words = signs.words_per_row();
  std::vector<float> weights(signs.exact_weights.size());
  for (int32_t j = 0; j < signs.rows; ++j)
    for (size_t c = 0; c < count; ++c) {
      const int32_t column = signs.exact_columns[c];
      const bool negative = (signs.bits[static_cast<size_t>(j) * words + column / kSignBitsPerWord] >>
                             (column % kSignBitsPerWord)) & 1u;
      const size_t at = static_cast<size_t>(j) * count + c;
      weights[at] = signs.exact_weights[at] - (negative ? -scale[j] : scale[j]);
    }
  return weights;
}

}  // namespace

struct DecodeLayer::Impl {
  const DeviceFfnWeights* weights;
  int32_t words = 0, words_per_part = 0;
  int32_t tiles = 0;
  DeviceBuffer<uint32_t> sign_tiles, large_tiles;  // tiled_plane of bits and large
  DeviceBuffer<float> scale, residual, small_scale, large_scale, two_bit_residual;  // [H] each
  DeviceBuffer<float> one_bit_exact_weights, two_bit_exact_weights;  // [H, c]: exact_weights_without_sign_term
  std::vector<int32_t> exact_columns;
  DeviceBuffer<CallSync> sync;
  DeviceBuffer<Counters> counters;    // [tiles]
  mutable bool all_counted_missed = true;  // every run since the last stats() counted misses
  // Every gate (GateSelection::all_neurons): gates [M, H] = x · projectionᵀ by cuBLASLt for M > 1.
  // A small workspace: this GEMM's M is at most 16, and a model holds one per layer.
  mutable RowMajorGemm gemm{kGatesGemmWorkspace};
  DeviceBuffer<float> gates;  // [kDecodeMaxRows, H]
  bool streamed_fits[2] = {};  // by token tiles − 1: every block of a streamed-gates call resident at once
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
  s.words_per_part = (s.words + kParts - 1) / kParts;
  s.tiles = (hidden + kTileNeurons - 1) / kTileNeurons;
  // The most any launch takes: two planes, and one or two token tiles (the slots fill what step 1 leaves).
  const size_t shared =
      static_cast<size_t>(std::max(shared_layout(2, kTokenTile, s.words, s.words_per_part).bytes(),
                                   shared_layout(2, 2 * kTokenTile, s.words, s.words_per_part).bytes()));
  TWELL_REQUIRE(shared <= static_cast<size_t>(device_facts().max_smem_per_block_optin) - 8 * 1024,
                "decode on CUDA: D = {} needs {} bytes of shared memory for the sign planes and two rows of 16 "
                "neurons, more than this GPU gives a block",
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
  if (exact_count > 0) {
    const std::vector<float> one_bit = exact_weights_without_sign_term(signs, signs.scale);
    const std::vector<float> two_bit = exact_weights_without_sign_term(signs, signs.small_scale);
    s.one_bit_exact_weights.upload(one_bit.data(), one_bit.size());
    s.two_bit_exact_weights.upload(two_bit.data(), two_bit.size());
  }
  s.sync.resize(1);
  TWELL_CUDA_CHECK(cudaMemset(s.sync.data(), 0, sizeof(CallSync)));
  s.counters.resize(s.tiles);
  TWELL_CUDA_CHECK(cudaMemset(s.counters.data(), 0, s.counters.bytes()));
  allow_shared<PredictorKind::sign_rule>(shared);
  allow_shared<PredictorKind::one_bit_gate>(shared);
  allow_shared<PredictorKind::normalized_one_bit_gate>(shared);
  allow_shared<PredictorKind::two_bit_gate>(shared);
  s.gates.resize(static_cast<size_t>(kDecodeMaxRows) * h);
  for (int token_tiles : {1, 2})
    s.streamed_fits[token_tiles - 1] = prepare_streamed_gates(token_tiles, weights.gated, s.words, s.tiles);
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
  p.sign_tiles = s.sign_tiles.data();
  p.large_tiles = s.large_tiles.data();
  p.scale = two_bit ? s.small_scale.data() : s.scale.data();
  p.large_scale = s.large_scale.data();
  p.residual = two_bit ? s.two_bit_residual.data() : s.residual.data();
  p.exact_weights = two_bit ? s.two_bit_exact_weights.data() : s.one_bit_exact_weights.data();
  p.exact_count = static_cast<int32_t>(s.exact_columns.size());
  for (int32_t c = 0; c < p.exact_count; ++c) p.exact_columns[c] = s.exact_columns[c];
  p.y = y;
  p.sync = s.sync.data();
  p.counters = s.counters.data();
  p.rows = static_cast<int32_t>(rows);
  p.cols = w.d_model;
  p.hidden = w.d_hidden;
  p.words = s.words;
  p.words_per_part = s.words_per_part;
  p.shared = shared_layout(planes_of(predictor.kind), rows > kTokenTile ? 2 * kTokenTile : kTokenTile, s.words,
                           s.words_per_part);
  p.max_negatives =
      predictor.kind == PredictorKind::sign_rule ? sign_rule_max_negatives(predictor.alpha, w.d_model) : 0;
  p.min_score = static_cast<float>(-predictor.margin);
  p.count_missed = options.count_missed;
  p.accumulate = options.accumulate;
  impl_->all_counted_missed = impl_->all_counted_missed && options.count_missed;

  if (computes_all_gates(options, predictor, rows, kCudaAllGates)) {
    const int token_tiles = rows > kTokenTile ? 2 : 1;
    if (options.all_gates_kernel == AllGatesKernel::streamed && s.streamed_fits[token_tiles - 1]) {
      launch_programmatic(streamed_gates_kernel_for(token_tiles, w.gated), dim3(s.tiles), dim3(kThreads),
                          static_cast<size_t>(streamed_shared_bytes(s.words, token_tiles * kTokenTile)), stream, p);
      return;
    }
    // gates [M, H] = x [M, D] · projectionᵀ: decode_gemv for one row, cuBLASLt for more (H200, the
    // whole call: 12.4 against 13.8 us at M = 1, 14.3 against 19.4 at M = 4; docs/perf-notes.md).
    if (rows == 1 && decode_gemv_supports(1, w.d_model))
      decode_gemv(1, w.d_hidden, w.d_model, GemvInput::rows(x), p.projection, s.gates.data(), GemvOutput::f32, stream);
    else
      s.gemm.run(rows, w.d_hidden, w.d_model, GemmOperand{x, w.d_model, false},
                 GemmOperand{p.projection, w.d_model, true}, s.gates.data(), w.d_hidden, GemmOutput::f32, 0.0f, stream);
    if (!options.accumulate)
      TWELL_CUDA_CHECK(cudaMemsetAsync(y, 0, static_cast<size_t>(rows) * w.d_model * sizeof(float), stream));
    p.gates = s.gates.data();
    if (w.gated)
      launch_programmatic(given_gates_kernel<true>, dim3(s.tiles), dim3(kThreads), 0, stream, p);
    else
      launch_programmatic(given_gates_kernel<false>, dim3(s.tiles), dim3(kThreads), 0, stream, p);
    return;
  }
  switch (predictor.kind) {
    case PredictorKind::sign_rule: launch<PredictorKind::sign_rule>(p, s.tiles, stream); break;
    case PredictorKind::one_bit_gate: launch<PredictorKind::one_bit_gate>(p, s.tiles, stream); break;
    case PredictorKind::normalized_one_bit_gate:
      launch<PredictorKind::normalized_one_bit_gate>(p, s.tiles, stream);
      break;
    case PredictorKind::two_bit_gate: launch<PredictorKind::two_bit_gate>(p, s.tiles, stream); break;
  }
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
