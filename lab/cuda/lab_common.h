// What every kernel lab shares: comma-separated argument lists, CUDA-event timing of a call over
// rotated input sets (warm-up first, then one event pair per call; median and spread), and the
// comparison of a packed gate with the float64 reference's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cuda/cuda_utils.h"
#include "twell/bench_record.h"
#include "twell/convert.h"

namespace twell::lab {

inline std::vector<int64_t> parse_list_int(const char* text) {
  std::vector<int64_t> values;
  for (const char* p = text; *p;) {
    values.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return values;
}

inline std::vector<double> parse_list_double(const char* text) {
  std::vector<double> values;
  for (const char* p = text; *p;) {
    values.push_back(std::strtod(p, const_cast<char**>(&p)));
    if (*p == ',') ++p;
  }
  return values;
}

// call(i) runs the op on input set i (0 .. input_sets-1); 5 warm-up calls, then `reps` timed ones.
template <typename Fn>
TimingStats time_calls(int reps, int input_sets, Fn&& call) {
  cudaEvent_t start, stop;
  TWELL_CUDA_CHECK(cudaEventCreate(&start));
  TWELL_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 5; ++i) call(i % input_sets);
  std::vector<double> samples;
  for (int i = 0; i < reps; ++i) {
    TWELL_CUDA_CHECK(cudaEventRecord(start));
    call(i % input_sets);
    TWELL_CUDA_CHECK(cudaEventRecord(stop));
    TWELL_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TWELL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    samples.push_back(ms);
  }
  TWELL_CUDA_CHECK(cudaEventDestroy(start));
  TWELL_CUDA_CHECK(cudaEventDestroy(stop));
  return summarize_ms(samples);
}

// Elements of the two unpacked gates that differ by more than bf16 rounding of an fp32 sum against
// bf16 of the float64 sum (one rounding step; a gate within fp32 rounding of 0 may fall either side).
inline int64_t differing_values(const TwellMatrix& got, const TwellMatrix& want) {
  const std::vector<bf16> got_dense = dense_from_twell(got), want_dense = dense_from_twell(want);
  float largest = 0.f;
  for (const bf16 value : want_dense) largest = std::max(largest, std::fabs(to_float(value)));
  int64_t differing = 0;
  for (size_t i = 0; i < got_dense.size(); ++i)
    if (std::fabs(to_float(got_dense[i]) - to_float(want_dense[i])) >
        1e-2f * std::fabs(to_float(want_dense[i])) + 1e-4f * largest)
      ++differing;
  return differing;
}

}  // namespace twell::lab
