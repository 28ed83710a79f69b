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
  if (call.probe_of_rows > 0) {
    const double keyed = nnz_per_row(call.probe_of_rows, call.layer);
    if (keyed < 0 || std::abs(density_bucket(keyed) - density_bucket(row_nnz)) >= 2)
      rechecks_.insert({row_bucket(call.probe_of_rows), call.layer});
    return;
  }
  const LayerAtRows at{row_bucket(call.rows), call.layer};
  if (call.hot == 0) {
    newest_nnz_per_row_[at.first] = row_nnz;
    layer_nnz_per_row_[at] = row_nnz;
    return;
  }
  const int64_t seen = density_bucket(row_nnz);
  const auto any_first = first_split_density_buckets_.try_emplace({call.bucket, call.hot}, seen).first;
  const auto [own_first, new_here] = split_density_buckets_.try_emplace({call.bucket, call.hot, call.layer}, seen);
  // A layer running on another layer's density (new weights, or a layer not yet seen plain) whose
  // split is far from that layer's would otherwise never be looked at again: its path stays the one
  // chosen for the other density (a split at 10% ran 4x slower than dense).
  const bool borrowed = !layer_nnz_per_row_.contains(at);
  const int64_t reference = !new_here ? own_first->second : borrowed ? any_first->second : seen;
  // Two buckets apart: one apart is the call-to-call noise of few rows (at M = 1 the rotated inputs
  // alone made a split recheck on every other call).
  if (std::abs(reference - seen) >= 2) rechecks_.insert(at);
}

double FfnDensityBook::nnz_per_row(int64_t rows, const void* layer) const {
  const int64_t bucket = row_bucket(rows);
  if (const auto own = layer_nnz_per_row_.find({bucket, layer}); own != layer_nnz_per_row_.end()) return own->second;
  const auto newest = newest_nnz_per_row_.find(bucket);
  return newest == newest_nnz_per_row_.end() ? -1.0 : newest->second;
}

bool FfnDensityBook::density_probe_due(int64_t rows, const void* layer) {
  const LayerAtRows at{row_bucket(rows), layer};
  const int64_t calls = ++dense_calls_[at];
  return calls % kDenseCallsPerProbe == 0 || (calls == 1 && !layer_nnz_per_row_.contains(at));
}

bool FfnDensityBook::take_recheck(int64_t rows, const void* layer) {
  return rechecks_.erase({row_bucket(rows), layer}) > 0;
}

}  // namespace twell::cuda
