// The model's causal grouped-query attention over its KV cache (include/twell/cpu.h).
//
// Per (query head, block of up to kQueryBlock queries): the block's scores against every position
// its last query sees are one sgemm, the softmax runs over each row's visible part (the rest set to
// 0), and P·V is a second sgemm. The loop it replaced, one query row at a time with scalar dot
// products (an fp32 sum does not vectorize without reassociation), was 4-6x slower at prefill and
// 2-3x at decode (docs/perf-notes.md, Model runtime).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "twell/cpu.h"
#include "twell/error.h"

namespace twell::cpu {
namespace {

// Queries per sgemm: enough rows for OpenBLAS's kernels; the masked corner it computes in vain,
// up to kQueryBlock / 2 scores per row, stays small next to rows of hundreds of positions.
constexpr int32_t kQueryBlock = 64;

// softmax over row[0, visible), 0 at row[visible, width).
void softmax_row(float* row, int32_t visible, int32_t width) {
  float max_score = -INFINITY;
  for (int32_t j = 0; j < visible; ++j) max_score = std::max(max_score, row[j]);
  float total = 0;
  for (int32_t j = 0; j < visible; ++j) {
    row[j] = std::exp(row[j] - max_score);
    total += row[j];
  }
  for (int32_t j = 0; j < visible; ++j) row[j] /= total;
  std::fill(row + visible, row + width, 0.0f);
}

}  // namespace

void causal_attention(const float* q, const float* keys, const float* values, const AttentionShape& s, float scale,
                      float* out, AttentionScratch& scratch) {
  TWELL_REQUIRE(q != nullptr && keys != nullptr && values != nullptr && out != nullptr,
                "causal_attention: q, keys, values and out must not be null");
  TWELL_REQUIRE(s.tokens >= 1 && s.head_dim >= 1 && s.start >= 0,
                "causal_attention: needs n >= 1, Dh >= 1 and start >= 0 (n {}, Dh {}, start {})", s.tokens,
                s.head_dim, s.start);
  TWELL_REQUIRE(s.n_kv_heads >= 1 && s.n_heads % s.n_kv_heads == 0,
                "causal_attention: n_heads ({}) must be a positive multiple of n_kv_heads ({})", s.n_heads,
                s.n_kv_heads);
  const int32_t dh = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const int32_t q_stride = s.n_heads * dh, kv_stride = s.n_kv_heads * dh;  // floats per token / position
  const int32_t blocks = (s.tokens + kQueryBlock - 1) / kQueryBlock;
  const int64_t items = int64_t{blocks} * s.n_heads;
  const int threads = static_cast<int>(std::min<int64_t>(num_threads(), items));
  if (static_cast<int>(scratch.scores.size()) < threads) scratch.scores.resize(threads);
  set_blas_threads(1);  // every sgemm below runs on the OpenMP thread that calls it

#pragma omp parallel for schedule(dynamic) num_threads(threads)
  for (int64_t item = 0; item < items; ++item) {
    // The last blocks see the most positions: start them first.
    const int32_t block = blocks - 1 - static_cast<int32_t>(item / s.n_heads);
    const int32_t h = static_cast<int32_t>(item % s.n_heads);
    const int32_t first = block * kQueryBlock, rows = std::min(kQueryBlock, s.tokens - first);
    const int32_t width = s.start + first + rows;  // positions the block's last query sees
    std::vector<float>& scores = scratch.scores[omp_get_thread_num()];  // [rows, width]
    if (scores.size() < static_cast<size_t>(rows) * width) scores.resize(static_cast<size_t>(rows) * width);
    const float* query = q + int64_t{first} * q_stride + int64_t{h} * dh;
    const float* key = keys + int64_t{h / group} * dh;
    const float* value = values + int64_t{h / group} * dh;
    float* result = out + int64_t{first} * q_stride + int64_t{h} * dh;
    if (rows == 1) {  // a decode step: OpenBLAS's sgemv is faster than its sgemm at M = 1
      cblas_sgemv(CblasRowMajor, CblasNoTrans, width, dh, scale, key, kv_stride, query, 1, 0.0f, scores.data(), 1);
      softmax_row(scores.data(), width, width);
      cblas_sgemv(CblasRowMajor, CblasTrans, width, dh, 1.0f, value, kv_stride, scores.data(), 1, 0.0f, result, 1);
      continue;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, width, dh, scale, query, q_stride, key, kv_stride,
                0.0f, scores.data(), width);
    for (int32_t r = 0; r < rows; ++r) softmax_row(scores.data() + int64_t{r} * width, width - rows + r + 1, width);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, dh, width, 1.0f, scores.data(), width, value,
                kv_stride, 0.0f, result, q_stride);
  }
}

}  // namespace twell::cpu
