// Dense <-> TwELL (include/twell/formats/twell.h), and the checker of every TwELL invariant.
#include <algorithm>

#include "twell/convert.h"
#include "twell/error.h"

namespace twell {
namespace {

// ±0.0 is "nothing here"; every other bit pattern (negative values and NaN too) is a stored value.
bool is_nonzero(bf16 value) { return (value.bits & 0x7fffu) != 0; }

void require_shape(const TwellShape& shape) {
  TWELL_REQUIRE(shape.rows >= 1, "TwELL rows (M) must be >= 1, got {}", shape.rows);
  TWELL_REQUIRE(shape.cols >= 1 && shape.cols <= kTwellMaxColumns,
                "TwELL cols (H) must lie in [1, {}] so a column fits 16 bits, got {}", kTwellMaxColumns, shape.cols);
  TWELL_REQUIRE(twell_tile_supported(shape.tile), "TwELL tile (T) must be 128 or 256, got {}", shape.tile);
  TWELL_REQUIRE(twell_compression_supported(shape.compression), "TwELL compression (C) must be 2, 4 or 8, got {}",
                shape.compression);
}

}  // namespace

TwellMatrix twell_from_dense(const bf16* dense, int64_t rows, int32_t cols, int32_t tile, int32_t compression) {
  TwellMatrix packed;
  packed.shape = TwellShape{.rows = rows, .cols = cols, .tile = tile, .compression = compression};
  require_shape(packed.shape);
  TWELL_REQUIRE(dense != nullptr, "twell_from_dense: dense must not be null");
  const TwellShape& shape = packed.shape;
  const int32_t slots = shape.slots();
  packed.slots.assign(static_cast<size_t>(shape.slot_count()), 0);
  packed.tile_nnz.assign(static_cast<size_t>(shape.tile_count()), 0);

  for (int64_t m = 0; m < rows; ++m) {
    const bf16* row = dense + m * cols;  // [H]
    for (int32_t t = 0; t < shape.n_tiles(); ++t) {
      const int32_t begin = t * tile;
      const int32_t end = std::min(begin + tile, cols);
      const int32_t nnz = static_cast<int32_t>(std::count_if(row + begin, row + end, is_nonzero));
      int32_t& tile_nnz = packed.tile_nnz[shape.tile_index(m, t)];
      if (nnz <= slots) {
        tile_nnz = nnz;
        int32_t slot = 0;
        for (int32_t col = begin; col < end; ++col)
          if (is_nonzero(row[col]))
            packed.slots[shape.slot_index(m, t, slot++)] = twell_make_slot(row[col].bits, static_cast<uint32_t>(col));
      } else {
        // Overflow: the whole tile goes densely to a new spill row (zeros as +0.0, as a slot-packed tile reads back).
        tile_nnz = twell_spilled_marker(packed.spill_used++);
        const size_t first = packed.spill.size();
        packed.spill.resize(first + tile, bf16{0});
        for (int32_t col = begin; col < end; ++col)
          if (is_nonzero(row[col])) packed.spill[first + (col - begin)] = row[col];
      }
    }
  }
  return packed;
}

std::vector<bf16> dense_from_twell(const TwellMatrix& packed) {
  validate(packed);
  const TwellShape& shape = packed.shape;
  std::vector<bf16> dense(static_cast<size_t>(shape.rows) * shape.cols, bf16{0});  // [M, H]
  for (int64_t m = 0; m < shape.rows; ++m) {
    bf16* row = dense.data() + m * shape.cols;
    for (int32_t t = 0; t < shape.n_tiles(); ++t) {
      const int32_t tile_nnz = packed.tile_nnz[shape.tile_index(m, t)];
      if (twell_tile_spilled(tile_nnz)) {
        const int32_t begin = t * shape.tile;
        const int32_t end = std::min(begin + shape.tile, shape.cols);
        const bf16* segment = packed.spill.data() + static_cast<size_t>(twell_spill_row(tile_nnz)) * shape.tile;
        std::copy(segment, segment + (end - begin), row + begin);
      } else {
        for (int32_t s = 0; s < tile_nnz; ++s) {
          const TwellSlot slot = packed.slots[shape.slot_index(m, t, s)];
          row[twell_slot_column(slot)] = bf16{twell_slot_value_bits(slot)};
        }
      }
    }
  }
  return dense;
}

void validate(const TwellMatrix& packed) {
  const TwellShape& shape = packed.shape;
  require_shape(shape);
  TWELL_REQUIRE(packed.slots.size() == static_cast<size_t>(shape.slot_count()),
                "TwELL slots must hold M*n_tiles*S = {} words, got {}", shape.slot_count(), packed.slots.size());
  TWELL_REQUIRE(packed.tile_nnz.size() == static_cast<size_t>(shape.tile_count()),
                "TwELL tile_nnz must hold M*n_tiles = {} counts, got {}", shape.tile_count(), packed.tile_nnz.size());
  TWELL_REQUIRE(packed.spill.size() % static_cast<size_t>(shape.tile) == 0,
                "TwELL spill must hold whole rows of T = {} values, got {} values", shape.tile, packed.spill.size());
  TWELL_REQUIRE(packed.spill_used >= 0, "TwELL spill_used must be >= 0, got {}", packed.spill_used);
  TWELL_REQUIRE(packed.complete(),
                "TwELL packing is incomplete: spill_used = {} rows requested but spill capacity is {} rows",
                packed.spill_used, packed.spill_capacity());

  const int32_t slots = shape.slots();
  std::vector<int64_t> spill_owner(static_cast<size_t>(packed.spill_used), -1);  // tile index using each spill row
  for (int64_t m = 0; m < shape.rows; ++m)
    for (int32_t t = 0; t < shape.n_tiles(); ++t) {
      const int32_t tile_nnz = packed.tile_nnz[shape.tile_index(m, t)];
      const int32_t begin = t * shape.tile;
      const int32_t end = std::min(begin + shape.tile, shape.cols);
      const TwellSlot* tile_slots = packed.slots.data() + shape.slot_index(m, t, 0);  // [S]
      const int32_t valid = twell_tile_spilled(tile_nnz) ? 0 : tile_nnz;
      TWELL_REQUIRE(valid <= slots, "TwELL tile_nnz[{}, {}] = {} exceeds the S = {} slots of a tile", m, t, tile_nnz,
                    slots);
      for (int32_t s = 0; s < valid; ++s) {
        const uint32_t col = twell_slot_column(tile_slots[s]);
        TWELL_REQUIRE(static_cast<int32_t>(col) >= begin && static_cast<int32_t>(col) < end,
                      "TwELL slot [{}, {}, {}] has column {}, outside its tile's columns [{}, {})", m, t, s, col, begin,
                      end);
        TWELL_REQUIRE(s == 0 || col > twell_slot_column(tile_slots[s - 1]),
                      "TwELL slot [{}, {}, {}] has column {}, not after the previous slot's column {}", m, t, s, col,
                      twell_slot_column(tile_slots[s - 1]));
      }
      for (int32_t s = valid; s < slots; ++s)
        TWELL_REQUIRE(tile_slots[s] == 0, "TwELL slot [{}, {}, {}] is unused (tile_nnz = {}) but holds {:#010x}, not 0",
                      m, t, s, tile_nnz, tile_slots[s]);
      if (!twell_tile_spilled(tile_nnz)) continue;

      const int64_t spill_row = -static_cast<int64_t>(tile_nnz) - 1;  // twell_spill_row, safe for INT32_MIN
      TWELL_REQUIRE(spill_row < packed.spill_used, "TwELL tile [{}, {}] points to spill row {}, but spill_used is {}",
                    m, t, spill_row, packed.spill_used);
      int64_t& owner = spill_owner[static_cast<size_t>(spill_row)];
      TWELL_REQUIRE(owner < 0, "TwELL spill row {} is used by two tiles ([{}, {}] and tile index {})", spill_row, m, t,
                    owner);
      owner = shape.tile_index(m, t);
      const bf16* segment = packed.spill.data() + static_cast<size_t>(spill_row) * shape.tile;  // [T]
      for (int32_t col = end; col < begin + shape.tile; ++col)
        TWELL_REQUIRE(segment[col - begin].bits == 0,
                      "TwELL spill row {} (tile [{}, {}]) holds {:#06x} at column {} past H = {}; it must be 0",
                      spill_row, m, t, segment[col - begin].bits, col, shape.cols);
    }
  for (size_t row = 0; row < spill_owner.size(); ++row)
    TWELL_REQUIRE(spill_owner[row] >= 0, "TwELL spill row {} of the {} in use belongs to no tile", row,
                  packed.spill_used);
}

}  // namespace twell
