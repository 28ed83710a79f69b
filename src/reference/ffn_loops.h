// The loops of the reference FFN, templated on the accumulator type. reference.cpp runs them in
// double: the oracle. The op tests run the very same loops in float: the naive same-precision
// computation whose error against double sets each kernel's tolerance (tests/op_harness.h).
// Plain loops on purpose; speed does not matter here.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "twell/bf16.h"
#include "twell/host_tensors.h"

namespace twell::ref {

// x·W^T: out[m, j] = Σ_k x[m, k]·w[j, k].  x [M, D], w [N, D]  -> [M, N]
template <typename Acc>
std::vector<Acc> project(const float* x, int64_t rows, int32_t d_model, const float* w, int32_t n) {
  std::vector<Acc> out(static_cast<size_t>(rows) * n);
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t j = 0; j < n; ++j) {
      Acc acc = 0;
      for (int32_t k = 0; k < d_model; ++k)
        acc += static_cast<Acc>(x[m * d_model + k]) * static_cast<Acc>(w[static_cast<size_t>(j) * d_model + k]);
      out[static_cast<size_t>(m) * n + j] = acc;
    }
  return out;
}

// relu(x·W^T) for W = weights.relu_projection().  -> [M, H]
template <typename Acc>
std::vector<Acc> relu_gate(const float* x, int64_t rows, const FfnWeights& weights) {
  std::vector<Acc> g = project<Acc>(x, rows, weights.d_model, weights.relu_projection().data(), weights.d_hidden);
  for (Acc& value : g) value = value > 0 ? value : Acc(0);
  return g;
}

template <typename Acc>
struct FfnFromGate {
  std::vector<Acc> h;  // [M, H] gated: g ⊙ (x·Wu^T) at g's non-zeros; non-gated: g. 0 elsewhere.
  std::vector<Acc> y;  // [M, D] h·Wd
};

// The FFN from the relu'd gate values g [M, H] (non-zero = active neuron): gated, up is computed
// only where g is non-zero. `round_hidden_to_bf16` replays a kernel that feeds h to the down
// projection in bf16.
template <typename Acc>
FfnFromGate<Acc> ffn_from_gate(const float* x, int64_t rows, const std::vector<Acc>& g, const FfnWeights& weights,
                               bool round_hidden_to_bf16 = false) {
  const int32_t d = weights.d_model, hidden = weights.d_hidden;
  FfnFromGate<Acc> out;
  out.h.assign(static_cast<size_t>(rows) * hidden, Acc(0));
  out.y.assign(static_cast<size_t>(rows) * d, Acc(0));
  for (int64_t m = 0; m < rows; ++m) {
    const float* x_row = x + m * d;  // [D]
    for (int32_t j = 0; j < hidden; ++j) {
      const Acc gate = g[static_cast<size_t>(m) * hidden + j];
      if (gate == 0) continue;
      Acc h = gate;
      if (weights.gated) {
        const float* up_row = weights.up.data() + static_cast<size_t>(j) * d;  // [D]
        Acc u = 0;
        for (int32_t k = 0; k < d; ++k) u += static_cast<Acc>(x_row[k]) * static_cast<Acc>(up_row[k]);
        h = gate * u;
      }
      if (round_hidden_to_bf16) h = static_cast<Acc>(round_to_bf16(static_cast<float>(h)));
      out.h[static_cast<size_t>(m) * hidden + j] = h;
      const float* down_row = weights.down.data() + static_cast<size_t>(j) * d;  // [D]
      Acc* y_row = out.y.data() + static_cast<size_t>(m) * d;
      for (int32_t k = 0; k < d; ++k) y_row[k] += h * static_cast<Acc>(down_row[k]);
    }
  }
  return out;
}

template <typename Acc>
struct FfnGradsOf {
  std::vector<Acc> dx;      // [M, D]
  std::vector<Acc> d_gate;  // [H, D]
  std::vector<Acc> d_up;    // [H, D]
  std::vector<Acc> d_down;  // [H, D]
};

// Gradients of L = <dy, y> + coeff·Σ|h|/M for the gated FFN on the relu'd gate values g [M, H]:
// h = g ⊙ u with u = x·Wu^T, y = h·Wd, and g = relu(x·Wg^T) differentiated at g's pattern
// (relu' = 1 where g is non-zero, 0 elsewhere). d|h|/dh is sign(h) (0 at 0).
template <typename Acc>
FfnGradsOf<Acc> ffn_backward_from_gate(const float* x, int64_t rows, const std::vector<Acc>& g,
                                       const FfnWeights& weights, const float* dy, double l1_coeff) {
  const int32_t d = weights.d_model, hidden = weights.d_hidden;
  const Acc l1_per_row = static_cast<Acc>(l1_coeff / static_cast<double>(rows));
  FfnGradsOf<Acc> grads;
  grads.dx.assign(static_cast<size_t>(rows) * d, Acc(0));
  grads.d_gate.assign(static_cast<size_t>(hidden) * d, Acc(0));
  grads.d_up.assign(static_cast<size_t>(hidden) * d, Acc(0));
  grads.d_down.assign(static_cast<size_t>(hidden) * d, Acc(0));
  for (int64_t m = 0; m < rows; ++m) {
    const float* x_row = x + m * d;    // [D]
    const float* dy_row = dy + m * d;  // [D]
    Acc* dx_row = grads.dx.data() + static_cast<size_t>(m) * d;
    for (int32_t j = 0; j < hidden; ++j) {
      const Acc gate = g[static_cast<size_t>(m) * hidden + j];
      if (gate == 0) continue;
      const size_t w_row = static_cast<size_t>(j) * d;  // neuron j's row in each [H, D] matrix
      Acc u = 0, dh = 0;
      for (int32_t k = 0; k < d; ++k) {
        u += static_cast<Acc>(x_row[k]) * static_cast<Acc>(weights.up[w_row + k]);
        dh += static_cast<Acc>(dy_row[k]) * static_cast<Acc>(weights.down[w_row + k]);
      }
      const Acc h = gate * u;
      dh += l1_per_row * static_cast<Acc>((h > 0) - (h < 0));
      const Acc d_gate_pre = dh * u;  // through relu: the pre-activation's gradient where g != 0
      const Acc d_up_pre = dh * gate;
      for (int32_t k = 0; k < d; ++k) {
        grads.d_down[w_row + k] += h * static_cast<Acc>(dy_row[k]);
        grads.d_gate[w_row + k] += d_gate_pre * static_cast<Acc>(x_row[k]);
        grads.d_up[w_row + k] += d_up_pre * static_cast<Acc>(x_row[k]);
        dx_row[k] += d_gate_pre * static_cast<Acc>(weights.gate[w_row + k]) +
                     d_up_pre * static_cast<Acc>(weights.up[w_row + k]);
      }
    }
  }
  return grads;
}

}  // namespace twell::ref
