// The CPU decode FFN (include/twell/decode.h): predictor -> exact gate for predicted-active neurons
// -> ReLU -> up and down for the truly active ones, fp32 with fp32 accumulation.
//
// Two phases in one OpenMP region:
//   1. neurons split statically over the threads: each thread scores its neurons for every row,
//      computes the exact projection for the predicted ones and appends the truly active ones
//      (row, neuron, relu(g)·u) to its own list. Only predicted rows of W are read. (With every gate,
//      DecodeOptions::gates, no scoring: blocks of neurons against all rows at once, as a GEMM.)
//   2. after the barrier, columns of y split over the threads: each thread adds coefficient · down[j]
//      over every list into its own columns. No atomics, and the sum order depends only on the
//      thread count, so a call is deterministic.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "decode_kernels.h"
#include "kernels.h"
#include "twell/convert.h"
#include "twell/decode.h"
#include "twell/error.h"

namespace twell::cpu {

const DecodeKernelTable& active_decode_kernels() {
  switch (active_isa()) {
    case Isa::avx512:
      return avx512_decode_kernels();
    case Isa::avx2:
      return avx2_decode_kernels();
    case Isa::scalar:
      break;
  }
  return scalar_decode_kernels();
}

namespace {

// Neurons per dot_block call when every gate is computed.
constexpr int32_t kAllGatesBlock = 64;

// The power-of-two step of gate_inputs for a row whose largest |x| over the approximated columns
// is `largest` (finite).
float gate_input_step(float largest) {
  if (!(largest > 0.0f)) return 1.0f;  // every q is 0
  int exponent;
  std::frexp(largest, &exponent);  // largest in [2^(exponent−1), 2^exponent)
  // 2^(exponent − 11) puts largest / step in [1024, 2048); one more step when it lands above 2047.
  float step = std::ldexp(1.0f, std::max(exponent - 11, std::numeric_limits<float>::min_exponent - 24));
  if (largest / step > static_cast<float>(kGateInputLevels)) step *= 2.0f;
  return step;
}

// x [M, D] -> x_quantized [M, 32·words] (gate_inputs' q, zeros past D and at the exact columns, so the
// masked sums cover the approximated columns only), the steps, q's row sums, the norms of step·q, x
// at the exact columns [M, c], and, when asked, x's sign bits [M, words] in the sign-bits format (bit
// set iff x < 0, so -0.0 packs as 0; every column, as the sign rule reads them).
void prepare_rows(const float* x, int64_t rows, const SignBits& signs, bool pack_signs, DecodeScratch& scratch) {
  const int32_t cols = signs.cols, words = signs.words_per_row();
  const int32_t padded = words * kSignBitsPerWord;
  const size_t exact_count = signs.exact_columns.size();
  scratch.x_quantized.assign(static_cast<size_t>(rows) * padded, 0);
  scratch.x_exact.resize(static_cast<size_t>(rows) * exact_count);
  scratch.steps.resize(rows);
  scratch.row_sums.resize(rows);
  scratch.row_norms.resize(rows);
  for (int64_t m = 0; m < rows; ++m) {
    const float* x_row = x + m * cols;  // [D]
    // One pass: every column must be finite; the step follows the approximated columns only.
    float largest = 0.0f;
    bool finite = true;
    for (int32_t k = 0, next = 0; k < cols; ++k) {
      finite &= std::isfinite(x_row[k]);
      if (next < static_cast<int32_t>(exact_count) && signs.exact_columns[next] == k) {
        ++next;
        continue;
      }
      largest = std::max(largest, std::abs(x_row[k]));
    }
    TWELL_REQUIRE(finite, "x must be finite: row {} of the decode input holds a NaN or infinity", m);
    for (size_t c = 0; c < exact_count; ++c) scratch.x_exact[m * exact_count + c] = x_row[signs.exact_columns[c]];
    const float step = gate_input_step(largest);
    const double inverse = 1.0 / step;  // exact: a power of two (in double even for the smallest step)
    int16_t* q_row = scratch.x_quantized.data() + m * padded;  // [32·words]
    int32_t sum = 0;
    int64_t square_sum = 0;
    for (int32_t k = 0; k < cols; ++k) {
      // Round to nearest even by adding and removing 1.5·2^52 (|x/step| <= 2047), which unlike
      // std::nearbyint needs no library call and vectorizes.
      constexpr double kRound = 6755399441055744.0;
      const int32_t q = static_cast<int32_t>((x_row[k] * inverse + kRound) - kRound);
      q_row[k] = static_cast<int16_t>(q);
      sum += q;
      square_sum += static_cast<int64_t>(q) * q;
    }
    for (int32_t column : signs.exact_columns) {
      sum -= q_row[column];
      square_sum -= static_cast<int64_t>(q_row[column]) * q_row[column];
      q_row[column] = 0;
    }
    scratch.steps[m] = step;
    scratch.row_sums[m] = sum;
    scratch.row_norms[m] = static_cast<float>(step * std::sqrt(static_cast<double>(square_sum)));
  }
  if (!pack_signs) return;
  scratch.x_signs.assign(static_cast<size_t>(rows) * words, 0u);
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t k = 0; k < cols; ++k)
      if (x[m * cols + k] < 0.0f) scratch.x_signs[m * words + k / kSignBitsPerWord] |= 1u << (k % kSignBitsPerWord);
}

// Scores one neuron for a block of up to kDecodeMaxRows rows in one pass over its bit words (the
// shared loops of the score functions and the decode FFN). Holds only pointers into the prepared
// scratch: cheap to build wherever a block is scored.
class BlockPredictor {
 public:
  BlockPredictor(const SignBits& signs, const DecodeScratch& scratch, int64_t first_row, int32_t rows)
      : signs_(signs),
        words_(signs.words_per_row()),
        exact_count_(static_cast<int32_t>(signs.exact_columns.size())),
        rows_(rows),
        kernels_(active_decode_kernels()) {
    x_quantized_ = scratch.x_quantized.data() + first_row * words_ * kSignBitsPerWord;
    x_exact_ = scratch.x_exact.data() + first_row * exact_count_;
    if (!scratch.x_signs.empty()) x_signs_ = scratch.x_signs.data() + first_row * words_;
    steps_ = scratch.steps.data() + first_row;
    row_sums_ = scratch.row_sums.data() + first_row;
    row_norms_ = scratch.row_norms.data() + first_row;
  }
  int32_t rows() const { return rows_; }
  void negative_counts(int32_t neuron, int32_t* counts) const { kernel_sums(PredictorKind::sign_rule, neuron, counts); }
  void one_bit_gate(int32_t neuron, float* scores) const { score(PredictorKind::one_bit_gate, neuron, scores); }
  void normalized_one_bit_gate(int32_t neuron, float* scores) const {
    score(PredictorKind::normalized_one_bit_gate, neuron, scores);
  }
  void two_bit_gate(int32_t neuron, float* scores) const { score(PredictorKind::two_bit_gate, neuron, scores); }
  // active[m]: row m predicted active under `kind` with its integer (sign rule) or score (gates) threshold.
  void predict(PredictorKind kind, int32_t neuron, int32_t max_negatives, float min_score, bool* active) const {
    int32_t sums[kSumsPerRow * kDecodeMaxRows];
    kernel_sums(kind, neuron, sums);
    if (kind == PredictorKind::sign_rule) {
      for (int32_t m = 0; m < rows_; ++m) active[m] = sums[m] <= max_negatives;
      return;
    }
    float scores[kDecodeMaxRows];
    scores_from(kind, neuron, sums, scores);
    for (int32_t m = 0; m < rows_; ++m) active[m] = scores[m] >= min_score;
  }

 private:
  // The integer sums `kind` scores a neuron from (the kernels' part, at most kSumsPerRow a row): the
  // sign rule's N_neg; the one-bit gates' Σ q over the set bits; two-bit's two signed sums.
  static constexpr int32_t kSumsPerRow = 2;
  void kernel_sums(PredictorKind kind, int32_t neuron, int32_t* sums) const {
    if (kind == PredictorKind::sign_rule) {
      kernels_.negative_counts(x_signs_, rows_, neuron_bits(neuron), words_, sums);
      return;
    }
    const uint32_t* large =
        kind == PredictorKind::two_bit_gate ? signs_.large.data() + static_cast<size_t>(neuron) * words_ : nullptr;
    kernels_.masked_sums(x_quantized_, rows_, neuron_bits(neuron), large, words_, sums);
  }
  // A gate's scores from its sums:
  //   one-bit  s = scale·step·(Σq − 2·Σ_{bit set} q) = scale·Σ x·sign(W) over the quantized x, plus the
  //            exact columns' part; one-bit-norm divides it by residual·||x||;
  //   two-bit  x·(sign·(small + (large − small)·L)) = small·Σ sign·x + (large − small)·Σ_L sign·x, plus
  //            the exact part, divided by two_bit_residual·||x||.
  void scores_from(PredictorKind kind, int32_t neuron, const int32_t* sums, float* scores) const {
    if (kind == PredictorKind::two_bit_gate) {
      const float small = signs_.small_scale[neuron], large = signs_.large_scale[neuron];
      for (int32_t m = 0; m < rows_; ++m)
        scores[m] = small * quantized_sum(m, sums[m]) + (large - small) * quantized_sum(m, sums[rows_ + m]);
    } else {
      for (int32_t m = 0; m < rows_; ++m)
        scores[m] = signs_.scale[neuron] * quantized_sum(m, row_sums_[m] - 2 * static_cast<int64_t>(sums[m]));
    }
    add_exact_part(neuron, scores);
    if (kind == PredictorKind::one_bit_gate) return;
    const float residual =
        kind == PredictorKind::two_bit_gate ? signs_.two_bit_residual[neuron] : signs_.residual[neuron];
    for (int32_t m = 0; m < rows_; ++m) scores[m] = normalized_score(scores[m], residual, row_norms_[m]);
  }
  void score(PredictorKind kind, int32_t neuron, float* scores) const {
    int32_t sums[kSumsPerRow * kDecodeMaxRows];
    kernel_sums(kind, neuron, sums);
    scores_from(kind, neuron, sums, scores);
  }
  // step·sum of row m: exact (a power of two times an integer) while |sum| < 2^24, i.e. D < 8196.
  float quantized_sum(int32_t m, int64_t sum) const { return steps_[m] * static_cast<float>(sum); }
  const uint32_t* neuron_bits(int32_t neuron) const { return signs_.bits.data() + static_cast<size_t>(neuron) * words_; }
  // scores[m] += Σ_c x[m, exact_columns[c]]·exact_weights[neuron, c] (nothing without exact columns).
  void add_exact_part(int32_t neuron, float* scores) const {
    const float* weights = signs_.exact_weights.data() + static_cast<size_t>(neuron) * exact_count_;  // [c]
    for (int32_t m = 0; m < rows_; ++m)
      for (int32_t c = 0; c < exact_count_; ++c) scores[m] += x_exact_[m * exact_count_ + c] * weights[c];
  }
  const SignBits& signs_;
  int32_t words_;
  int32_t exact_count_;
  int32_t rows_;
  const DecodeKernelTable& kernels_;
  const int16_t* x_quantized_ = nullptr;
  const float* x_exact_ = nullptr;
  const uint32_t* x_signs_ = nullptr;
  const float* steps_ = nullptr;
  const int32_t* row_sums_ = nullptr;
  const float* row_norms_ = nullptr;
};

// out [M, H] = (predictor.*score)(j) for every row and neuron j, the rows in blocks of kDecodeMaxRows.
template <typename Value>
void score_rows(const float* x, int64_t rows, const SignBits& signs, bool pack_signs,
                void (BlockPredictor::*score)(int32_t, Value*) const, Value* out) {
  TWELL_REQUIRE(rows >= 1, "rows (M) must be >= 1, got {}", rows);
  validate_sign_bits(signs, signs.rows, signs.cols);
  DecodeScratch scratch;
  prepare_rows(x, rows, signs, pack_signs, scratch);
  for (int64_t first = 0; first < rows; first += kDecodeMaxRows) {
    const BlockPredictor predictor(signs, scratch, first, static_cast<int32_t>(std::min<int64_t>(kDecodeMaxRows, rows - first)));
#pragma omp parallel for num_threads(num_threads()) schedule(static)
    for (int32_t j = 0; j < signs.rows; ++j) {
      Value block[kDecodeMaxRows];
      (predictor.*score)(j, block);
      for (int32_t m = 0; m < predictor.rows(); ++m) out[(first + m) * signs.rows + j] = block[m];
    }
  }
}

}  // namespace

std::vector<float> gate_inputs(const float* x, int64_t rows, const SignBits& signs) {
  TWELL_REQUIRE(rows >= 1, "rows (M) must be >= 1, got {}", rows);
  validate_exact_columns(signs.exact_columns, signs.cols);
  DecodeScratch scratch;
  prepare_rows(x, rows, signs, false, scratch);
  const int32_t cols = signs.cols, padded = signs.words_per_row() * kSignBitsPerWord;
  std::vector<float> seen(static_cast<size_t>(rows) * cols);
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t k = 0; k < cols; ++k)
      seen[m * cols + k] = scratch.steps[m] * scratch.x_quantized[m * padded + k];
  for (int64_t m = 0; m < rows; ++m)
    for (size_t c = 0; c < signs.exact_columns.size(); ++c)
      seen[m * cols + signs.exact_columns[c]] = scratch.x_exact[m * signs.exact_columns.size() + c];
  return seen;
}

void negative_sign_products(const float* x, int64_t rows, const SignBits& signs, int32_t* counts) {
  score_rows(x, rows, signs, true, &BlockPredictor::negative_counts, counts);
}

void one_bit_gate(const float* x, int64_t rows, const SignBits& signs, float* scores) {
  score_rows(x, rows, signs, false, &BlockPredictor::one_bit_gate, scores);
}

void normalized_one_bit_gate(const float* x, int64_t rows, const SignBits& signs, float* scores) {
  score_rows(x, rows, signs, false, &BlockPredictor::normalized_one_bit_gate, scores);
}

void two_bit_gate(const float* x, int64_t rows, const SignBits& signs, float* scores) {
  score_rows(x, rows, signs, false, &BlockPredictor::two_bit_gate, scores);
}

DecodeStats decode_ffn(const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                       const PredictorConfig& predictor, float* y, DecodeScratch& scratch,
                       const DecodeOptions& options) {
  validate(weights);
  const int32_t cols = weights.d_model, hidden = weights.d_hidden;
  TWELL_REQUIRE(rows >= 1 && rows <= kDecodeMaxRows, "rows (M) must lie in [1, {}], got {}", kDecodeMaxRows, rows);
  validate_sign_bits(signs, hidden, cols);
  const bool sign_rule = predictor.kind == PredictorKind::sign_rule;
  const int32_t max_negatives = sign_rule ? sign_rule_max_negatives(predictor.alpha, cols) : 0;
  const float min_score = static_cast<float>(-predictor.margin);
  const bool all_gates = computes_all_gates(options, predictor, rows, kCpuAllGates);
  prepare_rows(x, rows, signs, sign_rule, scratch);  // also refuses a non-finite x

  const KernelTable& kernels = active_kernels();
  const float* projection = weights.relu_projection().data();  // [H, D]
  const int threads = num_threads();
  scratch.active.resize(threads);
  int64_t predicted = 0, active = 0, missed = 0;

#pragma omp parallel num_threads(threads) reduction(+ : predicted, active, missed)
  {
    std::vector<DecodeScratch::ActiveNeuron>& found = scratch.active[omp_get_thread_num()];
    found.clear();
    // The exact gate of the predicted pairs, and the up row of the truly active ones, in batches of
    // kPairedDots pairs whose rows are read together: their cache misses overlap.
    struct Pair {
      int32_t row, neuron;
      float activation;
    };
    Pair gate_batch[kPairedDots], up_batch[kPairedDots];
    int32_t gate_count = 0, up_count = 0;
    const auto batch_dots = [&](const Pair* batch, int32_t count, const float* matrix, float* dots) {
      const float* x_rows[kPairedDots];
      const float* w_rows[kPairedDots];
      for (int32_t i = 0; i < count; ++i) {
        x_rows[i] = x + batch[i].row * cols;
        w_rows[i] = matrix + static_cast<size_t>(batch[i].neuron) * cols;
      }
      kernels.paired_dots(x_rows, w_rows, count, cols, dots);
    };
    const auto flush_up = [&] {
      float up[kPairedDots];
      batch_dots(up_batch, up_count, weights.up.data(), up);
      for (int32_t i = 0; i < up_count; ++i)
        found.push_back({up_batch[i].row, up_batch[i].neuron, up_batch[i].activation * up[i]});
      up_count = 0;
    };
    // An exact gate computed: the active ones go on (to their up row when gated).
    const auto take_gate = [&](int32_t row, int32_t neuron, float activation) {
      ++predicted;
      if (!(activation > 0.0f)) return;
      ++active;
      if (!weights.gated) {
        found.push_back({row, neuron, activation});
        return;
      }
      up_batch[up_count++] = {row, neuron, activation};
      if (up_count == kPairedDots) flush_up();
    };
    const auto flush_gates = [&] {
      float activation[kPairedDots];
      batch_dots(gate_batch, gate_count, projection, activation);
      for (int32_t i = 0; i < gate_count; ++i) take_gate(gate_batch[i].row, gate_batch[i].neuron, activation[i]);
      gate_count = 0;
    };

    if (all_gates) {
      // Every gate: blocks of neurons against all M rows at once (dot_block reads each row of W once
      // for every token; pair by pair it would be read M times).
#pragma omp for schedule(static) nowait
      for (int32_t first = 0; first < hidden; first += kAllGatesBlock) {
        const int32_t count = std::min(kAllGatesBlock, hidden - first);
        float gates[kDecodeMaxRows * kAllGatesBlock];
        kernels.dot_block(x, rows, projection + static_cast<size_t>(first) * cols, count, cols, gates,
                          kAllGatesBlock);
        for (int32_t n = 0; n < count; ++n)
          for (int32_t m = 0; m < rows; ++m) take_gate(m, first + n, gates[m * kAllGatesBlock + n]);
      }
    } else {
      const BlockPredictor scorer(signs, scratch, 0, static_cast<int32_t>(rows));
#pragma omp for schedule(static) nowait
      for (int32_t j = 0; j < hidden; ++j) {
        bool predicted_rows[kDecodeMaxRows];
        scorer.predict(predictor.kind, j, max_negatives, min_score, predicted_rows);
        for (int32_t m = 0; m < rows; ++m) {
          if (predicted_rows[m]) {
            gate_batch[gate_count++] = {m, j, 0.0f};
            if (gate_count == kPairedDots) flush_gates();
          } else if (options.count_missed) {
            float activation;
            kernels.dot_block(x + m * cols, 1, projection + static_cast<size_t>(j) * cols, 1, cols, &activation, 1);
            missed += activation > 0.0f;
          }
        }
      }
    }
    flush_gates();
    flush_up();
#pragma omp barrier  // every list is complete


    // Columns in 16-float blocks, so every thread's range starts on a 64-byte boundary of a row.
    const int32_t block = std::max<int32_t>(16, (cols / omp_get_num_threads() + 15) / 16 * 16);
    const int32_t begin = std::min(cols, block * omp_get_thread_num());
    const int32_t end = omp_get_thread_num() == omp_get_num_threads() - 1 ? cols : std::min(cols, begin + block);
    if (begin < end) {
      if (!options.accumulate)
        for (int64_t m = 0; m < rows; ++m) std::fill(y + m * cols + begin, y + m * cols + end, 0.0f);
      for (const auto& list : scratch.active)
        for (const DecodeScratch::ActiveNeuron& neuron : list)
          kernels.scatter_axpy(weights.down.data() + static_cast<size_t>(neuron.neuron) * cols + begin, end - begin,
                               &neuron.row, &neuron.coefficient, 1, y + begin, cols);
    }
  }
  return DecodeStats{predicted, active, options.count_missed ? missed : -1};
}

}  // namespace twell::cpu
