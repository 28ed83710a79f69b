// Predictor settings and their calibration (include/twell/decode.h). The exact projection and the
// predictor scores come from the CPU kernels, so calibrating on a few hundred sample tokens of a
// full-size layer takes about a second.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels.h"
#include "twell/convert.h"
#include "twell/decode.h"
#include "twell/error.h"

namespace twell {

std::string to_string(PredictorKind kind) {
  switch (kind) {
    case PredictorKind::sign_rule: return "sign";
    case PredictorKind::one_bit_gate: return "one-bit";
    case PredictorKind::normalized_one_bit_gate: return "one-bit-norm";
    case PredictorKind::two_bit_gate: return "two-bit-norm";
  }
  return "?";
}

PredictorKind parse_predictor_kind(const std::string& name) {
  for (PredictorKind kind : {PredictorKind::sign_rule, PredictorKind::one_bit_gate,
                             PredictorKind::normalized_one_bit_gate, PredictorKind::two_bit_gate})
    if (name == to_string(kind)) return kind;
  fail("predictor must be 'sign', 'one-bit', 'one-bit-norm' or 'two-bit-norm', got '{}'", name);
}

int32_t sign_rule_max_negatives(double alpha, int32_t d_model) {
  TWELL_REQUIRE(!std::isnan(alpha), "alpha must not be NaN");
  TWELL_REQUIRE(d_model >= 1, "d_model (D) must be >= 1, got {}", d_model);
  // "Predicted zero" is monotone in N_neg (alpha·(D − n) does not grow with n, also in rounded
  // double arithmetic), so the rule is exactly "N_neg <= the last n it keeps".
  int32_t kept = -1;
  for (int32_t n = 0; n <= d_model; ++n) {
    if (static_cast<double>(n) > alpha * static_cast<double>(d_model - n)) break;
    kept = n;
  }
  return kept;
}

namespace {

struct Samples {
  std::vector<float> projection;  // [M, H] exact x·W^T (fp32 kernels)
  std::vector<float> scores;      // [M, H] a gate's score, or N_neg as float for the sign rule
};

Samples score_samples(const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                      PredictorKind kind) {
  validate(weights);
  TWELL_REQUIRE(rows >= 1, "rows (M) must be >= 1, got {}", rows);
  const int32_t cols = weights.d_model, hidden = weights.d_hidden;
  TWELL_REQUIRE(signs.rows == hidden && signs.cols == cols,
                "signs must be packed from the relu projection [H={}, D={}], got [{}, {}]", hidden, cols, signs.rows,
                signs.cols);
  Samples samples;
  samples.projection.resize(static_cast<size_t>(rows) * hidden);
  const cpu::KernelTable& kernels = cpu::active_kernels();
  const float* projection = weights.relu_projection().data();
  constexpr int32_t kNeuronsPerTask = 64;
#pragma omp parallel for num_threads(cpu::num_threads()) schedule(dynamic)
  for (int32_t j = 0; j < hidden; j += kNeuronsPerTask)
    kernels.dot_block(x, rows, projection + static_cast<size_t>(j) * cols, std::min(kNeuronsPerTask, hidden - j),
                      cols, samples.projection.data() + j, hidden);
  samples.scores.resize(samples.projection.size());
  if (kind == PredictorKind::one_bit_gate) {
    cpu::one_bit_gate(x, rows, signs, samples.scores.data());
  } else if (kind == PredictorKind::normalized_one_bit_gate) {
    cpu::normalized_one_bit_gate(x, rows, signs, samples.scores.data());
  } else if (kind == PredictorKind::two_bit_gate) {
    cpu::two_bit_gate(x, rows, signs, samples.scores.data());
  } else {
    std::vector<int32_t> counts(samples.scores.size());
    cpu::negative_sign_products(x, rows, signs, counts.data());
    std::copy(counts.begin(), counts.end(), samples.scores.begin());
  }
  return samples;
}

PredictorQuality quality_of(const Samples& samples, const PredictorConfig& config, int32_t d_model) {
  const int32_t max_negatives =
      config.kind == PredictorKind::sign_rule ? sign_rule_max_negatives(config.alpha, d_model) : 0;
  const float min_score = static_cast<float>(-config.margin);
  PredictorQuality quality;
  quality.pairs = static_cast<int64_t>(samples.scores.size());
  for (size_t i = 0; i < samples.scores.size(); ++i) {
    const bool active = samples.projection[i] > 0.0f;
    const bool predicted = config.kind == PredictorKind::sign_rule
                               ? static_cast<int32_t>(samples.scores[i]) <= max_negatives
                               : samples.scores[i] >= min_score;
    quality.active += active;
    quality.predicted += predicted;
    quality.kept += active && predicted;
  }
  return quality;
}

}  // namespace

PredictorQuality measure_predictor(const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                                   const PredictorConfig& config) {
  return quality_of(score_samples(x, rows, weights, signs, config.kind), config, weights.d_model);
}

bool gates_all_neurons(const PredictorConfig& predictor, int64_t rows, const AllGatesRule& rule) {
  const double kept = std::clamp(predictor.predicted_fraction, 0.0, 1.0);
  return rows >= rule.min_rows ||
         (kept > 0.0 && 1.0 - std::pow(1.0 - kept, static_cast<double>(rows)) >= rule.coverage);
}

bool computes_all_gates(const DecodeOptions& options, const PredictorConfig& predictor, int64_t rows,
                        const AllGatesRule& rule) {
  return options.gates == GateSelection::all_neurons ||
         (options.gates == GateSelection::automatic && gates_all_neurons(predictor, rows, rule));
}

Calibration calibrate_predictor(const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                                PredictorKind kind, double target_recall) {
  TWELL_REQUIRE(target_recall > 0.0 && target_recall <= 1.0, "target_recall must lie in (0, 1], got {}",
                target_recall);
  const Samples samples = score_samples(x, rows, weights, signs, kind);
  std::vector<float> active_scores;  // the scores of the truly active pairs
  for (size_t i = 0; i < samples.scores.size(); ++i)
    if (samples.projection[i] > 0.0f) active_scores.push_back(samples.scores[i]);
  TWELL_REQUIRE(!active_scores.empty(), "calibration samples ({} rows) have no active neuron to keep", rows);
  std::sort(active_scores.begin(), active_scores.end());
  const size_t count = active_scores.size();
  // The fewest pairs that reach the target, as an index into the sorted scores.
  const size_t needed = std::min(count, static_cast<size_t>(std::ceil(target_recall * static_cast<double>(count))));

  Calibration result;
  result.config.kind = kind;
  if (kind != PredictorKind::sign_rule) {
    // Keep scores >= the needed-th largest one.
    result.config.margin = -static_cast<double>(active_scores[count - needed]);
  } else {
    // Keep N_neg <= the needed-th smallest one: the smallest alpha whose integer threshold reaches it.
    const int32_t d_model = weights.d_model;
    const int32_t max_negatives = static_cast<int32_t>(active_scores[needed - 1]);
    double alpha = max_negatives >= d_model ? std::numeric_limits<double>::infinity()
                                            : static_cast<double>(max_negatives) / (d_model - max_negatives);
    while (sign_rule_max_negatives(alpha, d_model) < max_negatives) alpha = std::nextafter(alpha, INFINITY);
    result.config.alpha = alpha;
  }
  result.quality = quality_of(samples, result.config, weights.d_model);
  result.config.predicted_fraction = result.quality.predicted_fraction();
  result.exact_columns = signs.exact_columns;
  return result;
}

std::vector<int32_t> choose_exact_columns(const float* x, int64_t rows, const float* w, int32_t hidden, int32_t cols,
                                          int max_columns) {
  TWELL_REQUIRE(rows >= 1 && hidden >= 1 && cols >= 1,
                "choose_exact_columns: x [M, D] and w [H, D] need M, H, D >= 1, got M = {}, H = {}, D = {}", rows,
                hidden, cols);
  TWELL_REQUIRE(x != nullptr && w != nullptr, "choose_exact_columns: x and w must not be null");
  TWELL_REQUIRE(max_columns >= 0 && max_columns <= kMaxExactColumns,
                "choose_exact_columns: max_columns must lie in [0, {}] (kMaxExactColumns), got {}", kMaxExactColumns,
                max_columns);
  // Σ_j (w[j, k] − scale_j·sign w[j, k])² per column: the one-bit approximation's squared error.
  std::vector<double> weight_error(static_cast<size_t>(cols), 0.0);
  for (int32_t j = 0; j < hidden; ++j) {
    const float* row = w + static_cast<size_t>(j) * cols;  // [D]
    double abs_sum = 0;
    for (int32_t k = 0; k < cols; ++k) abs_sum += std::abs(static_cast<double>(row[k]));
    const double scale = abs_sum / cols;
    for (int32_t k = 0; k < cols; ++k) {
      const double error = std::abs(static_cast<double>(row[k])) - scale;  // same sign as w, so |w − scale·sign w|
      weight_error[k] += error * error;
    }
  }
  std::vector<double> contribution(static_cast<size_t>(cols), 0.0);
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t k = 0; k < cols; ++k) contribution[k] += static_cast<double>(x[m * cols + k]) * x[m * cols + k];
  double mean = 0;
  for (int32_t k = 0; k < cols; ++k) {
    contribution[k] *= weight_error[k] / rows;
    mean += contribution[k] / cols;
  }
  if (!(mean > 0)) return {};  // x = 0 or W exactly ±scale: the estimate is exact already
  std::vector<int32_t> order(static_cast<size_t>(cols));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return contribution[a] > contribution[b]; });
  std::vector<int32_t> chosen;
  const int32_t limit = std::min(max_columns, cols - 1);  // at least one column stays approximated
  for (int32_t k : order) {
    if (static_cast<int32_t>(chosen.size()) == limit || !(contribution[k] >= kExactColumnFactor * mean)) break;
    chosen.push_back(k);
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

SignBits pack_sign_bits_for_samples(const float* x, int64_t rows, const FfnWeights& weights, int max_columns) {
  const float* projection = weights.relu_projection().data();
  return pack_sign_bits(projection, weights.d_hidden, weights.d_model,
                        choose_exact_columns(x, rows, projection, weights.d_hidden, weights.d_model, max_columns));
}

}  // namespace twell
