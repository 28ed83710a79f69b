// The CUDA decode step's RoPE and attention in one kernel (model_kernels::decode_attention_rope) on
// random bf16 qkv rows, with and without a bias, over caches holding random bf16 below the length
// and NaN from it on (the kernel must read neither the new position nor any after it). Each call is
// checked against float64 (RoPE of the biased query and new key with HF's fp32 angles, then
// ref::causal_attention over the cache and the new key and value) and against qkv_rope run on a copy
// of the inputs: the caches afterwards hold the same bits (the new key and value at the length,
// nothing else changed), and the output is the float64 attention over qkv_rope's query and caches
// within the output's one rounding. Batches of 1 and 3, GQA groups 1, 2 and 4, every supported Dh,
// odd cache strides, lengths from 0 to 4096, so that one split, many splits and a partial last split
// all run. Each case calls the kernel at several lengths in turn on one workspace, eagerly and as one
// captured CUDA graph replayed with the length changed on the device. Skipped without a GPU, but for
// the argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_test_support.h"
#include "cuda/cuda_utils.h"
#include "cuda/model_kernels.h"
#include "cuda_test_support.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"

namespace twell {
namespace {

namespace mk = cuda::model_kernels;

// Against the float64 attention over qkv_rope's bf16 query and caches, the kernel rounds only its
// output to bf16 (scores, exponentials and P·V stay fp32, probabilities unrounded). Round to nearest
// with 8 significant bits moves an element by at most 2^-8 = 3.9e-3 of itself, so no row's relative
// L2 error, nor the whole output's, exceeds 2^-8 plus the fp32 error (~1e-5 at these lengths: ~4·10^3
// terms of relative error 2^-24 summed in random directions). A position leaking across the mask, or
// a split lost or counted twice, moves a row by far more: the output is a sum of random values, so
// dropping 16 of 4097 similarly weighted positions moves it by about sqrt(16/4097) = 6%.
constexpr double kTolerance = 4.5e-3;
// Against the unrounded float64 RoPE, the query, new key and new value are bf16 too (as the caches
// store them): each element within 2^-8 of itself, which moves the scores and so the probabilities.
// A numpy model of these roundings on these shapes (and 40 draws at Dh = 8, where a score is a sum
// of only 8 products) gave at most 5.6e-3 for a whole output and 1.2e-2 for a row; the bf16 bound of
// the other attention tests, 1e-2, holds the whole output, rows get 3e-2. A wrong angle or a lost new
// position moves the rows of short caches by tens of percent.
constexpr double kReferenceTolerance = 1e-2;
constexpr double kReferenceRowTolerance = 3e-2;

struct DecodeCase {
  std::string name;
  int32_t batch, n_heads, n_kv_heads, head_dim, cache_stride;
  bool bias;
  float rope_theta;
  std::vector<int32_t> lengths;  // positions cached before the step: the query sees 0 ..= length
};

// What one call must produce.
struct Expected {
  std::vector<double> reference;    // [B, H_q·Dh] float64 RoPE and attention
  std::vector<double> composed;     // [B, H_q·Dh] float64 attention over qkv_rope's query and caches
  std::vector<float> keys, values;  // [B, H_kv, cache_stride, Dh] the caches after qkv_rope
};

// The first element whose bits differ (NaN poison included), as "(sequence, kv head, position, d)";
// empty when none does.
std::string first_difference(const std::vector<float>& got, const std::vector<float>& want,
                             const mk::AttentionShape& s) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " and " + std::to_string(want.size());
  for (size_t e = 0; e < got.size(); ++e) {
    if (std::memcmp(&got[e], &want[e], sizeof(float)) == 0) continue;
    const size_t d = e % s.head_dim, position = e / s.head_dim % s.cache_stride;
    const size_t kv_head = e / (size_t{1} * s.head_dim * s.cache_stride) % s.n_kv_heads;
    const size_t b = e / (size_t{1} * s.head_dim * s.cache_stride * s.n_kv_heads);
    return "(" + std::to_string(b) + ", " + std::to_string(kv_head) + ", " + std::to_string(position) + ", " +
           std::to_string(d) + "): " + std::to_string(got[e]) + " vs " + std::to_string(want[e]);
  }
  return {};
}

// One case's device buffers, refilled for each length in place: a captured graph keeps their
// addresses. The kernel's inputs and caches, and a copy of them for qkv_rope.
class DecodeBuffers {
 public:
  explicit DecodeBuffers(const DecodeCase& c)
      : case_(c),
        shape_{c.batch, 1, c.n_heads, c.n_kv_heads, c.head_dim, c.cache_stride},
        width_((int64_t{c.n_heads} + 2 * c.n_kv_heads) * c.head_dim),
        q_elements_(int64_t{c.batch} * c.n_heads * c.head_dim),
        cache_elements_(int64_t{c.batch} * c.n_kv_heads * c.cache_stride * c.head_dim),
        qkv_(cuda::make_device_array<bf16>(c.batch * width_)),
        bias_(cuda::make_device_array<float>(width_)),
        keys_(cuda::make_device_array<bf16>(cache_elements_)),
        values_(cuda::make_device_array<bf16>(cache_elements_)),
        out_(cuda::make_device_array<bf16>(q_elements_)),
        length_(cuda::make_device_array<int32_t>(1)),
        workspace_bytes_(mk::decode_attention_workspace_bytes(shape_)),
        workspace_(cuda::make_device_array<std::byte>(workspace_bytes_)),
        composed_q_(cuda::make_device_array<bf16>(q_elements_)),
        composed_keys_(cuda::make_device_array<bf16>(cache_elements_)),
        composed_values_(cuda::make_device_array<bf16>(cache_elements_)) {
    TWELL_CUDA_CHECK(cudaMemset(workspace_.get(), 0, workspace_bytes_));
  }

  // Random qkv rows and bias, caches random below `length` and NaN from it on, the length on the
  // device, the output NaN until written. Runs qkv_rope on the copy and returns what the kernel
  // must produce.
  Expected fill(int32_t length, uint64_t seed) {
    const std::vector<float> qkv = test::random_bf16(case_.batch * width_, seed);  // [B, H_q·Dh + 2·H_kv·Dh]
    const std::vector<float> bias = case_.bias ? make_normal(width_, 0.5, seed + 3) : std::vector<float>{};
    std::vector<float> keys = test::random_bf16(cache_elements_, seed + 1);    // [B, H_kv, cache_stride, Dh]
    std::vector<float> values = test::random_bf16(cache_elements_, seed + 2);  // [B, H_kv, cache_stride, Dh]
    const float poison = std::numeric_limits<float>::quiet_NaN();
    for (int64_t e = 0; e < cache_elements_; ++e)
      if ((e / case_.head_dim) % case_.cache_stride >= length) keys[e] = values[e] = poison;
    upload(qkv_.get(), qkv);
    if (case_.bias) cuda::copy_to_device(bias_.get(), bias.data(), bias.size() * sizeof(float));
    for (bf16* device : {keys_.get(), composed_keys_.get()}) upload(device, keys);
    for (bf16* device : {values_.get(), composed_values_.get()}) upload(device, values);
    cuda::copy_to_device(length_.get(), &length, sizeof(int32_t));
    TWELL_CUDA_CHECK(cudaMemset(out_.get(), 0xff, q_elements_ * sizeof(bf16)));

    Expected expected = run_qkv_rope(length);
    expected.reference = ref::decode_attention_rope(qkv.data(), case_.bias ? bias.data() : nullptr, std::move(keys),
                                                    std::move(values), ref_shape(length), case_.rope_theta, scale());
    return expected;
  }

  void enqueue(cudaStream_t stream) {
    mk::decode_attention_rope(qkv_.get(), bias_pointer(), shape_, length_.get(), case_.rope_theta, keys_.get(),
                              values_.get(), static_cast<float>(scale()), out_.get(), workspace_.get(),
                              workspace_bytes_, stream);
  }

  void check(const Expected& expected, const std::string& label) const {
    const std::vector<float> out = cuda::download_bf16(out_.get(), q_elements_);
    test::expect_attention_close(out, expected.composed, case_.head_dim, kTolerance, kTolerance,
                                 label + " against qkv_rope's");
    test::expect_attention_close(out, expected.reference, case_.head_dim, kReferenceTolerance, kReferenceRowTolerance,
                                 label + " against float64");
    EXPECT_EQ(first_difference(cuda::download_bf16(keys_.get(), cache_elements_), expected.keys, shape_), "")
        << label << ": key cache differs from qkv_rope's at (sequence, kv head, position, d)";
    EXPECT_EQ(first_difference(cuda::download_bf16(values_.get(), cache_elements_), expected.values, shape_), "")
        << label << ": value cache differs from qkv_rope's at (sequence, kv head, position, d)";
  }

  const mk::AttentionShape& shape() const { return shape_; }

 private:
  ref::CachedAttentionShape ref_shape(int32_t length) const {
    return {case_.batch, 1, case_.n_heads, case_.n_kv_heads, case_.head_dim, case_.cache_stride, length};
  }

  // qkv_rope on the copy of the caches: the caches it leaves and the attention over them.
  Expected run_qkv_rope(int32_t length) {
    mk::qkv_rope(qkv_.get(), bias_pointer(), shape_, length_.get(), case_.rope_theta, composed_q_.get(),
                 composed_keys_.get(), composed_values_.get(), nullptr);
    TWELL_CUDA_CHECK(cudaDeviceSynchronize());
    Expected expected;
    const std::vector<float> q = cuda::download_bf16(composed_q_.get(), q_elements_);
    expected.keys = cuda::download_bf16(composed_keys_.get(), cache_elements_);
    expected.values = cuda::download_bf16(composed_values_.get(), cache_elements_);
    expected.composed =
        ref::causal_attention(q.data(), expected.keys.data(), expected.values.data(), ref_shape(length), scale());
    return expected;
  }

  double scale() const { return 1.0 / std::sqrt(static_cast<double>(case_.head_dim)); }
  const float* bias_pointer() const { return case_.bias ? bias_.get() : nullptr; }
  static void upload(bf16* device, const std::vector<float>& host) {
    std::vector<bf16> converted(host.size());
    for (size_t i = 0; i < host.size(); ++i) converted[i] = to_bf16(host[i]);
    cuda::copy_to_device(device, converted.data(), converted.size() * sizeof(bf16));
  }

  DecodeCase case_;
  mk::AttentionShape shape_;
  int64_t width_, q_elements_, cache_elements_;
  cuda::DeviceArray<bf16> qkv_;        // [B, H_q·Dh + 2·H_kv·Dh]
  cuda::DeviceArray<float> bias_;      // [H_q·Dh + 2·H_kv·Dh]
  cuda::DeviceArray<bf16> keys_;       // [B, H_kv, cache_stride, Dh]
  cuda::DeviceArray<bf16> values_;     // [B, H_kv, cache_stride, Dh]
  cuda::DeviceArray<bf16> out_;        // [B, H_q·Dh]
  cuda::DeviceArray<int32_t> length_;  // [1]
  size_t workspace_bytes_;
  cuda::DeviceArray<std::byte> workspace_;
  cuda::DeviceArray<bf16> composed_q_;       // [B, H_q, 1, Dh] qkv_rope's
  cuda::DeviceArray<bf16> composed_keys_;    // [B, H_kv, cache_stride, Dh] qkv_rope's
  cuda::DeviceArray<bf16> composed_values_;  // [B, H_kv, cache_stride, Dh] qkv_rope's
};

std::string label(const DecodeCase& c, const char* how, int32_t length) {
  return c.name + " " + how + " length " + std::to_string(length);
}

class DecodeAttentionRope : public test::CudaTest<::testing::TestWithParam<DecodeCase>> {};

// One call per length in a row, on the same workspace: each must leave its arrival counters zero
// for the next.
TEST_P(DecodeAttentionRope, MatchesReferenceAtEachLength) {
  const DecodeCase& c = GetParam();
  DecodeBuffers buffers(c);
  std::printf("%s: %d splits per head\n", c.name.c_str(), mk::decode_attention_splits(buffers.shape()));
  for (const int32_t length : c.lengths) {
    const Expected expected = buffers.fill(length, 1000 + length);
    buffers.enqueue(nullptr);
    TWELL_CUDA_CHECK(cudaDeviceSynchronize());
    buffers.check(expected, label(c, "eager", length));
  }
}

// Captured once, replayed at each length: the kernel reads the length at replay, sizes its chunks,
// rotates and stores at it.
TEST_P(DecodeAttentionRope, GraphReplayFollowsDeviceLength) {
  const DecodeCase& c = GetParam();
  DecodeBuffers buffers(c);
  cudaStream_t stream = nullptr;  // blocking: it waits for fill()'s copies and launches on the default stream
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
    const Expected expected = buffers.fill(length, 2000 + length);
    TWELL_CUDA_CHECK(cudaGraphLaunch(replay, stream));
    TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));
    buffers.check(expected, label(c, "graph", length));
  }
}

// Odd strides, each past its longest length; lengths 0 (the new position alone), 1 and 17, just
// under one pass of the block (one split, written directly), the whole cache but the new position,
// 4096, and odd ones between with a partial last split. Qwen2's theta 1e6 and Llama 2's 1e4.
INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttentionRope,
    ::testing::Values(DecodeCase{"dh64_group1_bias", 3, 4, 4, 64, 3001, true, 1e4f, {0, 1, 17, 14, 16, 131, 3000, 7}},
                      DecodeCase{"dh64_group4_batch1", 1, 8, 2, 64, 1201, false, 1e6f, {1, 777, 1200, 200, 0}},
                      DecodeCase{"dh128_group2_bias", 3, 4, 2, 128, 2101, true, 1e6f, {33, 2100, 1999, 17}},
                      DecodeCase{"dh256_group4_bias", 3, 4, 1, 256, 701, true, 1e4f, {3, 700, 451, 0}},
                      DecodeCase{"dh32_group2", 3, 4, 2, 32, 4097, false, 1e4f, {4096, 61, 2333, 1}},
                      DecodeCase{"dh16_group1_batch1_bias", 1, 2, 2, 16, 999, true, 1e4f, {998, 100, 17}},
                      DecodeCase{"dh8_group4_bias", 3, 4, 1, 8, 4103, true, 1e4f, {4096, 516, 130, 0}}),
    [](const auto& info) { return info.param.name; });

// `call` throws twell::Error whose message contains `named`.
template <typename Call>
void expect_refused(Call&& call, const std::string& named) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming " << named;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(named), std::string::npos) << error.what();
  }
}

// The shape checks come before any CUDA call, so they run without a GPU too.
TEST(DecodeAttentionRopeRefusals, NameTheProblem) {
  EXPECT_FALSE(mk::decode_attention_supports(80));
  const auto call = [](const mk::AttentionShape& shape, float rope_theta = 1e4f, size_t workspace_bytes = 1 << 20) {
    mk::decode_attention_rope(nullptr, nullptr, shape, nullptr, rope_theta, nullptr, nullptr, 1.0f, nullptr, nullptr,
                              workspace_bytes, nullptr);
  };
  expect_refused([&] { call({1, 1, 2, 2, 80, 8}); }, "head_dim");
  expect_refused([&] { call({1, 2, 2, 2, 64, 8}); }, "one token per sequence");
  expect_refused([&] { call({1, 1, 3, 2, 64, 8}); }, "multiple of n_kv_heads");
  expect_refused([&] { call({1, 1, 2, 0, 64, 8}); }, "multiple of n_kv_heads");
  expect_refused([&] { call({0, 1, 2, 2, 64, 8}); }, "batch");
  expect_refused([&] { call({1, 1, 2, 2, 64, 0}); }, "cache_stride");
  expect_refused([&] { call({1, 1, 2, 2, 64, 8}, 0.0f); }, "rope_theta");
  // qkv_rope (prefill) rotates 8-byte pieces: a Dh the decode kernel refuses too, and one it would not.
  for (const int32_t head_dim : {12, 4})
    expect_refused([&] { mk::qkv_rope(nullptr, nullptr, {1, 2, 2, 2, head_dim, 8}, nullptr, 1e4f, nullptr, nullptr,
                                      nullptr, nullptr); },
                   "head_dim");
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device: the workspace size needs one";
  const mk::AttentionShape fits{1, 1, 2, 2, 64, 8};
  expect_refused([&] { call(fits, 1e4f, mk::decode_attention_workspace_bytes(fits) - 1); }, "workspace");
}

}  // namespace
}  // namespace twell
