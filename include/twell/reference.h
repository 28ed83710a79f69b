// Reference FFN ops: plain C++, float64 accumulation, obviously correct. They are the oracle every
// backend is tested against; speed does not matter here.
// Shapes: x [M, D], weights canonical [H, D] (host_tensors.h), y and dx [M, D], gate g [M, H].
#pragma once

#include <cstdint>
#include <vector>

#include "twell/host_tensors.h"

namespace twell::ref {

// y = (relu(x·Wg^T) ⊙ (x·Wu^T))·Wd, or relu(x·Wu^T)·Wd when !weights.gated.  -> [M, D]
std::vector<double> ffn_dense(const float* x, int64_t rows, const FfnWeights& weights);

// relu(x·W^T) for the relu projection (gate, or up when non-gated), in float64.  -> [M, H]
std::vector<double> relu_projection(const float* x, int64_t rows, const FfnWeights& weights);

// The gate activations rounded to bf16 and packed: what every gate -> TwELL kernel must produce.
// The float64 gate is rounded to bf16 once (round to nearest even, no detour through float);
// a value is stored iff that bf16 is non-zero (iff the gate is > 0, short of underflow below 2^-133).
TwellMatrix gate_to_twell(const float* x, int64_t rows, const FfnWeights& weights, int32_t tile, int32_t compression);

// y from the packed relu projection: gated -> up and down only at non-zero gates; non-gated -> down only.
std::vector<double> ffn_from_twell(const float* x, const TwellMatrix& gate, const FfnWeights& weights);

// Training FFN on the hybrid gate (gated weights only). h = g ⊙ (x·Wu^T) at g's non-zero pattern.
struct HybridForward {
  std::vector<double> y;  // [M, D]
  std::vector<double> h;  // [M, H] dense copy of the sparse h, 0 off the pattern
  double l1 = 0;          // coeff · Σ|h| / M
  double l0 = 0;          // mean non-zeros per row of g
};
HybridForward hybrid_ffn_forward(const float* x, const HybridMatrix& gate, const FfnWeights& weights, double l1_coeff);

// Gradients of  L = <dy, y> + coeff·Σ|h|/M  with respect to x and the three weight matrices,
// through g = relu(x·Wg^T) (the pattern of `gate`) and u = x·Wu^T.
struct FfnGrads {
  std::vector<double> dx;      // [M, D]
  std::vector<double> d_gate;  // [H, D]
  std::vector<double> d_up;    // [H, D]
  std::vector<double> d_down;  // [H, D]
};
FfnGrads hybrid_ffn_backward(const float* x, const HybridMatrix& gate, const FfnWeights& weights, const float* dy,
                             double l1_coeff);

// The same loss and gradients in float64 end to end, straight from x and the weights (g = relu(x·Wg^T)
// never rounded to bf16): the function whose finite differences check the gradients.
double ffn_train_loss(const float* x, int64_t rows, const FfnWeights& weights, const float* dy, double l1_coeff);
FfnGrads ffn_train_grads(const float* x, int64_t rows, const FfnWeights& weights, const float* dy, double l1_coeff);

// Sign-bit predictor. N_neg(m, j) = number of k < D with sign(x[m,k]) != sign(Wg[j,k]) (from the
// packed bits, so -0.0 counts as positive).  -> [M, H]
std::vector<int32_t> negative_sign_products(const SignBits& x_signs, const SignBits& gate_signs);
// Neuron j of row m is predicted zero iff N_neg > alpha·(D - N_neg).  -> [M, H], 1 = predicted active
std::vector<uint8_t> predict_active_sign_rule(const SignBits& x_signs, const SignBits& gate_signs, double alpha);
// The gates' scores in float64 (include/twell/decode.h); each predicts active iff score >= −margin.
// Every score adds the exact part E(m, j) = Σ_c x[m, exact_columns[c]]·exact_weights[j, c]; Σ_k and
// ||x[m]|| run over the approximated (non-exact) columns k only.
// One-bit gate s(m, j) = E(m, j) + scale_j · Σ_k x[m,k]·(bit set ? −1 : +1).  -> [M, H]
std::vector<double> one_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs);
// Normalized one-bit gate z(m, j) = s(m, j) / (residual_j · ||x[m]||₂) (±inf or 0 where that is 0).  -> [M, H]
std::vector<double> normalized_one_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs);
// Two-bit gate z(m, j) = (E(m, j) + Σ_k x[m,k]·sign·(large ? large_scale_j : small_scale_j)) /
// (two_bit_residual_j · ||x[m]||₂), the large plane read bit by bit.  -> [M, H]
std::vector<double> two_bit_gate(const float* x, int64_t rows, const SignBits& gate_signs);
// The decode FFN: the FFN restricted to the predicted-active neurons of each row (a neuron predicted
// zero contributes nothing, whatever its gate).  predicted_active [M, H] -> y [M, D]
std::vector<double> decode_ffn(const float* x, int64_t rows, const FfnWeights& weights,
                               const std::vector<uint8_t>& predicted_active);

// Causal grouped-query attention of n new tokens per sequence over a KV cache that already holds
// their keys and values (positions start .. start + n - 1 after the start cached before them): token
// t sees positions 0 ..= start + t, and query head h reads kv head h / (H_q / H_kv).
struct CachedAttentionShape {
  int32_t batch = 0;       // B
  int32_t tokens = 0;      // n per sequence
  int32_t n_heads = 0;     // H_q
  int32_t n_kv_heads = 0;  // H_kv
  int32_t head_dim = 0;    // Dh
  int32_t stride = 0;      // positions per (sequence, kv head) in the cache, >= start + n
  int32_t start = 0;       // positions cached before the new tokens
};
// softmax(scale·q·K^T)·V.  q [B, H_q, n, Dh], keys and values [B, H_kv, stride, Dh] -> [B·n, H_q·Dh]
std::vector<double> causal_attention(const float* q, const float* keys, const float* values,
                                     const CachedAttentionShape& shape, double scale);

// RMSNorm: weight ⊙ x / sqrt(mean(x²) + eps) of each row.  x [M, D], weight [D] -> [M, D]
std::vector<double> rms_norm(const float* x, int64_t rows, int32_t d, const float* weight, double eps);

// HF's RoPE (rotate_half) of one head x [Dh] at `position`, in place: the inverse frequencies and
// angles in fp32 as HF computes them (they define the model's positions), cos, sin and the rotation
// in float64.
void rope(double* x, int32_t head_dim, int32_t position, float rope_theta);

// One decode step (shape.tokens = 1, shape.start = the new position) from raw projections: each
// sequence's qkv row [H_q·Dh + 2·H_kv·Dh] plus `bias` (same width, or null), its q and k heads
// rotated by rope() at shape.start, the new keys and values put at shape.start of copies of the
// caches [B, H_kv, stride, Dh], then causal_attention. The rotated q, k and v enter the attention as
// fp32, as a cache would hold them.  qkv [B, width] -> [B, H_q·Dh]
std::vector<double> decode_attention_rope(const float* qkv, const float* bias, std::vector<float> keys,
                                          std::vector<float> values, const CachedAttentionShape& shape,
                                          float rope_theta, double scale);

}  // namespace twell::ref
