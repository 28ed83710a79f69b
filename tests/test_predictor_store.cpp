// DIR/twell_predictor.json (include/twell/predictor_store.h): a calibration written next to a
// checkpoint comes back through Model::load as the same per-layer settings; one calibrated on other
// weights, of another shape or malformed is refused naming the problem; a write is atomic.
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

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

  // Calibrates the fixture's layers on random tokens and stores the result.
  std::vector<Calibration> calibrate_and_store(PredictorKind kind) {
    Model model = Model::load(dir_.string());
    model.set_ffn_path(FfnPath::predict);
    std::mt19937 rng(7);
    std::vector<int32_t> tokens(48);
    for (int32_t& token : tokens) token = static_cast<int32_t>(rng() % model.config().vocab_size);
    std::vector<Calibration> calibration = model.calibrate_predictor(tokens, kind, 0.95);
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
      EXPECT_EQ(model.predictor()[l].kind, kind);
      // JSON keeps a double exactly (shortest round-trip representation).
      if (kind == PredictorKind::sign_rule)
        EXPECT_EQ(model.predictor()[l].alpha, calibration[l].config.alpha);
      else
        EXPECT_EQ(model.predictor()[l].margin, calibration[l].config.margin);
    }
    // Choosing the predict path keeps the stored settings (it does not reset them to "exact").
    model.set_ffn_path(FfnPath::predict);
    EXPECT_EQ(model.predictor()[0].kind, kind);
    // The write left no temporary file behind.
    for (const fs::directory_entry& entry : fs::directory_iterator(dir_))
      EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
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
  expect_refused([](nlohmann::json& r) { r["version"] = 2; }, "'version'");
  expect_refused([](nlohmann::json& r) { r["model"]["d_hidden"] = 999; }, "model.d_hidden");
  expect_refused([](nlohmann::json& r) { r["model"].erase("n_layers"); }, "model.n_layers");
  expect_refused([](nlohmann::json& r) { r["layers"].erase(1); }, "'layers'");
  expect_refused([](nlohmann::json& r) { r["layers"][0]["kind"] = "popcount"; }, "popcount");
  expect_refused([](nlohmann::json& r) { r["layers"][0].erase("margin"); }, "'margin'");
  expect_refused([](nlohmann::json& r) { r["layers"][0]["margin"] = nullptr; }, "'margin'");
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
