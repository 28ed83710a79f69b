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
#include <cstdlib>

#include <cooperative_groups.h>

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
  // Row-block form only: h of every listed non-zero, stored at its slot index (spill value (s, c) at
  // spill_h_base + s·T + c), and the rows this kernel finished itself (a tile lost to the spill).
  float* h_store;
  uint8_t* row_done;
  int64_t spill_h_base;
  // Listed rows only (the row-block form's rows with a lost tile): row_list[0 .. *row_count).
  const int32_t* row_list;
  const int32_t* row_count;
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

// Writes the tile's entries [first, end) (in column order) at list positions at + first, ...; with
// list_index, where each one's h is stored (row-block form: never a lost tile).
__device__ void list_tile_entries(const FfnFromTwellParams& p, int64_t row, int32_t tile, int at, int first, int end,
                                  uint32_t* list_column, float* list_value, int64_t* list_index) {
  const int64_t tile_entry = row * p.n_tiles + tile;
  const int32_t nnz = p.tile_nnz[tile_entry];
  if (nnz > 0) {
    const TwellSlot* tile_slots = p.slots + tile_entry * p.slots_per_tile;
    for (int k = first; k < end; ++k) {
      const TwellSlot slot = tile_slots[k];
      list_column[at + k] = twell_slot_column(slot);
      list_value[at + k] = twell_slot_value(slot);
      if (list_index) list_index[at + k] = tile_entry * p.slots_per_tile + k;
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
      if (list_index) list_index[at + k] = p.spill_h_base + spill_row * p.tile + c;
    }
    ++k;
  }
}

// kAccumulate is a template parameter, not a flag, and y's earlier value is read at the end: at the
// 64-register limit of 1024 threads, held through the loop, it spilled.
// kStoreH (the row-block form's first kernel): a row stores each non-zero's h and stops there; the
// down product is down_by_row_blocks_kernel's. A row with a tile lost to the spill is finished here
// as in the plain form (its gates need x and whole weight rows) and marked done for the down kernel.
template <bool kGated, bool kAccumulate, bool kStoreH>
__global__ void __launch_bounds__(kMaxThreads, 1) ffn_from_twell_kernel(FfnFromTwellParams p) {
  extern __shared__ uint4 x_shared[];  // [D/8] x[m]
  __shared__ uint32_t list_column[kListCapacity];
  __shared__ float list_value[kListCapacity];  // g, then h
  __shared__ int64_t list_index[kStoreH ? kListCapacity : 1];
  __shared__ int warp_sums[32];
  const int vectors = p.d_model / 8;
  const int v = threadIdx.x;  // this thread's 16-byte vector of y
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  // Rows: blockIdx.x, or (row_list) the listed rows, a grid-stride loop over them.
  for (int64_t item = blockIdx.x;; item += gridDim.x) {
    int64_t row = item;
    if (p.row_list != nullptr) {
      if (item >= *p.row_count) break;
      row = p.row_list[item];
      __syncthreads();  // the previous row's shared data has been read
    } else if (item != blockIdx.x) {
      break;
    }
    bool store_h = false;
    if constexpr (kStoreH) {
      bool lost = false;
      for (int32_t t = threadIdx.x; t < p.n_tiles; t += blockDim.x) {
        const int32_t nnz = p.tile_nnz[row * p.n_tiles + t];
        lost |= twell_tile_spilled(nnz) && twell_spill_row(nnz) >= p.spill_capacity;
      }
      store_h = !__syncthreads_or(lost);
      if (threadIdx.x == 0) p.row_done[row] = store_h ? 0 : 1;
    }
    for (int i = threadIdx.x; i < vectors; i += blockDim.x)
      x_shared[i] = load_vector(p.x + row * p.d_model + 8 * i);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};

    for (int32_t first_tile = 0; first_tile < p.n_tiles; first_tile += blockDim.x) {
      // ---- 1. this thread's tile: how many entries it lists, and where ----
      const int32_t tile = first_tile + threadIdx.x;
      const int count = tile < p.n_tiles ? tile_entry_count(p, row, tile) : 0;
      int total = 0;
      const int offset = block_exclusive_scan(count, &total, warp_sums);

      for (int base = 0; base < total; base += kListCapacity) {
        __syncthreads();  // the previous pass has read the list
        if (count > 0) list_tile_entries(p, row, tile, offset - base, max(base - offset, 0),
                                         min(count, base + kListCapacity - offset), list_column, list_value,
                                         store_h ? list_index : nullptr);
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
        if (store_h) {
          for (int e = threadIdx.x; e < listed; e += blockDim.x) p.h_store[list_index[e]] = list_value[e];
          continue;
        }

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

    if (v < vectors && !store_h) {
      if (kAccumulate) {  // y's earlier value read only now: no registers held for it through the loop
        const uint4 start = *reinterpret_cast<const uint4*>(p.y + row * p.d_model + 8 * v);
        const uint32_t words[4] = {start.x, start.y, start.z, start.w};
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] += bf16_low(words[i]);
          acc[2 * i + 1] += bf16_high(words[i]);
        }
      }
      uint4 packed;
      packed.x = float_to_bf16_bits(acc[0]) | static_cast<uint32_t>(float_to_bf16_bits(acc[1])) << 16;
      packed.y = float_to_bf16_bits(acc[2]) | static_cast<uint32_t>(float_to_bf16_bits(acc[3])) << 16;
      packed.z = float_to_bf16_bits(acc[4]) | static_cast<uint32_t>(float_to_bf16_bits(acc[5])) << 16;
      packed.w = float_to_bf16_bits(acc[6]) | static_cast<uint32_t>(float_to_bf16_bits(acc[7])) << 16;
      *reinterpret_cast<uint4*>(p.y + row * p.d_model + 8 * v) = packed;
    }
  }
}

// ---- shared by the row-block kernels ----
// Where a lane's (row, tile) puts its entries: the warp's inclusive scan of the lanes' counts.
__device__ __forceinline__ int warp_inclusive_scan(int value) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int below = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += below;
  }
  return value;
}

// take(e, column, g, h_index) for the entries [first, end) of one (row, tile) whose first entry is
// number `exclusive` of the warp: its stored slots, or (spilled, not lost) its spill row's non-zeros
// in column order. h_index: where the entry's h is kept (slot index; spill values after spill_h_base).
template <typename Take>
__device__ void for_tile_entries(const TwellSlot* slots, const uint16_t* spill, int64_t tile_entry, int32_t nnz,
                                 int32_t tile, int32_t tile_width, int32_t slots_per_tile, int64_t spill_h_base,
                                 int exclusive, int first, int end, Take&& take) {
  if (nnz > 0) {
    const int64_t slot0 = tile_entry * slots_per_tile;
    for (int e = first; e < end; ++e) {
      const int64_t slot = slot0 + (e - exclusive);
      const TwellSlot value = slots[slot];
      take(e, twell_slot_column(value), twell_slot_value(value), slot);
    }
    return;
  }
  const int64_t spill_row = twell_spill_row(nnz);
  const uint16_t* segment = spill + spill_row * tile_width;
  int e = exclusive;
  for (int c = 0; c < tile_width && e < end; ++c) {
    if ((segment[c] & 0x7fffu) == 0) continue;
    if (e >= first)
      take(e, static_cast<uint32_t>(tile * tile_width + c), bf16_to_float(segment[c]),
           spill_h_base + spill_row * tile_width + c);
    ++e;
  }
}

// ---- Row-block form: the up product by blocks of rows ----
// u = x[m]·Wu[j] for every non-zero of a block of rows, by a cluster of CTAs that each own one slice of
// D: a CTA holds its slice of the block's x rows in shared memory, so a slice of Wu[j] read once from
// the L2 serves every row of the block that has j (through the L1, the rows walking the tiles in step
// as in the down kernel). Each CTA writes its partial dots into its warps' lists; after a cluster
// barrier CTA k sums entries e = k (mod slices) over the cluster's CTAs in rank order (the same bits
// on every call) and stores h = g·u. A row with a tile lost to the spill is left to the row kernel
// (row_list mode): marked done, listed in lost_rows.
constexpr int kUpWarps = 16;
constexpr int kUpWarpList = 128;
constexpr int kUpSliceVectors = 32;  // 16-byte vectors of x per row and part (256 columns)

struct UpByRowBlocksParams {
  const uint16_t* x;         // [M, D]
  const uint16_t* up;        // [H, D] (gated)
  const TwellSlot* slots;
  const int32_t* tile_nnz;
  const uint16_t* spill;
  int64_t spill_capacity;
  float* h_store;
  uint8_t* row_done;
  int32_t* lost_rows;
  int32_t* lost_count;       // zeroed before the launch
  int64_t rows;
  int64_t spill_h_base;
  int32_t d_model;
  int32_t tile;
  int32_t n_tiles;
  int32_t slots_per_tile;
  int32_t parts;             // 256-column parts of a CTA's slice of D
  int32_t rows_per_warp;     // 8 / parts
  bool gated;
};

__global__ void __launch_bounds__(kUpWarps * 32) up_by_row_blocks_kernel(UpByRowBlocksParams p) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), slices = static_cast<int>(cluster.num_blocks());
  extern __shared__ uint4 x_slice[];  // [block rows][parts · 32]
  __shared__ uint32_t list_column[kUpWarps][kUpWarpList];  // column | row in the warp << 16
  __shared__ float list_g[kUpWarps][kUpWarpList];
  __shared__ float list_partial[kUpWarps][kUpWarpList];
  __shared__ int64_t list_index[kUpWarps][kUpWarpList];
  __shared__ int window_passes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_per_warp = p.rows_per_warp, window_tiles = 32 / rows_per_warp;
  const int block_rows = kUpWarps * rows_per_warp;
  const int row_vectors = kUpSliceVectors * p.parts;
  const int64_t block_first_row = static_cast<int64_t>(blockIdx.x) * block_rows;
  const int64_t first_row = block_first_row + warp * rows_per_warp;
  const int64_t column0 = static_cast<int64_t>(rank) * row_vectors * 8;  // first column of the slice

  for (int i = threadIdx.x; i < block_rows * row_vectors; i += blockDim.x) {
    const int64_t row = block_first_row + i / row_vectors, column = column0 + 8 * (i % row_vectors);
    x_slice[i] = row < p.rows && column < p.d_model ? load_vector(p.x + row * p.d_model + column) : uint4{0, 0, 0, 0};
  }
  __syncthreads();

  const int lane_row = lane / window_tiles, lane_tile = lane % window_tiles;
  const int64_t row = first_row + lane_row;
  bool row_lost = false;
  uint32_t* my_columns = list_column[warp];
  float* my_g = list_g[warp];
  float* my_partial = list_partial[warp];
  int64_t* my_index = list_index[warp];
  for (int32_t first_tile = 0; first_tile < p.n_tiles; first_tile += window_tiles) {
    const int32_t tile = first_tile + lane_tile;
    const int64_t tile_entry = row * p.n_tiles + tile;
    int32_t nnz = 0;
    int count = 0;
    if (row < p.rows && tile < p.n_tiles) {
      nnz = p.tile_nnz[tile_entry];
      if (nnz >= 0) {
        count = nnz;
      } else if (twell_spill_row(nnz) < p.spill_capacity) {
        count = spill_nonzeros(p.spill + static_cast<int64_t>(twell_spill_row(nnz)) * p.tile, p.tile);
      } else {
        row_lost = true;  // the row kernel does the whole row; its entries here are harmless
      }
    }
    const int inclusive = warp_inclusive_scan(count);
    const int exclusive = inclusive - count;
    const int total = __shfl_sync(0xffffffffu, inclusive, 31);
    // Every CTA of the cluster takes part in each pass's barriers: the block's passes are its
    // fullest warp's.
    if (threadIdx.x == 0) window_passes = 0;
    __syncthreads();
    if (lane == 0) atomicMax(&window_passes, (total + kUpWarpList - 1) / kUpWarpList);
    __syncthreads();
    const int passes = window_passes;

    for (int pass = 0; pass < passes; ++pass) {
      const int base = pass * kUpWarpList;
      const int first = max(exclusive, base), end = min(inclusive, base + kUpWarpList);
      if (first < end) {
        const uint32_t row_bits = static_cast<uint32_t>(lane_row) << 16;
        for_tile_entries(p.slots, p.spill, tile_entry, nnz, tile, p.tile, p.slots_per_tile, p.spill_h_base, exclusive,
                         first, end, [&](int e, uint32_t column, float g, int64_t h_index) {
                           my_columns[e - base] = column | row_bits;
                           my_g[e - base] = g;
                           my_index[e - base] = h_index;
                         });
      }
      __syncwarp();
      const int listed = max(min(total - base, kUpWarpList), 0);
      if (p.gated) {
        // Partial dots over this CTA's slice, four entries with their loads in flight together.
        for (int e0 = 0; e0 < listed; e0 += 4) {
          float dot[4] = {0.f, 0.f, 0.f, 0.f};
          for (int part = 0; part < p.parts; ++part) {
            const int vector = part * kUpSliceVectors + lane;
            const int64_t column = column0 + 8 * vector;
            if (column >= p.d_model) break;
            uint4 w[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const int e = min(e0 + k, listed - 1);
              w[k] = load_vector(p.up + static_cast<int64_t>(my_columns[e] & 0xffffu) * p.d_model + column);
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const int e = min(e0 + k, listed - 1);
              const int block_row = warp * rows_per_warp + static_cast<int>(my_columns[e] >> 16);
              dot[k] += dot8(x_slice[block_row * row_vectors + vector], w[k]);
            }
          }
          const float sum = warp_sum4(dot);
          const int e = e0 + ((lane >> 3) & 3);
          if ((lane & 7) == 0 && e < listed) my_partial[e] = sum;
        }
      }
      cluster.sync();  // every CTA's partials are in its lists
      for (int e = lane; e < listed; e += 32) {
        if (e % slices != rank) continue;
        float u = 0.f;
        for (int k = 0; k < slices; ++k) u += cluster.map_shared_rank(my_partial, k)[e];
        p.h_store[my_index[e]] = p.gated ? my_g[e] * u : my_g[e];
      }
      cluster.sync();  // the lists are read before the next pass rewrites them
    }
  }

  if (rank == 0) {
    const uint32_t lost_lanes = __ballot_sync(0xffffffffu, row_lost);
    if (lane < rows_per_warp && first_row + lane < p.rows) {
      const uint32_t row_lanes = ((window_tiles == 32 ? 0u : (1u << window_tiles)) - 1u) << (lane * window_tiles);
      const bool lost = (lost_lanes & row_lanes) != 0;
      p.row_done[first_row + lane] = lost ? 1 : 0;
      if (lost) p.lost_rows[atomicAdd(p.lost_count, 1)] = static_cast<int32_t>(first_row + lane);
    }
  }
}

// ---- Row-block form: the down product by blocks of rows ----
// y[m] = Σ_j h[m,j]·Wd[j] over blocks of kBlockRows rows and kSliceColumns columns of y: a block's rows
// share many of their active neurons (the union of 128 rows' non-zeros at 0.5% is about half their
// count), so a block reads each needed slice of Wd from the L2 about once and its rows find it in the
// L1. The rows walk the tiles in step (a barrier per window of kWindowTiles tiles), so the window's
// weight slices are what the L1 holds. Warp w owns kRowsPerWarp rows and lane l four columns of
// each, fp32 accumulators in registers; a lane reads one (row, tile) of the window, a warp scan lays
// the window's entries out row by row in the warp's shared list, and a round takes each row's next
// entry, all of the rows' weight loads in flight before their fused multiply-adds.
constexpr int kBlockWarps = 16;
constexpr int kRowsPerWarp = 8;
constexpr int kBlockRows = kBlockWarps * kRowsPerWarp;
constexpr int kWindowTiles = 32 / kRowsPerWarp;  // one (row, tile) of the window per lane
constexpr int kSliceColumns = 128;               // 4 columns of y per lane
constexpr int kWarpList = 128;                   // entries a warp lists per pass

struct DownByRowBlocksParams {
  const uint16_t* down;       // [H, D]
  const TwellSlot* slots;     // [M, n_tiles, S]
  const int32_t* tile_nnz;    // [M, n_tiles]
  const uint16_t* spill;      // [spill_capacity, T]
  const float* h_store;       // as FfnFromTwellParams::h_store
  const uint8_t* row_done;    // [M]
  uint16_t* y;                // [M, D] bf16
  int64_t rows;
  int64_t spill_h_base;
  int32_t d_model;
  int32_t tile;
  int32_t n_tiles;
  int32_t slots_per_tile;
};

template <bool kAccumulate>
__global__ void __launch_bounds__(kBlockWarps * 32) down_by_row_blocks_kernel(DownByRowBlocksParams p) {
  __shared__ uint32_t list_column[kBlockWarps][kWarpList];
  __shared__ float list_h[kBlockWarps][kWarpList];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kBlockRows + warp * kRowsPerWarp;
  const int column = blockIdx.y * kSliceColumns + 4 * lane;  // this lane's four columns of y
  const bool lane_columns = column < p.d_model;
  uint32_t* my_columns = list_column[warp];
  float* my_h = list_h[warp];

  // This lane's (row, tile) of each window.
  const int lane_row = lane / kWindowTiles, lane_tile = lane % kWindowTiles;
  const int64_t row = first_row + lane_row;
  const bool row_live = row < p.rows && p.row_done[row] == 0;

  float acc[kRowsPerWarp][4] = {};
  for (int32_t first_tile = 0; first_tile < p.n_tiles; first_tile += kWindowTiles) {
    const int32_t tile = first_tile + lane_tile;
    const int64_t tile_entry = row * p.n_tiles + tile;
    int32_t nnz = 0;
    int count = 0;
    if (row_live && tile < p.n_tiles) {
      nnz = p.tile_nnz[tile_entry];
      count = nnz >= 0 ? nnz : spill_nonzeros(p.spill + static_cast<int64_t>(twell_spill_row(nnz)) * p.tile, p.tile);
    }
    const int inclusive = warp_inclusive_scan(count);
    const int exclusive = inclusive - count;
    const int total = __shfl_sync(0xffffffffu, inclusive, 31);
    int row_begin[kRowsPerWarp], row_end[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      row_begin[i] = __shfl_sync(0xffffffffu, exclusive, i * kWindowTiles);
      row_end[i] = __shfl_sync(0xffffffffu, inclusive, i * kWindowTiles + kWindowTiles - 1);
    }

    for (int base = 0; base < total; base += kWarpList) {
      // ---- this lane's entries of the pass into the warp's list ----
      const int first = max(exclusive, base), end = min(inclusive, base + kWarpList);
      if (first < end) {
        for_tile_entries(p.slots, p.spill, tile_entry, nnz, tile, p.tile, p.slots_per_tile, p.spill_h_base, exclusive,
                         first, end, [&](int e, uint32_t column, float, int64_t h_index) {
                           my_columns[e - base] = column;
                           my_h[e - base] = p.h_store[h_index];
                         });
      }
      __syncwarp();

      // ---- rounds: each row's next entry, every row's load issued before the multiply-adds ----
      int start[kRowsPerWarp], length[kRowsPerWarp];
      int rounds = 0;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        start[i] = max(row_begin[i], base) - base;
        length[i] = max(min(row_end[i], base + kWarpList) - base - start[i], 0);
        rounds = max(rounds, length[i]);
      }
      for (int k = 0; k < rounds; ++k) {
        uint2 w[kRowsPerWarp];
        float h[kRowsPerWarp];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          if (k < length[i] && lane_columns) {
            const int e = start[i] + k;
            h[i] = my_h[e];
            w[i] = __ldg(reinterpret_cast<const uint2*>(p.down + static_cast<int64_t>(my_columns[e]) * p.d_model + column));
          }
        }
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          if (k < length[i] && lane_columns) {
            acc[i][0] = fmaf(h[i], bf16_low(w[i].x), acc[i][0]);
            acc[i][1] = fmaf(h[i], bf16_high(w[i].x), acc[i][1]);
            acc[i][2] = fmaf(h[i], bf16_low(w[i].y), acc[i][2]);
            acc[i][3] = fmaf(h[i], bf16_high(w[i].y), acc[i][3]);
          }
        }
      }
      __syncwarp();  // the list is rewritten by the next pass
    }
    __syncthreads();  // the block's rows stay in one window
  }

  if (!lane_columns) return;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t out_row = first_row + i;
    if (out_row >= p.rows || p.row_done[out_row] != 0) continue;
    uint2* out = reinterpret_cast<uint2*>(p.y + out_row * p.d_model + column);
    if (kAccumulate) {
      const uint2 start_value = *out;
      acc[i][0] += bf16_low(start_value.x);
      acc[i][1] += bf16_high(start_value.x);
      acc[i][2] += bf16_low(start_value.y);
      acc[i][3] += bf16_high(start_value.y);
    }
    uint2 packed;
    packed.x = float_to_bf16_bits(acc[i][0]) | static_cast<uint32_t>(float_to_bf16_bits(acc[i][1])) << 16;
    packed.y = float_to_bf16_bits(acc[i][2]) | static_cast<uint32_t>(float_to_bf16_bits(acc[i][3])) << 16;
    *out = packed;
  }
}

using RowKernel = void (*)(FfnFromTwellParams);
RowKernel row_kernel(bool gated, bool accumulate, bool store_h) {
  if (store_h)
    return gated ? (accumulate ? ffn_from_twell_kernel<true, true, true> : ffn_from_twell_kernel<true, false, true>)
                 : (accumulate ? ffn_from_twell_kernel<false, true, true> : ffn_from_twell_kernel<false, false, true>);
  return gated ? (accumulate ? ffn_from_twell_kernel<true, true, false> : ffn_from_twell_kernel<true, false, false>)
               : (accumulate ? ffn_from_twell_kernel<false, true, false> : ffn_from_twell_kernel<false, false, false>);
}

}  // namespace

void ffn_from_twell(const bf16* x, const DeviceTwell& gate, const DeviceFfnView& weights, bf16* y,
                    cudaStream_t stream, bool accumulate, UpDownScratch* row_blocks) {
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
  if (row_blocks == nullptr) {
    const auto kernel = row_kernel(weights.gated, accumulate, /*store_h=*/false);
    kernel<<<grid, threads, x_bytes, stream>>>(params);
    TWELL_CUDA_CHECK_LAUNCH();
    return;
  }

  const int64_t slot_count = gate.shape.slot_count();
  const int64_t h_count = slot_count + gate.spill_capacity * gate.shape.tile;
  if (row_blocks->h_capacity < h_count) {
    row_blocks->h = make_device_array<float>(static_cast<size_t>(h_count));
    row_blocks->h_capacity = h_count;
  }
  if (row_blocks->row_capacity < gate.shape.rows) {
    row_blocks->row_done = make_device_array<uint8_t>(static_cast<size_t>(gate.shape.rows));
    row_blocks->lost_rows = make_device_array<int32_t>(static_cast<size_t>(gate.shape.rows) + 1);
    row_blocks->row_capacity = gate.shape.rows;
  }
  params.h_store = row_blocks->h.get();
  params.row_done = row_blocks->row_done.get();
  params.spill_h_base = slot_count;
  static const bool up_by_blocks = std::getenv("TWELL_UP_BY_ROW_BLOCKS") != nullptr;  // experiment
  if (!up_by_blocks) {
    const auto up_kernel = row_kernel(weights.gated, accumulate, /*store_h=*/true);
    up_kernel<<<grid, threads, x_bytes, stream>>>(params);
    TWELL_CUDA_CHECK_LAUNCH();
  } else {
    int32_t* lost_count = row_blocks->lost_rows.get() + gate.shape.rows;
    TWELL_CUDA_CHECK(cudaMemsetAsync(lost_count, 0, sizeof(int32_t), stream));
    UpByRowBlocksParams up{};
    up.x = params.x;
    up.up = params.up;
    up.slots = params.slots;
    up.tile_nnz = params.tile_nnz;
    up.spill = params.spill;
    up.spill_capacity = params.spill_capacity;
    up.h_store = params.h_store;
    up.row_done = params.row_done;
    up.lost_rows = row_blocks->lost_rows.get();
    up.lost_count = lost_count;
    up.rows = gate.shape.rows;
    up.spill_h_base = slot_count;
    up.d_model = weights.d_model;
    up.tile = gate.shape.tile;
    up.n_tiles = params.n_tiles;
    up.slots_per_tile = params.slots_per_tile;
    up.parts = (weights.d_model + 2047) / 2048;
    up.rows_per_warp = 8 / up.parts;
    up.gated = weights.gated;
    const int block_rows = kUpWarps * up.rows_per_warp;
    const int slices = (weights.d_model + 256 * up.parts - 1) / (256 * up.parts);
    const size_t x_slice_bytes = static_cast<size_t>(block_rows) * kUpSliceVectors * up.parts * sizeof(uint4);
    static const bool attributes_set = [] {
      TWELL_CUDA_CHECK(cudaFuncSetAttribute(up_by_row_blocks_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            64 * 1024));
      return true;
    }();
    (void)attributes_set;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>((gate.shape.rows + block_rows - 1) / block_rows),
                          static_cast<unsigned>(slices));
    config.blockDim = dim3(kUpWarps * 32);
    config.dynamicSmemBytes = x_slice_bytes;
    config.stream = stream;
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 1;
    cluster.val.clusterDim.y = static_cast<unsigned>(slices);
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    TWELL_CUDA_CHECK(cudaLaunchKernelEx(&config, up_by_row_blocks_kernel, up));
    // The rows with a lost tile, whole, by the row kernel.
    FfnFromTwellParams lost = params;
    lost.row_list = row_blocks->lost_rows.get();
    lost.row_count = lost_count;
    const auto lost_kernel = row_kernel(weights.gated, accumulate, /*store_h=*/false);
    const unsigned lost_blocks =
        static_cast<unsigned>(std::min<int64_t>(gate.shape.rows, int64_t{2} * device_facts().sm_count));
    lost_kernel<<<lost_blocks, threads, x_bytes, stream>>>(lost);
    TWELL_CUDA_CHECK_LAUNCH();
  }

  DownByRowBlocksParams down{};
  down.down = params.down;
  down.slots = params.slots;
  down.tile_nnz = params.tile_nnz;
  down.spill = params.spill;
  down.h_store = params.h_store;
  down.row_done = params.row_done;
  down.y = params.y;
  down.rows = gate.shape.rows;
  down.spill_h_base = slot_count;
  down.d_model = weights.d_model;
  down.tile = gate.shape.tile;
  down.n_tiles = params.n_tiles;
  down.slots_per_tile = params.slots_per_tile;
  const dim3 down_grid(static_cast<unsigned>((gate.shape.rows + kBlockRows - 1) / kBlockRows),
                       static_cast<unsigned>((weights.d_model + kSliceColumns - 1) / kSliceColumns));
  const auto down_kernel = accumulate ? down_by_row_blocks_kernel<true> : down_by_row_blocks_kernel<false>;
  down_kernel<<<down_grid, kBlockWarps * 32, 0, stream>>>(down);
  TWELL_CUDA_CHECK_LAUNCH();
}

}  // namespace twell::cuda
