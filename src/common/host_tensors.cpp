#include "twell/host_tensors.h"

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

}  // namespace twell
