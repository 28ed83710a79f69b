// Causal prefill attention (cuda/prefill_attention.h): the fused flash-style kernel, and the
// materialized cuBLASLt path (with model_kernels' softmax and layout kernels) for other head dims.
#include "cuda/prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cuda/warp_math.cuh"
#include "twell/error.h"

namespace twell::cuda {
namespace {

using model_kernels::AttentionShape;

// ---- The fused kernel -------------------------------------------------------------------------
//
// Block: 4 warps, Br query tokens of one (sequence, query head); warp w owns Br/4 consecutive
// tokens, one or two m16n8k16 row tiles, so softmax statistics never leave the warp. Keys and
// values stream in tiles of 64 positions through double-buffered shared memory (cp.async): the
// tile after the current one loads while the current one is multiplied. Per key tile and warp:
//   S [16, 64] = Q [16, Dh] · K^T per row tile (Q's fragments stay in registers for the whole block)
//   causal mask (only on tiles that reach past a row tile's first token), running max and sum,
//   O [16, Dh] = O·correction + P [16, 64] · V [64, Dh]   (P: S's accumulators rounded to bf16)
// Two row tiles per warp (Dh <= 64) share each K and V fragment read from shared memory, half the
// ldmatrix traffic per MMA of one. At Dh 128 a second tile's accumulators would not fit in registers.
// Blocks run head after head (a 1-D grid), each head's token tiles longest first (most visible
// keys): the blocks in flight then share their heads' keys and values in L2, and short tiles fill
// the tail. (With the token tile as the slow grid index, the tiles of a head ran a whole grid row
// apart: ncu on the 2B layer, H100, saw 7% L2 hits and 69% of the DRAM bandwidth.)
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kKeyRows = 64;  // Bc
template <int kDh>
constexpr int kRowTiles = kDh <= 64 ? 2 : 1;  // per warp
template <int kDh>
constexpr int kQueryRows = 16 * kWarps * kRowTiles<kDh>;  // Br

// A [rows, Dh] bf16 tile in shared memory, row-major in 16-byte chunks, chunk c of row r stored at
// c ^ (r mod 8): the 8 rows an ldmatrix reads at one chunk column land in 8 different bank groups.
// (For Dh < 64 a row has fewer than 8 chunks; the XOR then spans them all and some conflicts remain.)
template <int kDh>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  constexpr int kChunks = kDh / 8;
  constexpr int kSwizzle = kChunks < 8 ? kChunks - 1 : 7;
  return (row * kChunks + (chunk ^ (row & kSwizzle))) * 8;
}

// rows [valid_rows, Dh] (global, row-major) -> tile rows 0 .. kRows-1, zeros past valid_rows.
template <int kDh, int kRows>
__device__ __forceinline__ void load_tile_async(bf16* tile, const bf16* rows, int valid_rows) {
  constexpr int kChunks = kDh / 8;
  static_assert(kRows * kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int k = 0; k < kRows * kChunks / kThreads; ++k) {
    const int i = threadIdx.x + k * kThreads, row = i / kChunks, chunk = i % kChunks;
    const bool valid = row < valid_rows;
    copy_16_async(tile + tile_offset<kDh>(row, chunk), valid ? rows + row * kDh + chunk * 8 : rows, valid);
  }
}

__device__ __forceinline__ void load_matrices(uint32_t (&r)[4], const bf16* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(shared)));
}
__device__ __forceinline__ void load_matrices_transposed(uint32_t (&r)[4], const bf16* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(shared)));
}


// Two floats rounded to a bf16 pair, `low` in the low half (cvt packs its first operand high).
__device__ __forceinline__ uint32_t pack_bf16(float low, float high) {
  uint32_t pair;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(pair) : "f"(high), "f"(low));
  return pair;
}

// Fragment coordinates (PTX m16n8k16): lane l holds accumulator rows l/4 and l/4 + 8, columns
// 2·(l%4) and 2·(l%4) + 1 of each 8-column tile; A's registers are (rows lo, k 0-7), (rows hi, k 0-7),
// (rows lo, k 8-15), (rows hi, k 8-15). ldmatrix.x4 takes lane l's address as row l%8 of matrix l/8.
// (At least 1 block per SM named: without it ptxas held Dh 32 to 96 registers and spilled.)
template <int kDh>
__global__ void __launch_bounds__(kThreads, 1)
    fused_prefill_attention_kernel(const bf16* q, const bf16* keys, const bf16* values, AttentionShape s, int32_t start,
                                   float scale_log2, bf16* out) {
  constexpr int kChunks = kDh / 8;
  constexpr int kDimSteps = kDh / 16;       // k steps of Q·K^T
  constexpr int kKeyTiles8 = kKeyRows / 8;  // 8-key column tiles of S
  constexpr int kTiles = kRowTiles<kDh>;
  constexpr int kRows = kQueryRows<kDh>;
  constexpr int kWarpRows = 16 * kTiles;
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  bf16* q_tile = reinterpret_cast<bf16*>(shared_bytes);  // [Br, Dh], later the output staging
  bf16* k_tiles = q_tile + kRows * kDh;                   // [2][Bc, Dh]
  bf16* v_tiles = k_tiles + 2 * kKeyRows * kDh;           // [2][Bc, Dh]

  const int32_t token_tiles = (s.tokens + kRows - 1) / kRows;
  const int32_t head_index = blockIdx.x / token_tiles;  // b·H_q + h
  const int32_t b = head_index / s.n_heads, h = head_index % s.n_heads;
  const int32_t first_token = (token_tiles - 1 - blockIdx.x % token_tiles) * kRows;
  const int32_t kv_head = h / (s.n_heads / s.n_kv_heads);
  const int64_t cache_base = (int64_t{b} * s.n_kv_heads + kv_head) * s.cache_stride * kDh;
  keys += cache_base;
  values += cache_base;
  // Positions the block's tokens see: [0, kv_end). None past start + n is read.
  const int32_t kv_end = start + min(first_token + kRows, s.tokens);
  const int32_t key_tiles = (kv_end + kKeyRows - 1) / kKeyRows;

  load_tile_async<kDh, kRows>(q_tile, q + ((int64_t{b} * s.n_heads + h) * s.tokens + first_token) * kDh,
                              s.tokens - first_token);
  load_tile_async<kDh, kKeyRows>(k_tiles, keys, kv_end);
  load_tile_async<kDh, kKeyRows>(v_tiles, values, kv_end);
  commit_copies();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = warp * kWarpRows;
  const int32_t warp_token = first_token + warp_row;  // the warp's first token
  uint32_t q_fragments[kTiles][kDimSteps][4];
  float o[kTiles][kDh / 8][4] = {};  // O [16, Dh] accumulators per row tile, unnormalized
  float row_max[kTiles][2], row_sum[kTiles][2];
#pragma unroll
  for (int m = 0; m < kTiles; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max[m][r] = -INFINITY, row_sum[m][r] = 0.0f;

  for (int32_t tile = 0; tile < key_tiles; ++tile) {
    const int buffer = tile & 1;
    if (tile + 1 < key_tiles) {
      const int32_t next = (tile + 1) * kKeyRows;
      load_tile_async<kDh, kKeyRows>(k_tiles + (buffer ^ 1) * kKeyRows * kDh, keys + int64_t{next} * kDh,
                                     kv_end - next);
      load_tile_async<kDh, kKeyRows>(v_tiles + (buffer ^ 1) * kKeyRows * kDh, values + int64_t{next} * kDh,
                                     kv_end - next);
    }
    commit_copies();  // possibly empty: the wait below always leaves exactly the next tile in flight
    wait_copies<1>();
    __syncthreads();
    if (tile == 0) {
#pragma unroll
      for (int m = 0; m < kTiles; ++m)
#pragma unroll
        for (int step = 0; step < kDimSteps; ++step)
          load_matrices(q_fragments[m][step], q_tile + tile_offset<kDh>(warp_row + 16 * m + lane % 8 + lane / 8 % 2 * 8,
                                                                        2 * step + lane / 16));
    }
    const int32_t first_key = tile * kKeyRows;
    // A tile wholly past the warp's last token adds nothing to its rows (only with start > 0 or
    // a partial last token tile); skipping it is warp-uniform.
    if (first_key <= start + warp_token + kWarpRows - 1) {
      const bf16* k_tile = k_tiles + buffer * kKeyRows * kDh;
      const bf16* v_tile = v_tiles + buffer * kKeyRows * kDh;
      float scores[kTiles][kKeyTiles8][4] = {};
#pragma unroll
      for (int step = 0; step < kDimSteps; ++step)
#pragma unroll
        for (int pair = 0; pair < kKeyTiles8 / 2; ++pair) {
          uint32_t k_fragments[4];  // b0, b1 of key tile 2·pair, then of 2·pair + 1
          load_matrices(k_fragments,
                        k_tile + tile_offset<kDh>(pair * 16 + lane / 16 * 8 + lane % 8, 2 * step + lane / 8 % 2));
#pragma unroll
          for (int m = 0; m < kTiles; ++m) {
            mma_bf16(scores[m][2 * pair], q_fragments[m][step], k_fragments[0], k_fragments[1]);
            mma_bf16(scores[m][2 * pair + 1], q_fragments[m][step], k_fragments[2], k_fragments[3]);
          }
        }
#pragma unroll
      for (int m = 0; m < kTiles; ++m) {
        const int32_t tile_token = warp_token + 16 * m;       // the row tile's first token
        if (first_key + kKeyRows - 1 > start + tile_token) {  // some key here is past some row's last
          const int32_t token_lo = tile_token + lane / 4, token_hi = token_lo + 8;  // this lane's two rows
#pragma unroll
          for (int t8 = 0; t8 < kKeyTiles8; ++t8)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              if (first_key + t8 * 8 + (lane % 4) * 2 + (i & 1) > start + (i < 2 ? token_lo : token_hi))
                scores[m][t8][i] = -INFINITY;
        }
        // Online softmax in the log2 domain. Position 0 is visible to every row and tile 0 comes
        // first, so each row's max is finite from the first tile on; a later tile wholly masked for
        // a row leaves its max as it was and adds exp2(-inf) = 0.
        float correction[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float tile_max = -INFINITY;
#pragma unroll
          for (int t8 = 0; t8 < kKeyTiles8; ++t8)
            tile_max = fmaxf(tile_max, fmaxf(scores[m][t8][2 * r], scores[m][t8][2 * r + 1]));
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
          const float new_max = fmaxf(row_max[m][r], tile_max);
          correction[r] = exp2f((row_max[m][r] - new_max) * scale_log2);
          row_max[m][r] = new_max;
          const float max_scaled = new_max * scale_log2;
          float sum = 0.0f;
#pragma unroll
          for (int t8 = 0; t8 < kKeyTiles8; ++t8)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float p = exp2f(fmaf(scores[m][t8][2 * r + c], scale_log2, -max_scaled));
              scores[m][t8][2 * r + c] = p;
              sum += p;
            }
          row_sum[m][r] = row_sum[m][r] * correction[r] + sum;  // this lane's columns; the quad's sum at the end
        }
#pragma unroll
        for (int d8 = 0; d8 < kDh / 8; ++d8)
#pragma unroll
          for (int i = 0; i < 4; ++i) o[m][d8][i] *= correction[i / 2];
      }
#pragma unroll
      for (int step = 0; step < kKeyRows / 16; ++step) {
        uint32_t p_fragments[kTiles][4];
#pragma unroll
        for (int m = 0; m < kTiles; ++m) {
          p_fragments[m][0] = pack_bf16(scores[m][2 * step][0], scores[m][2 * step][1]);
          p_fragments[m][1] = pack_bf16(scores[m][2 * step][2], scores[m][2 * step][3]);
          p_fragments[m][2] = pack_bf16(scores[m][2 * step + 1][0], scores[m][2 * step + 1][1]);
          p_fragments[m][3] = pack_bf16(scores[m][2 * step + 1][2], scores[m][2 * step + 1][3]);
        }
#pragma unroll
        for (int pair = 0; pair < kDh / 16; ++pair) {
          uint32_t v_fragments[4];  // b0, b1 of dim tile 2·pair, then of 2·pair + 1
          load_matrices_transposed(
              v_fragments, v_tile + tile_offset<kDh>(step * 16 + lane / 8 % 2 * 8 + lane % 8, 2 * pair + lane / 16));
#pragma unroll
          for (int m = 0; m < kTiles; ++m) {
            mma_bf16(o[m][2 * pair], p_fragments[m], v_fragments[0], v_fragments[1]);
            mma_bf16(o[m][2 * pair + 1], p_fragments[m], v_fragments[2], v_fragments[3]);
          }
        }
      }
    }
    __syncthreads();  // the next iteration loads into the buffer read here
  }

  // Normalize, stage the warp's rows in its own rows of q_tile (its Q fragments are in registers),
  // then write whole 16-byte pieces of each token's row of out.
#pragma unroll
  for (int m = 0; m < kTiles; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float total = row_sum[m][r];
      total += __shfl_xor_sync(0xffffffffu, total, 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      const float inv_sum = 1.0f / total;
      const int row = warp_row + 16 * m + lane / 4 + 8 * r;
#pragma unroll
      for (int d8 = 0; d8 < kDh / 8; ++d8)
        *reinterpret_cast<uint32_t*>(q_tile + tile_offset<kDh>(row, d8) + (lane % 4) * 2) =
            pack_bf16(o[m][d8][2 * r] * inv_sum, o[m][d8][2 * r + 1] * inv_sum);
    }
  __syncwarp();
  static_assert(kWarpRows * kChunks % 32 == 0, "every lane writes the same number of chunks");
#pragma unroll
  for (int k = 0; k < kWarpRows * kChunks / 32; ++k) {
    const int i = lane + 32 * k, row = i / kChunks, chunk = i % kChunks;
    const int32_t token = warp_token + row;
    if (token < s.tokens)
      reinterpret_cast<uint4*>(out + ((int64_t{b} * s.tokens + token) * s.n_heads + h) * kDh)[chunk] =
          *reinterpret_cast<const uint4*>(q_tile + tile_offset<kDh>(warp_row + row, chunk));
  }
}

template <int kDh>
void launch_fused(const bf16* q, const bf16* keys, const bf16* values, const AttentionShape& shape, int32_t start,
                  float scale, bf16* out, cudaStream_t stream) {
  constexpr int kRows = kQueryRows<kDh>;
  constexpr int kSharedBytes = (kRows + 4 * kKeyRows) * kDh * static_cast<int>(sizeof(bf16));
  const int64_t blocks = int64_t{shape.batch} * shape.n_heads * ((shape.tokens + kRows - 1) / kRows);
  TWELL_REQUIRE(blocks <= std::numeric_limits<int32_t>::max(),
                "fused prefill attention: B {} x H_q {} x n {} needs {} blocks, more than a grid holds", shape.batch,
                shape.n_heads, shape.tokens, blocks);
  static const bool opted_in = [] {  // once per head dim: 80 KB at Dh 128 is past the default 48 KB
    TWELL_CUDA_CHECK(cudaFuncSetAttribute(fused_prefill_attention_kernel<kDh>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
    return true;
  }();
  (void)opted_in;
  const dim3 grid(static_cast<unsigned>(blocks));
  const float scale_log2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x·log2 e)
  fused_prefill_attention_kernel<kDh>
      <<<grid, kThreads, kSharedBytes, stream>>>(q, keys, values, shape, start, scale_log2, out);
  TWELL_CUDA_CHECK_LAUNCH();
}

// The GEMM path materializes the scores of as many sequences at a time as fit in this.
constexpr int64_t kScoresBudgetBytes = int64_t{1} << 30;

void require_shape(const AttentionShape& s, int32_t start) {
  TWELL_REQUIRE(s.batch >= 1 && s.tokens >= 1, "prefill attention: needs B >= 1 and n >= 1, got B {} n {}", s.batch,
                s.tokens);
  TWELL_REQUIRE(s.n_kv_heads >= 1 && s.n_heads % s.n_kv_heads == 0,
                "prefill attention: n_heads ({}) must be a positive multiple of n_kv_heads ({})", s.n_heads,
                s.n_kv_heads);
  TWELL_REQUIRE(start >= 0 && start + s.tokens <= s.cache_stride,
                "prefill attention: start {} + n {} positions exceed the cache stride {}", start, s.tokens,
                s.cache_stride);
}

}  // namespace

bool fused_prefill_attention_supports(int32_t head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
}

void fused_prefill_attention(const bf16* q, const bf16* keys, const bf16* values, const AttentionShape& shape,
                             int32_t start, float scale, bf16* out, cudaStream_t stream) {
  require_shape(shape, start);
  TWELL_REQUIRE(fused_prefill_attention_supports(shape.head_dim),
                "fused prefill attention: head_dim must be 16, 32, 64 or 128, got {}", shape.head_dim);
  switch (shape.head_dim) {
    case 16:
      return launch_fused<16>(q, keys, values, shape, start, scale, out, stream);
    case 32:
      return launch_fused<32>(q, keys, values, shape, start, scale, out, stream);
    case 64:
      return launch_fused<64>(q, keys, values, shape, start, scale, out, stream);
    default:
      return launch_fused<128>(q, keys, values, shape, start, scale, out, stream);
  }
}

void GemmPrefillAttention::run(RowMajorGemm& gemm, const bf16* q, const bf16* keys, const bf16* values,
                               const AttentionShape& s, int32_t start, float scale, bf16* out, cudaStream_t stream) {
  require_shape(s, start);
  const int32_t n = s.tokens, dh = s.head_dim, group = s.n_heads / s.n_kv_heads;
  constexpr int32_t kAlign = kGemmAttentionPositionAlign;
  const int32_t padded = (start + n + kAlign - 1) / kAlign * kAlign;  // Lp
  TWELL_REQUIRE(s.cache_stride % kAlign == 0 && padded <= s.cache_stride,
                "prefill attention (GEMM path): the cache stride {} must be a multiple of {} holding {} positions",
                s.cache_stride, kAlign, padded);
  const int64_t per_sequence = int64_t{s.n_heads} * n * padded;
  const int32_t chunk = static_cast<int32_t>(
      std::clamp<int64_t>(kScoresBudgetBytes / (per_sequence * int64_t{sizeof(float)}), 1, s.batch));
  if (scores_.size() < static_cast<size_t>(chunk * per_sequence) ||
      heads_.size() < static_cast<size_t>(int64_t{chunk} * s.n_heads * n * dh)) {
    TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));  // earlier steps may still read the old buffers
    scores_.resize(chunk * per_sequence);
    probs_.resize(chunk * per_sequence);
    heads_.resize(int64_t{chunk} * s.n_heads * n * dh);
  }
  const int64_t kv_stride = int64_t{s.cache_stride} * dh;  // one (sequence, kv head) of the cache
  const int64_t group_rows = int64_t{group} * n;           // one kv head's query rows (head-major q)
  const int64_t q_width = int64_t{s.n_heads} * dh;
  for (int32_t first = 0; first < s.batch; first += chunk) {
    const int32_t count = std::min(chunk, s.batch - first);
    const GemmBatch per_kv_head{count * s.n_kv_heads, group_rows * dh, kv_stride, group_rows * padded};
    const bf16* q_chunk = q + int64_t{first} * s.n_heads * n * dh;
    const int64_t cache_offset = int64_t{first} * s.n_kv_heads * kv_stride;
    // scores [group·n, Lp] = q [group·n, Dh] · K^T, per (sequence, kv head)
    gemm.run(group_rows, padded, dh, {q_chunk, dh, false}, {keys + cache_offset, dh, true}, scores_.data(), padded,
             GemmOutput::f32, 0.0f, stream, GemmEpilogue::none, per_kv_head);
    model_kernels::causal_softmax(scores_.data(), int64_t{count} * s.n_heads * n, n, start, padded, scale,
                                  probs_.data(), stream);
    // heads [group·n, Dh] = P [group·n, Lp] · V [Lp, Dh]
    const GemmBatch pv{count * s.n_kv_heads, group_rows * padded, kv_stride, group_rows * dh};
    gemm.run(group_rows, dh, padded, {probs_.data(), padded, false}, {values + cache_offset, dh, false}, heads_.data(),
             dh, GemmOutput::bf16, 0.0f, stream, GemmEpilogue::none, pv);
    const AttentionShape chunk_shape{count, n, s.n_heads, s.n_kv_heads, dh, s.cache_stride};
    model_kernels::heads_to_tokens(heads_.data(), chunk_shape, out + int64_t{first} * n * q_width, stream);
  }
}

}  // namespace twell::cuda
