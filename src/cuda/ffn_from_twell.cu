// Up+down FFN from the packed gate (TwELL):
//   gated:     y[m] = Σ_j g[m,j] · (x[m]·Wu[j]) · Wd[j]     non-gated: y[m] = Σ_j g[m,j] · Wd[j]
// over the non-zeros j of row m; fp32 accumulation; y written once as bf16.
//
// Two kernels, each with few registers so that many warps keep many loads in flight (the work is
// bound by how fast weight rows stream out of L2, not by arithmetic):
//   1. up_at_nonzeros (gated only), one warp per (row, group of tiles): h = g·(x[m]·Wu[j]) for each stored
//      non-zero, kBatch warp dot products at a time (lane l reads 16-byte vectors l, l+32, ... of
//      x[m] and Wu[j]; a butterfly sum gives u_j). h goes to fp32 arrays parallel to the slots and
//      the spill rows (stream-ordered scratch).
//   2. down_from_nonzeros, one warp per (row, 256 columns of y): lane l owns 8 columns. The warp
//      reads 32 tile counts and the first 4 slots (and h) of each of those tiles in one round trip,
//      queues the non-zeros in shared memory and drains them kBatch rows of Wd at a time.
// Each weight row is read once per (row, non-zero) from L2; no reuse across the rows of a block yet.
// A tile lost to a too-small spill (spill row >= capacity) is recomputed in kernel 2 from x and the
// relu projection (relu(x·W[j]) in fp32, rounded to bf16, as the packer stores it), and Wu.
#include <cstdint>

#include "cuda/cuda_utils.h"
#include "cuda/warp_math.cuh"
#include "twell/cuda.h"

namespace twell::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kQueue = 64;       // queued non-zeros per warp (>= 32: one append adds at most 32)
constexpr int kPrefetchSlots = 4;  // slots of each tile read with its count (one 16-byte load)

struct FfnFromTwellParams {
  const uint16_t* x;               // [M, D] bf16
  const uint16_t* relu_weight;     // [H, D] gate (gated) or up (non-gated): recomputes lost tiles
  const uint16_t* up;              // [H, D] (gated only)
  const uint16_t* down;            // [H, D]
  const TwellSlot* slots;          // [M, n_tiles, S]
  const int32_t* tile_nnz;         // [M, n_tiles]
  const uint16_t* spill;           // [spill_capacity, T]
  int64_t spill_capacity;
  float* h_slots;                  // [M, n_tiles, S] h at each stored slot (gated only)
  float* h_spill;                  // [spill_capacity, T] h at each spilled non-zero (gated only)
  uint16_t* y;                     // [M, D] bf16
  int64_t rows;
  int32_t d_model;
  int32_t cols;
  int32_t tile;
  int32_t n_tiles;
  int32_t slots_per_tile;
};

__device__ __forceinline__ uint4 load_vector(const uint16_t* pointer) {
  return __ldg(reinterpret_cast<const uint4*>(pointer));
}
// dots[b] = x[m]·W[columns[b]] over all D, on every lane.
template <int kBatch>
__device__ __forceinline__ void warp_dots(const uint16_t* x_row, const uint16_t* weight, const int32_t (&columns)[kBatch],
                                          int d_model, int lane, float (&dots)[kBatch]) {
  float partial[kBatch];
#pragma unroll
  for (int b = 0; b < kBatch; ++b) partial[b] = 0.f;
  const int vectors = d_model / 8;
#pragma unroll 2
  for (int v = lane; v < vectors; v += 32) {
    const uint4 xv = load_vector(x_row + 8 * v);
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      partial[b] += dot8(xv, load_vector(weight + static_cast<int64_t>(columns[b]) * d_model + 8 * v));
  }
#pragma unroll
  for (int b = 0; b < kBatch; ++b) dots[b] = warp_sum(partial[b]);
}
__device__ __forceinline__ float warp_dot(const uint16_t* x_row, const uint16_t* weight, int32_t column, int d_model,
                                          int lane) {
  const int32_t columns[1] = {column};
  float dots[1];
  warp_dots<1>(x_row, weight, columns, d_model, lane, dots);
  return dots[0];
}

// ---- kernel 1: h = g·(x·Wu[j]) at every stored non-zero ----------------------------------------
template <int kBatch>
__device__ __forceinline__ void up_at_tile(const FfnFromTwellParams& p, const uint16_t* x_row, int64_t row,
                                           int32_t tile, int lane);

// One warp per (row, group of tiles_per_warp tiles): x[m] stays in L1 across the group's tiles.
template <int kBatch>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 1) up_at_nonzeros_kernel(FfnFromTwellParams p, int32_t tiles_per_warp) {
  const int lane = threadIdx.x % 32;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int32_t groups = (p.n_tiles + tiles_per_warp - 1) / tiles_per_warp;
  const int64_t row = warp_id / groups;
  if (row >= p.rows) return;
  const uint16_t* x_row = p.x + row * p.d_model;
  const int32_t first_tile = static_cast<int32_t>(warp_id % groups) * tiles_per_warp;
  const int32_t end_tile = min(first_tile + tiles_per_warp, p.n_tiles);
  for (int32_t tile = first_tile; tile < end_tile; ++tile) up_at_tile<kBatch>(p, x_row, row, tile, lane);
}

// h for the stored non-zeros of one (row, tile); lost tiles are left to kernel 2.
template <int kBatch>
__device__ __forceinline__ void up_at_tile(const FfnFromTwellParams& p, const uint16_t* x_row, int64_t row,
                                           int32_t tile, int lane) {
  const int64_t tile_entry = row * p.n_tiles + tile;
  const int32_t nnz = p.tile_nnz[tile_entry];
  if (nnz == 0 || (nnz < 0 && twell_spill_row(nnz) >= p.spill_capacity)) return;

  if (nnz > 0) {
    const TwellSlot* tile_slots = p.slots + tile_entry * p.slots_per_tile;
    float* tile_h = p.h_slots + tile_entry * p.slots_per_tile;
    for (int first = 0; first < nnz; first += kBatch) {
      int32_t columns[kBatch];
      float gates[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const TwellSlot slot = tile_slots[first + b < nnz ? first + b : first];
        columns[b] = static_cast<int32_t>(twell_slot_column(slot));
        gates[b] = twell_slot_value(slot);
      }
      float u[kBatch];
      warp_dots<kBatch>(x_row, p.up, columns, p.d_model, lane, u);
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (lane == b && first + b < nnz) tile_h[first + b] = gates[b] * u[b];
    }
    return;
  }
  const int64_t spill_row = twell_spill_row(nnz);
  const uint16_t* segment = p.spill + spill_row * p.tile;
  float* segment_h = p.h_spill + spill_row * p.tile;
  const int32_t first_col = tile * p.tile;
  for (int k = 0; k < p.tile; k += 32) {
    const float mine = bf16_to_float(segment[k + lane]);
    uint32_t pending = __ballot_sync(0xffffffffu, mine != 0.f && first_col + k + lane < p.cols);
    while (pending) {
      int32_t columns[kBatch];
      int offsets[kBatch];
      float gates[kBatch];
      const uint32_t batch_first = pending;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const uint32_t source = pending ? pending : batch_first;  // padding repeats a real entry
        offsets[b] = __ffs(source) - 1;
        if (pending) pending &= pending - 1;
        columns[b] = first_col + k + offsets[b];
        gates[b] = __shfl_sync(0xffffffffu, mine, offsets[b]);
      }
      float u[kBatch];
      warp_dots<kBatch>(x_row, p.up, columns, p.d_model, lane, u);
      // Padding entries write the same value as the real entry they repeat.
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (lane == b) segment_h[k + offsets[b]] = gates[b] * u[b];
    }
  }
}

// ---- kernel 2: y = Σ h_j·Wd[j] ------------------------------------------------------------------
template <int kBatch, bool kGated>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 2) down_from_nonzeros_kernel(FfnFromTwellParams p) {
  __shared__ int32_t queue_column[kWarpsPerBlock][kQueue];
  __shared__ float queue_h[kWarpsPerBlock][kQueue];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const int vectors = p.d_model / 8;
  const int chunks = (vectors + 31) / 32;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  const int64_t row = warp_id / chunks;
  if (row >= p.rows) return;  // whole warps leave; no block-wide barrier follows
  const int v = static_cast<int>(warp_id % chunks) * 32 + lane;  // this lane's 16-byte vector of y
  const bool owns_vector = v < vectors;
  const uint16_t* x_row = p.x + row * p.d_model;
  int32_t* my_columns = queue_column[warp];
  float* my_h = queue_h[warp];
  int queued = 0;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};

  auto drain = [&]() {
    __syncwarp();
    for (int first = 0; first < queued; first += kBatch) {
      uint4 w[kBatch];
      float h[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const bool real = first + b < queued;  // padding repeats a real neuron with weight 0
        const int32_t column = my_columns[real ? first + b : first];
        h[b] = real ? my_h[first + b] : 0.f;
        w[b] = owns_vector ? load_vector(p.down + static_cast<int64_t>(column) * p.d_model + 8 * v) : uint4{};
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        acc[0] = fmaf(h[b], bf16_low(w[b].x), acc[0]);
        acc[1] = fmaf(h[b], bf16_high(w[b].x), acc[1]);
        acc[2] = fmaf(h[b], bf16_low(w[b].y), acc[2]);
        acc[3] = fmaf(h[b], bf16_high(w[b].y), acc[3]);
        acc[4] = fmaf(h[b], bf16_low(w[b].z), acc[4]);
        acc[5] = fmaf(h[b], bf16_high(w[b].z), acc[5]);
        acc[6] = fmaf(h[b], bf16_low(w[b].w), acc[6]);
        acc[7] = fmaf(h[b], bf16_high(w[b].w), acc[7]);
      }
    }
    queued = 0;
    __syncwarp();
  };
  // Warp-uniform: every lane calls it; lanes with `active` add (column, h) in lane order.
  auto append = [&](bool active, int32_t column, float h) {
    const uint32_t mask = __ballot_sync(0xffffffffu, active);
    if (queued + __popc(mask) > kQueue) drain();
    if (active) {
      const int position = queued + __popc(mask & lanes_below);
      my_columns[position] = column;
      my_h[position] = h;
    }
    queued += __popc(mask);
  };

  for (int first_tile = 0; first_tile < p.n_tiles; first_tile += 32) {
    // Lane t reads tile (first_tile + t): its count and its first 4 slots (and h), one round trip.
    const int32_t my_tile = first_tile + lane;
    const int64_t my_entry = row * p.n_tiles + my_tile;
    const int32_t my_nnz = my_tile < p.n_tiles ? p.tile_nnz[my_entry] : 0;
    uint4 my_slots = {0u, 0u, 0u, 0u};
    float4 my_h4 = {0.f, 0.f, 0.f, 0.f};
    if (my_nnz > 0) {
      my_slots = __ldg(reinterpret_cast<const uint4*>(p.slots + my_entry * p.slots_per_tile));
      if constexpr (kGated) my_h4 = *reinterpret_cast<const float4*>(p.h_slots + my_entry * p.slots_per_tile);
    }
    uint32_t busy = __ballot_sync(0xffffffffu, my_nnz != 0);
    while (busy) {
      const int source = __ffs(busy) - 1;
      busy &= busy - 1;
      const int32_t tile = first_tile + source;
      const int64_t entry = row * p.n_tiles + tile;
      const int32_t nnz = __shfl_sync(0xffffffffu, my_nnz, source);
      const int32_t first_col = tile * p.tile;
      if (nnz > 0) {
        const uint32_t s0 = __shfl_sync(0xffffffffu, my_slots.x, source);
        const uint32_t s1 = __shfl_sync(0xffffffffu, my_slots.y, source);
        const uint32_t s2 = __shfl_sync(0xffffffffu, my_slots.z, source);
        const uint32_t s3 = __shfl_sync(0xffffffffu, my_slots.w, source);
        const float h0 = __shfl_sync(0xffffffffu, my_h4.x, source);
        const float h1 = __shfl_sync(0xffffffffu, my_h4.y, source);
        const float h2 = __shfl_sync(0xffffffffu, my_h4.z, source);
        const float h3 = __shfl_sync(0xffffffffu, my_h4.w, source);
        const TwellSlot slot = lane == 0 ? s0 : lane == 1 ? s1 : lane == 2 ? s2 : s3;
        const float h_prefetched = lane == 0 ? h0 : lane == 1 ? h1 : lane == 2 ? h2 : h3;
        append(lane < kPrefetchSlots && lane < nnz, static_cast<int32_t>(twell_slot_column(slot)),
               kGated ? h_prefetched : twell_slot_value(slot));
        for (int k = kPrefetchSlots; k < nnz; k += 32) {
          const bool active = k + lane < nnz;
          const TwellSlot rest = active ? p.slots[entry * p.slots_per_tile + k + lane] : 0u;
          float h = twell_slot_value(rest);
          if constexpr (kGated) h = active ? p.h_slots[entry * p.slots_per_tile + k + lane] : 0.f;
          append(active, static_cast<int32_t>(twell_slot_column(rest)), h);
        }
      } else if (twell_spill_row(nnz) < p.spill_capacity) {
        const int64_t spill_row = twell_spill_row(nnz);
        for (int k = 0; k < p.tile; k += 32) {
          const float gate = bf16_to_float(p.spill[spill_row * p.tile + k + lane]);
          const int32_t column = first_col + k + lane;
          const bool active = gate != 0.f && column < p.cols;
          float h = gate;
          if constexpr (kGated) h = active ? p.h_spill[spill_row * p.tile + k + lane] : 0.f;
          append(active, column, h);
        }
      } else {
        // Lost to a too-small spill: recompute the tile's gates (and u), one warp dot per column.
        for (int k = 0; k < p.tile; k += 32) {
          float mine = 0.f;
          for (int q = 0; q < 32; ++q) {
            const int32_t column = first_col + k + q;
            if (column >= p.cols) break;
            const float gate = round_to_bf16(warp_dot(x_row, p.relu_weight, column, p.d_model, lane));
            float h = gate;
            if (kGated && gate > 0.f) h = gate * warp_dot(x_row, p.up, column, p.d_model, lane);
            if (lane == q) mine = gate > 0.f ? h : 0.f;
          }
          const int32_t column = first_col + k + lane;
          append(mine != 0.f && column < p.cols, column, mine);
        }
      }
    }
  }
  drain();

  if (owns_vector) {
    uint4 packed;
    packed.x = float_to_bf16_bits(acc[0]) | static_cast<uint32_t>(float_to_bf16_bits(acc[1])) << 16;
    packed.y = float_to_bf16_bits(acc[2]) | static_cast<uint32_t>(float_to_bf16_bits(acc[3])) << 16;
    packed.z = float_to_bf16_bits(acc[4]) | static_cast<uint32_t>(float_to_bf16_bits(acc[5])) << 16;
    packed.w = float_to_bf16_bits(acc[6]) | static_cast<uint32_t>(float_to_bf16_bits(acc[7])) << 16;
    *reinterpret_cast<uint4*>(p.y + row * p.d_model + 8 * v) = packed;
  }
}

unsigned blocks_for_warps(int64_t warps) {
  const int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  TWELL_REQUIRE(blocks < (int64_t{1} << 31), "ffn_from_twell: {} warps exceed the grid limit", warps);
  return static_cast<unsigned>(blocks);
}

// Keep freed stream-ordered scratch in the pool: the h arrays are requested on every call.
void keep_pool_memory() {
  static const bool configured = [] {
    int device = 0;
    TWELL_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool;
    TWELL_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t threshold = UINT64_MAX;
    TWELL_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    return true;
  }();
  (void)configured;
}

}  // namespace

void ffn_from_twell(const bf16* x, const DeviceTwell& gate, const DeviceFfnWeights& weights, bf16* y,
                    cudaStream_t stream) {
  TWELL_REQUIRE(!gate.empty(), "ffn_from_twell: the packed gate is empty");
  TWELL_REQUIRE(gate.shape.cols == weights.d_hidden, "ffn_from_twell: gate has {} columns, weights have H = {}",
                gate.shape.cols, weights.d_hidden);
  TWELL_REQUIRE(weights.d_model % 64 == 0, "ffn_from_twell: d_model must be a multiple of 64, got {}",
                weights.d_model);
  FfnFromTwellParams params{};
  params.x = reinterpret_cast<const uint16_t*>(x);
  params.relu_weight = reinterpret_cast<const uint16_t*>(weights.relu_projection());
  params.up = reinterpret_cast<const uint16_t*>(weights.up.get());
  params.down = reinterpret_cast<const uint16_t*>(weights.down.get());
  params.slots = gate.slots.get();
  params.tile_nnz = gate.tile_nnz.get();
  params.spill = reinterpret_cast<const uint16_t*>(gate.spill.get());
  params.spill_capacity = gate.spill_capacity;
  params.y = reinterpret_cast<uint16_t*>(y);
  params.rows = gate.shape.rows;
  params.d_model = weights.d_model;
  params.cols = gate.shape.cols;
  params.tile = gate.shape.tile;
  params.n_tiles = gate.shape.n_tiles();
  params.slots_per_tile = gate.shape.slots();
  const int64_t chunks = (weights.d_model / 8 + 31) / 32;
  const unsigned down_blocks = blocks_for_warps(params.rows * chunks);
  if (!weights.gated) {
    down_from_nonzeros_kernel<8, false><<<down_blocks, kWarpsPerBlock * 32, 0, stream>>>(params);
    TWELL_CUDA_CHECK_LAUNCH();
    return;
  }
  keep_pool_memory();
  const size_t h_slot_bytes = static_cast<size_t>(gate.shape.slot_count()) * sizeof(float);
  const size_t h_spill_bytes = static_cast<size_t>(gate.spill_capacity) * gate.shape.tile * sizeof(float);
  TWELL_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&params.h_slots), h_slot_bytes, stream));
  TWELL_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&params.h_spill), h_spill_bytes, stream));
  // Large M has warps to spare: a warp takes 16 tiles of a row and reads x[m] once for all of them
  // (one warp per tile re-reads x[m] for every non-empty tile, as many bytes as the Wu rows at 0.5%).
  // Small M needs the warps: 2 tiles each.
  const int32_t tiles_per_warp = params.rows >= 1024 ? 16 : 2;
  const int64_t up_warps = params.rows * ((params.n_tiles + tiles_per_warp - 1) / tiles_per_warp);
  up_at_nonzeros_kernel<4><<<blocks_for_warps(up_warps), kWarpsPerBlock * 32, 0, stream>>>(params, tiles_per_warp);
  TWELL_CUDA_CHECK_LAUNCH();
  down_from_nonzeros_kernel<8, true><<<down_blocks, kWarpsPerBlock * 32, 0, stream>>>(params);
  TWELL_CUDA_CHECK_LAUNCH();
  TWELL_CUDA_CHECK(cudaFreeAsync(params.h_spill, stream));
  TWELL_CUDA_CHECK(cudaFreeAsync(params.h_slots, stream));
}

}  // namespace twell::cuda
