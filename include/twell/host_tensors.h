// Host-side owners of the FFN weights and of the three sparse formats.
// The layouts are those of include/twell/formats/*.h; these structs only hold the arrays.
#pragma once

#include <cstdint>
#include <vector>

#include "twell/bf16.h"
#include "twell/formats/hybrid.h"
#include "twell/formats/sign_bits.h"
#include "twell/formats/twell.h"

namespace twell {

// The FFN's gate activation. relu and fatrelu give activation sparsity; fatrelu(x) = x if x > t else 0.
// The sparse kernels implement relu; the dense paths (CPU and CUDA) take any of them.
enum class FfnActivation { silu, relu, fatrelu };

// Canonical FFN weight layout: every matrix neuron-major [H, D], so neuron j's gate, up and down
// rows are each D contiguous floats. down is Hugging Face's down_proj [D, H] transposed, once, at load.
//   gated:      y = (relu(x·gate^T) ⊙ (x·up^T)) · down
//   non-gated:  y = relu(x·up^T) · down            (gate is empty)
struct FfnWeights {
  int32_t d_model = 0;   // D
  int32_t d_hidden = 0;  // H
  bool gated = true;
  std::vector<float> gate;  // [H, D] (empty when !gated)
  std::vector<float> up;    // [H, D]
  std::vector<float> down;  // [H, D]

  // The projection whose relu is sparse and gets packed: gate when gated, up otherwise.
  const std::vector<float>& relu_projection() const { return gated ? gate : up; }
};

// Validates sizes; throws twell::Error naming the first mismatch.
void validate(const FfnWeights& weights);

// The same FFN with its neurons (rows of gate, up and down alike) in decreasing order of
// active_counts[j], ties in index order: the neurons most often active come first, so that a prefix
// of them can run densely (cuda::SparseFfnOptions::hot_fractions). Counts: cpu::count_active_neurons.
FfnWeights sort_neurons_by_activity(const FfnWeights& weights, const std::vector<int64_t>& active_counts);

struct TwellMatrix {
  TwellShape shape;
  std::vector<TwellSlot> slots;    // [M, n_tiles, S]
  std::vector<int32_t> tile_nnz;   // [M, n_tiles]
  std::vector<bf16> spill;         // [spill capacity, T]
  int32_t spill_used = 0;

  int64_t spill_capacity() const { return shape.tile == 0 ? 0 : static_cast<int64_t>(spill.size()) / shape.tile; }
  bool complete() const { return spill_used <= spill_capacity(); }
};

struct HybridMatrix {
  HybridShape shape;
  std::vector<bf16> ell_values;     // [M, W]
  std::vector<int32_t> ell_cols;    // [M, W]
  std::vector<int32_t> row_nnz;     // [M]
  std::vector<int32_t> backup_slot; // [M]
  std::vector<bf16> backup;         // [capacity, H]
  std::vector<int32_t> backup_rows; // [capacity]
  int32_t backup_used = 0;
};

struct SignBits {
  int32_t rows = 0;  // R
  int32_t cols = 0;  // K
  std::vector<uint32_t> bits;  // [R, ceil(K/32)]
  std::vector<float> scale;    // [R] mean |A[r, :]|
  std::vector<float> residual; // [R] rms of A[r, :] − scale[r]·sign(A[r, :])
  // The two-bit approximation: sign and whether |A| is among the row's largest (formats/sign_bits.h).
  std::vector<uint32_t> large;           // [R, ceil(K/32)] bit set iff |A[r, k]| > the row's 60% quantile |A|
  std::vector<float> small_scale;        // [R] mean |A[r, k]| over the elements not large
  std::vector<float> large_scale;        // [R] mean |A[r, k]| over the large elements (0 when none)
  std::vector<float> two_bit_residual;   // [R] rms of A[r, :] − its two-bit approximation
  // Columns kept exactly (formats/sign_bits.h): the scales, residuals and the large plane above cover
  // the other columns only; bits holds every column's sign.
  std::vector<int32_t> exact_columns;  // ascending, distinct, < K, at most kMaxExactColumns
  std::vector<float> exact_weights;    // [R, exact_columns.size()]: A[r, exact_columns[c]]

  int32_t words_per_row() const { return sign_words_per_row(cols); }
  // Bytes held by the arrays above; sign_bits_bytes(rows, cols, exact_columns.size()) when packed by pack_sign_bits.
  int64_t bytes() const {
    return static_cast<int64_t>(bits.size() + large.size()) * sizeof(uint32_t) +
           static_cast<int64_t>(scale.size() + residual.size() + small_scale.size() + large_scale.size() +
                                two_bit_residual.size() + exact_weights.size()) *
               sizeof(float) +
           static_cast<int64_t>(exact_columns.size()) * sizeof(int32_t);
  }
};

}  // namespace twell
