// The model runtime (CPU): a Hugging Face checkpoint directory -> config, fp32 weights, a forward
// pass with a KV cache, and sampling. One file per stage in src/model/: config.cpp, weights.cpp,
// forward.cpp, sampler.cpp. Decoder-only Llama-family transformers:
//   h = embed[token]
//   per layer:  h += o_proj(attention(rope(q_proj(rms(h))), rope(k_proj(rms(h))), v_proj(rms(h))))
//               h += ffn(rms(h))        ffn(x) = (act(x·Wg^T) ⊙ x·Wu^T)·Wd
//   logits = lm_head(rms(h))
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "twell/decode.h"
#include "twell/host_tensors.h"

namespace twell {

class Checkpoint;

// ---------------------------------------------------------------------------------------------
// Config

std::string to_string(FfnActivation activation);

struct ModelConfig {
  std::string model_type;  // "llama", "qwen2" or "llama_sparse_relu"
  int32_t vocab_size = 0;  // V
  int32_t d_model = 0;     // D (hidden_size)
  int32_t d_hidden = 0;    // H (intermediate_size)
  int32_t n_layers = 0;
  int32_t n_heads = 0;
  int32_t n_kv_heads = 0;  // grouped-query attention: n_heads / n_kv_heads query heads share a KV head
  int32_t head_dim = 0;    // Dh
  int32_t max_positions = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2
  FfnActivation activation = FfnActivation::silu;
  float activation_threshold = 0.0f;  // fatrelu only
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;

  bool relu_sparse() const { return activation != FfnActivation::silu; }
};

// Reads config.json as written by transformers 4.x and 5.x (rope_theta at the top level, in
// rope_scaling or in rope_parameters; head_dim present or derived). Refuses anything it cannot run
// with a twell::Error naming the key.
ModelConfig parse_model_config(const nlohmann::json& config);
ModelConfig load_model_config(const std::string& config_path);

// ---------------------------------------------------------------------------------------------
// Weights, all fp32 (bf16/fp16 checkpoints are widened once at load)

struct LayerWeights {
  std::vector<float> attn_norm;  // [D]
  std::vector<float> wq;         // [n_heads·Dh, D]
  std::vector<float> wk;         // [n_kv_heads·Dh, D]
  std::vector<float> wv;         // [n_kv_heads·Dh, D]
  std::vector<float> bq, bk, bv;  // [n_heads·Dh], [n_kv_heads·Dh] ×2; empty without qkv_bias
  std::vector<float> wo;         // [D, n_heads·Dh]
  std::vector<float> ffn_norm;   // [D]
  FfnWeights ffn;                // canonical neuron-major [H, D] (down_proj transposed at load)
};

struct ModelWeights {
  std::vector<float> embedding;   // [V, D]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [D]
  std::vector<float> lm_head;     // [V, D]; empty when tied (the embedding is used)

  const std::vector<float>& output_matrix() const { return lm_head.empty() ? embedding : lm_head; }
};

// Every tensor's shape is checked against the config; a missing or misshapen tensor throws naming it.
ModelWeights load_model_weights(const Checkpoint& checkpoint, const ModelConfig& config);

// Random models for benchmarks without a checkpoint (src/model/synthetic.cpp). Shapes by name:
// "2b" = 38 layers, D=2048, H=5632, 32 heads (MHA, Dh=64), V=49152, tied embeddings, ReLU FFN
// (the 2B SparseLM shape); "tiny" = 2 layers, D=128, H=512, 4 heads over 2 KV heads, V=256.
ModelConfig synthetic_model_config(const std::string& name);
// Each layer's FFN is the standard workload's (twell/workload.h) for `ffn_density`; the rest keeps
// that workload's premise, an FFN input whose column 0 is about 1: embedding column 0 is 1, and
// neither o_proj nor down_proj writes column 0 of the residual stream, so the gate threshold column
// sees a nearly constant input in every layer. Attention weights N(0, 1/D) (o_proj scaled by 0.05, so the
// residual stream's scale, and with it the density, drifts little over the layers).
ModelWeights make_synthetic_weights(const ModelConfig& config, double ffn_density, uint64_t seed);

// ---------------------------------------------------------------------------------------------
// Forward

// How the FFN is computed. dense: three OpenBLAS sgemm calls, any activation. twell: relu gate
// packed to TwELL (cpu::gate_to_twell + cpu::ffn_from_twell); needs a relu FFN. predict: the sign-bit
// predictor (cpu::decode_ffn) for steps of at most kDecodeMaxRows tokens, TwELL for longer ones.
enum class FfnPath { dense, twell, predict };
FfnPath parse_ffn_path(const std::string& name);  // "dense", "twell" or "predict"
std::string to_string(FfnPath path);

struct KvCache {
  int32_t capacity = 0;  // positions
  int32_t length = 0;    // positions filled
  std::vector<std::vector<float>> keys;    // per layer [capacity, n_kv_heads, Dh], after RoPE
  std::vector<std::vector<float>> values;  // per layer [capacity, n_kv_heads, Dh]
};

// Called once per layer and forward call with the FFN's activations act(x·Wg^T) [rows, H], when
// the dense path computes them (stats). layer, activations, rows.
using ActivationObserver = std::function<void(int32_t, const float*, int64_t)>;

class Model {
 public:
  // Loads config.json and the safetensors weights of a checkpoint directory.
  static Model load(const std::string& dir);
  Model(ModelConfig config, ModelWeights weights);
  ~Model();
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }

  // Refuses a path the model cannot take (twell/predict on a non-relu FFN) with the reason.
  void set_ffn_path(FfnPath path);
  FfnPath ffn_path() const { return ffn_path_; }
  // Per-layer predictor settings for FfnPath::predict, each with the exact columns its sign bits are
  // packed with: set here, filled by calibrate_predictor() from sample text, or read by load() from the
  // checkpoint's twell_predictor.json (twell/predictor_store.h). A layer whose columns change is
  // packed again.
  void set_predictor(std::vector<LayerPredictor> per_layer);
  const std::vector<LayerPredictor>& predictor() const { return predictors_; }  // empty until one of those
  // The sign bits of layer `layer`'s relu projection the predict path reads (packed with that layer's
  // exact columns); the predict path must be chosen.
  const SignBits& relu_signs(int32_t layer) const;
  // Runs `tokens` through the dense path, collecting each layer's FFN input, chooses each layer's
  // exact columns on those inputs (twell::choose_exact_columns, at most max_exact_columns; 0 = none)
  // and picks its predictor for `target_recall` (twell::calibrate_predictor).
  std::vector<Calibration> calibrate_predictor(const std::vector<int32_t>& tokens, PredictorKind kind,
                                               double target_recall, int max_exact_columns = kMaxExactColumns);
  // Each layer's FFN input [tokens, D] when `tokens` run from position 0 on the exact (dense) path:
  // what the predictor sees. The model's path, observer and predictor are left as they were.
  std::vector<std::vector<float>> ffn_inputs(const std::vector<int32_t>& tokens);
  // Puts each layer's FFN neurons (rows of gate, up and down alike) in decreasing order of how many
  // of `tokens` activate them (the dense path's activations, sort_neurons_by_activity): the model
  // computes the same function, and the neurons active for many tokens form a prefix that the CUDA
  // twell path can run densely beside TwELL (cuda::SparseFfnOptions::hot_fractions; a CudaModel
  // built from an ordered model times those split paths too). Sign bits the predict path holds are
  // packed again. Once per model (a second order would leave a CudaModel built in between with other
  // weights than the host's sign bits); needs a relu-sparse FFN. Returns each layer's counts, in the
  // new order.
  std::vector<std::vector<int64_t>> order_neurons_by_activity(const std::vector<int32_t>& tokens);
  bool neurons_ordered_by_activity() const { return neurons_ordered_; }
  void set_activation_observer(ActivationObserver observer) { observer_ = std::move(observer); }

  KvCache new_cache(int32_t capacity) const;
  // Runs tokens [n] at positions cache.length ..; appends their keys and values to the cache.
  // logits: [n, V] when all_logits, else [V] for the last token only.
  void forward(const int32_t* tokens, int32_t n, KvCache& cache, float* logits, bool all_logits = false);

 private:
  struct Workspace;
  void ffn(int32_t layer, const float* x, int32_t rows, float* y);
  SignBits pack_relu_signs(int32_t layer, const std::vector<int32_t>& exact_columns) const;

  ModelConfig config_;
  ModelWeights weights_;
  FfnPath ffn_path_ = FfnPath::dense;
  std::vector<SignBits> relu_signs_;  // per layer, built when the predict path is chosen
  std::vector<LayerPredictor> predictors_;
  ActivationObserver observer_;
  bool neurons_ordered_ = false;
  std::vector<std::vector<float>>* capture_ffn_inputs_ = nullptr;  // per layer [rows, D], while calibrating
  std::unique_ptr<Workspace> workspace_;
};

// ---------------------------------------------------------------------------------------------
// Sampling

struct SamplerConfig {
  float temperature = 0.0f;  // 0: greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(SamplerConfig config);
  // Picks a token from logits [V]: softmax(logits / temperature), restricted to the top_k largest,
  // then to the smallest set of those whose probability reaches top_p.
  int32_t sample(const float* logits, int32_t vocab_size);

 private:
  SamplerConfig config_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
};

}  // namespace twell
