// DIR/twell_predictor.json (include/twell/predictor_store.h): a calibration written next to a
// checkpoint comes back through Model::load as the same per-layer settings; one calibrated on other
// weights, of another shape or malformed is refused naming the problem; a write is atomic.
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "twell/convert.h"
#include "twell/error.h"
#include "twell/model.h"
#include "twell/predictor_store.h"

namespace twell {
namespace {

namespace fs = std::filesystem;

// A copy of the SparseLM-style fixture (ReLU FFN) in a fresh temporary directory.
class PredictorStoreTest : public testing::Test {
 protected:
  void SetUp() override {
    const fs::path fixture = fs::path(__FILE__).parent_path() / "fixtures" / "models" / "sparselm";
    dir_ = fs::temp_directory_path() /
           fmt::format("twell-predictor-store-{}-{}", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                       std::random_device{}());
    fs::create_directories(dir_);
    for (const fs::directory_entry& entry : fs::directory_iterator(fixture)) fs::copy(entry.path(), dir_ / entry.path().filename());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Calibrates the fixture's layers on random tokens and stores the result; with `exact_columns`,
  // calibrated with those columns in every layer instead of the chosen ones.
  std::vector<Calibration> calibrate_and_store(PredictorKind kind,
                                               const std::optional<std::vector<int32_t>>& exact_columns = {}) {
    Model model = Model::load(dir_.string());
    model.set_ffn_path(FfnPath::predict);
    std::mt19937 rng(7);
    std::vector<int32_t> tokens(48);
    for (int32_t& token : tokens) token = static_cast<int32_t>(rng() % model.config().vocab_size);
    std::vector<Calibration> calibration = model.calibrate_predictor(tokens, kind, 0.95);
    if (exact_columns) {
      const std::vector<std::vector<float>> inputs = model.ffn_inputs(tokens);
      for (int32_t l = 0; l < model.config().n_layers; ++l) {
        const FfnWeights& ffn = model.weights().layers[l].ffn;
        const SignBits signs =
            pack_sign_bits(ffn.relu_projection().data(), ffn.d_hidden, ffn.d_model, *exact_columns);
        calibration[l] = calibrate_predictor(inputs[l].data(), 48, ffn, signs, kind, 0.95);
      }
    }
    save_predictor_record(dir_.string(), model.config(), model.weights(), {0.95, 48, "random tokens", calibration});
    return calibration;
  }

  nlohmann::json read_record() const {
    std::ifstream in(dir_ / kPredictorFileName);
    return nlohmann::json::parse(in);
  }
  void write_record(const nlohmann::json& record) const { std::ofstream(dir_ / kPredictorFileName) << record.dump(); }

  // Model::load's error message, or "" when it loads.
  std::string load_error() const {
    try {
      Model::load(dir_.string());
      return "";
    } catch (const Error& error) {
      return error.what();
    }
  }

  fs::path dir_;
};

TEST_F(PredictorStoreTest, RoundTripThroughModelLoad) {
  EXPECT_TRUE(Model::load(dir_.string()).predictor().empty()) << "no file, no stored predictor";
  for (PredictorKind kind :
       {PredictorKind::one_bit_gate, PredictorKind::sign_rule, PredictorKind::normalized_one_bit_gate,
        PredictorKind::two_bit_gate}) {
    SCOPED_TRACE(to_string(kind));
    const std::vector<Calibration> calibration = calibrate_and_store(kind);
    Model model = Model::load(dir_.string());
    ASSERT_EQ(model.predictor().size(), calibration.size());
    for (size_t l = 0; l < calibration.size(); ++l) {
      EXPECT_EQ(model.predictor()[l].config.kind, kind);
      // JSON keeps a double exactly (shortest round-trip representation).
      if (kind == PredictorKind::sign_rule)
        EXPECT_EQ(model.predictor()[l].config.alpha, calibration[l].config.alpha);
      else
        EXPECT_EQ(model.predictor()[l].config.margin, calibration[l].config.margin);
      EXPECT_EQ(model.predictor()[l].exact_columns, calibration[l].exact_columns);
      EXPECT_GT(calibration[l].config.predicted_fraction, 0.0);
      EXPECT_EQ(model.predictor()[l].config.predicted_fraction, calibration[l].config.predicted_fraction);
    }
    // Choosing the predict path keeps the stored settings (it does not reset them to "exact").
    model.set_ffn_path(FfnPath::predict);
    EXPECT_EQ(model.predictor()[0].config.kind, kind);
    // The write left no temporary file behind.
    for (const fs::directory_entry& entry : fs::directory_iterator(dir_))
      EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  }
}

// Exact columns come back with their layer, and the predict path packs each layer's sign bits with
// them; the model then decodes with the stored margin exactly as calibrated.
TEST_F(PredictorStoreTest, ExactColumnsRoundTrip) {
  const std::vector<int32_t> columns = {0, 3, 17};
  const std::vector<Calibration> calibration = calibrate_and_store(PredictorKind::two_bit_gate, columns);
  EXPECT_EQ(read_record()["version"], 2);
  EXPECT_EQ(read_record()["layers"][1]["exact_columns"], nlohmann::json(columns));
  Model model = Model::load(dir_.string());
  model.set_ffn_path(FfnPath::predict);
  for (int32_t l = 0; l < model.config().n_layers; ++l) {
    EXPECT_EQ(model.predictor()[l].exact_columns, columns);
    EXPECT_EQ(model.predictor()[l].config.margin, calibration[l].config.margin);
    EXPECT_EQ(model.relu_signs(l).exact_columns, columns);
    EXPECT_EQ(model.relu_signs(l).exact_weights.size(), static_cast<size_t>(model.config().d_hidden) * columns.size());
  }
  // set_predictor packs a layer again when its columns change.
  std::vector<LayerPredictor> changed = model.predictor();
  changed[0].exact_columns = {5};
  model.set_predictor(changed);
  EXPECT_EQ(model.relu_signs(0).exact_columns, std::vector<int32_t>{5});
  EXPECT_EQ(model.relu_signs(1).exact_columns, columns);
  changed[1].exact_columns = {5, 5};
  EXPECT_THROW(model.set_predictor(changed), Error);
  EXPECT_EQ(model.relu_signs(0).exact_columns, std::vector<int32_t>{5}) << "a refused setting changes nothing";
}

// A version-1 file (before exact columns) still loads, as no exact columns.
TEST_F(PredictorStoreTest, VersionOneFileLoadsWithoutExactColumns) {
  const std::vector<Calibration> calibration = calibrate_and_store(PredictorKind::one_bit_gate, std::vector<int32_t>{});
  nlohmann::json record = read_record();
  record["version"] = 1;
  for (nlohmann::json& layer : record["layers"]) {
    layer.erase("exact_columns");
    layer.erase("predicted_fraction");
  }
  write_record(record);
  Model model = Model::load(dir_.string());
  ASSERT_EQ(model.predictor().size(), calibration.size());
  for (size_t l = 0; l < calibration.size(); ++l) {
    EXPECT_TRUE(model.predictor()[l].exact_columns.empty());
    EXPECT_EQ(model.predictor()[l].config.margin, calibration[l].config.margin);
    EXPECT_EQ(model.predictor()[l].config.predicted_fraction, 0.0) << "not in a version-1 file: not known";
  }
}

TEST_F(PredictorStoreTest, OtherWeightsAreRefused) {
  calibrate_and_store(PredictorKind::one_bit_gate);
  nlohmann::json record = read_record();
  std::string fingerprint = record["layers"][1]["fingerprint"];
  fingerprint[0] = fingerprint[0] == '0' ? '1' : '0';
  record["layers"][1]["fingerprint"] = fingerprint;
  write_record(record);
  const std::string error = load_error();
  EXPECT_NE(error.find("layers[1] was calibrated on other gate weights"), std::string::npos) << error;
  EXPECT_NE(error.find("twell calibrate"), std::string::npos) << error;
}

TEST_F(PredictorStoreTest, FingerprintFollowsTheGateWeights) {
  Model model = Model::load(dir_.string());
  FfnWeights weights = model.weights().layers[0].ffn;
  const uint64_t before = relu_projection_fingerprint(weights);
  ASSERT_TRUE(weights.gated);  // the relu projection is the gate
  weights.gate[17] += 1e-3f;
  EXPECT_NE(relu_projection_fingerprint(weights), before);
  FfnWeights up_changed = model.weights().layers[0].ffn;
  up_changed.down[5] += 1.0f;
  EXPECT_EQ(relu_projection_fingerprint(up_changed), before) << "the predictor reads only the relu projection";
}

TEST_F(PredictorStoreTest, MalformedRecordsAreRefusedNamingTheKey) {
  calibrate_and_store(PredictorKind::one_bit_gate);
  const nlohmann::json good = read_record();
  const auto expect_refused = [&](const std::function<void(nlohmann::json&)>& spoil, const std::string& expected) {
    nlohmann::json record = good;
    spoil(record);
    write_record(record);
    const std::string error = load_error();
    EXPECT_NE(error.find(expected), std::string::npos) << "expected '" << expected << "' in: " << error;
  };
  expect_refused([](nlohmann::json& r) { r["format"] = "other"; }, "'format'");
  expect_refused([](nlohmann::json& r) { r["version"] = 3; }, "'version'");
  expect_refused([](nlohmann::json& r) { r["version"] = 0; }, "'version'");
  expect_refused([](nlohmann::json& r) { r["layers"][1]["exact_columns"] = "0"; }, "layers[1].exact_columns");
  expect_refused([](nlohmann::json& r) { r["layers"][1]["exact_columns"] = {0.5}; }, "layers[1].exact_columns");
  expect_refused([](nlohmann::json& r) { r["layers"][0]["exact_columns"] = {4, 2}; },
                 "layers[0].exact_columns: exact columns must be ascending");
  expect_refused([](nlohmann::json& r) { r["layers"][0]["exact_columns"] = {0, 1u << 20}; },
                 "layers[0].exact_columns: column 1048576 outside");
  expect_refused([](nlohmann::json& r) { r["model"]["d_hidden"] = 999; }, "model.d_hidden");
  expect_refused([](nlohmann::json& r) { r["model"].erase("n_layers"); }, "model.n_layers");
  expect_refused([](nlohmann::json& r) { r["layers"].erase(1); }, "'layers'");
  expect_refused([](nlohmann::json& r) { r["layers"][0]["kind"] = "popcount"; }, "popcount");
  expect_refused([](nlohmann::json& r) { r["layers"][0].erase("margin"); }, "'margin'");
  expect_refused([](nlohmann::json& r) { r["layers"][0]["margin"] = nullptr; }, "'margin'");
  expect_refused([](nlohmann::json& r) { r["layers"][1]["predicted_fraction"] = 1.5; }, "layers[1].predicted_fraction");
  std::ofstream(dir_ / kPredictorFileName) << "{ not json";
  EXPECT_NE(load_error().find("not a JSON object"), std::string::npos) << load_error();
}

TEST_F(PredictorStoreTest, WrongLayerCountIsRefusedOnSave) {
  Model model = Model::load(dir_.string());
  EXPECT_THROW(save_predictor_record(dir_.string(), model.config(), model.weights(), {0.99, 1, "", {}}), Error);
  EXPECT_FALSE(fs::exists(dir_ / kPredictorFileName));
}

}  // namespace
}  // namespace twell
