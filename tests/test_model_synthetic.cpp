// Synthetic models (twell/model.h): the named shapes, and the FFN density they are built for.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace twell
