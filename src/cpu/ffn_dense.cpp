// The dense FFN through OpenBLAS (fp32 weights, all threads): the baseline every sparse CPU path
// is timed against. One row goes through sgemv (OpenBLAS 0.3.21 has no sgemm -> sgemv forwarding,
// and its sgemm at M = 1 is slower), more rows through sgemm.
//
// Threads: OpenBLAS runs single-threaded inside our OpenMP team, each thread on its own slice of
// the output (what OpenBLAS's own threading does too). Two thread pools on the same cores, OpenBLAS's
// pthreads and OpenMP's, spin-wait against each other: with 2 cores both the dense and the sparse
// timings became erratic (2-10x slower) when they alternated.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <climits>

#include "kernels.h"
#include "twell/error.h"

namespace twell::cpu {
namespace {

// Part `part` of `parts` equal slices of [0, count), boundaries on 16 floats (a cache line).
struct Slice {
  int32_t begin, end;
};
Slice slice_of(int part, int parts, int32_t count) {
  constexpr int32_t kAlign = 16;
  const int32_t step = ((count + parts - 1) / parts + kAlign - 1) / kAlign * kAlign;
  const int32_t begin = std::min(count, part * step);
  return {begin, std::min(count, begin + step)};
}

// out [M, H] = x [M, D] · w^T, w [H, D]; this thread's slice of the H columns.
void project(const float* x, int64_t rows, const float* w, int32_t h, int32_t d, float* out, Slice s) {
  if (s.end <= s.begin) return;
  const float* w_slice = w + static_cast<int64_t>(s.begin) * d;  // [s.end - s.begin, D]
  if (rows == 1)
    cblas_sgemv(CblasRowMajor, CblasNoTrans, s.end - s.begin, d, 1.0f, w_slice, d, x, 1, 0.0f, out + s.begin, 1);
  else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), s.end - s.begin, d, 1.0f, x, d,
                w_slice, d, 0.0f, out + s.begin, h);
}

// y [M, D] = hidden [M, H] · w, w [H, D]; this thread's slice of the D columns.
void project_down(const float* hidden, int64_t rows, const float* w, int32_t h, int32_t d, float* y, Slice s) {
  if (s.end <= s.begin) return;
  if (rows == 1)
    cblas_sgemv(CblasRowMajor, CblasTrans, h, s.end - s.begin, 1.0f, w + s.begin, d, hidden, 1, 0.0f, y + s.begin, 1);
  else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), s.end - s.begin, h, 1.0f, hidden,
                h, w + s.begin, d, 0.0f, y + s.begin, d);
}

}  // namespace

void ffn_dense(const float* x, int64_t rows, const FfnWeights& weights, float* y, DenseScratch& scratch) {
  validate(weights);
  TWELL_REQUIRE(x != nullptr && y != nullptr, "ffn_dense: x and y must not be null");
  TWELL_REQUIRE(rows >= 1 && rows <= INT32_MAX, "ffn_dense: rows (M) must lie in [1, 2^31), got {}", rows);
  const int32_t d = weights.d_model;
  const int32_t h = weights.d_hidden;
  const int64_t hidden_count = rows * h;
  scratch.gate.resize(hidden_count);                    // [M, H] relu projection, then h
  if (weights.gated) scratch.up.resize(hidden_count);  // [M, H]
  float* hidden = scratch.gate.data();
  const float* relu_weights = weights.relu_projection().data();
  const int threads = num_threads();
  set_blas_threads(1);

#pragma omp parallel num_threads(threads)
  {
    const int part = omp_get_thread_num();
    const Slice hidden_slice = slice_of(part, threads, h);
    project(x, rows, relu_weights, h, d, hidden, hidden_slice);
    if (weights.gated) project(x, rows, weights.up.data(), h, d, scratch.up.data(), hidden_slice);
    // Each thread finishes its own columns of h: no barrier needed before this step.
    const float* up = scratch.up.data();
    for (int64_t m = 0; m < rows; ++m)
      for (int32_t j = hidden_slice.begin; j < hidden_slice.end; ++j) {
        float& value = hidden[m * h + j];
        value = weights.gated ? std::max(value, 0.0f) * up[m * h + j] : std::max(value, 0.0f);
      }
#pragma omp barrier
    project_down(hidden, rows, weights.down.data(), h, d, y, slice_of(part, threads, d));
  }
}

std::vector<int64_t> count_active_neurons(const float* x, int64_t rows, const FfnWeights& weights) {
  validate(weights);
  TWELL_REQUIRE(x != nullptr, "count_active_neurons: x must not be null");
  TWELL_REQUIRE(rows >= 1, "count_active_neurons: rows (M) must be >= 1, got {}", rows);
  const int32_t d = weights.d_model, h = weights.d_hidden;
  constexpr int64_t kChunkRows = 256;  // bounds the [rows, H] projection held at once
  std::vector<float> projection(static_cast<size_t>(std::min(rows, kChunkRows)) * h);
  std::vector<int64_t> counts(static_cast<size_t>(h), 0);
  const int threads = num_threads();
  set_blas_threads(1);
  for (int64_t first = 0; first < rows; first += kChunkRows) {
    const int64_t chunk = std::min(kChunkRows, rows - first);
#pragma omp parallel num_threads(threads)
    {
      const Slice slice = slice_of(omp_get_thread_num(), threads, h);
      project(x + first * d, chunk, weights.relu_projection().data(), h, d, projection.data(), slice);
      for (int64_t m = 0; m < chunk; ++m)
        for (int32_t j = slice.begin; j < slice.end; ++j) counts[j] += projection[m * h + j] > 0.0f;
    }
  }
  return counts;
}

}  // namespace twell::cpu
