// The model's causal grouped-query attention over its KV cache (include/twell/cpu.h).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "twell/cpu.h"
#include "twell/error.h"

namespace twell::cpu {

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
  const int32_t positions = s.start + s.tokens;
  const int threads = num_threads();
  if (static_cast<int>(scratch.scores.size()) < threads) scratch.scores.resize(threads);
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads)
  for (int32_t i = 0; i < s.tokens; ++i) {
    for (int32_t h = 0; h < s.n_heads; ++h) {
      std::vector<float>& scores = scratch.scores[omp_get_thread_num()];
      if (static_cast<int32_t>(scores.size()) < positions) scores.resize(positions);
      const int32_t kv_head = h / group;
      const int32_t visible = s.start + i + 1;
      const float* query = q + (int64_t{i} * s.n_heads + h) * dh;
      float max_score = -INFINITY;
      for (int32_t j = 0; j < visible; ++j) {
        const float* key = keys + (int64_t{j} * s.n_kv_heads + kv_head) * dh;
        float dot = 0;
        for (int32_t d = 0; d < dh; ++d) dot += query[d] * key[d];
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      float total = 0;
      for (int32_t j = 0; j < visible; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        total += scores[j];
      }
      float* row = out + (int64_t{i} * s.n_heads + h) * dh;
      std::fill_n(row, dh, 0.0f);
      for (int32_t j = 0; j < visible; ++j) {
        const float weight = scores[j] / total;
        const float* value = values + (int64_t{j} * s.n_kv_heads + kv_head) * dh;
        for (int32_t d = 0; d < dh; ++d) row[d] += weight * value[d];
      }
    }
  }
}

}  // namespace twell::cpu
