// Fused up+down FFN from the packed gate (TwELL):
//   gated:     y[m] = Σ_j g[m,j] · (x[m]·Wu[j]) · Wd[j]     non-gated: y[m] = Σ_j g[m,j] · Wd[j]
// over the non-zeros j of row m; fp32 accumulation; y written once as bf16.
//
// One warp owns one (row, D-chunk of up to kVec·256 columns): its y chunk lives in registers
// (lane l holds 8 consecutive columns of every 256), so nothing is accumulated through memory and no
// atomics are needed. The warp walks the row's tiles (32 tile counts per ballot, empty tiles skipped),
// appends each non-zero (column, value) to a per-warp queue in shared memory, and drains the queue
// kBatch neurons at a time so that kBatch weight rows are in flight together:
//   up:   lane l reads 16-byte vectors l, l+32, ... of x[m] (L1-resident) and of each Wu[j]; a
//         butterfly sum gives u_j on every lane; h_j = g_j·u_j
//   down: lane l reads its vectors of each Wd[j] and adds h_j·Wd[j] into its y registers
// Weight rows come from L2 (Wu and Wd of a model fit the H200's 50 MB L2 at D=2048); a weight row is
// re-read for every row that uses it (no reuse across rows yet: that is the next step, see
// docs/perf-notes.md). A tile lost to a too-small spill (spill row >= capacity) is recomputed from
// x and the relu projection's rows: relu(x·W[j]) with fp32 accumulation, rounded to bf16.
#include <cstdint>

#include "cuda/cuda_utils.h"
#include "twell/cuda.h"

namespace twell::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kQueue = 64;  // queued non-zeros per warp (>= 32: one append adds at most 32)

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
__device__ __forceinline__ float low_bf16(uint32_t word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float high_bf16(uint32_t word) { return __uint_as_float(word & 0xffff0000u); }
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  float sum = low_bf16(a.x) * low_bf16(b.x);
  sum = fmaf(high_bf16(a.x), high_bf16(b.x), sum);
  sum = fmaf(low_bf16(a.y), low_bf16(b.y), sum);
  sum = fmaf(high_bf16(a.y), high_bf16(b.y), sum);
  sum = fmaf(low_bf16(a.z), low_bf16(b.z), sum);
  sum = fmaf(high_bf16(a.z), high_bf16(b.z), sum);
  sum = fmaf(low_bf16(a.w), low_bf16(b.w), sum);
  return fmaf(high_bf16(a.w), high_bf16(b.w), sum);
}
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}
// x[m]·W[j] over all D, the result on every lane.
__device__ __forceinline__ float warp_dot(const uint16_t* x_row, const uint16_t* weight_row, int vectors, int lane) {
  float partial = 0.f;
#pragma unroll 4
  for (int v = lane; v < vectors; v += 32) partial += dot8(load_vector(x_row + 8 * v), load_vector(weight_row + 8 * v));
  return warp_sum(partial);
}

template <int kVec, int kBatch, bool kGated>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) ffn_from_twell_kernel(FfnFromTwellParams p) {
  __shared__ int32_t queue_column[kWarpsPerBlock][kQueue];
  __shared__ float queue_value[kWarpsPerBlock][kQueue];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= p.rows) return;  // whole warps leave; no block-wide barrier follows

  const int vectors = p.d_model / 8;           // 16-byte vectors per row of D
  const int first_vector = blockIdx.y * kVec * 32;  // this warp's D-chunk
  const uint16_t* x_row = p.x + row * p.d_model;
  int32_t* my_columns = queue_column[warp];
  float* my_values = queue_value[warp];
  int queued = 0;

  float acc[kVec][8];  // y[row, chunk]: lane's 8 columns of each 256
#pragma unroll
  for (int i = 0; i < kVec; ++i)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;

  auto drain = [&]() {
    __syncwarp();
    for (int first = 0; first < queued; first += kBatch) {
      int32_t column[kBatch];
      float h[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const bool real = first + b < queued;  // padding repeats a real neuron with weight 0
        column[b] = my_columns[real ? first + b : first];
        h[b] = real ? my_values[first + b] : 0.f;
      }
      if constexpr (kGated) {
        float partial[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) partial[b] = 0.f;
#pragma unroll 2
        for (int v = lane; v < vectors; v += 32) {
          const uint4 xv = load_vector(x_row + 8 * v);
#pragma unroll
          for (int b = 0; b < kBatch; ++b)
            partial[b] += dot8(xv, load_vector(p.up + static_cast<int64_t>(column[b]) * p.d_model + 8 * v));
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) h[b] *= warp_sum(partial[b]);
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const int v = first_vector + i * 32 + lane;
        if (v < vectors) {
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const uint4 w = load_vector(p.down + static_cast<int64_t>(column[b]) * p.d_model + 8 * v);
            acc[i][0] = fmaf(h[b], low_bf16(w.x), acc[i][0]);
            acc[i][1] = fmaf(h[b], high_bf16(w.x), acc[i][1]);
            acc[i][2] = fmaf(h[b], low_bf16(w.y), acc[i][2]);
            acc[i][3] = fmaf(h[b], high_bf16(w.y), acc[i][3]);
            acc[i][4] = fmaf(h[b], low_bf16(w.z), acc[i][4]);
            acc[i][5] = fmaf(h[b], high_bf16(w.z), acc[i][5]);
            acc[i][6] = fmaf(h[b], low_bf16(w.w), acc[i][6]);
            acc[i][7] = fmaf(h[b], high_bf16(w.w), acc[i][7]);
          }
        }
      }
    }
    queued = 0;
    __syncwarp();
  };
  // Warp-uniform: every lane calls it; lanes with `active` add (column, value) in lane order.
  auto append = [&](bool active, int32_t column, float value) {
    const uint32_t mask = __ballot_sync(0xffffffffu, active);
    if (queued + __popc(mask) > kQueue) drain();
    if (active) {
      const int position = queued + __popc(mask & lanes_below);
      my_columns[position] = column;
      my_values[position] = value;
    }
    queued += __popc(mask);
  };

  const int32_t* row_tile_nnz = p.tile_nnz + row * p.n_tiles;
  for (int first_tile = 0; first_tile < p.n_tiles; first_tile += 32) {
    const int32_t my_tile_nnz = first_tile + lane < p.n_tiles ? row_tile_nnz[first_tile + lane] : 0;
    uint32_t busy = __ballot_sync(0xffffffffu, my_tile_nnz != 0);
    while (busy) {
      const int source = __ffs(busy) - 1;
      busy &= busy - 1;
      const int tile = first_tile + source;
      const int32_t nnz = __shfl_sync(0xffffffffu, my_tile_nnz, source);
      const int32_t first_col = tile * p.tile;
      if (nnz > 0) {
        const TwellSlot* tile_slots = p.slots + (row * p.n_tiles + tile) * p.slots_per_tile;
        for (int k = 0; k < nnz; k += 32) {
          const bool active = k + lane < nnz;
          const TwellSlot slot = active ? tile_slots[k + lane] : 0u;
          append(active, static_cast<int32_t>(twell_slot_column(slot)), twell_slot_value(slot));
        }
      } else if (twell_spill_row(nnz) < p.spill_capacity) {
        const uint16_t* segment = p.spill + static_cast<int64_t>(twell_spill_row(nnz)) * p.tile;
        for (int k = 0; k < p.tile; k += 32) {
          const float value = bf16_to_float(segment[k + lane]);
          const int32_t column = first_col + k + lane;
          append(value != 0.f && column < p.cols, column, value);
        }
      } else {
        // Lost to a too-small spill: recompute the tile's relu'd gates, one warp dot per column.
        for (int k = 0; k < p.tile; k += 32) {
          float mine = 0.f;
          for (int q = 0; q < 32; ++q) {
            const int32_t column = first_col + k + q;
            if (column < p.cols) {
              const float gate = warp_dot(x_row, p.relu_weight + static_cast<int64_t>(column) * p.d_model, vectors, lane);
              if (lane == q) mine = gate;
            }
          }
          const int32_t column = first_col + k + lane;
          append(mine > 0.f && column < p.cols, column, round_to_bf16(mine));
        }
      }
    }
  }
  drain();

  uint16_t* y_row = p.y + row * p.d_model;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const int v = first_vector + i * 32 + lane;
    if (v < vectors) {
      uint4 packed;
      packed.x = float_to_bf16_bits(acc[i][0]) | static_cast<uint32_t>(float_to_bf16_bits(acc[i][1])) << 16;
      packed.y = float_to_bf16_bits(acc[i][2]) | static_cast<uint32_t>(float_to_bf16_bits(acc[i][3])) << 16;
      packed.z = float_to_bf16_bits(acc[i][4]) | static_cast<uint32_t>(float_to_bf16_bits(acc[i][5])) << 16;
      packed.w = float_to_bf16_bits(acc[i][6]) | static_cast<uint32_t>(float_to_bf16_bits(acc[i][7])) << 16;
      *reinterpret_cast<uint4*>(y_row + 8 * v) = packed;
    }
  }
}

template <int kVec, int kBatch>
void launch(const FfnFromTwellParams& params, bool gated, cudaStream_t stream) {
  const int vectors = params.d_model / 8;
  const int chunks = (vectors + kVec * 32 - 1) / (kVec * 32);
  const dim3 grid(static_cast<unsigned>((params.rows + kWarpsPerBlock - 1) / kWarpsPerBlock), chunks);
  TWELL_REQUIRE(grid.x < (1u << 31), "ffn_from_twell: {} rows exceed the grid limit", params.rows);
  if (gated) {
    ffn_from_twell_kernel<kVec, kBatch, true><<<grid, kWarpsPerBlock * 32, 0, stream>>>(params);
  } else {
    ffn_from_twell_kernel<kVec, kBatch, false><<<grid, kWarpsPerBlock * 32, 0, stream>>>(params);
  }
  TWELL_CUDA_CHECK_LAUNCH();
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
  // kVec: y registers per lane are 8·kVec floats. D <= 2048 fits one chunk of 8 vectors per lane;
  // larger D takes chunks of 16 (D = 4096 in one, 8192 in two, recomputing the up dot per chunk).
  if (weights.d_model <= 2048) {
    launch<8, 4>(params, weights.gated, stream);
  } else {
    launch<16, 2>(params, weights.gated, stream);
  }
}

}  // namespace twell::cuda
