// Epilogue of the gate GEMM: relu, then TwELL packing (include/twell/formats/twell.h) straight from
// the WGMMA accumulators, as a CUTLASS operator-style epilogue (the interface of
// cutlass::epilogue::collective::DefaultEpilogue, run by the warp-specialized sm90 kernels through
// Sm90TmaWarpSpecializedAdapter). No fp32 tile goes through shared memory and no barrier wider
// than a warp is needed, so the persistent kernel's producer keeps loading the next tile meanwhile.
//
// The sm90 64xN accumulator layout gives lane l of a warp the rows l/4 and l/4 + 8 of the warp's
// 16, and within each block of 8 columns the columns 2·(l%4) and 2·(l%4)+1. So a row of a TwELL
// tile lies in the 4 lanes of one quad, and its non-zero mask in column order is the bitwise
// interleave of the quad's masks: each lane spreads its bit pairs to their column positions, the
// quad ORs them with two shuffles, and a non-zero's slot is the popcount of the mask below it.
//   count <= S: the slots (ascending columns), the rest of the S zeroed, are assembled in a per-warp
//               shared-memory buffer of 8 rows and leave it as 16-byte stores;
//   count >  S: one atomicAdd on spill_used claims a spill row; the whole T-segment goes there
//               (when the row is < capacity) and tile_nnz gets the spill marker. Rows >= capacity are
//               lost here, counted in spill_used, and the host or ffn_from_twell recovers them (cuda.h).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "twell/bf16.h"
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

// kTile = T. kMmaWarps: warps that hold accumulators (8 for two consumer warpgroups); each owns one
// 8-row slot buffer of S <= T/2 words (C >= 2).
template <int kTile, int kMmaWarps>
class TwellPackEpilogue {
 public:
  // What the sm90 kernels read from an epilogue type; C and D are not used.
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using Arguments = TwellPackOutput;
  using Params = TwellPackOutput;
  using ThreadEpilogueOp = void;  // GemmUniversalAdapter names it

  static constexpr int kRowsPerPass = 8;
  static constexpr int kMaxSlots = kTile / 2;
  static constexpr int kWords = kTile / 32;  // 32-bit words of a row's column mask
  struct SharedStorage {
    alignas(16) TwellSlot slots[kMmaWarps][kRowsPerPass * kMaxSlots];
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.slots_per_tile >= 16 && args.slots_per_tile <= kMaxSlots && args.slots_per_tile % 4 == 0;
  }

  CUTLASS_HOST_DEVICE explicit TwellPackEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK blk_shape_mnk, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* smem_buf) {
    using namespace cute;
    constexpr int kBlockN = size<1>(BlockShapeMNK{});
    static_assert(kBlockN % kTile == 0, "a CTA tile holds whole TwELL tiles");
    // ((2 columns, 2 row halves, atom N / 8 column blocks), MMA_M, MMA_N)
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "sm90 64xN accumulator layout");
    constexpr int kAtomBlocks = size<0, 2>(FrgLayout{});
    constexpr int kMmaM = size<1>(FrgLayout{});
    static_assert(kAtomBlocks * 8 * size<2>(FrgLayout{}) == kBlockN, "accumulators cover the CTA tile's columns");

    const int lane = thread_idx % 32;
    const int quad_lane = lane % 4;
    const int warp = thread_idx / 32;
    TwellSlot* buffer = reinterpret_cast<SharedStorage*>(smem_buf)->slots[warp];
    const int slots = params_.slots_per_tile;

    auto value = [&](int mm, int half, int block, int col) -> float {
      const float v = accumulators(make_coord(make_coord(col, half, block % kAtomBlocks), mm, block / kAtomBlocks));
      return v > 0.f ? v : 0.f;
    };
    Tensor tile_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(
        make_identity_tensor(take<0, 2>(blk_shape_mnk)));  // (MMA, MMA_M, MMA_N) -> (row, col) in the tile
    const int64_t first_tile_row = static_cast<int64_t>(get<0>(blk_coord_mnkl)) * size<0>(BlockShapeMNK{});
    const int first_tile = static_cast<int>(get<1>(blk_coord_mnkl)) * (kBlockN / kTile);
    unsigned long long found = 0;

    CUTE_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        // This pass: the warp's 8 consecutive rows, lane's row = pass_row + lane / 4.
        const int64_t pass_row =
            first_tile_row + get<0>(tile_coords(make_coord(make_coord(0, half, 0), mm, 0))) - lane / 4;
        const int64_t row = pass_row + lane / 4;
        const bool row_valid = row < params_.rows;
        CUTE_UNROLL
        for (int t = 0; t < kBlockN / kTile; ++t) {
          const int tile = first_tile + t;
          if (tile >= params_.n_tiles) break;  // uniform: the CTA's columns past H
          // Lane's non-zeros: bit 2·b + c for column block b of the tile, column 2·quad_lane + c.
          uint32_t own[kWords / 4] = {};
          CUTE_UNROLL
          for (int b = 0; b < kTile / 8; ++b) {
            const int block = t * (kTile / 8) + b;
            own[b / 16] |= (value(mm, half, block, 0) > 0.f ? 1u : 0u) << (2 * (b % 16));
            own[b / 16] |= (value(mm, half, block, 1) > 0.f ? 1u : 0u) << (2 * (b % 16) + 1);
          }
          // The row's mask in column order: word w = columns 32w.. = column blocks 4w..4w+3.
          uint32_t row_mask[kWords];
          int count = 0;
          CUTE_UNROLL
          for (int w = 0; w < kWords; ++w) {
            const uint32_t pairs = (own[w / 4] >> (8 * (w % 4))) & 0xffu;
            uint32_t spread = (pairs & 0x3u) | (pairs & 0xcu) << 6 | (pairs & 0x30u) << 12 | (pairs & 0xc0u) << 18;
            spread <<= 2 * quad_lane;
            spread |= __shfl_xor_sync(0xffffffffu, spread, 1);
            spread |= __shfl_xor_sync(0xffffffffu, spread, 2);
            row_mask[w] = spread;
            count += __popc(spread);
          }
          TwellSlot* row_buffer = buffer + (lane / 4) * slots;
          const int64_t tile_entry = row * params_.n_tiles + tile;
          // Quads disagree on spilling, so the spill row's shuffle happens outside the branches.
          int spill_row = 0;
          if (count > slots && quad_lane == 0 && row_valid) spill_row = atomicAdd(params_.spill_used, 1);
          spill_row = __shfl_sync(0xffffffffu, spill_row, lane & ~3);
          if (count <= slots) {
            // Static accumulator indices only (a data-dependent index would put them in local
            // memory): every column block is visited, groups of 4 without a lane's non-zero skipped.
            int words_before = 0;
            CUTE_UNROLL
            for (int w = 0; w < kWords; ++w) {
              const uint32_t below_mask = row_mask[w];
              if (below_mask & (0x03030303u << (2 * quad_lane))) {
                CUTE_UNROLL
                for (int a = 0; a < 4; ++a) {
                  CUTE_UNROLL
                  for (int c = 0; c < 2; ++c) {
                    const int bit = 8 * a + 2 * quad_lane + c;
                    if (below_mask >> bit & 1u) {
                      const int slot = words_before + __popc(below_mask & ((1u << bit) - 1u));
                      const float v = value(mm, half, t * (kTile / 8) + 4 * w + a, c);
                      row_buffer[slot] = twell_make_slot(float_to_bf16_bits(v), tile * kTile + 32 * w + bit);
                    }
                  }
                }
              }
              words_before += __popc(below_mask);
            }
            for (int slot = count + quad_lane; slot < slots; slot += 4) row_buffer[slot] = 0;
            if (quad_lane == 0 && row_valid) params_.tile_nnz[tile_entry] = count;
          } else {
            if (row_valid && spill_row < params_.spill_capacity) {
              uint32_t* segment = reinterpret_cast<uint32_t*>(params_.spill + static_cast<int64_t>(spill_row) * kTile);
              CUTE_UNROLL
              for (int b = 0; b < kTile / 8; ++b) {
                const int block = t * (kTile / 8) + b;
                segment[4 * b + quad_lane] = float_to_bf16_bits(value(mm, half, block, 0)) |
                                             uint32_t{float_to_bf16_bits(value(mm, half, block, 1))} << 16;
              }
            }
            for (int slot = quad_lane; slot < slots; slot += 4) row_buffer[slot] = 0;
            if (quad_lane == 0 && row_valid) params_.tile_nnz[tile_entry] = twell_spilled_marker(spill_row);
          }
          if (row_valid && quad_lane == 0) found += count;
          __syncwarp();
          // 8 rows x S slots leave as 16-byte stores; rows past M are not written.
          const int chunks_per_row = slots / 4;
          for (int chunk = lane; chunk < kRowsPerPass * chunks_per_row; chunk += 32) {
            const int r = chunk / chunks_per_row;
            const int64_t out_row = pass_row + r;
            if (out_row >= params_.rows) continue;
            const uint4 data = reinterpret_cast<const uint4*>(buffer + r * slots)[chunk % chunks_per_row];
            reinterpret_cast<uint4*>(params_.slots + (out_row * params_.n_tiles + tile) * slots)[chunk % chunks_per_row] =
                data;
          }
          __syncwarp();
        }
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) found += __shfl_xor_sync(0xffffffffu, found, offset);
    if (lane == 0 && found > 0) atomicAdd(params_.nnz_total, found);
  }

 private:
  Params params_;
};

}  // namespace twell::cuda
