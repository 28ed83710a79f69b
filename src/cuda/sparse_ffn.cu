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
  TWELL_CUDA_CHECK(cudaMallocHost(&nnz_host_, sizeof *nnz_host_));
  TWELL_CUDA_CHECK(cudaMallocHost(&spill_used_host_, sizeof *spill_used_host_));
  *nnz_host_ = 0;
  *spill_used_host_ = 0;
}

SparseFfn::~SparseFfn() {
  cudaDeviceSynchronize();  // the pinned counters may still be written by the last call
  cudaFreeHost(spill_used_host_);
  cudaFreeHost(nnz_host_);
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

void SparseFfn::run_path(bool dense, const bf16* x, int64_t rows, const DeviceFfnWeights& weights, bf16* y,
                         cudaStream_t stream) {
  if (dense) {
    dense_.run(x, rows, weights, y, stream);
    return;
  }
  // The last call's counters (copied asynchronously at its end) are ready once its work is; reading
  // them here costs no synchronization when this stream has moved on, which is the common case.
  if (last_rows_ > 0 && cudaEventQuery(stop_) != cudaErrorNotReady) {
    last_nnz_per_row_ = static_cast<double>(*nnz_host_) / static_cast<double>(last_rows_);
    if (*spill_used_host_ > packed_.spill_capacity && !packed_.empty())
      reserve(packed_, packed_.shape, *spill_used_host_ + *spill_used_host_ / 4);
  }
  gate_to_twell(x, rows, weights, options_.tile, options_.compression, packed_, stream);
  ffn_from_twell(x, packed_, weights, y, stream);
  TWELL_CUDA_CHECK(cudaMemcpyAsync(nnz_host_, packed_.nnz_total.get(), sizeof *nnz_host_, cudaMemcpyDeviceToHost, stream));
  TWELL_CUDA_CHECK(
      cudaMemcpyAsync(spill_used_host_, packed_.spill_used.get(), sizeof *spill_used_host_, cudaMemcpyDeviceToHost, stream));
  last_rows_ = rows;
}

float SparseFfn::timed_run(bool dense, const bf16* x, int64_t rows, const DeviceFfnWeights& weights, bf16* y,
                           cudaStream_t stream) {
  // The untimed first run takes the one-time costs (plans, allocations, kernel attributes) out; the
  // fastest of kTimedRuns takes out a run slowed by something else (one sample flipped M = 1 at 2%).
  constexpr int kTimedRuns = 3;
  run_path(dense, x, rows, weights, y, stream);
  float fastest = 0;
  for (int run = 0; run < kTimedRuns; ++run) {
    TWELL_CUDA_CHECK(cudaEventRecord(start_, stream));
    run_path(dense, x, rows, weights, y, stream);
    TWELL_CUDA_CHECK(cudaEventRecord(stop_, stream));
    TWELL_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    TWELL_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    fastest = run == 0 ? ms : std::min(fastest, ms);
  }
  return fastest;
}

void SparseFfn::run(const bf16* x, int64_t rows, const DeviceFfnWeights& weights, bf16* y, cudaStream_t stream) {
  if (!options_.allow_dense) {
    run_path(false, x, rows, weights, y, stream);
    TWELL_CUDA_CHECK(cudaEventRecord(stop_, stream));
    last_dense_ = false;
    return;
  }
  BucketTiming& timing = timings_[bucket_key(rows, last_nnz_per_row_)];
  if (timing.twell_ms < 0) {
    const float twell_ms = timed_run(false, x, rows, weights, y, stream);
    // The key came from the previous call's density; the time belongs to the bucket of the density
    // this call had (else a time measured at 0.5% could stand for 2% after the input changed).
    last_nnz_per_row_ = static_cast<double>(*nnz_host_) / rows;
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
  if (!last_dense_) TWELL_CUDA_CHECK(cudaEventRecord(stop_, stream));
}

}  // namespace twell::cuda
