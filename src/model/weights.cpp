// Checkpoint tensors (HF names and layouts) -> fp32 ModelWeights, with every shape checked.
#include <fmt/ranges.h>

#include "twell/error.h"
#include "twell/model.h"
#include "twell/safetensors.h"

namespace twell {

namespace {

std::vector<float> load(const Checkpoint& checkpoint, const std::string& name, std::vector<int64_t> shape) {
  const TensorView& tensor = checkpoint.get(name);
  TWELL_REQUIRE(tensor.shape == shape, "tensor '{}': shape [{}], expected [{}] from config.json", name,
                fmt::join(tensor.shape, ", "), fmt::join(shape, ", "));
  return to_float_vector(tensor);
}

// HF down_proj [D, H] -> canonical neuron-major [H, D].
std::vector<float> transposed(const std::vector<float>& matrix, int64_t rows, int64_t cols) {
  std::vector<float> result(matrix.size());
  constexpr int64_t kBlock = 64;  // cache blocking; the transpose runs once per load
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock)
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock)
      for (int64_t r = r0; r < std::min(rows, r0 + kBlock); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + kBlock); ++c) result[c * rows + r] = matrix[r * cols + c];
  return result;
}

}  // namespace

ModelWeights load_model_weights(const Checkpoint& checkpoint, const ModelConfig& config) {
  const int64_t V = config.vocab_size, D = config.d_model, H = config.d_hidden;
  const int64_t q_dim = int64_t{config.n_heads} * config.head_dim;
  const int64_t kv_dim = int64_t{config.n_kv_heads} * config.head_dim;
  ModelWeights weights;
  weights.embedding = load(checkpoint, "model.embed_tokens.weight", {V, D});
  weights.final_norm = load(checkpoint, "model.norm.weight", {D});
  if (!config.tie_word_embeddings) weights.lm_head = load(checkpoint, "lm_head.weight", {V, D});
  weights.layers.resize(config.n_layers);

  // Layers convert in parallel: bf16 -> fp32 widening and the down_proj transpose dominate loading.
  std::exception_ptr first_error;
#pragma omp parallel for schedule(dynamic)
  for (int32_t i = 0; i < config.n_layers; ++i) {
    try {
      const std::string prefix = fmt::format("model.layers.{}.", i);
      LayerWeights& layer = weights.layers[i];
      layer.attn_norm = load(checkpoint, prefix + "input_layernorm.weight", {D});
      layer.ffn_norm = load(checkpoint, prefix + "post_attention_layernorm.weight", {D});
      layer.wq = load(checkpoint, prefix + "self_attn.q_proj.weight", {q_dim, D});
      layer.wk = load(checkpoint, prefix + "self_attn.k_proj.weight", {kv_dim, D});
      layer.wv = load(checkpoint, prefix + "self_attn.v_proj.weight", {kv_dim, D});
      layer.wo = load(checkpoint, prefix + "self_attn.o_proj.weight", {D, q_dim});
      if (config.qkv_bias) {
        layer.bq = load(checkpoint, prefix + "self_attn.q_proj.bias", {q_dim});
        layer.bk = load(checkpoint, prefix + "self_attn.k_proj.bias", {kv_dim});
        layer.bv = load(checkpoint, prefix + "self_attn.v_proj.bias", {kv_dim});
      }
      FfnWeights& ffn = layer.ffn;
      ffn.d_model = config.d_model;
      ffn.d_hidden = config.d_hidden;
      ffn.gated = true;
      ffn.gate = load(checkpoint, prefix + "mlp.gate_proj.weight", {H, D});
      ffn.up = load(checkpoint, prefix + "mlp.up_proj.weight", {H, D});
      ffn.down = transposed(load(checkpoint, prefix + "mlp.down_proj.weight", {D, H}), D, H);
    } catch (...) {
#pragma omp critical
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  return weights;
}

}  // namespace twell
