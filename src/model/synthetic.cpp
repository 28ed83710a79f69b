// Synthetic models (twell/model.h): the benchmark shapes with random weights, built in memory.
#include <cmath>

#include "twell/error.h"
#include "twell/model.h"
#include "twell/workload.h"

namespace twell {

ModelConfig synthetic_model_config(const std::string& name) {
  ModelConfig c;
  c.model_type = "llama_sparse_relu";
  c.activation = FfnActivation::relu;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = true;
  if (name == "2b") {
    c.vocab_size = 49152;
    c.d_model = 2048;
    c.d_hidden = 5632;
    c.n_layers = 38;
    c.n_heads = 32;
    c.n_kv_heads = 32;
    c.head_dim = 64;
    c.max_positions = 8192;
  } else if (name == "tiny") {
    c.vocab_size = 256;
    c.d_model = 128;
    c.d_hidden = 512;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 32;
    c.max_positions = 1024;
  } else {
    fail("--synthetic must be 2b or tiny, got '{}'", name);
  }
  return c;
}

ModelWeights make_synthetic_weights(const ModelConfig& config, double ffn_density, uint64_t seed) {
  TWELL_REQUIRE(ffn_density >= 0.0 && ffn_density <= 1.0, "FFN density must lie in [0, 1], got {}", ffn_density);
  const int64_t V = config.vocab_size, D = config.d_model;
  const int64_t q_dim = int64_t{config.n_heads} * config.head_dim, kv_dim = int64_t{config.n_kv_heads} * config.head_dim;
  const double projection_stddev = 1.0 / std::sqrt(static_cast<double>(D));
  ModelWeights w;
  w.embedding = make_normal(V * D, 1.0, seed);
  for (int64_t v = 0; v < V; ++v) w.embedding[v * D] = 1.0f;
  w.final_norm.assign(D, 1.0f);
  w.layers.resize(config.n_layers);
#pragma omp parallel for schedule(dynamic)
  for (int32_t i = 0; i < config.n_layers; ++i) {
    LayerWeights& layer = w.layers[i];
    const uint64_t layer_seed = seed * 1000003 + 16 * static_cast<uint64_t>(i);
    layer.attn_norm.assign(D, 1.0f);
    layer.ffn_norm.assign(D, 1.0f);
    layer.wq = make_normal(q_dim * D, projection_stddev, layer_seed + 1);
    layer.wk = make_normal(kv_dim * D, projection_stddev, layer_seed + 2);
    layer.wv = make_normal(kv_dim * D, projection_stddev, layer_seed + 3);
    layer.wo = make_normal(D * q_dim, 0.05 / std::sqrt(static_cast<double>(q_dim)), layer_seed + 4);
    std::fill_n(layer.wo.begin(), q_dim, 0.0f);  // row 0: column 0 of the residual stream stays put
    WorkloadSpec spec;
    spec.d_model = config.d_model;
    spec.d_hidden = config.d_hidden;
    spec.density = ffn_density;
    spec.seed = layer_seed + 5;
    layer.ffn = make_workload(spec).weights;
    for (int64_t j = 0; j < config.d_hidden; ++j) layer.ffn.down[j * D] = 0.0f;
  }
  return w;
}

}  // namespace twell
