// Token sampling: greedy, or temperature with optional top-k and top-p (nucleus) truncation.
#include <algorithm>
#include <cmath>

#include "twell/error.h"
#include "twell/model.h"

namespace twell {

Sampler::Sampler(SamplerConfig config) : config_(config), rng_(config.seed) {
  TWELL_REQUIRE(config.temperature >= 0 && std::isfinite(config.temperature),
                "temperature must be a finite number >= 0, got {}", config.temperature);
  TWELL_REQUIRE(config.top_k >= 0, "top_k must be >= 0 (0 = off), got {}", config.top_k);
  TWELL_REQUIRE(config.top_p > 0 && config.top_p <= 1, "top_p must be in (0, 1], got {}", config.top_p);
}

int32_t Sampler::sample(const float* logits, int32_t vocab_size) {
  TWELL_REQUIRE(vocab_size >= 1, "sample: vocab_size must be >= 1, got {}", vocab_size);
  if (config_.temperature == 0.0f) {
    // Greedy; std::max_element keeps the first of equal maxima, so ties go to the lowest id (as torch.argmax).
    return static_cast<int32_t>(std::max_element(logits, logits + vocab_size) - logits);
  }
  candidates_.clear();
  for (int32_t id = 0; id < vocab_size; ++id) candidates_.emplace_back(logits[id], id);
  auto larger = [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; };
  size_t kept = candidates_.size();
  if (config_.top_k > 0 && static_cast<size_t>(config_.top_k) < kept) {
    kept = config_.top_k;
    std::partial_sort(candidates_.begin(), candidates_.begin() + kept, candidates_.end(), larger);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), larger);
  }
  // Softmax over the kept candidates, largest first; then the nucleus: the shortest prefix whose
  // probability reaches top_p.
  const float max_logit = candidates_[0].first;
  double total = 0;
  for (size_t i = 0; i < kept; ++i) {
    candidates_[i].first = std::exp((candidates_[i].first - max_logit) / config_.temperature);
    total += candidates_[i].first;
  }
  if (config_.top_p < 1.0f) {
    double cumulative = 0;
    size_t nucleus = 0;
    while (nucleus < kept) {
      cumulative += candidates_[nucleus].first / total;
      ++nucleus;
      if (cumulative >= config_.top_p) break;
    }
    kept = nucleus;
    total = 0;
    for (size_t i = 0; i < kept; ++i) total += candidates_[i].first;
  }
  const double target = std::uniform_real_distribution<double>(0.0, total)(rng_);
  double cumulative = 0;
  for (size_t i = 0; i < kept; ++i) {
    cumulative += candidates_[i].first;
    if (target < cumulative) return candidates_[i].second;
  }
  return candidates_[kept - 1].second;
}

}  // namespace twell
