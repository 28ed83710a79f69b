// The float64 reference attention and RoPE (include/twell/reference.h): the oracles of the CUDA
// attention kernels, written as the definitions read, one query row (one head) at a time.
#include <algorithm>
#include <cmath>

#include "twell/error.h"
#include "twell/reference.h"

namespace twell::ref {

std::vector<double> causal_attention(const float* q, const float* keys, const float* values,
                                     const CachedAttentionShape& s, double scale) {
  TWELL_REQUIRE(s.batch >= 1 && s.tokens >= 1 && s.head_dim >= 1, "causal_attention: empty shape (B {}, n {}, Dh {})",
                s.batch, s.tokens, s.head_dim);
  TWELL_REQUIRE(s.n_kv_heads >= 1 && s.n_heads % s.n_kv_heads == 0,
                "causal_attention: n_heads ({}) must be a positive multiple of n_kv_heads ({})", s.n_heads,
                s.n_kv_heads);
  TWELL_REQUIRE(s.start >= 0 && s.start + s.tokens <= s.stride,
                "causal_attention: start {} + n {} positions exceed the cache stride {}", s.start, s.tokens, s.stride);
  const int64_t dh = s.head_dim, group = s.n_heads / s.n_kv_heads;
  std::vector<double> out(static_cast<size_t>(int64_t{s.batch} * s.tokens * s.n_heads * dh));
  std::vector<double> weights(static_cast<size_t>(s.start + s.tokens));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.n_heads; ++h) {
      const int64_t cache_base = (b * s.n_kv_heads + h / group) * s.stride * dh;
      for (int64_t t = 0; t < s.tokens; ++t) {
        const float* query = q + ((b * s.n_heads + h) * s.tokens + t) * dh;
        const int64_t visible = s.start + t + 1;
        double max_score = -INFINITY;
        for (int64_t j = 0; j < visible; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < dh; ++d) dot += double{query[d]} * keys[cache_base + j * dh + d];
          weights[j] = scale * dot;
          max_score = std::max(max_score, weights[j]);
        }
        double total = 0;
        for (int64_t j = 0; j < visible; ++j) total += weights[j] = std::exp(weights[j] - max_score);
        double* row = out.data() + ((b * s.tokens + t) * s.n_heads + h) * dh;
        for (int64_t j = 0; j < visible; ++j)
          for (int64_t d = 0; d < dh; ++d) row[d] += weights[j] / total * values[cache_base + j * dh + d];
      }
    }
  return out;
}

std::vector<double> rms_norm(const float* x, int64_t rows, int32_t d, const float* weight, double eps) {
  std::vector<double> y(static_cast<size_t>(rows) * d);
  for (int64_t r = 0; r < rows; ++r) {
    double sum_squares = 0;
    for (int32_t k = 0; k < d; ++k) sum_squares += double{x[r * d + k]} * x[r * d + k];
    const double inv_rms = 1.0 / std::sqrt(sum_squares / d + eps);
    for (int32_t k = 0; k < d; ++k) y[r * d + k] = weight[k] * (x[r * d + k] * inv_rms);
  }
  return y;
}

void rope(double* x, int32_t head_dim, int32_t position, float rope_theta) {
  TWELL_REQUIRE(head_dim >= 2 && head_dim % 2 == 0, "rope: head_dim must be even, got {}", head_dim);
  const int32_t half = head_dim / 2;
  for (int32_t i = 0; i < half; ++i) {
    const float inv_freq = 1.0f / std::pow(rope_theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
    const double angle = static_cast<float>(position) * inv_freq;
    const double c = std::cos(angle), s = std::sin(angle), x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x1 * c + x0 * s;
  }
}

std::vector<double> decode_attention_rope(const float* qkv, const float* bias, std::vector<float> keys,
                                          std::vector<float> values, const CachedAttentionShape& shape,
                                          float rope_theta, double scale) {
  TWELL_REQUIRE(shape.tokens == 1, "decode_attention_rope: one token per sequence, got {}", shape.tokens);
  const int32_t dh = shape.head_dim;
  const int64_t q_width = int64_t{shape.n_heads} * dh, kv_width = int64_t{shape.n_kv_heads} * dh;
  const int64_t width = q_width + 2 * kv_width;
  TWELL_REQUIRE(keys.size() == values.size() &&
                    keys.size() == static_cast<size_t>(int64_t{shape.batch} * kv_width * shape.stride),
                "decode_attention_rope: caches of {} and {} elements, {} expected", keys.size(), values.size(),
                int64_t{shape.batch} * kv_width * shape.stride);
  std::vector<float> q(static_cast<size_t>(shape.batch * q_width));  // [B, H_q, Dh]
  std::vector<double> row(static_cast<size_t>(width));
  for (int32_t b = 0; b < shape.batch; ++b) {
    for (int64_t k = 0; k < width; ++k) row[k] = double{qkv[b * width + k]} + (bias ? bias[k] : 0.0);
    for (int32_t h = 0; h < shape.n_heads + shape.n_kv_heads; ++h)  // q heads, then k heads
      rope(row.data() + h * dh, dh, shape.start, rope_theta);
    for (int64_t e = 0; e < q_width; ++e) q[b * q_width + e] = static_cast<float>(row[e]);
    for (int32_t h = 0; h < shape.n_kv_heads; ++h) {
      const int64_t at = ((int64_t{b} * shape.n_kv_heads + h) * shape.stride + shape.start) * dh;
      for (int32_t d = 0; d < dh; ++d) {
        keys[at + d] = static_cast<float>(row[q_width + h * dh + d]);
        values[at + d] = static_cast<float>(row[q_width + kv_width + h * dh + d]);
      }
    }
  }
  return causal_attention(q.data(), keys.data(), values.data(), shape, scale);
}

}  // namespace twell::ref
