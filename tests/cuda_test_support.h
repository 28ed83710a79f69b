// What the CUDA test files share: a fixture base that skips where there is no GPU, and a workload
// uploaded beside its float64 reference output.
#pragma once

#include <vector>

#include <gtest/gtest.h>

#include "twell/bench_record.h"
#include "twell/cuda.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell::test {

// Base of a CUDA test fixture: every test of the suite is skipped without a CUDA device. Base is
// testing::Test, or testing::TestWithParam<...> for a parameterized suite.
template <typename Base = testing::Test>
class CudaTest : public Base {
 protected:
  void SetUp() override {
    if (!cuda::available()) GTEST_SKIP() << "no CUDA device is available";
  }
};

// Weights for the kernels that take any D a multiple of 8 (the decode and training kernels):
// cuda::upload_weights asks for the 64 the gate kernel needs, so the arrays go up one by one.
inline cuda::DeviceFfnWeights upload_weights_any_width(const FfnWeights& weights) {
  validate(weights);
  cuda::DeviceFfnWeights device;
  device.d_model = weights.d_model;
  device.d_hidden = weights.d_hidden;
  device.gated = weights.gated;
  if (weights.gated) device.gate = cuda::upload_bf16(weights.gate.data(), weights.gate.size());
  device.up = cuda::upload_bf16(weights.up.data(), weights.up.size());
  device.down = cuda::upload_bf16(weights.down.data(), weights.down.size());
  return device;
}

// A workload on the device (D a multiple of 64) and its float64 y.
struct WorkloadOnDevice {
  Workload work;
  cuda::DeviceFfnWeights weights;
  cuda::DeviceArray<bf16> x;  // [M, D]
  std::vector<double> y_ref;  // [M, D]
};

inline WorkloadOnDevice upload_workload(const WorkloadSpec& spec) {
  WorkloadOnDevice d{make_workload(spec), {}, {}, {}};
  d.weights = cuda::upload_weights(d.work.weights);
  d.x = cuda::upload_bf16(d.work.x.data(), d.work.x.size());
  d.y_ref = ref::ffn_dense(d.work.x.data(), spec.rows, d.work.weights);
  return d;
}

// Relative L2 error of y [M, D] (on the host, or on the device as bf16) against the float64 y.
inline double error_of(const WorkloadOnDevice& d, const std::vector<float>& y) {
  return relative_l2_error(y.data(), d.y_ref.data(), y.size());
}

inline double error_of(const WorkloadOnDevice& d, const cuda::DeviceArray<bf16>& y) {
  return error_of(d, cuda::download_bf16(y.get(), d.y_ref.size()));
}

}  // namespace twell::test
