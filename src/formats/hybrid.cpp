// Dense / TwELL -> hybrid ELL + dense backup (include/twell/formats/hybrid.h), and its checker.
#include <algorithm>

#include "twell/convert.h"
#include "twell/error.h"

namespace twell {
namespace {

bool is_nonzero(bf16 value) { return (value.bits & 0x7fffu) != 0; }

void require_shape(const HybridShape& shape) {
  TWELL_REQUIRE(shape.rows >= 1, "hybrid rows (M) must be >= 1, got {}", shape.rows);
  TWELL_REQUIRE(shape.cols >= 1, "hybrid cols (H) must be >= 1, got {}", shape.cols);
  TWELL_REQUIRE(shape.ell_width >= 1 && shape.ell_width <= shape.cols,
                "hybrid ell_width (W) must lie in [1, H = {}], got {}", shape.cols, shape.ell_width);
}

}  // namespace

HybridMatrix hybrid_from_dense(const bf16* dense, int64_t rows, int32_t cols, int32_t ell_width) {
  HybridMatrix hybrid;
  hybrid.shape = HybridShape{.rows = rows, .cols = cols, .ell_width = ell_width};
  require_shape(hybrid.shape);
  TWELL_REQUIRE(dense != nullptr, "hybrid_from_dense: dense must not be null");
  const HybridShape& shape = hybrid.shape;
  hybrid.ell_values.assign(static_cast<size_t>(shape.ell_count()), bf16{0});
  hybrid.ell_cols.assign(static_cast<size_t>(shape.ell_count()), 0);
  hybrid.row_nnz.assign(static_cast<size_t>(rows), 0);
  hybrid.backup_slot.assign(static_cast<size_t>(rows), kHybridRowInEll);

  for (int64_t m = 0; m < rows; ++m) {
    const bf16* row = dense + m * cols;  // [H]
    const int32_t nnz = static_cast<int32_t>(std::count_if(row, row + cols, is_nonzero));
    hybrid.row_nnz[m] = nnz;
    if (nnz <= ell_width) {
      int32_t k = 0;
      for (int32_t col = 0; col < cols; ++col)
        if (is_nonzero(row[col])) {
          hybrid.ell_values[shape.ell_index(m, k)] = row[col];
          hybrid.ell_cols[shape.ell_index(m, k)] = col;
          ++k;
        }
    } else {
      // The backup grows by one dense row; zeros are stored as +0.0, as an ELL row reads back.
      const int32_t b = hybrid.backup_used++;
      hybrid.backup_slot[m] = b;
      hybrid.backup_rows.push_back(static_cast<int32_t>(m));
      hybrid.backup.resize(hybrid.backup.size() + cols, bf16{0});
      bf16* backup_row = hybrid.backup.data() + static_cast<size_t>(b) * cols;
      for (int32_t col = 0; col < cols; ++col)
        if (is_nonzero(row[col])) backup_row[col] = row[col];
    }
  }
  return hybrid;
}

HybridMatrix hybrid_from_twell(const TwellMatrix& packed, int32_t ell_width) {
  // Through the dense rows: a TwELL slot that holds a bf16 zero (a gate that underflowed) is then
  // dropped like any other zero.
  const std::vector<bf16> dense = dense_from_twell(packed);  // [M, H]
  return hybrid_from_dense(dense.data(), packed.shape.rows, packed.shape.cols, ell_width);
}

std::vector<bf16> dense_from_hybrid(const HybridMatrix& hybrid) {
  validate(hybrid);
  const HybridShape& shape = hybrid.shape;
  std::vector<bf16> dense(static_cast<size_t>(shape.rows) * shape.cols, bf16{0});  // [M, H]
  for (int64_t m = 0; m < shape.rows; ++m) {
    bf16* row = dense.data() + m * shape.cols;
    const int32_t b = hybrid.backup_slot[m];
    if (b != kHybridRowInEll) {
      const bf16* backup_row = hybrid.backup.data() + static_cast<size_t>(b) * shape.cols;
      std::copy(backup_row, backup_row + shape.cols, row);
    } else {
      for (int32_t k = 0; k < hybrid.row_nnz[m]; ++k)
        row[hybrid.ell_cols[shape.ell_index(m, k)]] = hybrid.ell_values[shape.ell_index(m, k)];
    }
  }
  return dense;
}

void validate(const HybridMatrix& hybrid) {
  const HybridShape& shape = hybrid.shape;
  require_shape(shape);
  const size_t ell_count = static_cast<size_t>(shape.ell_count());
  const size_t rows = static_cast<size_t>(shape.rows);
  TWELL_REQUIRE(hybrid.ell_values.size() == ell_count, "hybrid ell_values must hold M*W = {} values, got {}",
                ell_count, hybrid.ell_values.size());
  TWELL_REQUIRE(hybrid.ell_cols.size() == ell_count, "hybrid ell_cols must hold M*W = {} columns, got {}", ell_count,
                hybrid.ell_cols.size());
  TWELL_REQUIRE(hybrid.row_nnz.size() == rows, "hybrid row_nnz must hold M = {} counts, got {}", rows,
                hybrid.row_nnz.size());
  TWELL_REQUIRE(hybrid.backup_slot.size() == rows, "hybrid backup_slot must hold M = {} entries, got {}", rows,
                hybrid.backup_slot.size());
  const size_t capacity = hybrid.backup_rows.size();
  TWELL_REQUIRE(hybrid.backup.size() == capacity * shape.cols,
                "hybrid backup must hold capacity*H = {}*{} values (capacity = backup_rows.size()), got {}", capacity,
                shape.cols, hybrid.backup.size());
  TWELL_REQUIRE(hybrid.backup_used >= 0 && static_cast<size_t>(hybrid.backup_used) <= capacity,
                "hybrid backup_used must lie in [0, capacity = {}], got {} (an incomplete backup)", capacity,
                hybrid.backup_used);

  for (int64_t m = 0; m < shape.rows; ++m) {
    const int32_t nnz = hybrid.row_nnz[m];
    const int32_t b = hybrid.backup_slot[m];
    TWELL_REQUIRE(nnz >= 0 && nnz <= shape.cols, "hybrid row_nnz[{}] must lie in [0, H = {}], got {}", m, shape.cols,
                  nnz);
    const int32_t valid = b == kHybridRowInEll ? nnz : 0;  // ELL entries in use
    if (b == kHybridRowInEll) {
      TWELL_REQUIRE(nnz <= shape.ell_width,
                    "hybrid row {} has row_nnz = {} > W = {} but no backup row (backup_slot = -1)", m, nnz,
                    shape.ell_width);
    } else {
      TWELL_REQUIRE(b >= 0 && b < hybrid.backup_used, "hybrid backup_slot[{}] must be -1 or in [0, backup_used = {}), got {}",
                    m, hybrid.backup_used, b);
      TWELL_REQUIRE(hybrid.backup_rows[b] == m, "hybrid backup row {} is claimed by row {} but backup_rows[{}] = {}", b,
                    m, b, hybrid.backup_rows[b]);
      TWELL_REQUIRE(nnz > shape.ell_width, "hybrid row {} lives in the backup but has row_nnz = {} <= W = {}", m, nnz,
                    shape.ell_width);
      const bf16* backup_row = hybrid.backup.data() + static_cast<size_t>(b) * shape.cols;
      const auto backup_nnz = std::count_if(backup_row, backup_row + shape.cols, is_nonzero);
      TWELL_REQUIRE(backup_nnz == nnz, "hybrid row {}: row_nnz = {} but its backup row {} holds {} non-zeros", m, nnz,
                    b, backup_nnz);
    }
    for (int32_t k = 0; k < valid; ++k) {
      const int32_t col = hybrid.ell_cols[shape.ell_index(m, k)];
      TWELL_REQUIRE(col >= 0 && col < shape.cols, "hybrid ell_cols[{}, {}] = {} is outside [0, H = {})", m, k, col,
                    shape.cols);
      TWELL_REQUIRE(k == 0 || col > hybrid.ell_cols[shape.ell_index(m, k - 1)],
                    "hybrid ell_cols[{}, {}] = {} is not after the previous column {}", m, k, col,
                    hybrid.ell_cols[shape.ell_index(m, k - 1)]);
    }
    for (int32_t k = valid; k < shape.ell_width; ++k)
      TWELL_REQUIRE(hybrid.ell_values[shape.ell_index(m, k)].bits == 0 && hybrid.ell_cols[shape.ell_index(m, k)] == 0,
                    "hybrid ELL entry [{}, {}] is unused but holds value {:#06x}, column {}; both must be 0", m, k,
                    hybrid.ell_values[shape.ell_index(m, k)].bits, hybrid.ell_cols[shape.ell_index(m, k)]);
  }
  // Each backup row in use is claimed by exactly one row: the check above covers rows -> backup rows,
  // this one covers backup rows -> rows.
  for (int32_t b = 0; b < hybrid.backup_used; ++b) {
    const int32_t owner = hybrid.backup_rows[b];
    TWELL_REQUIRE(owner >= 0 && owner < shape.rows && hybrid.backup_slot[owner] == b,
                  "hybrid backup row {} names row {}, which does not point back to it", b, owner);
  }
}

}  // namespace twell
