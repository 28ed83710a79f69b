// The dense FFN through OpenBLAS (fp32 weights, all threads): the baseline every sparse CPU path
// is timed against. One row goes through sgemv (OpenBLAS 0.3.21 has no sgemm -> sgemv forwarding,
// and its sgemm at M = 1 is slower), more rows through sgemm.
#include <cblas.h>

#include <algorithm>

#include "kernels.h"
#include "twell/error.h"

namespace twell::cpu {
namespace {

// out [M, H] = x [M, D] · w^T, w [H, D].
void project(const float* x, int64_t rows, const float* w, int32_t h, int32_t d, float* out) {
  if (rows == 1)
    cblas_sgemv(CblasRowMajor, CblasNoTrans, h, d, 1.0f, w, d, x, 1, 0.0f, out, 1);
  else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), h, d, 1.0f, x, d, w, d, 0.0f, out, h);
}

// y [M, D] = hidden [M, H] · w, w [H, D].
void project_down(const float* hidden, int64_t rows, const float* w, int32_t h, int32_t d, float* y) {
  if (rows == 1)
    cblas_sgemv(CblasRowMajor, CblasTrans, h, d, 1.0f, w, d, hidden, 1, 0.0f, y, 1);
  else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), d, h, 1.0f, hidden, h, w, d, 0.0f,
                y, d);
}

}  // namespace

void ffn_dense(const float* x, int64_t rows, const FfnWeights& weights, float* y, DenseScratch& scratch) {
  validate(weights);
  TWELL_REQUIRE(x != nullptr && y != nullptr, "ffn_dense: x and y must not be null");
  TWELL_REQUIRE(rows >= 1 && rows <= INT32_MAX, "ffn_dense: rows (M) must lie in [1, 2^31), got {}", rows);
  const int32_t d = weights.d_model;
  const int32_t h = weights.d_hidden;
  const int64_t hidden_count = rows * h;
  set_blas_threads(num_threads());

  scratch.gate.resize(hidden_count);  // [M, H] relu projection, then h
  project(x, rows, weights.relu_projection().data(), h, d, scratch.gate.data());
  float* hidden = scratch.gate.data();
  if (weights.gated) {
    scratch.up.resize(hidden_count);  // [M, H]
    project(x, rows, weights.up.data(), h, d, scratch.up.data());
    const float* up = scratch.up.data();
#pragma omp parallel for simd num_threads(num_threads()) schedule(static)
    for (int64_t i = 0; i < hidden_count; ++i) hidden[i] = std::max(hidden[i], 0.0f) * up[i];
  } else {
#pragma omp parallel for simd num_threads(num_threads()) schedule(static)
    for (int64_t i = 0; i < hidden_count; ++i) hidden[i] = std::max(hidden[i], 0.0f);
  }
  project_down(hidden, rows, weights.down.data(), h, d, y);
}

}  // namespace twell::cpu
