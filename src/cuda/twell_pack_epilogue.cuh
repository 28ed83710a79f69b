// Epilogue of the gate GEMM: packs one [BM, T] tile of relu'd fp32 gates, staged in shared memory,
// into TwELL (include/twell/formats/twell.h). One warp packs one row at a time:
//   1. lane l reads columns l, l+32, ... of the row (conflict-free: consecutive words),
//   2. a ballot per 32 columns gives the non-zero mask; popc of the masks gives the count,
//   3. count <= S: each non-zero goes to slot  (non-zeros before it in the row) = ascending columns,
//      the rest of the S slots get 0;
//      count >  S: one atomicAdd on spill_used claims a spill row; the whole T-segment goes there
//      (when the row is < capacity) and tile_nnz gets the spill marker. Rows >= capacity are lost
//      here, counted in spill_used, and the host or ffn_from_twell recovers them (cuda.h).
#pragma once

#include <cstdint>

#include "twell/formats/twell.h"

namespace twell::cuda {

struct TwellPackOutput {
  TwellSlot* slots;               // [M, n_tiles, S]
  int32_t* tile_nnz;              // [M, n_tiles]
  uint16_t* spill;                // [spill_capacity, T] bf16 bits
  int32_t* spill_used;            // [1]
  unsigned long long* nnz_total;  // [1]
  int64_t spill_capacity;
  int64_t rows;                   // M
  int32_t cols;                   // H
  int32_t n_tiles;
  int32_t slots_per_tile;         // S
};

// gate_tile: fp32 [kBlockM, kTile] with row stride kRowStride (floats), already relu'd (x > 0 or 0).
// Every thread of the block calls it; warps take rows round-robin.
template <int kBlockM, int kTile, int kRowStride, int kThreads>
__device__ __forceinline__ void pack_gate_tile(const float* gate_tile, int64_t first_row, int32_t tile_index,
                                               const TwellPackOutput& out) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kChunks = kTile / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const int32_t first_col = tile_index * kTile;
  unsigned long long found = 0;

  for (int r = warp; r < kBlockM; r += kWarps) {
    const int64_t row = first_row + r;
    if (row >= out.rows) break;
    float value[kChunks];
    uint32_t nonzero[kChunks];
    int count = 0;
#pragma unroll
    for (int q = 0; q < kChunks; ++q) {
      const int col = q * 32 + lane;
      value[q] = gate_tile[r * kRowStride + col];
      nonzero[q] = __ballot_sync(0xffffffffu, value[q] > 0.f && first_col + col < out.cols);
      count += __popc(nonzero[q]);
    }
    found += count;
    const int64_t tile_entry = row * out.n_tiles + tile_index;
    TwellSlot* tile_slots = out.slots + tile_entry * out.slots_per_tile;
    if (count <= out.slots_per_tile) {
      int before = 0;
#pragma unroll
      for (int q = 0; q < kChunks; ++q) {
        if (nonzero[q] >> lane & 1u) {
          const int slot = before + __popc(nonzero[q] & lanes_below);
          tile_slots[slot] = twell_make_slot(float_to_bf16_bits(value[q]), first_col + q * 32 + lane);
        }
        before += __popc(nonzero[q]);
      }
      for (int slot = count + lane; slot < out.slots_per_tile; slot += 32) tile_slots[slot] = 0;
      if (lane == 0) out.tile_nnz[tile_entry] = count;
    } else {
      int spill_row = 0;
      if (lane == 0) spill_row = atomicAdd(out.spill_used, 1);
      spill_row = __shfl_sync(0xffffffffu, spill_row, 0);
      if (spill_row < out.spill_capacity) {
        uint16_t* segment = out.spill + static_cast<int64_t>(spill_row) * kTile;
#pragma unroll
        for (int q = 0; q < kChunks; ++q) {
          const bool stored = nonzero[q] >> lane & 1u;  // columns past H and non-positive values are 0
          segment[q * 32 + lane] = stored ? float_to_bf16_bits(value[q]) : uint16_t{0};
        }
      }
      for (int slot = lane; slot < out.slots_per_tile; slot += 32) tile_slots[slot] = 0;
      if (lane == 0) out.tile_nnz[tile_entry] = twell_spilled_marker(spill_row);
    }
  }
  if (lane == 0 && found > 0) atomicAdd(out.nnz_total, found);
}

}  // namespace twell::cuda
