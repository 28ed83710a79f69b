// The standard synthetic workload: the density it promises, reproducibility, x[:, 0] = 1, bf16 values.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "twell/bf16.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell {
namespace {

TEST(Workload, AchievedDensityIsCloseToTarget) {
  // 64 tokens x 5632 neurons; the mean over neurons of their (spread) densities has a relative
  // standard deviation of a few percent (seen: within 1.3%), so 10% is safe and still catches a wrong t0.
  for (double density : {0.005, 0.02, 0.1}) {
    const Workload work = make_workload({.rows = 64, .d_model = 256, .d_hidden = 5632, .density = density, .seed = 4});
    const double achieved = measured_nnz_per_row(work.x.data(), 64, work.weights) / 5632;
    EXPECT_NEAR(achieved, density, 0.10 * density) << "target density " << density;
  }
}

TEST(Workload, ExtremeDensitiesAreExact) {
  for (bool gated : {true, false}) {
    const WorkloadSpec none{.rows = 17, .d_model = 64, .d_hidden = 1000, .density = 0.0, .gated = gated, .seed = 2};
    const Workload empty = make_workload(none);
    EXPECT_EQ(measured_nnz_per_row(empty.x.data(), 17, empty.weights), 0.0);
    WorkloadSpec all = none;
    all.density = 1.0;
    const Workload full = make_workload(all);
    EXPECT_EQ(measured_nnz_per_row(full.x.data(), 17, full.weights), 1000.0);
  }
}

TEST(Workload, HotNeuronsAreActiveForAlmostEveryToken) {
  const Workload work =
      make_workload({.rows = 300, .d_model = 128, .d_hidden = 200, .density = 0.005, .hot_neurons = 5, .seed = 8});
  const std::vector<double> g = ref::relu_projection(work.x.data(), 300, work.weights);  // [M, H]
  for (int32_t j = 0; j < 5; ++j) {
    int active = 0;
    for (int64_t m = 0; m < 300; ++m) active += g[m * 200 + j] > 0;
    EXPECT_GE(active, 290) << "hot neuron " << j;
  }
}

TEST(Workload, SeedsReproduceAndDiffer) {
  const WorkloadSpec spec{.rows = 3, .d_model = 96, .d_hidden = 300, .density = 0.02, .hot_neurons = 2, .seed = 42};
  const Workload a = make_workload(spec);
  const Workload b = make_workload(spec);
  EXPECT_EQ(a.x, b.x);
  EXPECT_EQ(a.weights.gate, b.weights.gate);
  EXPECT_EQ(a.weights.up, b.weights.up);
  EXPECT_EQ(a.weights.down, b.weights.down);
  WorkloadSpec other = spec;
  other.seed = 43;
  const Workload c = make_workload(other);
  EXPECT_NE(a.x, c.x);
  EXPECT_NE(a.weights.gate, c.weights.gate);
  EXPECT_NE(a.weights.down, c.weights.down);
  EXPECT_EQ(make_activations(5, 64, 7), make_activations(5, 64, 7));
  EXPECT_NE(make_activations(5, 64, 7), make_activations(5, 64, 8));
}

TEST(Workload, RotatedInputsStartWithTheWorkloadsOwnX) {
  const Workload work = make_workload({.rows = 3, .d_model = 96, .d_hidden = 300, .seed = 42});
  const std::vector<std::vector<float>> inputs = rotated_inputs(work, 3);
  ASSERT_EQ(inputs.size(), 3u);
  EXPECT_EQ(inputs[0], work.x);
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(inputs[i], make_activations(3, 96, 42 + 1000 * i));
    EXPECT_NE(inputs[i], inputs[i - 1]);
  }
  EXPECT_EQ(rotated_inputs(work, 1).size(), 1u);
  EXPECT_THROW(rotated_inputs(work, 0), Error);
}

TEST(Workload, ShapesBiasColumnAndBf16Values) {
  for (bool gated : {true, false}) {
    const Workload work =
        make_workload({.rows = 17, .d_model = 200, .d_hidden = 1000, .density = 0.1, .gated = gated, .seed = 5});
    ASSERT_EQ(work.x.size(), 17u * 200);
    EXPECT_NO_THROW(validate(work.weights));
    EXPECT_EQ(work.weights.gate.empty(), !gated);
    for (int64_t m = 0; m < 17; ++m) EXPECT_EQ(work.x[m * 200], 1.0f) << "row " << m;
    size_t nonzero = 0;
    for (float v : work.x) {
      EXPECT_EQ(round_to_bf16(v), v);
      nonzero += v != 0.0f;
    }
    EXPECT_GT(nonzero, work.x.size() / 2) << "inputs are never (nearly) all zero";
    for (const std::vector<float>* matrix : {&work.weights.gate, &work.weights.up, &work.weights.down})
      for (float v : *matrix) ASSERT_EQ(round_to_bf16(v), v);
  }
}

TEST(Workload, BadSpecsThrow) {
  EXPECT_THROW(make_workload({.rows = 0}), Error);
  EXPECT_THROW(make_workload({.d_model = 1}), Error);
  EXPECT_THROW(make_workload({.d_hidden = 0}), Error);
  EXPECT_THROW(make_workload({.d_model = 64, .d_hidden = 10, .density = 1.5}), Error);
  EXPECT_THROW(make_workload({.d_hidden = 10, .hot_neurons = 11}), Error);
}

}  // namespace
}  // namespace twell
