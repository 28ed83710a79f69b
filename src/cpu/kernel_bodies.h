// The inner loops of kernels.h written once over a vector type V (simd_scalar.h, simd_avx2.h,
// simd_avx512.h). Each kernels_<isa>.cpp includes this after its vector header and instantiates
// make_kernel_table<V>() with its own compiler flags.
//
// Everything here lives in an anonymous namespace and uses no out-of-line helpers from shared
// headers: a function instantiated under -mavx512f must never be the copy the linker picks for the
// scalar path.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels.h"

namespace twell::cpu {
namespace {

// kRows x kNeurons dot products of length d, accumulated in registers; lanes past the last full
// vector are finished in scalar code.
template <typename V, int kRows, int kNeurons>
void dot_tile(const float* x, int32_t d, const float* w, float* out, int64_t out_stride) {
  typename V::Vec acc[kRows][kNeurons];
  for (int r = 0; r < kRows; ++r)
    for (int n = 0; n < kNeurons; ++n) acc[r][n] = V::zero();
  const int32_t vector_end = d - d % V::kLanes;
  for (int32_t k = 0; k < vector_end; k += V::kLanes) {
    typename V::Vec x_vec[kRows];
    for (int r = 0; r < kRows; ++r) x_vec[r] = V::load(x + static_cast<int64_t>(r) * d + k);
    for (int n = 0; n < kNeurons; ++n) {
      typename V::Vec w_vec = V::load(w + static_cast<int64_t>(n) * d + k);
      for (int r = 0; r < kRows; ++r) acc[r][n] = V::fma(x_vec[r], w_vec, acc[r][n]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int n = 0; n < kNeurons; ++n) {
      float total = V::sum(acc[r][n]);
      for (int32_t k = vector_end; k < d; ++k) total += x[static_cast<int64_t>(r) * d + k] * w[static_cast<int64_t>(n) * d + k];
      out[r * out_stride + n] = total;
    }
}

// Neuron blocks outside, row blocks inside: a block of weight rows is streamed from memory once and
// reused from cache by every row block. A single row gets the wide neuron block (more streams).
template <typename V>
void dot_block(const float* x, int64_t rows, const float* w, int32_t neurons, int32_t d, float* out,
               int64_t out_stride) {
  auto rows_of_block = [&](const float* w_block, float* out_block, auto neuron_count) {
    constexpr int kNeurons = decltype(neuron_count)::value;
    int64_t r = 0;
    for (; r + V::kRowBlock <= rows; r += V::kRowBlock)
      dot_tile<V, V::kRowBlock, kNeurons>(x + r * d, d, w_block, out_block + r * out_stride, out_stride);
    for (; r < rows; ++r) dot_tile<V, 1, kNeurons>(x + r * d, d, w_block, out_block + r * out_stride, out_stride);
  };
  int32_t n = 0;
  if (rows == 1)
    for (; n + V::kWideNeuronBlock <= neurons; n += V::kWideNeuronBlock)
      dot_tile<V, 1, V::kWideNeuronBlock>(x, d, w + static_cast<int64_t>(n) * d, out + n, out_stride);
  for (; n + V::kNeuronBlock <= neurons; n += V::kNeuronBlock)
    rows_of_block(w + static_cast<int64_t>(n) * d, out + n, std::integral_constant<int, V::kNeuronBlock>{});
  for (; n < neurons; ++n)
    rows_of_block(w + static_cast<int64_t>(n) * d, out + n, std::integral_constant<int, 1>{});
}

template <typename V>
float dot(const float* a, const float* b, int32_t n) {
  // Four independent accumulators hide the FMA latency.
  typename V::Vec acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
  int32_t k = 0;
  for (; k + 4 * V::kLanes <= n; k += 4 * V::kLanes)
    for (int u = 0; u < 4; ++u) acc[u] = V::fma(V::load(a + k + u * V::kLanes), V::load(b + k + u * V::kLanes), acc[u]);
  for (; k + V::kLanes <= n; k += V::kLanes) acc[0] = V::fma(V::load(a + k), V::load(b + k), acc[0]);
  float total = V::sum(acc[0]) + V::sum(acc[1]) + V::sum(acc[2]) + V::sum(acc[3]);
  for (; k < n; ++k) total += a[k] * b[k];
  return total;
}

template <typename V>
void axpy(float alpha, const float* w, float* y, int32_t n) {
  const typename V::Vec alpha_vec = V::broadcast(alpha);
  int32_t k = 0;
  for (; k + V::kLanes <= n; k += V::kLanes) V::store(y + k, V::fma(alpha_vec, V::load(w + k), V::load(y + k)));
  for (; k < n; ++k) y[k] += alpha * w[k];
}

template <typename V>
int32_t find_positive(const float* values, int32_t n, int32_t* positive, bool* has_nan) {
  int32_t count = 0;
  uint32_t nan_lanes = 0;
  int32_t k = 0;
  for (; k + V::kLanes <= n; k += V::kLanes) {
    typename V::Vec chunk = V::load(values + k);
    nan_lanes |= V::nan_mask(chunk);
    for (uint32_t mask = V::positive_mask(chunk); mask != 0; mask &= mask - 1)
      positive[count++] = k + __builtin_ctz(mask);
  }
  for (; k < n; ++k) {
    nan_lanes |= values[k] != values[k];
    if (values[k] > 0.0f) positive[count++] = k;
  }
  if (nan_lanes) *has_nan = true;
  return count;
}

template <typename V>
constexpr KernelTable make_kernel_table() {
  return KernelTable{&dot_block<V>, &dot<V>, &axpy<V>, &find_positive<V>};
}

}  // namespace
}  // namespace twell::cpu
