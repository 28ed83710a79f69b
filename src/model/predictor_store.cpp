// DIR/twell_predictor.json (include/twell/predictor_store.h).
#include "twell/predictor_store.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "twell/convert.h"
#include "twell/error.h"
#include "twell/model.h"

namespace twell {
namespace {

// 2 added each layer's exact_columns. A version-1 file (none) still loads; a twell that knows only
// version 1 refuses a version-2 file rather than apply its margins to sign bits without the columns.
constexpr int kPredictorFileVersion = 2;

uint64_t fnv1a(uint64_t hash, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ull;
  return hash;
}

std::string hex(uint64_t value) { return fmt::format("{:016x}", value); }

}  // namespace

uint64_t relu_projection_fingerprint(const FfnWeights& weights) {
  const std::vector<float>& projection = weights.relu_projection();
  const int32_t dims[2] = {weights.d_hidden, weights.d_model};
  uint64_t hash = fnv1a(0xcbf29ce484222325ull, dims, sizeof dims);
  return fnv1a(hash, projection.data(), projection.size() * sizeof(float));
}

void save_predictor_record(const std::string& dir, const ModelConfig& config, const ModelWeights& weights,
                           const PredictorRecord& record) {
  TWELL_REQUIRE(static_cast<int32_t>(record.layers.size()) == config.n_layers,
                "predictor record: {} layers calibrated, the model has {}", record.layers.size(), config.n_layers);
  nlohmann::json layers = nlohmann::json::array();
  for (int32_t l = 0; l < config.n_layers; ++l) {
    const Calibration& c = record.layers[l];
    nlohmann::json layer = {{"layer", l},
                            {"kind", to_string(c.config.kind)},
                            {"fingerprint", hex(relu_projection_fingerprint(weights.layers[l].ffn))},
                            {"exact_columns", c.exact_columns},
                            {"recall", c.quality.recall()},
                            {"predicted_fraction", c.config.predicted_fraction},
                            {"predicted_over_active", c.quality.predicted_over_active()}};
    if (c.config.kind == PredictorKind::sign_rule)
      layer["alpha"] = c.config.alpha;
    else
      layer["margin"] = c.config.margin;
    layers.push_back(layer);
  }
  const nlohmann::json file = {
      {"format", "twell-predictor"},
      {"version", kPredictorFileVersion},
      {"model",
       {{"model_type", config.model_type},
        {"d_model", config.d_model},
        {"d_hidden", config.d_hidden},
        {"n_layers", config.n_layers}}},
      {"target_recall", record.target_recall},
      {"sample_tokens", record.sample_tokens},
      {"sample_text", record.sample_text},
      {"layers", layers}};
  const std::filesystem::path target = std::filesystem::path(dir) / kPredictorFileName;
  const std::filesystem::path temporary =
      std::filesystem::path(dir) / fmt::format(".{}.{}.tmp", kPredictorFileName, ::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    TWELL_REQUIRE(out.good(), "cannot write '{}': {}", temporary.string(), std::strerror(errno));
    out << file.dump(2) << "\n";
    out.flush();
    if (!out.good()) {
      std::filesystem::remove(temporary);
      fail("cannot write '{}': disk full or I/O error", temporary.string());
    }
  }
  std::error_code error;
  std::filesystem::rename(temporary, target, error);
  if (error) {
    std::filesystem::remove(temporary);
    fail("cannot rename '{}' to '{}': {}", temporary.string(), target.string(), error.message());
  }
}

std::optional<std::vector<LayerPredictor>> load_predictor_record(const std::string& dir, const ModelConfig& config,
                                                                  const ModelWeights& weights) {
  const std::filesystem::path path = std::filesystem::path(dir) / kPredictorFileName;
  if (!std::filesystem::exists(path)) return std::nullopt;
  const std::string name = path.string();
  std::ifstream in(path, std::ios::binary);
  TWELL_REQUIRE(in.good(), "cannot read '{}'", name);
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json file = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  TWELL_REQUIRE(!file.is_discarded() && file.is_object(), "{}: not a JSON object", name);
  TWELL_REQUIRE(file.value("format", "") == "twell-predictor", "{}: 'format' must be \"twell-predictor\"", name);
  TWELL_REQUIRE(file.contains("version") && file["version"].is_number_integer() &&
                    file["version"].get<int>() >= 1 && file["version"].get<int>() <= kPredictorFileVersion,
                "{}: 'version' must be 1 to {} (written by another twell?)", name, kPredictorFileVersion);
  const std::string stale = fmt::format("; run `twell calibrate -m {}` again or delete the file", dir);
  const nlohmann::json& model = file.value("model", nlohmann::json::object());
  const auto same = [&](const char* key, int32_t expected) {
    TWELL_REQUIRE(model.contains(key) && model[key].is_number_integer() && model[key].get<int64_t>() == expected,
                  "{}: calibrated for model.{} = {}, this model has {}{}", name, key,
                  model.contains(key) ? model[key].dump() : "(missing)", expected, stale);
  };
  same("d_model", config.d_model);
  same("d_hidden", config.d_hidden);
  same("n_layers", config.n_layers);
  TWELL_REQUIRE(file.contains("layers") && file["layers"].is_array() &&
                    static_cast<int32_t>(file["layers"].size()) == config.n_layers,
                "{}: 'layers' must be an array of {} entries{}", name, config.n_layers, stale);
  std::vector<LayerPredictor> result;
  for (int32_t l = 0; l < config.n_layers; ++l) {
    const nlohmann::json& layer = file["layers"][l];
    TWELL_REQUIRE(layer.is_object() && layer.contains("kind") && layer["kind"].is_string() &&
                      layer.contains("fingerprint") && layer["fingerprint"].is_string(),
                  "{}: layers[{}] needs 'kind' and 'fingerprint'", name, l);
    const std::string expected = hex(relu_projection_fingerprint(weights.layers[l].ffn));
    TWELL_REQUIRE(layer["fingerprint"].get<std::string>() == expected,
                  "{}: layers[{}] was calibrated on other gate weights (fingerprint {}, these weights {}){}", name, l,
                  layer["fingerprint"].get<std::string>(), expected, stale);
    LayerPredictor stored;
    PredictorConfig& predictor = stored.config;
    predictor.kind = parse_predictor_kind(layer["kind"].get<std::string>());
    const char* key = predictor.kind == PredictorKind::sign_rule ? "alpha" : "margin";
    TWELL_REQUIRE(layer.contains(key) && layer[key].is_number() && std::isfinite(layer[key].get<double>()),
                  "{}: layers[{}] ({}) needs a finite number '{}'", name, l, to_string(predictor.kind), key);
    (predictor.kind == PredictorKind::sign_rule ? predictor.alpha : predictor.margin) = layer[key].get<double>();
    if (layer.contains("predicted_fraction")) {  // absent in files of older twells: not known
      const nlohmann::json& fraction = layer["predicted_fraction"];
      TWELL_REQUIRE(fraction.is_number() && fraction.get<double>() >= 0.0 && fraction.get<double>() <= 1.0,
                    "{}: layers[{}].predicted_fraction must be a number in [0, 1]", name, l);
      predictor.predicted_fraction = fraction.get<double>();
    }
    if (layer.contains("exact_columns")) {  // absent in version 1: none
      const nlohmann::json& columns = layer["exact_columns"];
      TWELL_REQUIRE(columns.is_array() && std::all_of(columns.begin(), columns.end(),
                                                      [](const nlohmann::json& c) { return c.is_number_integer(); }),
                    "{}: layers[{}].exact_columns must be an array of column indices", name, l);
      for (const nlohmann::json& column : columns) {
        const int64_t index = column.get<int64_t>();
        TWELL_REQUIRE(index >= 0 && index < config.d_model, "{}: layers[{}].exact_columns: column {} outside [0, {})",
                      name, l, index, config.d_model);
        stored.exact_columns.push_back(static_cast<int32_t>(index));
      }
      try {
        validate_exact_columns(stored.exact_columns, config.d_model);
      } catch (const Error& error) {
        fail("{}: layers[{}].exact_columns: {}", name, l, error.what());
      }
    }
    result.push_back(std::move(stored));
  }
  return result;
}

}  // namespace twell
