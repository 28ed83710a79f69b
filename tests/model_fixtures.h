// The model fixtures (tests/fixtures/models/*, made by scripts/make_fixtures.py) for the golden
// tests of the CPU and CUDA runtimes: where they are, HF's golden record, and the error measure.
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace twell::test {

inline std::string model_dir(const std::string& name) {
  return (std::filesystem::path(__FILE__).parent_path() / "fixtures" / "models" / name).string();
}

struct Golden {
  std::vector<int32_t> prompt;
  std::vector<std::vector<double>> logits;  // [n, V] HF transformers, fp32
  std::vector<int32_t> greedy;              // HF's greedy continuation
};

inline Golden read_golden(const std::string& name) {
  std::ifstream stream(std::filesystem::path(model_dir(name)) / "golden.json");
  const nlohmann::json json = nlohmann::json::parse(stream);
  return {json["prompt"].get<std::vector<int32_t>>(), json["logits"].get<std::vector<std::vector<double>>>(),
          json["greedy"].get<std::vector<int32_t>>()};
}

// ||got - expected|| / ||expected|| over expected.size() values.
template <typename Expected>
double relative_l2(const float* got, const Expected& expected) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff += (got[i] - expected[i]) * (got[i] - expected[i]);
    norm += static_cast<double>(expected[i]) * expected[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace twell::test
