// What the CUDA attention tests share: random bf16 inputs whose softmax rows are neither flat nor
// one-hot, and the comparison of an output with its float64 reference, whole and row by row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "twell/bench_record.h"
#include "twell/bf16.h"
#include "twell/workload.h"

namespace twell::test {

// Random bf16 values (as floats) of standard deviation `stddev`: scores q·k/sqrt(Dh) of about that
// squared, so the softmax rows are neither flat nor one-hot.
inline std::vector<float> random_bf16(int64_t count, uint64_t seed, double stddev = 1.2) {
  std::vector<float> values = make_normal(count, stddev, seed);
  for (float& value : values) value = round_to_bf16(value);
  return values;
}

// got and expected [rows, Dh]: the whole output's relative L2 error under `tolerance`, and the
// worst of its rows' (one (token, head) each) under `row_tolerance`; a NaN anywhere fails both.
inline void expect_attention_close(const std::vector<float>& got, const std::vector<double>& expected, int32_t head_dim,
                                   double tolerance, double row_tolerance, const std::string& label) {
  ASSERT_EQ(got.size(), expected.size()) << label;
  const double error = relative_l2_error(got.data(), expected.data(), got.size());
  double worst_row = 0;
  for (size_t row = 0; row < got.size() / head_dim; ++row) {
    const double row_error = relative_l2_error(got.data() + row * head_dim, expected.data() + row * head_dim, head_dim);
    worst_row = std::isnan(row_error) ? row_error : std::max(worst_row, row_error);
    if (std::isnan(worst_row)) break;
  }
  std::printf("[ %s ] relative L2 %.3g, worst row %.3g\n", label.c_str(), error, worst_row);
  EXPECT_LT(error, tolerance) << label;
  EXPECT_LT(worst_row, row_tolerance) << label;
}

}  // namespace twell::test
