// config.json -> ModelConfig. Keys moved between transformers versions; each form is read here
// once, and anything twell cannot run is refused naming the key.
#include <fstream>

#include "twell/error.h"
#include "twell/model.h"

namespace twell {

std::string to_string(FfnActivation activation) {
  switch (activation) {
    case FfnActivation::silu: return "silu";
    case FfnActivation::relu: return "relu";
    case FfnActivation::fatrelu: return "fatrelu";
  }
  return "?";
}

namespace {

using nlohmann::json;

bool present(const json& object, const char* key) { return object.contains(key) && !object[key].is_null(); }

int32_t positive_int(const json& config, const char* key) {
  TWELL_REQUIRE(present(config, key), "config.json: missing '{}'", key);
  const json& value = config[key];
  TWELL_REQUIRE(value.is_number_integer() && value.get<int64_t>() > 0 && value.get<int64_t>() <= (int64_t{1} << 30),
                "config.json: '{}' must be a positive integer, got {}", key, value.dump());
  return static_cast<int32_t>(value.get<int64_t>());
}

double positive_number(const json& object, const char* key, const char* where) {
  const json& value = object[key];
  TWELL_REQUIRE(value.is_number() && value.get<double>() > 0, "config.json: '{}{}' must be a positive number, got {}",
                where, key, value.dump());
  return value.get<double>();
}

bool boolean_or(const json& config, const char* key, bool fallback) {
  if (!present(config, key)) return fallback;
  TWELL_REQUIRE(config[key].is_boolean(), "config.json: '{}' must be true or false, got {}", key, config[key].dump());
  return config[key].get<bool>();
}

// rope_scaling (4.x) and rope_parameters (5.x) both carry a type; only plain RoPE is supported.
// 5.x also moves rope_theta into rope_parameters.
void read_rope(const json& config, ModelConfig& out) {
  if (present(config, "rope_theta")) out.rope_theta = positive_number(config, "rope_theta", "");
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!present(config, key)) continue;
    const json& rope = config[key];
    TWELL_REQUIRE(rope.is_object(), "config.json: '{}' must be an object, got {}", key, rope.dump());
    for (const char* type_key : {"rope_type", "type"}) {
      if (!present(rope, type_key)) continue;
      const json& type = rope[type_key];
      TWELL_REQUIRE(type.is_string() && type.get<std::string>() == "default",
                    "config.json: '{}.{}' = {} is not supported (only \"default\" RoPE)", key, type_key, type.dump());
    }
    if (present(rope, "rope_theta")) out.rope_theta = positive_number(rope, "rope_theta", (std::string(key) + ".").c_str());
    if (present(rope, "partial_rotary_factor"))
      TWELL_REQUIRE(rope["partial_rotary_factor"] == 1.0, "config.json: '{}.partial_rotary_factor' = {} is not supported",
                    key, rope["partial_rotary_factor"].dump());
  }
  if (present(config, "partial_rotary_factor"))
    TWELL_REQUIRE(config["partial_rotary_factor"] == 1.0, "config.json: 'partial_rotary_factor' = {} is not supported",
                  config["partial_rotary_factor"].dump());
}

std::vector<int32_t> token_ids(const json& config, const char* key) {
  if (!present(config, key)) return {};
  const json& value = config[key];
  std::vector<int32_t> ids;
  auto add = [&](const json& id) {
    TWELL_REQUIRE(id.is_number_integer() && id.get<int64_t>() >= 0, "config.json: '{}' must hold token ids, got {}", key,
                  value.dump());
    ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  };
  if (value.is_array()) {
    for (const json& id : value) add(id);
  } else {
    add(value);
  }
  return ids;
}

}  // namespace

ModelConfig parse_model_config(const json& config) {
  TWELL_REQUIRE(config.is_object(), "config.json: expected a JSON object");
  ModelConfig out;
  TWELL_REQUIRE(present(config, "model_type") && config["model_type"].is_string(), "config.json: missing 'model_type'");
  out.model_type = config["model_type"].get<std::string>();
  TWELL_REQUIRE(out.model_type == "llama" || out.model_type == "qwen2" || out.model_type == "llama_sparse_relu",
                "config.json: 'model_type' = \"{}\" is not supported (llama, qwen2, llama_sparse_relu)", out.model_type);

  out.vocab_size = positive_int(config, "vocab_size");
  out.d_model = positive_int(config, "hidden_size");
  out.d_hidden = positive_int(config, "intermediate_size");
  out.n_layers = positive_int(config, "num_hidden_layers");
  out.n_heads = positive_int(config, "num_attention_heads");
  out.n_kv_heads = present(config, "num_key_value_heads") ? positive_int(config, "num_key_value_heads") : out.n_heads;
  TWELL_REQUIRE(out.n_heads % out.n_kv_heads == 0,
                "config.json: 'num_attention_heads' = {} is not a multiple of 'num_key_value_heads' = {}", out.n_heads,
                out.n_kv_heads);
  if (present(config, "head_dim")) {
    out.head_dim = positive_int(config, "head_dim");
  } else {
    TWELL_REQUIRE(out.d_model % out.n_heads == 0,
                  "config.json: 'hidden_size' = {} is not a multiple of 'num_attention_heads' = {} (and no 'head_dim')",
                  out.d_model, out.n_heads);
    out.head_dim = out.d_model / out.n_heads;
  }
  TWELL_REQUIRE(out.head_dim % 2 == 0, "config.json: head dimension {} must be even for RoPE", out.head_dim);
  out.max_positions = present(config, "max_position_embeddings") ? positive_int(config, "max_position_embeddings") : 4096;
  if (present(config, "rms_norm_eps")) out.rms_norm_eps = positive_number(config, "rms_norm_eps", "");
  read_rope(config, out);
  out.tie_word_embeddings = boolean_or(config, "tie_word_embeddings", false);

  // The FFN activation. SparseLM's config says "silu" but its FFN is ReLU: the model_type decides.
  if (out.model_type == "llama_sparse_relu") {
    out.activation = FfnActivation::relu;
  } else {
    TWELL_REQUIRE(present(config, "hidden_act") && config["hidden_act"].is_string(), "config.json: missing 'hidden_act'");
    const std::string act = config["hidden_act"].get<std::string>();
    if (act == "silu" || act == "swish") {
      out.activation = FfnActivation::silu;
    } else if (act == "relu") {
      out.activation = FfnActivation::relu;
    } else if (act == "fatrelu") {  // ProSparse
      TWELL_REQUIRE(present(config, "hidden_act_param") && config["hidden_act_param"].is_number() &&
                        config["hidden_act_param"].get<double>() >= 0,
                    "config.json: 'hidden_act' = \"fatrelu\" needs a non-negative 'hidden_act_param' threshold");
      out.activation_threshold = config["hidden_act_param"].get<float>();
      out.activation = out.activation_threshold == 0.0f ? FfnActivation::relu : FfnActivation::fatrelu;
    } else {
      fail("config.json: 'hidden_act' = \"{}\" is not supported (silu, relu, fatrelu)", act);
    }
  }

  // Biases: Qwen2 always has q/k/v biases; Llama-family ones with extra biases are refused.
  out.qkv_bias = out.model_type == "qwen2";
  TWELL_REQUIRE(!boolean_or(config, "attention_bias", false) || out.qkv_bias,
                "config.json: 'attention_bias' = true is not supported for model_type {}", out.model_type);
  TWELL_REQUIRE(!boolean_or(config, "mlp_bias", false), "config.json: 'mlp_bias' = true is not supported");
  TWELL_REQUIRE(!boolean_or(config, "use_sliding_window", false),
                "config.json: 'use_sliding_window' = true is not supported");
  TWELL_REQUIRE(!present(config, "quantization_config"), "config.json: 'quantization_config' is not supported");

  out.eos_token_ids = token_ids(config, "eos_token_id");
  const std::vector<int32_t> bos = token_ids(config, "bos_token_id");
  out.bos_token_id = bos.empty() ? -1 : bos[0];
  for (int32_t id : out.eos_token_ids)
    TWELL_REQUIRE(id < out.vocab_size, "config.json: 'eos_token_id' {} is outside the vocabulary of {}", id, out.vocab_size);
  TWELL_REQUIRE(out.bos_token_id < out.vocab_size, "config.json: 'bos_token_id' {} is outside the vocabulary of {}",
                out.bos_token_id, out.vocab_size);
  return out;
}

ModelConfig load_model_config(const std::string& config_path) {
  std::ifstream stream(config_path);
  TWELL_REQUIRE(stream.good(), "cannot read '{}'", config_path);
  json config;
  try {
    config = json::parse(stream);
  } catch (const json::exception& error) {
    fail("{}: not valid JSON: {}", config_path, error.what());
  }
  return parse_model_config(config);
}

}  // namespace twell
