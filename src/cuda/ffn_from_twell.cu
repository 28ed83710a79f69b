// Up+down FFN from the packed gate (TwELL):
//   gated:     y[m] = Σ_j g[m,j] · (x[m]·Wu[j]) · Wd[j]     non-gated: y[m] = Σ_j g[m,j] · Wd[j]
// over the non-zeros j of row m (added to y's own value when accumulating); fp32 accumulation; y
// written once as bf16.
//
// One fused kernel, one block per row, in the shape of the training row kernels (train_sparse.cu),
// which stream weight rows out of L2 at ~9 TB/s: thread v owns the 16-byte vector v of y (8 columns),
// so blockDim = D/8 rounded up to whole warps (at least 4 warps).
//   1. gather: thread i reads the count of tile i (a window of blockDim tiles at a time); a block
//      scan gives each tile's place in a shared list of (column, g), which the threads fill in column
//      order. Up to kListCapacity entries per pass; a longer window (dense rows) takes more passes.
//   2. up (gated): warp w computes u = x[m]·Wu[j] for entries w, w + warps, ..., two at a time, x[m]
//      from shared memory; h = g·u replaces g in the list. h never leaves the chip.
//   3. down: every thread adds h·Wd[j][its 8 columns] for each entry, kDownUnroll rows in flight.
// Overflowed tiles: a spill row in use is scanned for its non-zeros; a tile lost to a too-small spill
// (spill row >= capacity) lists all its columns marked kGateLost, and step 2 recomputes their gates
// from x and the relu projection (relu(x·W[j]) in fp32, rounded to bf16, as the packer stores it).
// The list order is fixed by the tile order, so y is the same bits on every call.
#include <algorithm>
#include <cstdint>

#include "cuda/cuda_utils.h"
#include "cuda/warp_math.cuh"
#include "twell/cuda.h"

namespace twell::cuda {
namespace {

constexpr int kMaxThreads = 1024;       // D <= 8192: one 16-byte vector of y per thread
constexpr int kMinThreads = 128;        // small D still gets four warps for the up dots
constexpr int kListCapacity = 512;      // (column, g/h) entries staged per pass
constexpr int kDownUnroll = 4;          // Wd rows in flight per thread
constexpr int kUpUnroll = 2;            // 16-byte vectors per Wu row in flight per lane (two rows at once)
constexpr uint32_t kGateLost = 1u << 31;  // list column flag: gate to be recomputed from x

struct FfnFromTwellParams {
  const uint16_t* x;               // [M, D] bf16
  const uint16_t* relu_weight;     // [H, D] gate (gated) or up (non-gated): recomputes lost tiles
  const uint16_t* up;              // [H, D] (gated only)
  const uint16_t* down;            // [H, D]
  const TwellSlot* slots;          // [M, n_tiles, S]
  const int32_t* tile_nnz;         // [M, n_tiles]
  const uint16_t* spill;           // [spill_capacity, T]
  int64_t spill_capacity;
  uint16_t* y;                     // [M, D] bf16
  int32_t d_model;
  int32_t cols;
  int32_t tile;
  int32_t n_tiles;
  int32_t slots_per_tile;
};

__device__ __forceinline__ uint4 load_vector(const uint16_t* pointer) {
  return __ldg(reinterpret_cast<const uint4*>(pointer));
}

// Exclusive prefix sum over the block; *total gets the block's sum. warp_sums: [32] shared.
__device__ int block_exclusive_scan(int value, int* total, int* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int below = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += below;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int sum = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int below = __shfl_up_sync(0xffffffffu, sum, offset);
      if (lane >= offset) sum += below;
    }
    warp_sums[lane] = sum;
  }
  __syncthreads();
  const int exclusive = (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - value;
  *total = warp_sums[warps - 1];
  __syncthreads();  // warp_sums is rewritten by the next call
  return exclusive;
}

// x[m]·W[column] on every lane of the warp, x[m] from shared memory.  x_row: [D/8] shared
__device__ __forceinline__ float warp_dot(const uint4* x_row, const uint16_t* weight, uint32_t column, int vectors) {
  const uint4* w = reinterpret_cast<const uint4*>(weight + static_cast<int64_t>(column) * (vectors * 8));
  float partial = 0.f;
#pragma unroll kUpUnroll
  for (int v = threadIdx.x % 32; v < vectors; v += 32) partial += dot8(x_row[v], __ldg(w + v));
  return warp_sum(partial);
}
// Two dot products with both rows' loads in flight together.
__device__ __forceinline__ void warp_dot2(const uint4* x_row, const uint16_t* weight, uint32_t column0, uint32_t column1,
                                          int vectors, float& dot0, float& dot1) {
  const uint4* w0 = reinterpret_cast<const uint4*>(weight + static_cast<int64_t>(column0) * (vectors * 8));
  const uint4* w1 = reinterpret_cast<const uint4*>(weight + static_cast<int64_t>(column1) * (vectors * 8));
  float partial0 = 0.f, partial1 = 0.f;
#pragma unroll kUpUnroll
  for (int v = threadIdx.x % 32; v < vectors; v += 32) {
    const uint4 xv = x_row[v];
    partial0 += dot8(xv, __ldg(w0 + v));
    partial1 += dot8(xv, __ldg(w1 + v));
  }
  dot0 = warp_sum(partial0);
  dot1 = warp_sum(partial1);
}

// Non-zeros of one tile's spill row (columns past H are 0 by the format).
__device__ int spill_nonzeros(const uint16_t* segment, int tile) {
  int count = 0;
  for (int k = 0; k < tile; k += 8) {
    const uint4 values = load_vector(segment + k);
    const uint32_t words[4] = {values.x, values.y, values.z, values.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) count += ((words[i] & 0x7fffu) != 0) + ((words[i] & 0x7fff0000u) != 0);
  }
  return count;
}

// Entries tile `tile` of `row` puts in the list: its stored non-zeros, the non-zeros of its spill
// row, or (lost to a too-small spill) all its columns.
__device__ int tile_entry_count(const FfnFromTwellParams& p, int64_t row, int32_t tile) {
  const int32_t nnz = p.tile_nnz[row * p.n_tiles + tile];
  if (nnz >= 0) return nnz;
  const int64_t spill_row = twell_spill_row(nnz);
  if (spill_row < p.spill_capacity) return spill_nonzeros(p.spill + spill_row * p.tile, p.tile);
  return min(p.tile, p.cols - tile * p.tile);
}

// Writes the tile's entries [first, end) (in column order) at list positions at + first, ...
__device__ void list_tile_entries(const FfnFromTwellParams& p, int64_t row, int32_t tile, int at, int first, int end,
                                  uint32_t* list_column, float* list_value) {
  const int64_t tile_entry = row * p.n_tiles + tile;
  const int32_t nnz = p.tile_nnz[tile_entry];
  if (nnz > 0) {
    const TwellSlot* tile_slots = p.slots + tile_entry * p.slots_per_tile;
    for (int k = first; k < end; ++k) {
      const TwellSlot slot = tile_slots[k];
      list_column[at + k] = twell_slot_column(slot);
      list_value[at + k] = twell_slot_value(slot);
    }
    return;
  }
  const int64_t spill_row = twell_spill_row(nnz);
  if (spill_row >= p.spill_capacity) {
    for (int k = first; k < end; ++k) {
      list_column[at + k] = static_cast<uint32_t>(tile * p.tile + k) | kGateLost;
      list_value[at + k] = 0.f;
    }
    return;
  }
  const uint16_t* segment = p.spill + spill_row * p.tile;
  const int tile_columns = min(p.tile, p.cols - tile * p.tile);
  int k = 0;  // non-zeros seen so far
  for (int c = 0; c < tile_columns && k < end; ++c) {
    const float gate = bf16_to_float(segment[c]);
    if (gate == 0.f) continue;
    if (k >= first) {
      list_column[at + k] = static_cast<uint32_t>(tile * p.tile + c);
      list_value[at + k] = gate;
    }
    ++k;
  }
}

// kAccumulate is a template parameter, not a flag: the plain kernel then keeps y's earlier values out
// of its registers (with them, at the 64-register limit of 1024 threads, it spilled).
template <bool kGated, bool kAccumulate>
__global__ void __launch_bounds__(kMaxThreads, 1) ffn_from_twell_kernel(FfnFromTwellParams p) {
  extern __shared__ uint4 x_shared[];  // [D/8] x[m]
  __shared__ uint32_t list_column[kListCapacity];
  __shared__ float list_value[kListCapacity];  // g, then h
  __shared__ int warp_sums[32];
  const int64_t row = blockIdx.x;
  const int vectors = p.d_model / 8;
  const int v = threadIdx.x;  // this thread's 16-byte vector of y
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x)
    x_shared[i] = load_vector(p.x + row * p.d_model + 8 * i);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (kAccumulate && v < vectors) {
    const uint4 start = *reinterpret_cast<const uint4*>(p.y + row * p.d_model + 8 * v);
    const uint32_t words[4] = {start.x, start.y, start.z, start.w};
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] = bf16_low(words[i]);
      acc[2 * i + 1] = bf16_high(words[i]);
    }
  }

  for (int32_t first_tile = 0; first_tile < p.n_tiles; first_tile += blockDim.x) {
    // ---- 1. this thread's tile: how many entries it lists, and where ----
    const int32_t tile = first_tile + threadIdx.x;
    const int count = tile < p.n_tiles ? tile_entry_count(p, row, tile) : 0;
    int total = 0;
    const int offset = block_exclusive_scan(count, &total, warp_sums);

    for (int base = 0; base < total; base += kListCapacity) {
      __syncthreads();  // the previous pass has read the list
      if (count > 0) list_tile_entries(p, row, tile, offset - base, max(base - offset, 0),
                                       min(count, base + kListCapacity - offset), list_column, list_value);
      __syncthreads();
      const int listed = min(kListCapacity, total - base);

      // ---- 2. h = g·u (gated); lost gates recomputed (both) ----
      for (int e0 = warp; e0 < listed; e0 += 2 * warps) {
        const int e1 = e0 + warps < listed ? e0 + warps : e0;
        const uint32_t c0 = list_column[e0], c1 = list_column[e1];
        if (((c0 | c1) & kGateLost) == 0) {
          if constexpr (kGated) {
            float u0, u1;
            warp_dot2(x_shared, p.up, c0, c1, vectors, u0, u1);
            if (lane == 0) {
              list_value[e0] *= u0;
              if (e1 != e0) list_value[e1] *= u1;
            }
          }
          continue;
        }
        for (int e = e0; e <= e1; e += max(e1 - e0, 1)) {
          const uint32_t column = list_column[e] & ~kGateLost;
          float h = list_value[e];
          if (list_column[e] & kGateLost) {
            const float gate = round_to_bf16(warp_dot(x_shared, p.relu_weight, column, vectors));
            h = gate > 0.f ? gate : 0.f;
            if (kGated && gate > 0.f) h = gate * warp_dot(x_shared, p.up, column, vectors);
          } else if (kGated) {
            h *= warp_dot(x_shared, p.up, column, vectors);
          }
          __syncwarp();  // every lane has read the entry before lane 0 rewrites it
          if (lane == 0) {
            list_column[e] = column;
            list_value[e] = h;
          }
        }
      }
      __syncthreads();

      // ---- 3. y += h·Wd[j] over the list ----
      if (v < vectors) {
        const uint4* down = reinterpret_cast<const uint4*>(p.down) + v;
#pragma unroll kDownUnroll
        for (int e = 0; e < listed; ++e) {
          const float h = list_value[e];
          const uint4 w = __ldg(down + static_cast<int64_t>(list_column[e]) * vectors);
          acc[0] = fmaf(h, bf16_low(w.x), acc[0]);
          acc[1] = fmaf(h, bf16_high(w.x), acc[1]);
          acc[2] = fmaf(h, bf16_low(w.y), acc[2]);
          acc[3] = fmaf(h, bf16_high(w.y), acc[3]);
          acc[4] = fmaf(h, bf16_low(w.z), acc[4]);
          acc[5] = fmaf(h, bf16_high(w.z), acc[5]);
          acc[6] = fmaf(h, bf16_low(w.w), acc[6]);
          acc[7] = fmaf(h, bf16_high(w.w), acc[7]);
        }
      }
    }
  }

  if (v < vectors) {
    uint4 packed;
    packed.x = float_to_bf16_bits(acc[0]) | static_cast<uint32_t>(float_to_bf16_bits(acc[1])) << 16;
    packed.y = float_to_bf16_bits(acc[2]) | static_cast<uint32_t>(float_to_bf16_bits(acc[3])) << 16;
    packed.z = float_to_bf16_bits(acc[4]) | static_cast<uint32_t>(float_to_bf16_bits(acc[5])) << 16;
    packed.w = float_to_bf16_bits(acc[6]) | static_cast<uint32_t>(float_to_bf16_bits(acc[7])) << 16;
    *reinterpret_cast<uint4*>(p.y + row * p.d_model + 8 * v) = packed;
  }
}

}  // namespace

void ffn_from_twell(const bf16* x, const DeviceTwell& gate, const DeviceFfnView& weights, bf16* y,
                    cudaStream_t stream, bool accumulate) {
  TWELL_REQUIRE(!gate.empty(), "ffn_from_twell: the packed gate is empty");
  TWELL_REQUIRE(gate.shape.cols == weights.d_hidden, "ffn_from_twell: gate has {} columns, weights have H = {}",
                gate.shape.cols, weights.d_hidden);
  TWELL_REQUIRE(weights.d_model % 64 == 0 && weights.d_model <= 8 * kMaxThreads,
                "ffn_from_twell: d_model must be a multiple of 64 and at most {}, got {}", 8 * kMaxThreads,
                weights.d_model);
  TWELL_REQUIRE(gate.shape.rows < (int64_t{1} << 31), "ffn_from_twell: {} rows exceed the grid limit",
                gate.shape.rows);
  if (gate.shape.rows == 0) return;
  FfnFromTwellParams params{};
  params.x = reinterpret_cast<const uint16_t*>(x);
  params.relu_weight = reinterpret_cast<const uint16_t*>(weights.relu_projection());
  params.up = reinterpret_cast<const uint16_t*>(weights.up);
  params.down = reinterpret_cast<const uint16_t*>(weights.down);
  params.slots = gate.slots.get();
  params.tile_nnz = gate.tile_nnz.get();
  params.spill = reinterpret_cast<const uint16_t*>(gate.spill.get());
  params.spill_capacity = gate.spill_capacity;
  params.y = reinterpret_cast<uint16_t*>(y);
  params.d_model = weights.d_model;
  params.cols = gate.shape.cols;
  params.tile = gate.shape.tile;
  params.n_tiles = gate.shape.n_tiles();
  params.slots_per_tile = gate.shape.slots();
  const int vectors = weights.d_model / 8;
  const int threads = std::max(kMinThreads, (vectors + 31) / 32 * 32);
  const size_t x_bytes = static_cast<size_t>(vectors) * sizeof(uint4);
  const dim3 grid(static_cast<unsigned>(gate.shape.rows));
  const auto kernel = weights.gated ? (accumulate ? ffn_from_twell_kernel<true, true> : ffn_from_twell_kernel<true, false>)
                                    : (accumulate ? ffn_from_twell_kernel<false, true> : ffn_from_twell_kernel<false, false>);
  kernel<<<grid, threads, x_bytes, stream>>>(params);
  TWELL_CUDA_CHECK_LAUNCH();
}

}  // namespace twell::cuda
