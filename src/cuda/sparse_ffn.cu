// SparseFfn: the FFN a model calls, TwELL or dense per call (rule in include/twell/cuda.h).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

#include "cuda/cuda_utils.h"
#include "cuda/ffn_density_book.h"
#include "cuda/timed_choice.h"
#include "twell/cuda.h"

namespace twell::cuda {

SparseFfn::SparseFfn(SparseFfnOptions options)
    : options_(std::move(options)), densities_(std::make_unique<FfnDensityBook>(kCounterSlots)) {
  for (double fraction : options_.hot_fractions)
    TWELL_REQUIRE(fraction > 0 && fraction < 1, "SparseFfn: hot fractions must lie in (0, 1), got {}", fraction);
  TWELL_REQUIRE(twell_tile_supported(options_.tile), "SparseFfn: tile must be 128 or 256, got {}", options_.tile);
  TWELL_REQUIRE(twell_compression_supported(options_.compression), "SparseFfn: compression must be 2, 4 or 8, got {}",
                options_.compression);
  TWELL_CUDA_CHECK(cudaEventCreate(&start_));
  TWELL_CUDA_CHECK(cudaEventCreate(&stop_));
  TWELL_CUDA_CHECK(cudaMallocHost(&counters_host_, kCounterSlots * sizeof *counters_host_));
  for (cudaEvent_t& ready : counters_ready_) TWELL_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  if (options_.split_side_stream && !options_.hot_fractions.empty()) {
    side_ = std::make_unique<SideStream>();
    TWELL_CUDA_CHECK(cudaEventCreateWithFlags(&twell_done_, cudaEventDisableTiming));
  }
}

SparseFfn::~SparseFfn() {
  cudaDeviceSynchronize();  // the pinned counters may still be written by the last calls
  for (cudaEvent_t ready : counters_ready_) cudaEventDestroy(ready);
  if (twell_done_) cudaEventDestroy(twell_done_);
  cudaFreeHost(counters_host_);
  cudaEventDestroy(stop_);
  cudaEventDestroy(start_);
}

int64_t SparseFfn::scratch_bytes() const {
  const int64_t packed = packed_.slot_capacity * static_cast<int64_t>(sizeof(TwellSlot)) +
                         packed_.tile_capacity * static_cast<int64_t>(sizeof(int32_t)) +
                         packed_.spill_capacity * packed_.shape.tile * static_cast<int64_t>(sizeof(bf16));
  return packed + dense_.scratch_bytes();
}

void SparseFfn::read_counters() {
  if (twell_calls_ >= kCounterSlots && newest_read_ < twell_calls_ - kCounterSlots)
    TWELL_CUDA_CHECK(cudaEventSynchronize(counters_ready_[(twell_calls_ - kCounterSlots) % kCounterSlots]));
  // Oldest first, every finished one: the slots hold different layers' calls and probes, and
  // reading only the newest dropped the others' densities. Every issue comes after a read, so no
  // unread call's slot has been reused.
  for (int64_t call = newest_read_ + 1; call < twell_calls_; ++call) {
    const int slot = static_cast<int>(call % kCounterSlots);
    const cudaError_t state = cudaEventQuery(counters_ready_[slot]);
    if (state == cudaErrorNotReady) return;
    TWELL_CUDA_CHECK(state);
    const Counters counters = counters_host_[slot];
    densities_->observe(slot, counters.nnz);
    if (counters.spill_used > packed_.spill_capacity && !packed_.empty())
      reserve(packed_, packed_.shape, counters.spill_used + counters.spill_used / 4);
    newest_read_ = call;
  }
}

std::vector<std::pair<std::string, float>> SparseFfn::last_bucket_times() const {
  std::vector<std::pair<std::string, float>> times;
  const auto found = timings_.find(current_bucket_);
  if (found == timings_.end()) return times;
  for (int path = 0; path < path_count(); ++path) {
    const float ms = found->second[static_cast<size_t>(path)];
    if (ms < 0 || !std::isfinite(ms)) continue;
    const double fraction = path >= kFirstSplitPath ? options_.hot_fractions[static_cast<size_t>(path - kFirstSplitPath)] : 0;
    times.emplace_back(path == kTwellPath   ? "twell"
                       : path == kDensePath ? "dense"
                                            : fmt::format("hot_{:.3f}", fraction),
                       ms);
  }
  return times;
}

int32_t SparseFfn::hot_neurons(int path, int32_t hidden) const {
  if (path < kFirstSplitPath) return 0;
  return split_hot_neurons(options_.hot_fractions[static_cast<size_t>(path - kFirstSplitPath)], hidden, options_.tile);
}

bool SparseFfn::path_available(int path, int32_t hidden) const {
  if (path == kDensePath) return options_.allow_dense;
  const int32_t hot = hot_neurons(path, hidden);
  return path == kTwellPath || (hot > 0 && hot < hidden);
}

void SparseFfn::run_path(int path, const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y,
                         cudaStream_t stream) {
  if (path == kDensePath) {
    dense_.run(x, rows, weights, y, stream);
    return;
  }
  const int32_t hot = hot_neurons(path, weights.d_hidden);
  const bool side_by_side = hot > 0 && side_ != nullptr;
  if (side_by_side) {
    side_->wait_for(stream);  // x
  } else if (hot > 0) {
    dense_.run(x, rows, weights.neurons(0, hot), y, stream);
  }
  const DeviceFfnView sparse = weights.neurons(hot, weights.d_hidden);
  read_counters();  // also frees this call's slot
  gate_to_twell(x, rows, sparse, options_.tile, options_.compression, packed_, stream);
  ffn_from_twell(x, packed_, sparse, y, stream, /*accumulate=*/hot > 0 && !side_by_side);
  if (side_by_side) {
    // TwELL first on the caller's stream: its chain (gate GEMM, then up+down) is the longer one.
    TWELL_CUDA_CHECK(cudaEventRecord(twell_done_, stream));
    dense_.run(x, rows, weights.neurons(0, hot), y, side_->get(), {}, /*add_to_y=*/true, twell_done_);
    side_->join_into(stream);
  }
  copy_counters(rows, hot, weights.relu_projection(), /*probe_of_rows=*/0, stream);
}

void SparseFfn::copy_counters(int64_t rows, int32_t hot, const void* layer, int64_t probe_of_rows,
                              cudaStream_t stream) {
  const int slot = static_cast<int>(twell_calls_ % kCounterSlots);
  Counters* counters = counters_host_ + slot;
  TWELL_CUDA_CHECK(
      cudaMemcpyAsync(&counters->nnz, packed_.nnz_total.get(), sizeof counters->nnz, cudaMemcpyDeviceToHost, stream));
  TWELL_CUDA_CHECK(cudaMemcpyAsync(&counters->spill_used, packed_.spill_used.get(), sizeof counters->spill_used,
                                   cudaMemcpyDeviceToHost, stream));
  TWELL_CUDA_CHECK(cudaEventRecord(counters_ready_[slot], stream));
  densities_->issue(slot, {.rows = rows, .hot = hot, .bucket = current_bucket_, .layer = layer,
                           .probe_of_rows = probe_of_rows});
  ++twell_calls_;
}

void SparseFfn::probe_density(const bf16* x, int64_t rows, const DeviceFfnView& weights, cudaStream_t stream) {
  // Rows from the middle: a batch's first rows are its first sequence's first tokens, whose
  // activations are the least typical.
  const int64_t probed = std::min(rows, kProbeRows);
  read_counters();  // also frees this probe's slot
  gate_to_twell(x + (rows - probed) / 2 * weights.d_model, probed, weights, options_.tile, options_.compression,
                packed_, stream);
  copy_counters(probed, /*hot=*/0, weights.relu_projection(), rows, stream);
}

float SparseFfn::time_once(int path, const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y,
                           cudaStream_t stream) {
  float ms = 0;
  TWELL_CUDA_CHECK(cudaEventRecord(start_, stream));
  run_path(path, x, rows, weights, y, stream);
  TWELL_CUDA_CHECK(cudaEventRecord(stop_, stream));
  TWELL_CUDA_CHECK(cudaEventSynchronize(stop_));
  TWELL_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
  return ms;
}

float SparseFfn::timed_run(int path, const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y,
                           cudaStream_t stream) {
  // The untimed first run takes the one-time costs (plans, allocations, kernel attributes) out.
  run_path(path, x, rows, weights, y, stream);
  std::vector<float> ms(kTimedRuns);
  for (float& run_ms : ms) run_ms = time_once(path, x, rows, weights, y, stream);
  return median_of(std::move(ms));
}

void SparseFfn::time_in_turns(const int (&paths)[2], const bf16* x, int64_t rows, const DeviceFfnView& weights,
                              bf16* y, cudaStream_t stream, std::vector<float>& timing) {
  std::vector<float> ms[2] = {std::vector<float>(kTimedRuns), std::vector<float>(kTimedRuns)};
  for (int run = 0; run < kTimedRuns; ++run)
    for (int turn = 0; turn < 2; ++turn) {
      const int side = (run + turn) % 2;  // each path goes first in every other round
      ms[side][run] = time_once(paths[side], x, rows, weights, y, stream);
    }
  for (int side = 0; side < 2; ++side) timing[static_cast<size_t>(paths[side])] = median_of(std::move(ms[side]));
}

void SparseFfn::run(const bf16* x, int64_t rows, const DeviceFfnView& weights, bf16* y, cudaStream_t stream) {
  const auto finish = [&](int path, bool measured = false) {
    last_path_ = path;
    last_hot_neurons_ = hot_neurons(path, weights.d_hidden);
    last_call_measured_ = measured;
  };
  if (!options_.allow_dense && options_.hot_fractions.empty()) {
    run_path(kTwellPath, x, rows, weights, y, stream);
    finish(kTwellPath);
    return;
  }
  const void* layer = weights.relu_projection();
  const auto bucket = [&]() -> std::vector<float>& {
    std::vector<float>& ms = timings_[call_bucket(rows, densities_->nnz_per_row(rows, layer))];
    if (ms.empty()) ms.assign(static_cast<size_t>(path_count()), -1.0f);
    return ms;
  };
  read_counters();
  if (densities_->take_recheck(rows, layer)) {
    run_path(kTwellPath, x, rows, weights, y, stream);
    finish(kTwellPath, /*measured=*/true);
    return;
  }
  current_bucket_ = call_bucket(rows, densities_->nnz_per_row(rows, layer));
  std::vector<float>& timing = bucket();
  if (timing[kTwellPath] < 0) {
    const float twell_ms = timed_run(kTwellPath, x, rows, weights, y, stream);
    // The key came from an earlier call's density; the time belongs to the bucket of the density
    // this call had (else a time measured at 0.5% could stand for 2% after the input changed).
    read_counters();  // the timed runs synchronized: the newest slot is this call's
    std::vector<float>& measured = bucket();
    if (measured[kTwellPath] < 0) measured[kTwellPath] = twell_ms;
    finish(kTwellPath, /*measured=*/true);
    return;
  }
  for (int path = kDensePath; path < path_count(); ++path) {
    if (timing[path] >= 0) continue;
    if (!path_available(path, weights.d_hidden)) {
      timing[path] = std::numeric_limits<float>::infinity();
      continue;
    }
    timing[path] = timed_run(path, x, rows, weights, y, stream);
    finish(path, /*measured=*/true);
    return;
  }
  const FastestTwo two = fastest_two(timing, kCloseRatio);
  // Each path was timed in a call of its own, one after the other: the GPU's clocks and temperature
  // drift between them by as much as close paths differ (H100: the split 5-6% faster than dense at
  // D = 4096, M = 16384, 2%, yet dense chosen; docs/perf-notes.md). The two fastest, if close, are
  // timed once more in alternation, and that decides.
  if (two.close_second >= 0 && compared_buckets_.insert(current_bucket_).second) {
    time_in_turns({two.best, two.close_second}, x, rows, weights, y, stream, timing);
    finish(timing[two.close_second] < timing[two.best] ? two.close_second : two.best, /*measured=*/true);
    return;
  }
  const int best = two.best;
  run_path(best, x, rows, weights, y, stream);
  if (best == kDensePath && densities_->density_probe_due(rows, layer)) probe_density(x, rows, weights, stream);
  finish(best);
}

}  // namespace twell::cuda
