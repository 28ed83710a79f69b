// config.json parsing: the forms written by transformers 4.x and 5.x, the sparse variants, and a
// refusal naming the key for everything twell cannot run.
#include <gtest/gtest.h>

#include "twell/error.h"
#include "twell/model.h"

namespace twell {
namespace {

nlohmann::json llama_config() {
  return nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
    "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": null, "pretraining_tp": 1, "torch_dtype": "float16"})");
}

void expect_refused(const nlohmann::json& config, const std::string& key) {
  try {
    parse_model_config(config);
    ADD_FAILURE() << "accepted: " << config.dump();
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(key), std::string::npos) << error.what();
  }
}

TEST(ModelConfig, ReadsLlama2AsTransformers4WroteIt) {
  const ModelConfig config = parse_model_config(llama_config());
  EXPECT_EQ(config.d_model, 4096);
  EXPECT_EQ(config.n_kv_heads, 32);  // no num_key_value_heads: multi-head attention
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_EQ(config.rope_theta, 10000.0);  // default
  EXPECT_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_EQ(config.activation, FfnActivation::silu);
  EXPECT_EQ(config.bos_token_id, 1);
  EXPECT_EQ(config.eos_token_ids, std::vector<int32_t>{2});
  EXPECT_FALSE(config.qkv_bias);
}

TEST(ModelConfig, ReadsRopeFromEachPlace) {
  nlohmann::json config = llama_config();
  config["rope_theta"] = 500000.0;
  EXPECT_EQ(parse_model_config(config).rope_theta, 500000.0);
  config.erase("rope_theta");
  config["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};  // transformers 5
  EXPECT_EQ(parse_model_config(config).rope_theta, 1e6);
  config["rope_parameters"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"rope_theta", 1e6}};
  expect_refused(config, "rope_parameters.rope_type");
  config.erase("rope_parameters");
  config["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  expect_refused(config, "rope_scaling.type");
}

TEST(ModelConfig, ReadsGqaHeadDimAndEosLists) {
  nlohmann::json config = llama_config();
  config["num_key_value_heads"] = 8;
  config["head_dim"] = 64;
  config["eos_token_id"] = {2, 7};
  const ModelConfig parsed = parse_model_config(config);
  EXPECT_EQ(parsed.n_kv_heads, 8);
  EXPECT_EQ(parsed.head_dim, 64);
  EXPECT_EQ(parsed.eos_token_ids, (std::vector<int32_t>{2, 7}));
  config["num_key_value_heads"] = 5;
  expect_refused(config, "num_key_value_heads");
}

TEST(ModelConfig, SparseVariants) {
  nlohmann::json sparselm = llama_config();
  sparselm["model_type"] = "llama_sparse_relu";  // hidden_act stays "silu": the model_type decides
  EXPECT_EQ(parse_model_config(sparselm).activation, FfnActivation::relu);

  nlohmann::json relufied = llama_config();
  relufied["hidden_act"] = "relu";
  EXPECT_TRUE(parse_model_config(relufied).relu_sparse());

  nlohmann::json prosparse = llama_config();
  prosparse["hidden_act"] = "fatrelu";
  prosparse["hidden_act_param"] = 0.01;
  const ModelConfig parsed = parse_model_config(prosparse);
  EXPECT_EQ(parsed.activation, FfnActivation::fatrelu);
  EXPECT_FLOAT_EQ(parsed.activation_threshold, 0.01f);
  prosparse["hidden_act_param"] = 0;  // fatrelu at 0 is relu: the sparse kernels apply
  EXPECT_EQ(parse_model_config(prosparse).activation, FfnActivation::relu);
  prosparse.erase("hidden_act_param");
  expect_refused(prosparse, "hidden_act_param");
}

TEST(ModelConfig, Qwen2HasQkvBias) {
  nlohmann::json qwen = llama_config();
  qwen["model_type"] = "qwen2";
  qwen["use_sliding_window"] = false;
  qwen["tie_word_embeddings"] = true;
  const ModelConfig parsed = parse_model_config(qwen);
  EXPECT_TRUE(parsed.qkv_bias);
  EXPECT_TRUE(parsed.tie_word_embeddings);
  qwen["use_sliding_window"] = true;
  expect_refused(qwen, "use_sliding_window");
}

TEST(ModelConfig, RefusesWhatItCannotRun) {
  auto with = [](const char* key, nlohmann::json value) {
    nlohmann::json config = llama_config();
    if (value.is_null()) config.erase(key);
    else config[key] = value;
    return config;
  };
  expect_refused(with("model_type", "mistral"), "model_type");
  expect_refused(with("hidden_act", "gelu"), "hidden_act");
  expect_refused(with("hidden_size", -4), "hidden_size");
  expect_refused(with("hidden_size", 4001), "num_attention_heads");  // 4001 / 32 heads is not whole
  expect_refused(with("vocab_size", nullptr), "vocab_size");
  expect_refused(with("intermediate_size", "11008"), "intermediate_size");
  expect_refused(with("mlp_bias", true), "mlp_bias");
  expect_refused(with("attention_bias", true), "attention_bias");
  expect_refused(with("quantization_config", nlohmann::json::object()), "quantization_config");
  expect_refused(with("eos_token_id", 32000), "eos_token_id");
  expect_refused(with("rms_norm_eps", 0), "rms_norm_eps");
  expect_refused(with("tie_word_embeddings", "yes"), "tie_word_embeddings");
  expect_refused(nlohmann::json::array(), "JSON object");
  EXPECT_THROW(load_model_config("/nonexistent/config.json"), Error);
}

}  // namespace
}  // namespace twell
