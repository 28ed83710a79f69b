#include "twell/workload.h"

#include <cmath>

#include "twell/cpu.h"
#include "twell/error.h"

namespace twell {
namespace {

// splitmix64: tiny, fast and identical on every platform (std::normal_distribution is not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1): never 0, so the logarithm below is finite.
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() {  // Box-Muller, one value per call for simplicity
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
  }

 private:
  uint64_t state_;
};

void fill_normal(std::vector<float>& out, size_t count, double stddev, Rng& rng) {
  out.resize(count);
  for (auto& value : out) value = round_to_bf16(static_cast<float>(stddev * rng.normal()));
}

double standard_normal_cdf(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

}  // namespace

double gate_threshold_for_density(double density) {
  TWELL_REQUIRE(density >= 0.0 && density <= 1.0, "density must lie in [0, 1], got {}", density);
  // Far enough out that no realistic pre-activation crosses it.
  if (density == 0.0) return 64.0;
  if (density == 1.0) return -64.0;
  double lo = -40.0, hi = 40.0;  // Φ^-1(1 - density) by bisection: monotone and exact enough
  for (int i = 0; i < 200; ++i) {
    double mid = 0.5 * (lo + hi);
    (standard_normal_cdf(mid) < 1.0 - density ? lo : hi) = mid;
  }
  return std::sqrt(1.25) * 0.5 * (lo + hi);
}

std::vector<float> make_activations(int64_t rows, int32_t d_model, uint64_t seed) {
  TWELL_REQUIRE(rows >= 1, "rows (M) must be >= 1, got {}", rows);
  TWELL_REQUIRE(d_model >= 2, "d_model (D) must be >= 2, got {}", d_model);
  Rng rng(seed * 0x2545f4914f6cdd1dull + 17);
  std::vector<float> x;
  fill_normal(x, static_cast<size_t>(rows) * d_model, 1.0, rng);
  for (int64_t m = 0; m < rows; ++m) x[m * d_model] = 1.0f;
  return x;
}

std::vector<std::vector<float>> rotated_inputs(const Workload& work, int count) {
  TWELL_REQUIRE(count >= 1, "input sets must be >= 1, got {}", count);
  std::vector<std::vector<float>> inputs = {work.x};
  for (int i = 1; i < count; ++i)
    inputs.push_back(
        make_activations(work.spec.rows, work.spec.d_model, work.spec.seed + 1000 * static_cast<uint64_t>(i)));
  return inputs;
}

std::vector<float> make_normal(size_t count, double stddev, uint64_t seed) {
  Rng rng(seed * 0xd1342543de82ef95ull + 29);
  std::vector<float> values;
  fill_normal(values, count, stddev, rng);
  return values;
}

Workload make_workload(const WorkloadSpec& spec) {
  TWELL_REQUIRE(spec.d_hidden >= 1, "d_hidden (H) must be >= 1, got {}", spec.d_hidden);
  TWELL_REQUIRE(spec.hot_neurons >= 0 && spec.hot_neurons <= spec.d_hidden,
                "hot_neurons must lie in [0, H={}], got {}", spec.d_hidden, spec.hot_neurons);
  Workload work;
  work.spec = spec;
  work.x = make_activations(spec.rows, spec.d_model, spec.seed);

  FfnWeights& w = work.weights;
  w.d_model = spec.d_model;
  w.d_hidden = spec.d_hidden;
  w.gated = spec.gated;
  const size_t count = static_cast<size_t>(spec.d_hidden) * spec.d_model;
  const double stddev = 1.0 / std::sqrt(static_cast<double>(spec.d_model));
  Rng rng(spec.seed * 0x9e3779b97f4a7c15ull + 3);
  if (spec.gated) fill_normal(w.gate, count, stddev, rng);
  fill_normal(w.up, count, stddev, rng);
  fill_normal(w.down, count, stddev, rng);

  std::vector<float>& relu_weights = spec.gated ? w.gate : w.up;
  const double t0 = gate_threshold_for_density(spec.density);
  for (int32_t j = 0; j < spec.d_hidden; ++j) {
    double threshold = j < spec.hot_neurons ? -3.0 : t0 + 0.5 * rng.normal();
    relu_weights[static_cast<size_t>(j) * spec.d_model] = round_to_bf16(static_cast<float>(-threshold));
  }
  return work;
}

double measured_nnz_per_row(const float* x, int64_t rows, const FfnWeights& weights) {
  validate(weights);
  const std::vector<float>& w = weights.relu_projection();
  const int32_t d = weights.d_model;
  int64_t nnz = 0;
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t j = 0; j < weights.d_hidden; ++j) {
      double acc = 0.0;
      for (int32_t k = 0; k < d; ++k) acc += static_cast<double>(x[m * d + k]) * w[static_cast<size_t>(j) * d + k];
      nnz += acc > 0.0;
    }
  return static_cast<double>(nnz) / static_cast<double>(rows);
}

FfnWeights sorted_by_activity(const FfnWeights& weights, uint64_t seed) {
  constexpr int64_t kCalibrationRows = 1024;
  const std::vector<float> x = make_activations(kCalibrationRows, weights.d_model, seed);
  return sort_neurons_by_activity(weights, cpu::count_active_neurons(x.data(), kCalibrationRows, weights));
}

}  // namespace twell
