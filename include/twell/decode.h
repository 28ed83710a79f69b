// The decode path (M = 1..16 tokens per step): a predictor that reads only the sign bits of the
// relu projection (gate when gated, up otherwise) decides, before any multiplication, which
// neurons can be non-zero; the exact projection is computed only for those, and up + down only for
// the truly active ones. Batched TwELL cannot help here: its gate GEMV reads all of Wg.
//
// Predictors (both read the packed sign bits of W = weights.relu_projection(), docs/formats.md):
//   sign rule     N_neg(m, j) = popcount(sign(x[m]) XOR sign(W[j])) over D;
//                 neuron j predicted zero iff N_neg > alpha·(D − N_neg).        (the seed's method)
//   one-bit gate  s(m, j) = scale_j · Σ_k x[m,k]·sign(W[j,k]),  sign = −1 where the bit is set, else +1,
//                 scale_j = mean |W[j, :]|; predicted active iff s(m, j) >= −margin. (PredictorConfig's
//                 default: every backend has it; `twell calibrate -m` stores two-bit-norm, the best)
//                 margin > 0 keeps neurons whose estimate is a little below zero. On a real ReLU model
//                 the calibrated margin comes out positive (0.66-1.46 on the L1-trained model of
//                 docs/perf-notes.md: the estimate tracks a pre-activation whose threshold is 0); on
//                 the synthetic workload, whose gate threshold sits in one weight column that the
//                 estimate cannot see, it is negative.
//   normalized one-bit gate  z(m, j) = s(m, j) / (residual_j · ||x[m]||₂), residual_j = rms of
//                 W[j] − scale_j·sign(W[j]) (docs/formats.md); predicted active iff z >= −margin.
//                 The estimate's error x·(W[j] − scale_j·sign W[j]) grows with ||x|| and with how far
//                 row j is from ±scale_j, so one margin in units of that error fits every neuron and
//                 token, where the plain margin must cover the worst neuron. Same bits read, one
//                 division more. On a real L1-trained model it keeps ~4x fewer neurons than the
//                 one-bit gate at 99% recall (docs/perf-notes.md "Decode FFN").
//   two-bit gate  the same normalized score with two bits per weight: W[j, k] ≈ sign·(large ?
//                 large_scale_j : small_scale_j), large = |W[j, k]| above the row's 60% quantile of |W| (the
//                 sign-bits format's second plane), divided by ||x||·two_bit_residual_j; predicted
//                 active iff >= −margin. Twice the predictor's bits (on the CPU one pass over both
//                 planes, two sums of sign·x per neuron: over every column and over the large ones),
//                 ~4x fewer kept neurons than one-bit-norm on a real model.
// Exact columns (the sign-bits format's exact_columns): the three gates add Σ_c x[m, col_c]·W[j, col_c]
// over a handful of columns of W kept exactly, approximate only the other columns (scale_j, the
// residuals and the large plane cover those), and take ||x[m]|| over those other columns. Where one
// input channel carries much of the signal (the synthetic workload's threshold column, where x = 1
// meets W[j, 0] = −t_j; an LLM's "massive activation" channels), the bits cannot see it, and keeping it
// exact shrinks the kept set several fold at the same recall. The sign rule ignores them.
// Each is a per-layer setting, chosen by calibrate_predictor for a target recall. On the CPU every
// predictor scores all M tokens of a step in one pass over each neuron's bit words, and the gates
// sum x quantized per token (cpu::gate_inputs below; the CUDA kernel sums x in bf16).
//
// The CUDA decode FFN is in twell/decode_cuda.h.
//
// Errors: a neuron predicted active whose exact gate is <= 0 costs one gate row (the result stays
// exact); a neuron predicted zero whose exact gate is > 0 is dropped: the only lossy case.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "twell/host_tensors.h"
#include "twell/portability.h"

namespace twell {

inline constexpr int32_t kDecodeMaxRows = 16;  // tokens per decode step the fused kernels support

enum class PredictorKind { sign_rule, one_bit_gate, normalized_one_bit_gate, two_bit_gate };
std::string to_string(PredictorKind kind);  // "sign", "one-bit", "one-bit-norm", "two-bit-norm"
PredictorKind parse_predictor_kind(const std::string& name);  // the names above; throws otherwise

struct PredictorConfig {
  PredictorKind kind = PredictorKind::one_bit_gate;
  double alpha = 1.0;   // sign rule
  double margin = 0.0;  // one-bit and two-bit gates
  // Share of (token, neuron) pairs the setting predicts active, as calibrated (calibrate_predictor);
  // 0 when not known. GateSelection::automatic decides from it.
  double predicted_fraction = 0.0;
};

// The setting that keeps every neuron (the sign rule at alpha = +inf, predicted_fraction 1): exact,
// and under GateSelection::automatic served by every gate without scoring. A model's until calibrated.
inline PredictorConfig keeps_every_neuron() {
  return {PredictorKind::sign_rule, std::numeric_limits<double>::infinity(), 0.0, 1.0};
}

// z = score / (residual · norm), the normalized one-bit and two-bit gates; a zero denominator (a row that is
// exactly ±scale, or x = 0) makes the estimate exact, so z is ±inf by the sign of the score (0 for 0).
// Host and device: the CUDA kernels apply the same rule.
TWELL_HD float normalized_score(float score, float residual, float norm) {
  const float unit = residual * norm;
  if (unit > 0.0f) return score / unit;
  return score > 0.0f ? std::numeric_limits<float>::infinity()
                      : score < 0.0f ? -std::numeric_limits<float>::infinity() : 0.0f;
}

// The sign rule as an integer threshold: neuron predicted active iff N_neg <= this
// (-1 when alpha is so small that nothing is kept). Exactly the rule above, evaluated in double.
int32_t sign_rule_max_negatives(double alpha, int32_t d_model);

// Counters of one decode call, summed over its M tokens.
struct DecodeStats {
  int64_t predicted = 0;  // (token, neuron) pairs predicted active: exact gate computed
  int64_t active = 0;     // of those, exact gate > 0: up + down computed
  int64_t missed = -1;    // predicted zero but exact gate > 0; -1 unless DecodeOptions::count_missed
};

// Which neurons a decode call computes the exact gate of.
enum class GateSelection {
  automatic,    // all_neurons where the backend's AllGatesRule says so, else predicted
  predicted,    // the neurons the predictor keeps for some token of the call
  all_neurons,  // every neuron for every token: no predictor runs and nothing is dropped; all of the
                // projection is read, as a dense GEMV reads it, but up and down only for active neurons
};

// Where a backend serves M tokens better with every gate than with the predictor's (measured, per
// backend): from min_rows tokens on whatever the predictor, or when the neurons it keeps for some
// token would cover at least `coverage` of H (tokens taken as independent, 1 − (1 − f)^M with f =
// predicted_fraction; unknown f (0): never by coverage). With most of H covered, the gate rows read
// are nearly all of them anyway and the scoring (its cost grows with M) buys almost nothing.
struct AllGatesRule {
  int64_t min_rows;
  double coverage;
};
// CPU (every gate as one blocked product over all rows): two-bit-norm's predictor stays faster up to
// M = 16 (3.5 against 4.5 ms on the standard workload), the predictor lost at 90% coverage and won at
// 62% (docs/perf-notes.md, "CPU: every gate as a blocked product").
inline constexpr AllGatesRule kCpuAllGates{kDecodeMaxRows + 1, 0.75};
// CUDA: every gate (the streamed kernel) from M = 3 on. With the weights in DRAM, as a model's layers
// find them (H100, graph us a call): at M = 1 the one-bit predictor 9.2 against 10.6, at M = 4 the
// streamed kernel 11.3 against 12.4 (two-bit-norm) and 12.9 (one-bit), at M = 16 18.3 against 23.3;
// M = 2 and 3 were not timed, 3 is where the two lines cross (docs/perf-notes.md, "Every gate in one
// streamed kernel, with the weights in DRAM"). A predictor keeping half of H reads as much as every
// gate costs.
inline constexpr AllGatesRule kCudaAllGates{3, 0.5};
bool gates_all_neurons(const PredictorConfig& predictor, int64_t rows, const AllGatesRule& rule);

// CUDA, every gate: how the gates are computed (the CPU has one way, a blocked product).
enum class AllGatesKernel {
  product,   // decode_gemv (M = 1) or cuBLASLt writes the gates [M, H]; a second kernel does the active pairs
  streamed,  // one kernel: each block copies its 16 neurons' gate rows into shared memory (from before the
             // previous kernel ends), computes their gates for every token on the tensor cores and goes
             // straight on to its active pairs. Only where every block of the call is resident at once
             // (the rows must fit: D = 2048 does, three blocks an SM); elsewhere the product runs. The
             // default: H100, weights in DRAM, graph us a call, streamed against product: 10.6 / 14.6 at
             // M = 1, 11.3 / 15.3 at M = 4, 18.2 / 19.5 at M = 16 (docs/perf-notes.md, "Every gate in
             // one streamed kernel, with the weights in DRAM").
};

struct DecodeOptions {
  // Also compute the exact gate of every neuron predicted zero, to count `missed` (diagnostics and
  // calibration only: it reads all of W and throws the speed away; the output is unchanged).
  bool count_missed = false;
  // y += the FFN's output instead of y = it: the model adds the FFN straight into its residual
  // stream (no zeroing, no separate residual add).
  bool accumulate = false;
  GateSelection gates = GateSelection::automatic;
  AllGatesKernel all_gates_kernel = AllGatesKernel::streamed;
};

// Whether a call computes every gate: gates = all_neurons, or automatic where gates_all_neurons.
bool computes_all_gates(const DecodeOptions& options, const PredictorConfig& predictor, int64_t rows,
                        const AllGatesRule& rule);

// Quality of a predictor on sample inputs, against the exact float64 projection.
struct PredictorQuality {
  int64_t pairs = 0;      // M·H
  int64_t active = 0;     // exact projection > 0
  int64_t predicted = 0;  // predicted active
  int64_t kept = 0;       // active and predicted active
  double recall() const { return active == 0 ? 1.0 : static_cast<double>(kept) / active; }
  double precision() const { return predicted == 0 ? 1.0 : static_cast<double>(kept) / predicted; }
  double predicted_fraction() const { return pairs == 0 ? 0.0 : static_cast<double>(predicted) / pairs; }
  double predicted_over_active() const { return active == 0 ? 0.0 : static_cast<double>(predicted) / active; }
};

// Picks alpha (sign rule) or margin (one-bit gate) so that at least `target_recall` of the truly
// active (token, neuron) pairs of the samples x [M, D] are predicted active, with the smallest
// predicted set the rule allows. Returns the config and its quality on the same samples.
struct Calibration {
  PredictorConfig config;
  PredictorQuality quality;
  std::vector<int32_t> exact_columns;  // signs.exact_columns: the setting holds for sign bits packed with these
};
Calibration calibrate_predictor(const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                                PredictorKind kind, double target_recall = 0.99);
PredictorQuality measure_predictor(const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                                   const PredictorConfig& config);

// One layer's predictor as a model keeps, stores and runs it: the setting and the exact columns its
// sign bits are packed with. They travel together because a margin calibrated with exact columns
// means nothing for sign bits packed without them.
struct LayerPredictor {
  PredictorConfig config;
  std::vector<int32_t> exact_columns;  // ascending; empty: none
};

// The columns of W [H, D] worth keeping exact for the gates on inputs like x [M, D] (the sign-bits
// format's exact_columns): column k's share of the one-bit estimate's error variance is
//   contribution_k = mean_m x[m, k]² · Σ_j (W[j, k] − scale_j·sign W[j, k])²,  scale_j = mean_k |W[j, k]|,
// and the columns with contribution_k >= kExactColumnFactor × the mean contribution are kept, the
// largest first, at most max_columns (and fewer than D), returned ascending. The threshold picks
// outliers only: with every column alike no contribution comes near 16x the mean (sampling noise
// of a few hundred tokens moves one by tens of percent), while a channel that carries the gate's
// offset (the synthetic workload's x[:, 0] = 1 against W[j, 0] = −t_j holds most of the total error,
// about D times the mean) or an LLM's massive-activation channel (x² hundreds of times the typical)
// stands far above it. Each exact column costs a float per neuron and a multiply-add per (token,
// neuron), so only the few that dominate the error are worth it.
inline constexpr double kExactColumnFactor = 16.0;
std::vector<int32_t> choose_exact_columns(const float* x, int64_t rows, const float* w, int32_t hidden, int32_t cols,
                                          int max_columns = kMaxExactColumns);
// The sign bits of weights.relu_projection() packed with the exact columns chosen on the samples
// x [rows, D] (choose_exact_columns, at most max_columns).
SignBits pack_sign_bits_for_samples(const float* x, int64_t rows, const FfnWeights& weights,
                                    int max_columns = kMaxExactColumns);

}  // namespace twell

namespace twell::cpu {

// The CPU gates see each token's x quantized over the approximated columns: x_k -> step·q_k,
// q_k = round-to-nearest-even(x_k / step), step = the smallest power of two (>= the smallest float)
// with max_k |x_k| / step <= kGateInputLevels; exact columns keep x_k. So |x_k − step·q_k| <= step/2
// < max_k |x_k| / 2047 (11 bits, against bf16's 8 in the CUDA kernel's x), the gates' masked sums are
// exact sums of 16-bit integers (32 columns per AVX-512 add, and a score depends neither on M, nor
// on the ISA, nor on a summation order), and step·q_k is a float, so a float64 reference fed these
// inputs gives the same scores up to the final roundings. Outlier channels coarsen every other
// column's step: exact columns are the place for them. The sign rule reads x's signs unquantized.
inline constexpr int32_t kGateInputLevels = 2047;
// x [M, D] as the CPU gates see it: [M, D] (for tests and the quality tools).
std::vector<float> gate_inputs(const float* x, int64_t rows, const SignBits& signs);

// The predictor's raw scores, for tests and calibration. x [M, D], signs packed from W [H, D].
void negative_sign_products(const float* x, int64_t rows, const SignBits& signs, int32_t* counts);  // [M, H]
void one_bit_gate(const float* x, int64_t rows, const SignBits& signs, float* scores);               // [M, H]
void normalized_one_bit_gate(const float* x, int64_t rows, const SignBits& signs, float* scores);    // [M, H] z
void two_bit_gate(const float* x, int64_t rows, const SignBits& signs, float* scores);               // [M, H] z

// Buffers reused across calls (grown, never shrunk); a call allocates only to grow them.
struct DecodeScratch {
  std::vector<int16_t> x_quantized;  // [M, 32·words] q (gate_inputs), zero past D and at the exact columns
  std::vector<float> steps;          // [M] the step of each row's q
  std::vector<int32_t> row_sums;     // [M] Σ_k q[m, k]
  std::vector<float> row_norms;      // [M] ||step·q[m, :]||₂
  std::vector<float> x_exact;        // [M, c] x at the signs' exact columns
  std::vector<uint32_t> x_signs;     // [M, words]
  struct ActiveNeuron {
    int32_t row;
    int32_t neuron;
    float coefficient;  // relu(g)·u (gated) or relu(u): the weight of neuron's down row
  };
  std::vector<std::vector<ActiveNeuron>> active;  // one list per thread
};

// y [M, D] = Σ over predicted-active neurons with exact gate > 0 of coefficient · down[j].
// x [M, D], 1 <= M <= kDecodeMaxRows; signs = pack_sign_bits(weights.relu_projection()).
DecodeStats decode_ffn(const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                       const PredictorConfig& predictor, float* y, DecodeScratch& scratch,
                       const DecodeOptions& options = {});

}  // namespace twell::cpu
