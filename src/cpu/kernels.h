// The ISA-specific inner loops of the CPU backend, as one table of function pointers per ISA.
// The drivers (gate_to_twell.cpp, ffn_from_twell.cpp) hold the blocking, threading and format
// logic once; only these loops differ between scalar, AVX2 and AVX-512.
#pragma once

#include <cstdint>

#include "twell/cpu.h"

namespace twell::cpu {

inline constexpr int32_t kPairedDots = 8;

struct KernelTable {
  // out[r * out_stride + n] = x[r, :]·w[n, :]  for r < rows, n < neurons.
  // x [rows, d] (row stride d), w [neurons, d], out [rows, out_stride].
  void (*dot_block)(const float* x, int64_t rows, const float* w, int32_t neurons, int32_t d, float* out,
                    int64_t out_stride);
  // out[i] = x_rows[i]·w_rows[i] (length d) for i < count: rows anywhere in memory, up to
  // kPairedDots read together so that their cache misses overlap (the decode FFN's predicted rows:
  // one 8 KB row after another streams at about 60% of the rate of four at once; eight beat four
  // by ~8%). Each sum is the one dot_block gives for that row and neuron alone.
  void (*paired_dots)(const float* const* x_rows, const float* const* w_rows, int32_t count, int32_t d, float* out);
  // values[i] *= x[rows[i], :]·w for i < count.  w [d], x [*, d], rows [count], values [count]
  void (*scale_by_dots)(const float* w, const float* x, int32_t d, const int32_t* rows, int64_t count,
                        float* values);
  // y[rows[i] * y_stride + 0:n] += alphas[i]·w[0:n] for i < count.  w [n]; rows distinct
  void (*scatter_axpy)(const float* w, int32_t n, const int32_t* rows, const float* alphas, int64_t count, float* y,
                       int64_t y_stride);
  // Writes the indices i < n with values[i] > 0 to positive[] in ascending order and returns how
  // many; sets *has_nan when a value is NaN. positive [n].
  int32_t (*find_positive)(const float* values, int32_t n, int32_t* positive, bool* has_nan);
};

// Each defined in kernels_<isa>.cpp, compiled with that ISA's flags. Call only on a CPU that has it.
const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();

// The table of active_isa().
const KernelTable& active_kernels();

// OpenBLAS threads outside our own parallel regions (inside them every sgemm must run on its caller).
void set_blas_threads(int threads);

}  // namespace twell::cpu
