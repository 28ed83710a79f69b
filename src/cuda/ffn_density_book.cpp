#include "cuda/ffn_density_book.h"

#include <cstdlib>

#include "cuda/timed_choice.h"
#include "twell/error.h"

namespace twell::cuda {

FfnDensityBook::FfnDensityBook(int slots) {
  TWELL_REQUIRE(slots >= 1, "FfnDensityBook: slots must be >= 1, got {}", slots);
  calls_.resize(static_cast<size_t>(slots));
}

void FfnDensityBook::issue(int slot, const Call& call) { calls_.at(static_cast<size_t>(slot)) = call; }

void FfnDensityBook::observe(int slot, uint64_t nnz) {
  const Call& call = calls_.at(static_cast<size_t>(slot));
  const double row_nnz = static_cast<double>(nnz) / static_cast<double>(call.rows);
  if (call.hot == 0) {
    nnz_per_row_[row_bucket(call.rows)] = row_nnz;
    return;
  }
  // Two buckets apart: one apart is the call-to-call noise of few rows (at M = 1 the rotated inputs
  // alone made a split recheck on every other call).
  const auto [seen, first] =
      split_density_buckets_.try_emplace({call.bucket, call.hot, call.layer}, density_bucket(row_nnz));
  if (!first && std::abs(seen->second - density_bucket(row_nnz)) >= 2) recheck_rows_.insert(row_bucket(call.rows));
}

double FfnDensityBook::nnz_per_row(int64_t rows) const {
  const auto seen = nnz_per_row_.find(row_bucket(rows));
  return seen == nnz_per_row_.end() ? -1.0 : seen->second;
}

bool FfnDensityBook::take_recheck(int64_t rows) { return recheck_rows_.erase(row_bucket(rows)) > 0; }

}  // namespace twell::cuda
