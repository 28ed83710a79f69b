// Golden end-to-end tests of the CPU runtime against HF transformers (tests/fixtures/models/*,
// made by scripts/make_fixtures.py): every position's logits of the prompt, and the greedy
// continuation through the KV cache. The sparse paths (TwELL, predictor) must give the same tokens.
#include <gtest/gtest.h>

#include <cmath>

#include "model_fixtures.h"
#include "twell/error.h"
#include "twell/model.h"

namespace twell {
namespace {

using test::Golden;
using test::model_dir;
using test::read_golden;
using test::relative_l2;

// Prefill the prompt, then decode one token at a time through the cache.
std::vector<int32_t> greedy_continuation(Model& model, const std::vector<int32_t>& prompt, int32_t new_tokens) {
  const int32_t vocab = model.config().vocab_size;
  KvCache cache = model.new_cache(static_cast<int32_t>(prompt.size()) + new_tokens);
  std::vector<float> logits(vocab, NAN);
  model.forward(prompt.data(), static_cast<int32_t>(prompt.size()), cache, logits.data());
  Sampler greedy(SamplerConfig{});
  std::vector<int32_t> tokens;
  for (int32_t step = 0; step < new_tokens; ++step) {
    tokens.push_back(greedy.sample(logits.data(), vocab));
    std::fill(logits.begin(), logits.end(), NAN);
    if (step + 1 < new_tokens) model.forward(&tokens.back(), 1, cache, logits.data());
  }
  return tokens;
}

class GoldenModel : public ::testing::TestWithParam<std::string> {};

// fp32 compute on the same (bf16/fp16/fp32-stored) weights as HF's fp32 run: only the order of
// summation differs, measured < 1e-6 relative L2 per position; the bound is 1e-5; the greedy tokens are exact.
TEST_P(GoldenModel, DenseMatchesTransformers) {
  const Golden golden = read_golden(GetParam());
  Model model = Model::load(model_dir(GetParam()));
  const int32_t n = static_cast<int32_t>(golden.prompt.size());
  const int32_t vocab = model.config().vocab_size;
  ASSERT_EQ(golden.logits.size(), static_cast<size_t>(n));
  ASSERT_EQ(golden.logits[0].size(), static_cast<size_t>(vocab));

  KvCache cache = model.new_cache(n);
  std::vector<float> logits(static_cast<size_t>(n) * vocab, NAN);
  model.forward(golden.prompt.data(), n, cache, logits.data(), /*all_logits=*/true);
  for (int32_t i = 0; i < n; ++i)
    EXPECT_LT(relative_l2(logits.data() + static_cast<size_t>(i) * vocab, golden.logits[i]), 1e-5) << "position " << i;

  // The same positions one at a time through the cache.
  KvCache incremental = model.new_cache(n);
  std::vector<float> step_logits(vocab, NAN);
  for (int32_t i = 0; i < n; ++i) {
    model.forward(&golden.prompt[i], 1, incremental, step_logits.data());
    EXPECT_LT(relative_l2(step_logits.data(), golden.logits[i]), 1e-5) << "position " << i;
  }

  EXPECT_EQ(greedy_continuation(model, golden.prompt, static_cast<int32_t>(golden.greedy.size())), golden.greedy);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenModel, ::testing::Values("llama", "qwen2", "sparselm", "prosparse"),
                         [](const auto& info) { return info.param; });

TEST(GoldenModel, ConfigsParseAsIntended) {
  EXPECT_EQ(load_model_config(model_dir("llama") + "/config.json").n_kv_heads, 2);
  const ModelConfig qwen = load_model_config(model_dir("qwen2") + "/config.json");
  EXPECT_TRUE(qwen.qkv_bias);
  EXPECT_TRUE(qwen.tie_word_embeddings);
  EXPECT_EQ(qwen.rope_theta, 1e6);
  const ModelConfig sparse = load_model_config(model_dir("sparselm") + "/config.json");
  EXPECT_EQ(sparse.activation, FfnActivation::relu);  // its hidden_act says silu
  const ModelConfig prosparse = load_model_config(model_dir("prosparse") + "/config.json");
  EXPECT_EQ(prosparse.activation, FfnActivation::fatrelu);
  EXPECT_FLOAT_EQ(prosparse.activation_threshold, 0.02f);
}

// TwELL stores the gate in bf16, so its logits are within bf16 tolerance of the dense ones and the
// greedy tokens (fixtures chosen with top-2 margins >= 0.05) are identical.
TEST(GoldenModel, SparsePathsMatchDense) {
  const Golden golden = read_golden("sparselm");
  Model model = Model::load(model_dir("sparselm"));
  const int32_t n = static_cast<int32_t>(golden.prompt.size());
  const int32_t vocab = model.config().vocab_size;
  for (FfnPath path : {FfnPath::twell, FfnPath::predict}) {
    SCOPED_TRACE(to_string(path));
    model.set_ffn_path(path);
    KvCache cache = model.new_cache(n);
    std::vector<float> logits(static_cast<size_t>(n) * vocab, NAN);
    model.forward(golden.prompt.data(), n, cache, logits.data(), true);
    for (int32_t i = 0; i < n; ++i)
      EXPECT_LT(relative_l2(logits.data() + static_cast<size_t>(i) * vocab, golden.logits[i]), 1e-2) << i;
    EXPECT_EQ(greedy_continuation(model, golden.prompt, static_cast<int32_t>(golden.greedy.size())), golden.greedy);
  }
  // The predictor calibrated on the prompt for 100% recall drops no active neuron of the prompt.
  std::vector<Calibration> calibration = model.calibrate_predictor(golden.prompt, PredictorKind::sign_rule, 1.0);
  ASSERT_EQ(calibration.size(), 2u);
  for (const Calibration& layer : calibration) EXPECT_EQ(layer.quality.recall(), 1.0);
  EXPECT_EQ(greedy_continuation(model, golden.prompt, 1), std::vector<int32_t>(1, golden.greedy[0]));
}

TEST(GoldenModel, SparsePathsRefuseNonReluModels) {
  Model silu = Model::load(model_dir("llama"));
  EXPECT_THROW(silu.set_ffn_path(FfnPath::twell), Error);
  Model fatrelu = Model::load(model_dir("prosparse"));
  EXPECT_THROW(fatrelu.set_ffn_path(FfnPath::predict), Error);
  EXPECT_THROW(parse_ffn_path("sparse"), Error);
}

TEST(GoldenModel, ForwardRefusesBadInput) {
  Model model = Model::load(model_dir("qwen2"));
  KvCache cache = model.new_cache(2);
  std::vector<float> logits(model.config().vocab_size);
  const int32_t out_of_vocab = model.config().vocab_size;
  EXPECT_THROW(model.forward(&out_of_vocab, 1, cache, logits.data()), Error);
  const std::vector<int32_t> three = {1, 2, 3};
  EXPECT_THROW(model.forward(three.data(), 3, cache, logits.data()), Error);  // over capacity
}

}  // namespace
}  // namespace twell
