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

// kRows x kNeurons dot products of length d, accumulated in registers: sums[r][n] = x_rows[r]·w[n],
// w rows at stride d. Lanes past the last full vector are finished in scalar code.
template <typename V, int kRows, int kNeurons>
void dot_tile(const float* const* x_rows, const float* w, int32_t d, float (&sums)[kRows][kNeurons]) {
  typename V::Vec acc[kRows][kNeurons];
  for (int r = 0; r < kRows; ++r)
    for (int n = 0; n < kNeurons; ++n) acc[r][n] = V::zero();
  const int32_t vector_end = d - d % V::kLanes;
  for (int32_t k = 0; k < vector_end; k += V::kLanes) {
    typename V::Vec x_vec[kRows];
    for (int r = 0; r < kRows; ++r) x_vec[r] = V::load(x_rows[r] + k);
    for (int n = 0; n < kNeurons; ++n) {
      typename V::Vec w_vec = V::load(w + static_cast<int64_t>(n) * d + k);
      for (int r = 0; r < kRows; ++r) acc[r][n] = V::fma(x_vec[r], w_vec, acc[r][n]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int n = 0; n < kNeurons; ++n) {
      float total = V::sum(acc[r][n]);
      for (int32_t k = vector_end; k < d; ++k) total += x_rows[r][k] * w[static_cast<int64_t>(n) * d + k];
      sums[r][n] = total;
    }
}

// Neuron blocks outside, row blocks inside: a block of weight rows is streamed from memory once and
// reused from cache by every row block. A single row gets the wide neuron block (more streams).
template <typename V>
void dot_block(const float* x, int64_t rows, const float* w, int32_t neurons, int32_t d, float* out,
               int64_t out_stride) {
  auto tile = [&](int64_t first_row, int32_t first_neuron, auto row_count, auto neuron_count) {
    constexpr int kRows = decltype(row_count)::value;
    constexpr int kNeurons = decltype(neuron_count)::value;
    const float* x_rows[kRows];
    for (int r = 0; r < kRows; ++r) x_rows[r] = x + (first_row + r) * d;
    float sums[kRows][kNeurons];
    dot_tile<V, kRows, kNeurons>(x_rows, w + static_cast<int64_t>(first_neuron) * d, d, sums);
    for (int r = 0; r < kRows; ++r)
      for (int n = 0; n < kNeurons; ++n) out[(first_row + r) * out_stride + first_neuron + n] = sums[r][n];
  };
  auto rows_of_block = [&](int32_t first_neuron, auto neuron_count) {
    int64_t r = 0;
    for (; r + V::kRowBlock <= rows; r += V::kRowBlock)
      tile(r, first_neuron, std::integral_constant<int, V::kRowBlock>{}, neuron_count);
    for (; r < rows; ++r) tile(r, first_neuron, std::integral_constant<int, 1>{}, neuron_count);
  };
  int32_t n = 0;
  if (rows == 1)
    for (; n + V::kWideNeuronBlock <= neurons; n += V::kWideNeuronBlock)
      tile(0, n, std::integral_constant<int, 1>{}, std::integral_constant<int, V::kWideNeuronBlock>{});
  for (; n + V::kNeuronBlock <= neurons; n += V::kNeuronBlock)
    rows_of_block(n, std::integral_constant<int, V::kNeuronBlock>{});
  for (; n < neurons; ++n) rows_of_block(n, std::integral_constant<int, 1>{});
}

// out[i] = x_rows[i]·w_rows[i] for kCount pairs, the loads of all pairs interleaved; each pair's
// accumulator, reduction and scalar tail are dot_tile<V, 1, 1>'s.
template <typename V, int kCount>
void paired_dot_tile(const float* const* x_rows, const float* const* w_rows, int32_t d, float* out) {
  typename V::Vec acc[kCount];
  for (int i = 0; i < kCount; ++i) acc[i] = V::zero();
  const int32_t vector_end = d - d % V::kLanes;
  for (int32_t k = 0; k < vector_end; k += V::kLanes)
    for (int i = 0; i < kCount; ++i) acc[i] = V::fma(V::load(x_rows[i] + k), V::load(w_rows[i] + k), acc[i]);
  for (int i = 0; i < kCount; ++i) {
    float total = V::sum(acc[i]);
    for (int32_t k = vector_end; k < d; ++k) total += x_rows[i][k] * w_rows[i][k];
    out[i] = total;
  }
}

template <typename V>
void paired_dots(const float* const* x_rows, const float* const* w_rows, int32_t count, int32_t d, float* out) {
  int32_t i = 0;
  for (; i + 8 <= count; i += 8) paired_dot_tile<V, 8>(x_rows + i, w_rows + i, d, out + i);
  for (; i + 4 <= count; i += 4) paired_dot_tile<V, 4>(x_rows + i, w_rows + i, d, out + i);
  for (; i + 2 <= count; i += 2) paired_dot_tile<V, 2>(x_rows + i, w_rows + i, d, out + i);
  for (; i < count; ++i) paired_dot_tile<V, 1>(x_rows + i, w_rows + i, d, out + i);
}

// values[i] *= x[rows[i], :]·w, rows blocked so each vector of w is loaded once per block.
template <typename V>
void scale_by_dots(const float* w, const float* x, int32_t d, const int32_t* rows, int64_t count, float* values) {
  constexpr int kBlock = 4;  // 4 accumulators + 4 rows of x + w: fits AVX2's 16 registers
  auto block = [&](int64_t first, auto row_count) {
    constexpr int kRows = decltype(row_count)::value;
    const float* x_rows[kRows];
    for (int r = 0; r < kRows; ++r) x_rows[r] = x + static_cast<int64_t>(rows[first + r]) * d;
    float sums[kRows][1];
    dot_tile<V, kRows, 1>(x_rows, w, d, sums);
    for (int r = 0; r < kRows; ++r) values[first + r] *= sums[r][0];
  };
  int64_t i = 0;
  for (; i + kBlock <= count; i += kBlock) block(i, std::integral_constant<int, kBlock>{});
  for (; i < count; ++i) block(i, std::integral_constant<int, 1>{});
}

// y[rows[i] * y_stride + 0:n] += alphas[i]·w[0:n]. Row by row over the whole slice: streaming
// one y row at a time is what the prefetchers follow best (holding a chunk of w in registers across
// rows and hopping between y rows measured 1.6x slower on Zen 5).
template <typename V>
void scatter_axpy(const float* w, int32_t n, const int32_t* rows, const float* alphas, int64_t count, float* y,
                  int64_t y_stride) {
  for (int64_t i = 0; i < count; ++i) {
    float* y_row = y + rows[i] * y_stride;
    const typename V::Vec alpha = V::broadcast(alphas[i]);
    int32_t k = 0;
    for (; k + V::kLanes <= n; k += V::kLanes) V::store(y_row + k, V::fma(alpha, V::load(w + k), V::load(y_row + k)));
    for (; k < n; ++k) y_row[k] += alphas[i] * w[k];
  }
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
  return KernelTable{&dot_block<V>, &paired_dots<V>, &scale_by_dots<V>, &scatter_axpy<V>, &find_positive<V>};
}

}  // namespace
}  // namespace twell::cpu
