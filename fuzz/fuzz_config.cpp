// libFuzzer target: config.json text -> ModelConfig or twell::Error (JSON errors included).
#include <cstddef>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "twell/error.h"
#include "twell/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json config = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) return 0;
  try {
    twell::parse_model_config(config);
  } catch (const twell::Error&) {
  }
  return 0;
}
