// Hybrid ELL + dense-backup format: the sparse activations of the training FFN.
// Shared by CPU and CUDA code; docs/formats.md carries the same text.
//
// Parameters
//   M          rows (tokens)
//   H          columns (FFN hidden neurons), 1 <= H < 2^31
//   W          ELL width: the most non-zeros a row may keep in the compact block, 1 <= W <= H
//   capacity   rows the dense backup can hold
//
// Arrays (row-major)
//   ell_values  bf16  [M, W]        row r's non-zeros in ascending column order in [r, 0:row_nnz[r]]
//                                   when row_nnz[r] <= W; every other entry 0.
//   ell_cols    int32 [M, W]        their columns; every other entry 0 (harmless with a 0 value).
//   row_nnz     int32 [M]           the row's true number of non-zeros (also when it exceeds W).
//   backup_slot int32 [M]           -1 when the row fits the ELL block; otherwise b, and the row
//                                   lives densely in backup[b] while its ELL entries are all 0.
//   backup      bf16  [capacity, H] dense copies of the rows with more than W non-zeros (exactly
//                                   row_nnz non-zeros each; zeros written as +0.0).
//   backup_rows int32 [capacity]    backup row b holds row backup_rows[b]; entries >= backup_used unused.
//                                   For b < backup_used: backup_rows[b] == r iff backup_slot[r] == b.
//   backup_used int32               backup rows in use. A producer never drops a row: it grows the
//                                   backup (CPU) or reports backup_used > capacity so the caller can
//                                   grow it and repeat, or take the dense path (GPU).
#pragma once

#include <cstdint>

#include "twell/bf16.h"
#include "twell/portability.h"

namespace twell {

struct HybridShape {
  int64_t rows = 0;      // M
  int32_t cols = 0;      // H
  int32_t ell_width = 0; // W

  TWELL_HD constexpr int64_t ell_count() const { return rows * ell_width; }
  TWELL_HD constexpr int64_t ell_index(int64_t row, int32_t k) const { return row * ell_width + k; }
};

inline constexpr int32_t kHybridRowInEll = -1;

static_assert(sizeof(bf16) == 2 && sizeof(int32_t) == 4, "hybrid arrays use 2-byte values and 4-byte indices");

}  // namespace twell
