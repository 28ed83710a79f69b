// SparseFfn: the FFN a model calls, TwELL or dense per call (rule in include/twell/cuda.h).
#include <algorithm>
#include <cmath>

#include "cuda/cuda_utils.h"
#include "twell/cuda.h"

namespace twell::cuda {

SparseFfn::SparseFfn(SparseFfnOptions options) : options_(options) {
  TWELL_REQUIRE(twell_tile_supported(options.tile), "SparseFfn: tile must be 128 or 256, got {}", options.tile);
  TWELL_REQUIRE(twell_compression_supported(options.compression), "SparseFfn: compression must be 2, 4 or 8, got {}",
                options.compression);
  TWELL_CUDA_CHECK(cudaEventCreate(&start_));
  TWELL_CUDA_CHECK(cudaEventCreate(&stop_));
  TWELL_CUDA_CHECK(cudaMallocHost(&counters_host_, kCounterSlots * sizeof *counters_host_));
  for (cudaEvent_t& ready : counters_ready_) TWELL_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
}

SparseFfn::~SparseFfn() {
  cudaDeviceSynchronize();  // the pinned counters may still be written by the last calls
  for (cudaEvent_t ready : counters_ready_) cudaEventDestroy(ready);
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

int64_t SparseFfn::bucket_key(int64_t rows, double nnz_per_row) {
  const int64_t row_bucket = static_cast<int64_t>(std::ceil(std::log2(static_cast<double>(rows))));
  const int64_t density_bucket = nnz_per_row < 0 ? -1 : static_cast<int64_t>(std::floor(std::log2(1.0 + nnz_per_row)));
  return row_bucket * 64 + density_bucket + 1;
}

void SparseFfn::read_counters() {
  const int64_t oldest_in_flight = std::max<int64_t>(newest_read_ + 1, twell_calls_ - kCounterSlots);
  if (twell_calls_ >= kCounterSlots && newest_read_ < twell_calls_ - kCounterSlots)
    TWELL_CUDA_CHECK(cudaEventSynchronize(counters_ready_[(twell_calls_ - kCounterSlots) % kCounterSlots]));
  for (int64_t call = twell_calls_ - 1; call >= oldest_in_flight; --call) {
    const int slot = static_cast<int>(call % kCounterSlots);
    const cudaError_t state = cudaEventQuery(counters_ready_[slot]);
    if (state == cudaErrorNotReady) continue;
    TWELL_CUDA_CHECK(state);
    const Counters counters = counters_host_[slot];
    last_nnz_per_row_ = static_cast<double>(counters.nnz) / static_cast<double>(slot_rows_[slot]);
    if (counters.spill_used > packed_.spill_capacity && !packed_.empty())
      reserve(packed_, packed_.shape, counters.spill_used + counters.spill_used / 4);
    newest_read_ = call;
    return;
  }
}

void SparseFfn::run_path(bool dense, const bf16* x, int64_t rows, const DeviceFfnWeights& weights, bf16* y,
                         cudaStream_t stream) {
  if (dense) {
    dense_.run(x, rows, weights, y, stream);
    return;
  }
  read_counters();  // also frees this call's slot
  gate_to_twell(x, rows, weights, options_.tile, options_.compression, packed_, stream);
  ffn_from_twell(x, packed_, weights, y, stream);
  const int slot = static_cast<int>(twell_calls_ % kCounterSlots);
  Counters* counters = counters_host_ + slot;
  TWELL_CUDA_CHECK(
      cudaMemcpyAsync(&counters->nnz, packed_.nnz_total.get(), sizeof counters->nnz, cudaMemcpyDeviceToHost, stream));
  TWELL_CUDA_CHECK(cudaMemcpyAsync(&counters->spill_used, packed_.spill_used.get(), sizeof counters->spill_used,
                                   cudaMemcpyDeviceToHost, stream));
  TWELL_CUDA_CHECK(cudaEventRecord(counters_ready_[slot], stream));
  slot_rows_[slot] = rows;
  ++twell_calls_;
}

float SparseFfn::timed_run(bool dense, const bf16* x, int64_t rows, const DeviceFfnWeights& weights, bf16* y,
                           cudaStream_t stream) {
  // The untimed first run takes the one-time costs (plans, allocations, kernel attributes) out.
  constexpr int kTimedRuns = 5;
  run_path(dense, x, rows, weights, y, stream);
  float ms[kTimedRuns];
  for (float& run_ms : ms) {
    TWELL_CUDA_CHECK(cudaEventRecord(start_, stream));
    run_path(dense, x, rows, weights, y, stream);
    TWELL_CUDA_CHECK(cudaEventRecord(stop_, stream));
    TWELL_CUDA_CHECK(cudaEventSynchronize(stop_));
    TWELL_CUDA_CHECK(cudaEventElapsedTime(&run_ms, start_, stop_));
  }
  std::nth_element(ms, ms + kTimedRuns / 2, ms + kTimedRuns);
  return ms[kTimedRuns / 2];
}

void SparseFfn::run(const bf16* x, int64_t rows, const DeviceFfnWeights& weights, bf16* y, cudaStream_t stream) {
  if (!options_.allow_dense) {
    run_path(false, x, rows, weights, y, stream);
    last_dense_ = false;
    return;
  }
  read_counters();
  BucketTiming& timing = timings_[bucket_key(rows, last_nnz_per_row_)];
  if (timing.twell_ms < 0) {
    const float twell_ms = timed_run(false, x, rows, weights, y, stream);
    // The key came from an earlier call's density; the time belongs to the bucket of the density
    // this call had (else a time measured at 0.5% could stand for 2% after the input changed).
    read_counters();  // the timed runs synchronized: the newest slot is this call's
    BucketTiming& measured = timings_[bucket_key(rows, last_nnz_per_row_)];
    if (measured.twell_ms < 0) measured.twell_ms = twell_ms;
    last_dense_ = false;
    return;
  }
  if (timing.dense_ms < 0) {
    timing.dense_ms = timed_run(true, x, rows, weights, y, stream);
    last_dense_ = true;
    return;
  }
  last_dense_ = timing.dense_ms < timing.twell_ms;
  run_path(last_dense_, x, rows, weights, y, stream);
}

}  // namespace twell::cuda
