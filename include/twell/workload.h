// The standard synthetic workload, used by every test and benchmark.
//   x ~ N(0, 1) with x[:, 0] = 1
//   relu projection (gate when gated, up otherwise): column 0 is -t_j, t_j = t0 + 0.5·N(0, 1),
//     t0 chosen so that P(gate > 0) equals the target density; every other entry N(0, 1/D)
//   all other weights N(0, 1/D)
// Every value is rounded to bf16, so fp32 CPU code and bf16 GPU code see identical numbers.
// The pre-activation of neuron j is about N(-t0, 1.25), so t0 = sqrt(1.25)·Φ^-1(1 - density).
// Skew: `hot_neurons` neurons get t_j = -3 (active for almost every token).
#pragma once

#include <cstdint>
#include <vector>

#include "twell/host_tensors.h"

namespace twell {

struct WorkloadSpec {
  int64_t rows = 1;         // M
  int32_t d_model = 2048;   // D
  int32_t d_hidden = 5632;  // H
  double density = 0.005;   // target mean fraction of active neurons, in [0, 1]
  bool gated = true;
  int32_t hot_neurons = 0;
  uint64_t seed = 1;
};

struct Workload {
  WorkloadSpec spec;
  std::vector<float> x;  // [M, D]
  FfnWeights weights;
};

Workload make_workload(const WorkloadSpec& spec);
// Fresh activations for the same weights (benchmarks rotate several input sets).
std::vector<float> make_activations(int64_t rows, int32_t d_model, uint64_t seed);
// The `count` input sets a benchmark rotates so the cache does not hold x between calls, each
// [M, D]: the workload's own x first (the one a reference checks), then make_activations with seeds
// spec.seed + 1000·i.
std::vector<std::vector<float>> rotated_inputs(const Workload& work, int count);
// `count` values N(0, stddev²), each rounded to bf16, from the workload's generator.
std::vector<float> make_normal(size_t count, double stddev, uint64_t seed);
double gate_threshold_for_density(double density);
// The weights with their neurons sorted by how many of 1024 calibration rows activate each
// (make_activations with `seed`, apart from any timed input set): the order the split paths of
// cuda::SparseFfn and cuda::FfnTrainOp want (sort_neurons_by_activity).
FfnWeights sorted_by_activity(const FfnWeights& weights, uint64_t seed);
// Mean non-zeros per row of relu(x·W^T) for the relu projection W, computed exactly.
double measured_nnz_per_row(const float* x, int64_t rows, const FfnWeights& weights);

}  // namespace twell
