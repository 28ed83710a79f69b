// TwELL (tile-wise ELLPACK): the sparse form of the gate activations g = relu(x·Wg^T).
// Shared by CPU and CUDA code; docs/formats.md carries the same text.
//
// Parameters
//   M            rows (tokens)                              1 <= M
//   H            columns (FFN hidden neurons)               1 <= H <= 65536 (a column fits a uint16)
//   T  (tile)    tile width, equal to the gate GEMM's N tile; compile-time in kernels: 128 or 256
//   C  (compression)                                         2, 4 or 8
//   S = T / C    slots per (row, tile)
//   n_tiles = ceil(H / T); the last tile covers columns [(n_tiles-1)·T, H) and may be partial.
//
// Arrays (all row-major, no padding between rows)
//   slots     uint32 [M, n_tiles, S]   slot = bf16 bits of the value (low 16) | global column (high 16).
//                                       Valid slots come first, in ascending column order.
//                                       Unused slots are 0 (value +0.0, column 0), so a consumer
//                                       that reads a whole slot vector without looking at the count
//                                       adds nothing.
//   tile_nnz  int32  [M, n_tiles]      v >= 0: the tile has v non-zeros, all in slots[r, t, 0:v] (v <= S).
//                                       v <  0: the tile overflowed (more than S non-zeros); its whole
//                                       dense segment lives in spill row (-v - 1); its slots are all 0.
//   spill     bf16   [spill_capacity, T]  dense relu'd values of an overflowing tile's T columns,
//                                       columns past H written as 0. Each spill row in
//                                       [0, spill_used) belongs to exactly one tile; the order of
//                                       the rows is the producer's.
//   spill_used int32 (one counter)      number of spill rows requested. May exceed spill_capacity:
//                                       then the packing is incomplete and the producer's caller must
//                                       either grow the spill and pack again or take the dense path.
//                                       Consumers refuse an incomplete packing (TwellMatrix::complete()).
//
// Non-zero means any bf16 other than +0.0 and -0.0; a zero a producer writes is +0.0.
// Overflow is exact: a spilled tile keeps all T of its values; nothing is dropped, nothing is read
// out of bounds. A producer spills a tile iff it has more than S non-zeros. Values are stored as
// bf16 (the same rounding the dense bf16 path applies); a value that rounds to zero is still stored
// if the fp32 gate was > 0, so the pattern is that of relu(fp32).
#pragma once

#include <cstdint>

#include "twell/bf16.h"
#include "twell/portability.h"

namespace twell {

inline constexpr int kTwellMaxColumns = 65536;

TWELL_HD constexpr bool twell_tile_supported(int tile) { return tile == 128 || tile == 256; }
TWELL_HD constexpr bool twell_compression_supported(int compression) {
  return compression == 2 || compression == 4 || compression == 8;
}

// Compile-time view of one TwELL configuration, for kernels.
template <int kTileWidth, int kCompressionFactor>
struct TwellConfig {
  static_assert(twell_tile_supported(kTileWidth), "TwELL tile width must be 128 or 256");
  static_assert(twell_compression_supported(kCompressionFactor), "TwELL compression must be 2, 4 or 8");
  static constexpr int kTile = kTileWidth;
  static constexpr int kCompression = kCompressionFactor;
  static constexpr int kSlots = kTileWidth / kCompressionFactor;
  static_assert(kSlots * kCompressionFactor == kTileWidth, "slots must divide the tile exactly");
  static_assert(kSlots % 4 == 0, "a slot vector must be loadable as 16-byte words");
};

// Run-time shape of one TwELL matrix; every size below derives from it.
struct TwellShape {
  int64_t rows = 0;       // M
  int32_t cols = 0;       // H
  int32_t tile = 128;     // T
  int32_t compression = 4;  // C

  TWELL_HD constexpr int32_t slots() const { return tile / compression; }
  TWELL_HD constexpr int32_t n_tiles() const { return (cols + tile - 1) / tile; }
  TWELL_HD constexpr int64_t slot_count() const { return rows * n_tiles() * slots(); }
  TWELL_HD constexpr int64_t tile_count() const { return rows * n_tiles(); }
  TWELL_HD constexpr int64_t slot_index(int64_t row, int32_t tile_index, int32_t slot) const {
    return (row * n_tiles() + tile_index) * slots() + slot;
  }
  TWELL_HD constexpr int64_t tile_index(int64_t row, int32_t tile_index) const {
    return row * n_tiles() + tile_index;
  }
};

using TwellSlot = uint32_t;
static_assert(sizeof(TwellSlot) == 4, "a TwELL slot is one 32-bit word");

TWELL_HD constexpr TwellSlot twell_make_slot(uint16_t value_bits, uint32_t column) {
  return static_cast<TwellSlot>(value_bits) | (column << 16);
}
TWELL_HD constexpr uint16_t twell_slot_value_bits(TwellSlot slot) { return static_cast<uint16_t>(slot & 0xffffu); }
TWELL_HD constexpr uint32_t twell_slot_column(TwellSlot slot) { return slot >> 16; }
TWELL_HD float twell_slot_value(TwellSlot slot) { return bf16_to_float(twell_slot_value_bits(slot)); }

// tile_nnz encodes either a count (>= 0) or a spill row (< 0).
TWELL_HD constexpr bool twell_tile_spilled(int32_t tile_nnz) { return tile_nnz < 0; }
TWELL_HD constexpr int32_t twell_spill_row(int32_t tile_nnz) { return -tile_nnz - 1; }
TWELL_HD constexpr int32_t twell_spilled_marker(int32_t spill_row) { return -spill_row - 1; }

static_assert(twell_slot_column(twell_make_slot(0x3f80, 65535)) == 65535, "column must survive packing");
static_assert(twell_slot_value_bits(twell_make_slot(0xbf80, 65535)) == 0xbf80, "value must survive packing");
static_assert(twell_spill_row(twell_spilled_marker(0)) == 0 && twell_spilled_marker(0) < 0,
              "spill marker must be negative and invertible");

}  // namespace twell
