#include "twell/host_tensors.h"

#include <algorithm>
#include <numeric>

#include "twell/error.h"

namespace twell {

void validate(const FfnWeights& weights) {
  TWELL_REQUIRE(weights.d_model >= 1, "FfnWeights.d_model (D) must be >= 1, got {}", weights.d_model);
  TWELL_REQUIRE(weights.d_hidden >= 1, "FfnWeights.d_hidden (H) must be >= 1, got {}", weights.d_hidden);
  const size_t expected = static_cast<size_t>(weights.d_model) * weights.d_hidden;
  TWELL_REQUIRE(weights.up.size() == expected, "FfnWeights.up must hold H*D = {} floats, got {}", expected,
                weights.up.size());
  TWELL_REQUIRE(weights.down.size() == expected, "FfnWeights.down must hold H*D = {} floats, got {}", expected,
                weights.down.size());
  if (weights.gated)
    TWELL_REQUIRE(weights.gate.size() == expected, "FfnWeights.gate must hold H*D = {} floats, got {}", expected,
                  weights.gate.size());
  else
    TWELL_REQUIRE(weights.gate.empty(), "a non-gated FfnWeights must have no gate, got {} floats",
                  weights.gate.size());
}

FfnWeights sort_neurons_by_activity(const FfnWeights& weights, const std::vector<int64_t>& active_counts) {
  validate(weights);
  TWELL_REQUIRE(active_counts.size() == static_cast<size_t>(weights.d_hidden),
                "sort_neurons_by_activity: {} counts for H = {} neurons", active_counts.size(), weights.d_hidden);
  std::vector<int32_t> order(static_cast<size_t>(weights.d_hidden));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return active_counts[a] > active_counts[b]; });
  FfnWeights sorted = weights;
  const size_t d = static_cast<size_t>(weights.d_model);
  const auto permute = [&](const std::vector<float>& from, std::vector<float>& to) {
    for (size_t j = 0; j < order.size(); ++j)
      std::copy_n(from.begin() + static_cast<ptrdiff_t>(order[j] * d), d, to.begin() + static_cast<ptrdiff_t>(j * d));
  };
  if (weights.gated) permute(weights.gate, sorted.gate);
  permute(weights.up, sorted.up);
  permute(weights.down, sorted.down);
  return sorted;
}

}  // namespace twell
