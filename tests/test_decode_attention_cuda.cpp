// The CUDA decode attention (model_kernels::decode_attention, split over positions) against the
// float64 reference (ref::causal_attention with one token per sequence): random bf16 q, keys and
// values, batches of 3, GQA groups 1, 2 and 4, every supported Dh, odd cache strides, lengths from 0
// to the whole cache, so that one split, many splits and a partial last split all run. Each case
// calls the kernel at several lengths in turn on one workspace, eagerly and as one captured CUDA
// graph replayed with the length changed on the device. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_test_support.h"
#include "cuda/cuda_utils.h"
#include "cuda/model_kernels.h"
#include "cuda_test_support.h"
#include "twell/error.h"
#include "twell/reference.h"

namespace twell {
namespace {

namespace mk = cuda::model_kernels;

// The kernel rounds only its output to bf16 (inputs are bf16 values, exact in the reference; scores,
// exponentials and P·V stay fp32, probabilities unrounded). Round to nearest with 8 significant bits
// moves an element by at most 2^-8 = 3.9e-3 of itself, so no row's relative L2 error, nor the whole
// output's, exceeds 2^-8 plus the fp32 error (~1e-5 at these lengths: ~4·10^3 terms of relative
// error 2^-24 summed in random directions). A position leaking across the mask, or a split lost or
// counted twice, moves a row by far more: the output is a sum of random values, so dropping 16 of
// 4097 similarly weighted positions moves it by about sqrt(16/4097) = 6%.
constexpr double kTolerance = 4.5e-3;

struct DecodeCase {
  std::string name;
  int32_t batch, n_heads, n_kv_heads, head_dim, cache_stride;
  std::vector<int32_t> lengths;  // positions cached before the step: the query sees 0 ..= length
};

// One case's device buffers, refilled for each length in place: a captured graph keeps their addresses.
class DecodeBuffers {
 public:
  explicit DecodeBuffers(const DecodeCase& c)
      : shape_{c.batch, 1, c.n_heads, c.n_kv_heads, c.head_dim, c.cache_stride},
        q_elements_(int64_t{c.batch} * c.n_heads * c.head_dim),
        cache_elements_(int64_t{c.batch} * c.n_kv_heads * c.cache_stride * c.head_dim),
        q_(cuda::make_device_array<bf16>(q_elements_)),
        keys_(cuda::make_device_array<bf16>(cache_elements_)),
        values_(cuda::make_device_array<bf16>(cache_elements_)),
        out_(cuda::make_device_array<bf16>(q_elements_)),
        length_(cuda::make_device_array<int32_t>(1)),
        workspace_bytes_(mk::decode_attention_workspace_bytes(shape_)),
        workspace_(cuda::make_device_array<std::byte>(workspace_bytes_)) {
    TWELL_CUDA_CHECK(cudaMemset(workspace_.get(), 0, workspace_bytes_));
  }

  // Random q and cache up to position `length`, NaN after it (the kernel must not read those), the
  // length on the device, the output NaN until written; returns the float64 output [B, H_q·Dh].
  std::vector<double> fill(int32_t length, uint64_t seed) {
    std::vector<float> q = test::random_bf16(q_elements_, seed);
    std::vector<float> keys = test::random_bf16(cache_elements_, seed + 1);
    std::vector<float> values = test::random_bf16(cache_elements_, seed + 2);
    const float poison = std::numeric_limits<float>::quiet_NaN();
    for (int64_t e = 0; e < cache_elements_; ++e)
      if ((e / shape_.head_dim) % shape_.cache_stride > length) keys[e] = values[e] = poison;
    upload(q_.get(), q);
    upload(keys_.get(), keys);
    upload(values_.get(), values);
    cuda::copy_to_device(length_.get(), &length, sizeof(int32_t));
    TWELL_CUDA_CHECK(cudaMemset(out_.get(), 0xff, q_elements_ * sizeof(bf16)));
    const ref::CachedAttentionShape ref_shape{
        shape_.batch, 1, shape_.n_heads, shape_.n_kv_heads, shape_.head_dim, shape_.cache_stride, length};
    return ref::causal_attention(q.data(), keys.data(), values.data(), ref_shape, scale());
  }

  void enqueue(cudaStream_t stream) {
    mk::decode_attention(q_.get(), keys_.get(), values_.get(), shape_, length_.get(), static_cast<float>(scale()),
                         out_.get(), workspace_.get(), workspace_bytes_, stream);
  }

  std::vector<float> output() const { return cuda::download_bf16(out_.get(), q_elements_); }
  int32_t head_dim() const { return shape_.head_dim; }

 private:
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(shape_.head_dim)); }
  static void upload(bf16* device, const std::vector<float>& host) {
    std::vector<bf16> converted(host.size());
    for (size_t i = 0; i < host.size(); ++i) converted[i] = to_bf16(host[i]);
    cuda::copy_to_device(device, converted.data(), converted.size() * sizeof(bf16));
  }

  mk::AttentionShape shape_;
  int64_t q_elements_, cache_elements_;
  cuda::DeviceArray<bf16> q_;          // [B, H_q, Dh]
  cuda::DeviceArray<bf16> keys_;       // [B, H_kv, cache_stride, Dh]
  cuda::DeviceArray<bf16> values_;     // [B, H_kv, cache_stride, Dh]
  cuda::DeviceArray<bf16> out_;        // [B, H_q·Dh]
  cuda::DeviceArray<int32_t> length_;  // [1]
  size_t workspace_bytes_;
  cuda::DeviceArray<std::byte> workspace_;
};

std::string label(const DecodeCase& c, const char* how, int32_t length) {
  return c.name + " " + how + " length " + std::to_string(length);
}

class DecodeAttention : public test::CudaTest<::testing::TestWithParam<DecodeCase>> {};

// One call per length in a row, on the same workspace: each must leave its arrival counters zero
// for the next.
TEST_P(DecodeAttention, MatchesReferenceAtEachLength) {
  const DecodeCase& c = GetParam();
  DecodeBuffers buffers(c);
  std::printf("%s: %d splits per head\n", c.name.c_str(),
              mk::decode_attention_splits({c.batch, 1, c.n_heads, c.n_kv_heads, c.head_dim, c.cache_stride}));
  for (const int32_t length : c.lengths) {
    const std::vector<double> expected = buffers.fill(length, 1000 + length);
    buffers.enqueue(nullptr);
    TWELL_CUDA_CHECK(cudaDeviceSynchronize());
    test::expect_attention_close(buffers.output(), expected, buffers.head_dim(), kTolerance, kTolerance,
                                 label(c, "eager", length));
  }
}

// Captured once, replayed at each length: the kernel reads the length at replay and sizes its
// chunks from it.
TEST_P(DecodeAttention, GraphReplayFollowsDeviceLength) {
  const DecodeCase& c = GetParam();
  DecodeBuffers buffers(c);
  cudaStream_t stream = nullptr;  // blocking: it waits for fill()'s copies and memsets on the default stream
  TWELL_CUDA_CHECK(cudaStreamCreate(&stream));
  const std::unique_ptr<std::remove_pointer_t<cudaStream_t>, decltype(&cudaStreamDestroy)> stream_owner(
      stream, cudaStreamDestroy);
  cudaGraph_t graph = nullptr;
  TWELL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  buffers.enqueue(stream);
  TWELL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  const std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, decltype(&cudaGraphDestroy)> graph_owner(graph,
                                                                                                     cudaGraphDestroy);
  cudaGraphExec_t replay = nullptr;
  TWELL_CUDA_CHECK(cudaGraphInstantiate(&replay, graph, 0));
  const std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, decltype(&cudaGraphExecDestroy)> replay_owner(
      replay, cudaGraphExecDestroy);
  for (const int32_t length : c.lengths) {
    const std::vector<double> expected = buffers.fill(length, 2000 + length);
    TWELL_CUDA_CHECK(cudaGraphLaunch(replay, stream));
    TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));
    test::expect_attention_close(buffers.output(), expected, buffers.head_dim(), kTolerance, kTolerance,
                                 label(c, "graph", length));
  }
}

// Odd strides; lengths 0 (one position) and just under one pass of the block (one split, written
// directly), a stride's worth (the whole cache), and odd ones between with a partial last split.
INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttention,
    ::testing::Values(DecodeCase{"dh64_group1", 3, 4, 4, 64, 3001, {0, 14, 16, 131, 1022, 3000, 7}},
                      DecodeCase{"dh64_group4", 3, 8, 2, 64, 1201, {1, 777, 1200, 200}},
                      DecodeCase{"dh128_group2", 3, 4, 2, 128, 2101, {33, 2100, 1999}},
                      DecodeCase{"dh256_group4", 3, 4, 1, 256, 701, {3, 700, 451}},
                      DecodeCase{"dh32_group2", 3, 4, 2, 32, 4097, {4096, 61, 2333}},
                      DecodeCase{"dh16_group1", 3, 2, 2, 16, 999, {998, 100}},
                      DecodeCase{"dh8_group4", 3, 4, 1, 8, 517, {516, 130, 0}}),
    [](const auto& info) { return info.param.name; });

TEST(DecodeAttentionRefusals, NameTheProblem) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device is available";
  EXPECT_FALSE(mk::decode_attention_supports(80));
  const mk::AttentionShape dh80{1, 1, 2, 2, 80, 8};
  EXPECT_THROW(mk::decode_attention(nullptr, nullptr, nullptr, dh80, nullptr, 1.0f, nullptr, nullptr, 0, nullptr),
               Error);
  const mk::AttentionShape bad_group{1, 1, 3, 2, 64, 8};
  EXPECT_THROW(
      mk::decode_attention(nullptr, nullptr, nullptr, bad_group, nullptr, 1.0f, nullptr, nullptr, 1 << 20, nullptr),
      Error);
  const mk::AttentionShape fits{1, 1, 2, 2, 64, 8};
  const size_t needed = mk::decode_attention_workspace_bytes(fits);
  EXPECT_THROW(
      mk::decode_attention(nullptr, nullptr, nullptr, fits, nullptr, 1.0f, nullptr, nullptr, needed - 1, nullptr),
      Error);
}

}  // namespace
}  // namespace twell
