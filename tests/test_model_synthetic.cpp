// Synthetic models (twell/model.h): the named shapes, the FFN density they are built for, and the
// order of their FFN neurons by activity (Model::order_neurons_by_activity).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "model_fixtures.h"
#include "twell/convert.h"
#include "twell/error.h"
#include "twell/model.h"

namespace twell {
namespace {

TEST(SyntheticModel, NamedShapes) {
  const ModelConfig c = synthetic_model_config("2b");
  EXPECT_EQ(c.n_layers, 38);
  EXPECT_EQ(c.d_model, 2048);
  EXPECT_EQ(c.d_hidden, 5632);
  EXPECT_EQ(c.n_heads, 32);
  EXPECT_EQ(c.head_dim * c.n_heads, c.d_model);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.activation, FfnActivation::relu);
  EXPECT_THROW(synthetic_model_config("7b"), Error);
  EXPECT_THROW(make_synthetic_weights(synthetic_model_config("tiny"), 1.5, 1), Error);
}

// The FFN's measured activation density in every layer stays near the workload's target: the
// construction keeps the threshold column's input near 1 through the residual stream.
TEST(SyntheticModel, FfnDensityNearTarget) {
  const ModelConfig config = synthetic_model_config("tiny");
  for (double target : {0.02, 0.1}) {
    SCOPED_TRACE(target);
    Model model(config, make_synthetic_weights(config, target, 7));
    model.set_ffn_path(FfnPath::predict);
    std::vector<int32_t> tokens;
    for (int32_t i = 0; i < 96; ++i) tokens.push_back((i * 37 + 11) % config.vocab_size);
    const std::vector<Calibration> layers = model.calibrate_predictor(tokens, PredictorKind::one_bit_gate, 0.99);
    ASSERT_EQ(layers.size(), static_cast<size_t>(config.n_layers));
    for (const Calibration& layer : layers) {
      const double density = static_cast<double>(layer.quality.active) / layer.quality.pairs;
      EXPECT_GT(density, target / 2);
      EXPECT_LT(density, target * 2);
    }
  }
}

// The synthetic model's threshold column reaches every layer's FFN input, so calibration keeps it
// exact in every layer and packs the predict path's sign bits with it; max_exact_columns = 0 keeps none.
TEST(SyntheticModel, CalibrationKeepsTheThresholdColumnExact) {
  const ModelConfig config = synthetic_model_config("tiny");
  Model model(config, make_synthetic_weights(config, 0.05, 7));
  model.set_ffn_path(FfnPath::predict);
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 96; ++i) tokens.push_back((i * 37 + 11) % config.vocab_size);
  const std::vector<Calibration> layers = model.calibrate_predictor(tokens, PredictorKind::two_bit_gate, 0.99);
  for (int32_t l = 0; l < config.n_layers; ++l) {
    EXPECT_EQ(layers[l].exact_columns, std::vector<int32_t>{0}) << "layer " << l;
    EXPECT_EQ(model.predictor()[l].exact_columns, layers[l].exact_columns);
    EXPECT_EQ(model.predictor()[l].config.margin, layers[l].config.margin);
    EXPECT_EQ(model.relu_signs(l).exact_columns, layers[l].exact_columns);
    EXPECT_GE(layers[l].quality.recall(), 0.99);
  }
  model.calibrate_predictor(tokens, PredictorKind::two_bit_gate, 0.99, 0);
  for (int32_t l = 0; l < config.n_layers; ++l) {
    EXPECT_TRUE(model.predictor()[l].exact_columns.empty());
    EXPECT_TRUE(model.relu_signs(l).exact_columns.empty());
  }
}

TEST(SyntheticModel, Deterministic) {
  const ModelConfig config = synthetic_model_config("tiny");
  const ModelWeights a = make_synthetic_weights(config, 0.05, 9), b = make_synthetic_weights(config, 0.05, 9);
  EXPECT_EQ(a.embedding, b.embedding);
  EXPECT_EQ(a.layers[1].ffn.gate, b.layers[1].ffn.gate);
  EXPECT_EQ(a.layers[1].wo, b.layers[1].wo);
  EXPECT_NE(a.layers[0].wq, a.layers[1].wq);
}

// Ordering the FFN neurons by activity keeps the model's function on every path, packs the predict
// path's sign bits again (with the old bits its predictor would score other neurons), and puts the
// neurons most often active first.
TEST(SyntheticModel, OrderingNeuronsByActivityKeepsTheLogits) {
  const ModelConfig config = synthetic_model_config("tiny");
  Model model(config, make_synthetic_weights(config, 0.05, 11));
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 96; ++i) tokens.push_back((i * 37 + 11) % config.vocab_size);
  model.set_ffn_path(FfnPath::predict);
  model.calibrate_predictor(tokens, PredictorKind::one_bit_gate, 0.99);
  // 12 tokens (predict: the decode kernels), then 30 more (predict: TwELL).
  const std::vector<int32_t> first = {3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 26, 43};
  std::vector<int32_t> second(30);
  for (size_t i = 0; i < second.size(); ++i) second[i] = static_cast<int32_t>((53 * i + 7) % config.vocab_size);
  const auto logits_of = [&](FfnPath path) {
    model.set_ffn_path(path);
    KvCache cache = model.new_cache(64);
    std::vector<float> logits((first.size() + second.size()) * config.vocab_size, NAN);
    model.forward(first.data(), static_cast<int32_t>(first.size()), cache, logits.data(), true);
    model.forward(second.data(), static_cast<int32_t>(second.size()), cache,
                  logits.data() + first.size() * config.vocab_size, true);
    return logits;
  };
  const FfnPath paths[] = {FfnPath::dense, FfnPath::twell, FfnPath::predict};
  std::vector<std::vector<float>> before;
  for (FfnPath path : paths) before.push_back(logits_of(path));
  const FfnWeights layer0 = model.weights().layers[0].ffn;

  EXPECT_FALSE(model.neurons_ordered_by_activity());
  const std::vector<std::vector<int64_t>> counts = model.order_neurons_by_activity(tokens);
  EXPECT_TRUE(model.neurons_ordered_by_activity());
  ASSERT_EQ(counts.size(), static_cast<size_t>(config.n_layers));
  for (const std::vector<int64_t>& layer : counts) {
    ASSERT_EQ(layer.size(), static_cast<size_t>(config.d_hidden));
    EXPECT_TRUE(std::is_sorted(layer.rbegin(), layer.rend()));
    EXPECT_GT(layer.front(), 4 * std::max<int64_t>(layer.back(), 1));  // the workload's neurons differ in activity
  }
  // Neuron 0 now is one of the old neurons, its gate, up and down rows moved together.
  const FfnWeights& ordered = model.weights().layers[0].ffn;
  const int64_t D = config.d_model;
  int64_t found = -1;
  for (int64_t j = 0; j < config.d_hidden && found < 0; ++j)
    if (std::equal(ordered.gate.begin(), ordered.gate.begin() + D, layer0.gate.begin() + j * D)) found = j;
  ASSERT_GE(found, 0);
  EXPECT_TRUE(std::equal(ordered.up.begin(), ordered.up.begin() + D, layer0.up.begin() + found * D));
  EXPECT_TRUE(std::equal(ordered.down.begin(), ordered.down.begin() + D, layer0.down.begin() + found * D));

  for (int32_t l = 0; l < config.n_layers; ++l) {
    const FfnWeights& ffn = model.weights().layers[l].ffn;
    const SignBits repacked =
        pack_sign_bits(ffn.gate.data(), config.d_hidden, config.d_model, model.predictor()[l].exact_columns);
    EXPECT_EQ(model.relu_signs(l).bits, repacked.bits) << "layer " << l;
    EXPECT_EQ(model.relu_signs(l).scale, repacked.scale) << "layer " << l;
  }
  for (size_t p = 0; p < std::size(paths); ++p) {
    const std::vector<float> after = logits_of(paths[p]);
    const double error = test::relative_l2(after.data(), before[p]);
    EXPECT_LT(error, 1e-5) << to_string(paths[p]);  // fp32 sums over the neurons in another order
  }
  EXPECT_THROW(model.order_neurons_by_activity(tokens), Error);  // once per model
}

TEST(SyntheticModel, OrderingNeuronsRefusesBadInput) {
  const ModelConfig config = synthetic_model_config("tiny");
  Model model(config, make_synthetic_weights(config, 0.05, 11));
  EXPECT_THROW(model.order_neurons_by_activity({}), Error);
  ModelConfig silu = config;
  silu.activation = FfnActivation::silu;
  Model dense(silu, make_synthetic_weights(config, 0.05, 11));
  EXPECT_THROW(dense.order_neurons_by_activity({1, 2, 3}), Error);
  EXPECT_FALSE(model.neurons_ordered_by_activity());
}

}  // namespace
}  // namespace twell
