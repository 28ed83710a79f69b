// The CUDA model runtime (twell/model_cuda.h) against HF transformers' golden logits and greedy
// continuations (tests/fixtures/models/*), the CPU runtime, and itself: every FFN path, batches of
// sequences, CUDA-graph decode steps. Skipped where no GPU is present (one test checks the refusal).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cuda_test_support.h"
#include "model_fixtures.h"
#include "twell/cuda.h"
#include "twell/error.h"
#include "twell/model.h"
#include "twell/model_cuda.h"

namespace twell {
namespace {

using test::Golden;
using test::model_dir;
using test::read_golden;
using test::relative_l2;

// bf16 weights and activations against HF's fp32 run: measured errors are printed; the bound is the
// bf16 tolerance of the project (relative L2 about 1e-2).
constexpr double kLogitTolerance = 2e-2;

// Prefill, then greedy steps through forward() one token at a time (the host path of generate).
std::vector<int32_t> greedy_tokens(cuda::CudaModel& gpu, const std::vector<int32_t>& prompt, int32_t new_tokens) {
  const int32_t vocab = gpu.config().vocab_size;
  gpu.reset(1, static_cast<int32_t>(prompt.size()) + new_tokens);
  std::vector<float> logits(vocab, NAN);
  gpu.forward(prompt.data(), static_cast<int32_t>(prompt.size()), logits.data());
  Sampler greedy(SamplerConfig{});
  std::vector<int32_t> tokens;
  for (int32_t step = 0; step < new_tokens; ++step) {
    tokens.push_back(greedy.sample(logits.data(), vocab));
    std::fill(logits.begin(), logits.end(), NAN);
    if (step + 1 < new_tokens) gpu.forward(&tokens.back(), 1, logits.data());
  }
  return tokens;
}

class CudaModelTest : public test::CudaTest<> {};

class CudaGolden : public test::CudaTest<::testing::TestWithParam<std::string>> {};

// Every prompt position's logits (prefill through the batched attention GEMMs, then one position at
// a time through the decode attention kernel), and HF's greedy continuation: the fixtures' smallest
// top-2 margin (0.066) is several times the logit error bf16 causes, so the tokens must be equal.
TEST_P(CudaGolden, MatchesTransformers) {
  const Golden golden = read_golden(GetParam());
  const Model host = Model::load(model_dir(GetParam()));
  cuda::CudaModel gpu(host);
  const int32_t n = static_cast<int32_t>(golden.prompt.size());
  const int32_t vocab = gpu.config().vocab_size;

  gpu.reset(1, n);
  std::vector<float> logits(static_cast<size_t>(n) * vocab, NAN);
  gpu.forward(golden.prompt.data(), n, logits.data(), /*all_logits=*/true);
  double worst = 0;
  for (int32_t i = 0; i < n; ++i) {
    const double error = relative_l2(logits.data() + static_cast<size_t>(i) * vocab, golden.logits[i]);
    EXPECT_LT(error, kLogitTolerance) << "prefill position " << i;
    worst = std::max(worst, error);
  }
  gpu.reset(1, n);
  std::vector<float> step_logits(vocab, NAN);
  for (int32_t i = 0; i < n; ++i) {
    gpu.forward(&golden.prompt[i], 1, step_logits.data());
    const double error = relative_l2(step_logits.data(), golden.logits[i]);
    EXPECT_LT(error, kLogitTolerance) << "decode position " << i;
    worst = std::max(worst, error);
  }
  std::printf("[ %s ] worst logits relative L2 vs HF: %.3g\n", GetParam().c_str(), worst);
  EXPECT_EQ(greedy_tokens(gpu, golden.prompt, static_cast<int32_t>(golden.greedy.size())), golden.greedy);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaGolden, ::testing::Values("llama", "qwen2", "sparselm", "prosparse"),
                         [](const auto& info) { return info.param; });

// The TwELL path (forced, no dense fallback) and the predictor path (exact until calibrated, then
// calibrated for 100% recall on the prompt) give HF's logits within bf16 tolerance and its tokens.
TEST_F(CudaModelTest, SparsePathsMatchTransformers) {
  const Golden golden = read_golden("sparselm");
  Model host = Model::load(model_dir("sparselm"));
  cuda::CudaModel gpu(host, cuda::CudaModelOptions{.ffn_dispatch = false});
  const int32_t n = static_cast<int32_t>(golden.prompt.size());
  const int32_t vocab = gpu.config().vocab_size;
  for (FfnPath path : {FfnPath::twell, FfnPath::predict}) {
    SCOPED_TRACE(to_string(path));
    gpu.set_ffn_path(path);
    gpu.reset(1, n);
    std::vector<float> logits(static_cast<size_t>(n) * vocab, NAN);
    gpu.forward(golden.prompt.data(), n, logits.data(), true);
    for (int32_t i = 0; i < n; ++i)
      EXPECT_LT(relative_l2(logits.data() + static_cast<size_t>(i) * vocab, golden.logits[i]), kLogitTolerance) << i;
    EXPECT_EQ(greedy_tokens(gpu, golden.prompt, static_cast<int32_t>(golden.greedy.size())), golden.greedy);
  }
  host.set_ffn_path(FfnPath::predict);
  for (PredictorKind kind : {PredictorKind::one_bit_gate, PredictorKind::normalized_one_bit_gate,
                             PredictorKind::two_bit_gate}) {
    SCOPED_TRACE(to_string(kind));
    host.calibrate_predictor(golden.prompt, kind, 1.0);
    gpu.set_predictor(host);
    EXPECT_EQ(greedy_tokens(gpu, golden.prompt, 1), std::vector<int32_t>(1, golden.greedy[0]));
  }
}

// B sequences in one call give each sequence's single-sequence results (rows > 16, so the predict
// path runs its prefill through SparseFfn), for every path.
TEST_F(CudaModelTest, BatchOfSequencesMatchesOneAtATime) {
  const Golden golden = read_golden("sparselm");
  const Model host = Model::load(model_dir("sparselm"));
  cuda::CudaModel gpu(host, cuda::CudaModelOptions{.ffn_dispatch = false});
  const int32_t n = static_cast<int32_t>(golden.prompt.size()), vocab = gpu.config().vocab_size;
  constexpr int32_t kBatch = 3, kSteps = 6;
  std::vector<int32_t> prompts;
  for (int32_t b = 0; b < kBatch; ++b)
    for (int32_t i = 0; i < n; ++i) prompts.push_back(golden.prompt[(i + 3 * b) % n]);
  for (FfnPath path : {FfnPath::dense, FfnPath::twell, FfnPath::predict}) {
    SCOPED_TRACE(to_string(path));
    gpu.set_ffn_path(path);
    gpu.reset(kBatch, n + kSteps);
    std::vector<float> batch_logits(static_cast<size_t>(kBatch) * vocab);
    gpu.forward(prompts.data(), n, batch_logits.data());
    std::vector<int32_t> batch_tokens(kBatch * kSteps, -1);
    gpu.decode_greedy(kSteps, batch_tokens.data());
    for (int32_t b = 0; b < kBatch; ++b) {
      const std::vector<int32_t> prompt(prompts.begin() + b * n, prompts.begin() + (b + 1) * n);
      gpu.reset(1, n + kSteps);
      std::vector<float> logits(vocab);
      gpu.forward(prompt.data(), n, logits.data());
      EXPECT_LT(relative_l2(batch_logits.data() + static_cast<size_t>(b) * vocab, logits), 1e-2) << "sequence " << b;
      std::vector<int32_t> tokens(kSteps, -1);
      gpu.decode_greedy(kSteps, tokens.data());
      EXPECT_EQ(std::vector<int32_t>(batch_tokens.begin() + b * kSteps, batch_tokens.begin() + (b + 1) * kSteps), tokens)
          << "sequence " << b;
    }
  }
}

// Decode steps replayed from CUDA graphs give the tokens (and, on the deterministic dense path, the
// bit-identical logits) of steps launched one kernel at a time.
TEST_F(CudaModelTest, GraphDecodeMatchesEagerDecode) {
  const ModelConfig config = synthetic_model_config("tiny");
  const Model host(config, make_synthetic_weights(config, 0.05, 3));
  cuda::CudaModel gpu(host);
  const std::vector<int32_t> prompt = {5, 17, 200, 3, 99, 42, 7};
  const int32_t n = static_cast<int32_t>(prompt.size());
  constexpr int32_t kSteps = 24;
  for (FfnPath path : {FfnPath::dense, FfnPath::predict}) {
    SCOPED_TRACE(to_string(path));
    gpu.set_ffn_path(path);
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<float>> last_logits;
    for (bool graphs : {false, true}) {
      gpu.set_decode_graphs(graphs);
      gpu.reset(2, n + kSteps + 1);
      std::vector<int32_t> two_prompts(prompt);
      two_prompts.insert(two_prompts.end(), prompt.rbegin(), prompt.rend());
      std::vector<float> logits(2 * static_cast<size_t>(config.vocab_size));
      gpu.forward(two_prompts.data(), n, logits.data());
      tokens.emplace_back(2 * kSteps);
      gpu.decode_greedy(kSteps, tokens.back().data());
      EXPECT_EQ(gpu.graph_replays() > 0, graphs);
      const std::vector<int32_t> next = {tokens.back()[kSteps - 1], tokens.back()[2 * kSteps - 1]};
      gpu.forward(next.data(), 1, logits.data());  // through forward(): the graph of the step with copied logits
      last_logits.push_back(logits);
    }
    EXPECT_EQ(tokens[0], tokens[1]);
    if (path == FfnPath::dense) EXPECT_EQ(last_logits[0], last_logits[1]);
    else EXPECT_LT(relative_l2(last_logits[1].data(), last_logits[0]), 1e-5);
  }
}

// The CUDA runtime and the CPU runtime agree on a synthetic model: a prompt, then a continuation
// longer than one 64-token tile of the fused attention over the cached prompt, at head_dim 32 (the
// fused prefill attention) and 8 (the GEMM path).
TEST_F(CudaModelTest, SyntheticModelMatchesCpu) {
  for (const int32_t head_dim : {32, 8}) {
    ModelConfig config = synthetic_model_config("tiny");
    config.head_dim = head_dim;
    Model host(config, make_synthetic_weights(config, 0.05, 5));
    cuda::CudaModel gpu(host);
    const std::vector<int32_t> prompt = {1, 2, 3, 250, 128, 64, 32, 16, 8};
    std::vector<int32_t> continuation(70);
    for (size_t i = 0; i < continuation.size(); ++i) continuation[i] = static_cast<int32_t>((37 * i + 11) % 256);
    const auto capacity = static_cast<int32_t>(prompt.size() + continuation.size());
    KvCache cache = host.new_cache(capacity);
    gpu.reset(1, capacity);
    const std::vector<int32_t>* parts[] = {&prompt, &continuation};
    for (const std::vector<int32_t>* part : parts) {
      const auto n = static_cast<int32_t>(part->size());
      std::vector<float> cpu_logits(static_cast<size_t>(n) * config.vocab_size), gpu_logits(cpu_logits.size());
      host.forward(part->data(), n, cache, cpu_logits.data(), true);
      gpu.forward(part->data(), n, gpu_logits.data(), true);
      const double error = relative_l2(gpu_logits.data(), cpu_logits);
      const char* what = part == &prompt ? "prompt" : "continuation";
      std::printf("[ synthetic tiny, head_dim %d, %s ] logits relative L2, CUDA vs CPU: %.3g\n", head_dim, what, error);
      EXPECT_LT(error, kLogitTolerance) << "head_dim " << head_dim << ", " << what;
    }
  }
}

// A CudaModel built from a model whose FFN neurons are ordered by activity also times split paths
// (the most active neurons densely beside TwELL). Its dispatch runs every path in the first
// forwards (its timing runs), and each forward must give the CPU's logits.
TEST_F(CudaModelTest, OrderedNeuronsSplitPathsMatchCpu) {
  ModelConfig config = synthetic_model_config("tiny");
  config.d_hidden = 1024;  // every split fraction (1/8 .. 1/2) a whole number of TwELL tiles
  Model host(config, make_synthetic_weights(config, 0.05, 13));
  std::vector<int32_t> prompt(300);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((37 * i + 11) % config.vocab_size);
  host.order_neurons_by_activity(prompt);
  host.set_ffn_path(FfnPath::twell);
  const auto n = static_cast<int32_t>(prompt.size());
  std::vector<float> cpu_logits(static_cast<size_t>(n) * config.vocab_size), gpu_logits(cpu_logits.size());
  KvCache cache = host.new_cache(n);
  host.forward(prompt.data(), n, cache, cpu_logits.data(), true);

  cuda::CudaModel gpu(host);
  gpu.set_ffn_path(FfnPath::twell);
  cuda::CudaModel::FfnCalls calls;
  double worst = 0;
  for (int pass = 0; pass < 30; ++pass) {  // 2 layers a pass; the dispatch times 6 paths, 6 calls each
    gpu.reset(1, n);
    std::fill(gpu_logits.begin(), gpu_logits.end(), NAN);
    gpu.forward(prompt.data(), n, gpu_logits.data(), true);
    const double error = relative_l2(gpu_logits.data(), cpu_logits);
    EXPECT_LT(error, kLogitTolerance) << "pass " << pass;
    worst = std::max(worst, error);
    const cuda::CudaModel::FfnCalls pass_calls = gpu.sparse_ffn_calls();
    calls.twell += pass_calls.twell;
    calls.dense += pass_calls.dense;
    calls.split += pass_calls.split;
    calls.measured += pass_calls.measured;
    calls.hot_neurons += pass_calls.hot_neurons;
  }
  std::printf("[ ordered neurons ] worst logits relative L2, CUDA vs CPU: %.3g; FFN calls: %lld TwELL (%lld splits), "
              "%lld dense, %lld timing runs\n",
              worst, static_cast<long long>(calls.twell), static_cast<long long>(calls.split),
              static_cast<long long>(calls.dense), static_cast<long long>(calls.measured));
  EXPECT_GT(calls.split, 0);  // the split paths ran (their timing runs at least) and were checked
  // Each split kept some but not all neurons dense: one of the hot fractions of H.
  EXPECT_GT(calls.hot_neurons, 0);
  EXPECT_LT(calls.hot_neurons, calls.split * config.d_hidden);

  // A host ordered after the GPU copy was made no longer matches it: its sign bits are refused.
  Model late(config, make_synthetic_weights(config, 0.05, 13));
  cuda::CudaModel built_before(late);
  late.order_neurons_by_activity(prompt);
  late.set_ffn_path(FfnPath::predict);
  built_before.set_ffn_path(FfnPath::predict);
  EXPECT_THROW(built_before.set_predictor(late), Error);
}

// Stage timing: every stage of an eager prefill takes time, reading the sums empties them, and
// decode steps captured in a graph record no events (an event recorded inside a capture would fail
// the read that follows).
TEST_F(CudaModelTest, StageTimesCoverEagerSteps) {
  const ModelConfig config = synthetic_model_config("tiny");
  Model host(config, make_synthetic_weights(config, 0.05, 5));
  cuda::CudaModel gpu(host);
  gpu.reset(1, 64);
  gpu.set_stage_timing(true);
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((29 * i + 3) % config.vocab_size);
  std::vector<float> logits(config.vocab_size);
  gpu.forward(prompt.data(), static_cast<int32_t>(prompt.size()), logits.data());
  const cuda::CudaModel::StageTimes t = gpu.stage_times();
  for (const double ms : {t.embed, t.norm_qkv, t.rope, t.rope_attention, t.o_proj_norm, t.ffn, t.lm_head})
    EXPECT_GT(ms, 0.0);
  EXPECT_GT(t.rope_attention, t.rope);  // the attention after qkv_rope
  const cuda::CudaModel::StageTimes empty = gpu.stage_times();
  EXPECT_EQ(empty.ffn + empty.embed + empty.lm_head, 0.0);
  gpu.decode_greedy(8);  // the first step eager, the second captured, the rest replayed
  const cuda::CudaModel::StageTimes decode = gpu.stage_times();
  EXPECT_GT(gpu.graph_replays(), 0);
  EXPECT_GT(decode.ffn, 0.0);  // the eager step
  gpu.set_stage_timing(false);
}

TEST_F(CudaModelTest, RefusesBadInput) {
  const Model silu = Model::load(model_dir("llama"));
  cuda::CudaModel gpu(silu);
  EXPECT_THROW(gpu.set_ffn_path(FfnPath::twell), Error);
  std::vector<float> logits(gpu.config().vocab_size);
  const int32_t token = 1;
  EXPECT_THROW(gpu.forward(&token, 1, logits.data()), Error);  // no reset() yet
  gpu.reset(1, 2);
  const int32_t out_of_vocab = gpu.config().vocab_size;
  EXPECT_THROW(gpu.forward(&out_of_vocab, 1, logits.data()), Error);
  const std::vector<int32_t> three = {1, 2, 3};
  EXPECT_THROW(gpu.forward(three.data(), 3, logits.data()), Error);  // over capacity
  EXPECT_THROW(gpu.decode_greedy(1), Error);                          // no logits to start from
  EXPECT_THROW(gpu.reset(0, 4), Error);
  EXPECT_THROW(gpu.set_predictor(silu), Error);  // not on the predict path
}

// Without a GPU the runtime refuses with a message instead of failing later.
TEST(CudaModelWithoutGpu, RefusesToStart) {
  if (cuda::available()) GTEST_SKIP() << "a CUDA device is present";
  const Model host = Model::load(model_dir("llama"));
  try {
    cuda::CudaModel gpu(host);
    FAIL() << "CudaModel started without a GPU";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("no usable CUDA device"), std::string::npos) << error.what();
  }
}

// NVML through dlopen: where it is present the counter is finite and does not run backwards.
TEST(EnergyCounter, ReadsOrSaysWhyNot) {
  cuda::EnergyCounter energy;
  if (!energy.available()) {
    EXPECT_FALSE(energy.why_unavailable().empty());
    EXPECT_TRUE(std::isnan(energy.joules()));
    return;
  }
  const double first = energy.joules();
  EXPECT_TRUE(std::isfinite(first));
  EXPECT_GE(energy.joules(), first);
}

}  // namespace
}  // namespace twell
