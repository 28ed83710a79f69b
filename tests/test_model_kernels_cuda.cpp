// The CUDA model runtime's row kernels around the residual stream (src/cuda/model_kernels.h):
// add_rms_norm must leave the same bits as add_residual followed by rms_norm (the runtime swaps one
// for the other between layers), and add_residual must add every element once, including a count
// not a multiple of its 4-element pieces and one past a single pass of its grid. Against float64,
// add_rms_norm is the harness op Ops/ResidualNormTest (tests/op_model.cpp). Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cuda/cuda_utils.h"
#include "cuda/model_kernels.h"
#include "cuda_test_support.h"
#include "twell/bf16.h"
#include "twell/cuda.h"
#include "twell/workload.h"

namespace twell {
namespace {

namespace mk = cuda::model_kernels;

class ModelRowKernels : public test::CudaTest<> {};

std::vector<float> download_floats(const cuda::DeviceArray<float>& device, size_t count) {
  std::vector<float> host(count);
  cuda::copy_to_host(host.data(), device.get(), count * sizeof(float));
  return host;
}

cuda::DeviceArray<float> upload_floats(const std::vector<float>& host) {
  cuda::DeviceArray<float> device = cuda::make_device_array<float>(host.size());
  cuda::copy_to_device(device.get(), host.data(), host.size() * sizeof(float));
  return device;
}

TEST_F(ModelRowKernels, FusedNormEqualsAddThenNorm) {
  for (const auto [rows, d] : {std::pair<int64_t, int32_t>{37, 2048}, {5, 1001}, {1, 8}}) {
    SCOPED_TRACE(testing::Message() << "rows " << rows << ", D " << d);
    const size_t count = static_cast<size_t>(rows) * d;
    const std::vector<float> hidden = make_normal(static_cast<int64_t>(count), 2.0, 7 + d);
    const std::vector<float> y = make_normal(static_cast<int64_t>(count), 1.0, 8 + d);
    const std::vector<float> weight = make_normal(d, 1.0, 9 + d);
    const cuda::DeviceArray<bf16> y_device = cuda::upload_bf16(y.data(), count);
    const cuda::DeviceArray<float> weight_device = upload_floats(weight);
    const std::vector<float> poison(count, std::numeric_limits<float>::quiet_NaN());

    const cuda::DeviceArray<float> plain = upload_floats(hidden), fused = upload_floats(hidden);
    const cuda::DeviceArray<bf16> plain_normed = cuda::upload_bf16(poison.data(), count);
    const cuda::DeviceArray<bf16> fused_normed = cuda::upload_bf16(poison.data(), count);
    mk::add_residual(plain.get(), y_device.get(), static_cast<int64_t>(count), nullptr);
    mk::rms_norm(plain.get(), rows, 0, 1, d, weight_device.get(), 1e-6f, plain_normed.get(), nullptr);
    mk::add_rms_norm(fused.get(), y_device.get(), rows, d, weight_device.get(), 1e-6f, fused_normed.get(), nullptr);

    const std::vector<float> plain_sum = download_floats(plain, count), fused_sum = download_floats(fused, count);
    const std::vector<float> plain_out = cuda::download_bf16(plain_normed.get(), count);
    const std::vector<float> fused_out = cuda::download_bf16(fused_normed.get(), count);
    int64_t sums_differ = 0, norms_differ = 0;
    for (size_t i = 0; i < count; ++i) {
      sums_differ += plain_sum[i] != fused_sum[i];
      norms_differ += !(plain_out[i] == fused_out[i]);  // a NaN left in either counts
    }
    EXPECT_EQ(sums_differ, 0) << "elements of the summed stream that differ";
    EXPECT_EQ(norms_differ, 0) << "normalized elements that differ";
  }
}

TEST_F(ModelRowKernels, AddResidualAddsEveryElementOnce) {
  // 4·k + 3 elements: pieces and a tail; the larger one needs more than one pass of the grid
  // (at most 32 blocks of 256 threads per SM, 4 elements each).
  const int64_t one_pass = int64_t{cuda::device_facts().sm_count} * 32 * 256 * 4;
  for (const int64_t count : {int64_t{4003}, one_pass * 2 + 3}) {
    SCOPED_TRACE(testing::Message() << count << " elements");
    const std::vector<float> hidden = make_normal(count, 2.0, 21);
    std::vector<float> y = make_normal(count, 1.0, 22);
    for (float& v : y) v = round_to_bf16(v);
    const cuda::DeviceArray<float> device = upload_floats(hidden);
    const cuda::DeviceArray<bf16> y_device = cuda::upload_bf16(y.data(), static_cast<size_t>(count));
    mk::add_residual(device.get(), y_device.get(), count, nullptr);
    const std::vector<float> got = download_floats(device, static_cast<size_t>(count));
    int64_t wrong = 0, first_wrong = -1;
    for (int64_t i = 0; i < count; ++i)
      if (got[i] != hidden[i] + y[i] && wrong++ == 0) first_wrong = i;
    EXPECT_EQ(wrong, 0) << "elements not equal to hidden + y; the first at " << first_wrong;
  }
}

}  // namespace
}  // namespace twell
