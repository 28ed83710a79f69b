// Epilogue of the gate GEMM, in two halves that run on different warps of one block:
//   stage_relu_bf16x2  (consumer warpgroups) relu'd accumulators -> bf16 pairs in a shared-memory
//                      staging tile, so the accumulators are free for the next tile's mainloop;
//   pack_staged_tile   (packer warps) the staged [BM, T] tile -> TwELL (include/twell/formats/twell.h),
//                      one warp (T = 256) or half-warp (T = 128) per row at a time:
//   1. each lane of the row's T/8 lanes reads 8 consecutive columns (one 16-byte load),
//   2. one ballot per column position within the lane gives the non-zero masks; popc gives the count,
//   3. count <= S: each non-zero goes to slot (non-zeros before it in the row) = ascending columns,
//      the rest of the S slots get 0;
//      count >  S: one atomicAdd on spill_used claims a spill row; the whole T-segment goes there
//      (when the row is < capacity) and tile_nnz gets the spill marker. Rows >= capacity are lost
//      here, counted in spill_used, and the host or ffn_from_twell recovers them (cuda.h).
//
// Staged values are the bf16 bits of relu(fp32 gate) with one twist: a positive gate that rounds to
// bf16 zero (below 2^-133) is staged as 0x8000 (-0.0, which relu never produces), so "stored iff the
// fp32 gate is > 0" survives the staging; the packer stores it as the value +0.0 (twell.h).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

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

// Two adjacent fp32 gates (columns c, c+1) -> relu'd bf16 pair, low half = column c.
__device__ __forceinline__ uint32_t stage_relu_bf16x2(float low, float high) {
  low = low > 0.f ? low : 0.f;  // NaN -> 0, as relu(x) = x > 0 ? x : 0
  high = high > 0.f ? high : 0.f;
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  uint32_t bits = *reinterpret_cast<const uint32_t*>(&pair);
  if (low > 0.f && (bits & 0xffffu) == 0) bits |= 0x8000u;
  if (high > 0.f && (bits >> 16) == 0) bits |= 0x80000000u;
  return bits;
}

// staged: bf16 bits [kBlockM, kTile], row stride kRowStride (elements, a multiple of 8: 16-byte rows).
// Called by the kPackerWarps packer warps of the block (warp_index 0..kPackerWarps-1, whole warps).
// A row takes kTile / 8 lanes of 8 columns each, so at T = 128 a warp packs two rows per pass (the
// ballots and shuffles of a row are masked to its half-warp). Returns the non-zeros of the rows
// this lane's row group packed, counted in every lane of the group; the caller adds them to
// nnz_total from one lane per group.
template <int kBlockM, int kTile, int kRowStride, int kPackerWarps>
__device__ __forceinline__ unsigned long long pack_staged_tile(const uint16_t* staged, int64_t first_row,
                                                               int32_t tile_index, const TwellPackOutput& out,
                                                               int warp_index) {
  constexpr int kPerLane = 8;
  constexpr int kLanesPerRow = kTile / kPerLane;  // 16 or 32
  constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static_assert(kLanesPerRow == 16 || kLanesPerRow == 32, "T must be 128 or 256");
  static_assert(kRowStride % 8 == 0, "staged rows must stay 16-byte aligned");
  const int lane = threadIdx.x % 32;
  const int row_in_pass = lane / kLanesPerRow;
  const int lane_in_row = lane % kLanesPerRow;
  const int row_leader = row_in_pass * kLanesPerRow;
  const uint32_t row_lanes = kLanesPerRow == 32 ? 0xffffffffu : 0xffffu << row_leader;
  const uint32_t lanes_before = ((1u << lane) - 1u) & row_lanes;
  const int32_t first_col = tile_index * kTile + lane_in_row * kPerLane;
  unsigned long long found = 0;

  for (int pass = warp_index; pass * kRowsPerPass < kBlockM; pass += kPackerWarps) {
    if (first_row + pass * kRowsPerPass >= out.rows) break;  // no row of this pass exists
    const int r = pass * kRowsPerPass + row_in_pass;
    const int64_t row = first_row + r;
    const bool row_exists = row < out.rows;
    const uint4 chunk = *reinterpret_cast<const uint4*>(staged + r * kRowStride + lane_in_row * kPerLane);
    const uint32_t word[4] = {chunk.x, chunk.y, chunk.z, chunk.w};  // bf16 pairs, low half = lower column
    const auto value = [&](int e) { return (word[e / 2] >> (16 * (e % 2))) & 0xffffu; };
    // Columns past H hold 0 already (the TMA fills rows of W past H with zeros); the test keeps
    // the packing right even if a future load path did not.
    uint32_t own = 0;  // bit e: this lane's column e is non-zero
    int count = 0, before = 0;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const uint32_t nonzero = __ballot_sync(0xffffffffu, row_exists && value(e) != 0 && first_col + e < out.cols);
      count += __popc(nonzero & row_lanes);
      before += __popc(nonzero & lanes_before);
      own |= (nonzero >> lane & 1u) << e;
    }
    if (!row_exists) continue;
    found += count;
    const int64_t tile_entry = row * out.n_tiles + tile_index;
    TwellSlot* tile_slots = out.slots + tile_entry * out.slots_per_tile;
    if (count <= out.slots_per_tile) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e)
        if (own >> e & 1u) {
          tile_slots[before] = twell_make_slot(value(e) & 0x7fffu, first_col + e);
          ++before;
        }
      for (int slot = count + lane_in_row; slot < out.slots_per_tile; slot += kLanesPerRow) tile_slots[slot] = 0;
      if (lane_in_row == 0) out.tile_nnz[tile_entry] = count;
    } else {
      int spill_row = 0;
      if (lane_in_row == 0) spill_row = atomicAdd(out.spill_used, 1);
      spill_row = __shfl_sync(row_lanes, spill_row, row_leader);
      if (spill_row < out.spill_capacity) {
        // Stored values as they are, the underflow marker as +0.0, zeros past H as +0.0.
        uint32_t segment[4];
#pragma unroll
        for (int e = 0; e < kPerLane; e += 2)
          segment[e / 2] = (own >> e & 1u ? value(e) & 0x7fffu : 0u) | (own >> (e + 1) & 1u ? value(e + 1) & 0x7fffu : 0u) << 16;
        *reinterpret_cast<uint4*>(out.spill + static_cast<int64_t>(spill_row) * kTile + lane_in_row * kPerLane) =
            make_uint4(segment[0], segment[1], segment[2], segment[3]);
      }
      for (int slot = lane_in_row; slot < out.slots_per_tile; slot += kLanesPerRow) tile_slots[slot] = 0;
      if (lane_in_row == 0) out.tile_nnz[tile_entry] = twell_spilled_marker(spill_row);
    }
  }
  return found;
}

}  // namespace twell::cuda
