// The CPU forward pass: embedding, RMSNorm, RoPE, grouped-query attention over a KV cache, the FFN
// through the chosen path, LM head. fp32 throughout; the projections are OpenBLAS sgemm calls.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>

#include "twell/convert.h"
#include "twell/cpu.h"
#include "twell/error.h"
#include "twell/host_tensors.h"
#include "twell/model.h"
#include "twell/predictor_store.h"
#include "twell/safetensors.h"

namespace twell {

FfnPath parse_ffn_path(const std::string& name) {
  if (name == "dense") return FfnPath::dense;
  if (name == "twell") return FfnPath::twell;
  if (name == "predict") return FfnPath::predict;
  fail("--ffn must be dense, twell or predict, got '{}'", name);
}

std::string to_string(FfnPath path) {
  switch (path) {
    case FfnPath::dense: return "dense";
    case FfnPath::twell: return "twell";
    case FfnPath::predict: return "predict";
  }
  return "?";
}

namespace {

// TwELL packing of the model's gate: 128-column tiles with 32 slots each (compression 4) hold up
// to 25% density per tile without spilling; denser tiles spill exactly.
constexpr int32_t kTwellTile = 128;
constexpr int32_t kTwellCompression = 4;

// y [rows, out] = x [rows, in] · W^T, W [out, in]; plus bias [out] when given.
void linear(const float* x, int64_t rows, const std::vector<float>& weight, int64_t in, int64_t out, float* y,
            const std::vector<float>& bias = {}) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(out),
              static_cast<int>(in), 1.0f, x, static_cast<int>(in), weight.data(), static_cast<int>(in), 0.0f, y,
              static_cast<int>(out));
  if (bias.empty()) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) y[r * out + o] += bias[o];
}

// y [rows, D] = x / sqrt(mean(x²) + eps) ⊙ weight, as HF's LlamaRMSNorm computes it in fp32.
void rms_norm(const float* x, int64_t rows, int32_t d, const std::vector<float>& weight, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * d;
    float sum_squares = 0;
    for (int32_t k = 0; k < d; ++k) sum_squares += row[k] * row[k];
    const float inv_rms = 1.0f / std::sqrt(sum_squares / d + static_cast<float>(eps));
    for (int32_t k = 0; k < d; ++k) y[r * d + k] = weight[k] * (row[k] * inv_rms);
  }
}

// Rotates the two halves of each head's vector (HF's rotate_half convention), in place.
// x [rows, n_heads, Dh]; row r sits at position first_position + r. Angles in fp32 as HF computes them.
void apply_rope(float* x, int64_t rows, int32_t n_heads, int32_t head_dim, int32_t first_position, double theta) {
  const int32_t half = head_dim / 2;
  std::vector<float> inv_freq(half);
  for (int32_t i = 0; i < half; ++i)
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(head_dim));
  std::vector<float> cos_table(half), sin_table(half);
  for (int64_t r = 0; r < rows; ++r) {
    const float position = static_cast<float>(first_position + r);
    for (int32_t i = 0; i < half; ++i) {
      const float angle = position * inv_freq[i];
      cos_table[i] = std::cos(angle);
      sin_table[i] = std::sin(angle);
    }
    for (int32_t h = 0; h < n_heads; ++h) {
      float* v = x + (r * n_heads + h) * head_dim;
      for (int32_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_table[i] - b * sin_table[i];
        v[i + half] = b * cos_table[i] + a * sin_table[i];
      }
    }
  }
}

float activate(FfnActivation activation, float threshold, float g) {
  switch (activation) {
    case FfnActivation::silu: return g / (1.0f + std::exp(-g));
    case FfnActivation::relu: return g > 0.0f ? g : 0.0f;
    case FfnActivation::fatrelu: return g > threshold ? g : 0.0f;
  }
  return 0.0f;
}

}  // namespace

// Buffers reused across forward calls, grown to the largest call so far.
struct Model::Workspace {
  std::vector<float> hidden;     // [n, D] residual stream
  std::vector<float> normed;     // [n, D]
  std::vector<float> q;          // [n, n_heads, Dh]
  std::vector<float> k;          // [n, n_kv_heads, Dh]
  std::vector<float> v;          // [n, n_kv_heads, Dh]
  std::vector<float> attention;  // [n, n_heads, Dh]
  std::vector<float> projected;  // [n, D]
  std::vector<float> gate;       // [n, H]
  std::vector<float> up;         // [n, H]
  cpu::AttentionScratch attention_scratch;
  TwellMatrix gate_packed;
  cpu::DecodeScratch decode;

  void reserve(int64_t n, const ModelConfig& c) {
    auto grow = [](std::vector<float>& buffer, int64_t size) {
      if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    };
    grow(hidden, n * c.d_model);
    grow(normed, n * c.d_model);
    grow(q, n * c.n_heads * c.head_dim);
    grow(k, n * c.n_kv_heads * c.head_dim);
    grow(v, n * c.n_kv_heads * c.head_dim);
    grow(attention, n * c.n_heads * c.head_dim);
    grow(projected, n * c.d_model);
  }
};

Model Model::load(const std::string& dir) {
  const ModelConfig config = load_model_config((std::filesystem::path(dir) / "config.json").string());
  const Checkpoint checkpoint = Checkpoint::open_dir(dir);
  Model model(config, load_model_weights(checkpoint, config));
  if (auto stored = load_predictor_record(dir, model.config_, model.weights_)) model.predictors_ = std::move(*stored);
  return model;
}

Model::Model(ModelConfig config, ModelWeights weights)
    : config_(std::move(config)), weights_(std::move(weights)), workspace_(std::make_unique<Workspace>()) {}
Model::~Model() = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;

void Model::set_ffn_path(FfnPath path) {
  if (path != FfnPath::dense)
    TWELL_REQUIRE(config_.activation == FfnActivation::relu,
                  "--ffn {} needs a ReLU FFN; this model's activation is {}{}", to_string(path),
                  to_string(config_.activation),
                  config_.activation == FfnActivation::fatrelu ? " (threshold > 0: the sparse kernels implement plain relu)"
                                                               : "");
  if (path == FfnPath::predict && predictors_.empty())
    predictors_.assign(config_.n_layers, LayerPredictor{keeps_every_neuron(), {}});
  if (path == FfnPath::predict && relu_signs_.empty()) {
    for (int32_t layer = 0; layer < config_.n_layers; ++layer)
      relu_signs_.push_back(pack_relu_signs(layer, predictors_[layer].exact_columns));
  }
  ffn_path_ = path;
}

SignBits Model::pack_relu_signs(int32_t layer, const std::vector<int32_t>& exact_columns) const {
  return pack_sign_bits(weights_.layers[layer].ffn.relu_projection().data(), config_.d_hidden, config_.d_model,
                        exact_columns);
}

void Model::set_predictor(std::vector<LayerPredictor> per_layer) {
  TWELL_REQUIRE(static_cast<int32_t>(per_layer.size()) == config_.n_layers,
                "set_predictor: expected one config per layer ({}), got {}", config_.n_layers, per_layer.size());
  for (const LayerPredictor& layer : per_layer) validate_exact_columns(layer.exact_columns, config_.d_model);
  for (int32_t layer = 0; layer < static_cast<int32_t>(relu_signs_.size()); ++layer)
    if (relu_signs_[layer].exact_columns != per_layer[layer].exact_columns)
      relu_signs_[layer] = pack_relu_signs(layer, per_layer[layer].exact_columns);
  predictors_ = std::move(per_layer);
}

const SignBits& Model::relu_signs(int32_t layer) const {
  TWELL_REQUIRE(!relu_signs_.empty(), "relu_signs: select the predict path first");
  TWELL_REQUIRE(layer >= 0 && layer < config_.n_layers, "relu_signs: layer {} outside [0, {})", layer,
                config_.n_layers);
  return relu_signs_[layer];
}

std::vector<std::vector<float>> Model::ffn_inputs(const std::vector<int32_t>& tokens) {
  TWELL_REQUIRE(!tokens.empty(), "ffn_inputs: needs at least one token");
  std::vector<std::vector<float>> inputs(config_.n_layers);
  // The guard restores the model after, also when forward throws.
  struct Restore {
    Model& model;
    FfnPath path;
    ActivationObserver observer;
    ~Restore() {
      model.ffn_path_ = path;
      model.capture_ffn_inputs_ = nullptr;
      model.observer_ = std::move(observer);
    }
  } restore{*this, ffn_path_, std::move(observer_)};
  observer_ = nullptr;
  ffn_path_ = FfnPath::dense;
  capture_ffn_inputs_ = &inputs;
  KvCache cache = new_cache(static_cast<int32_t>(tokens.size()));
  std::vector<float> logits(config_.vocab_size);
  forward(tokens.data(), static_cast<int32_t>(tokens.size()), cache, logits.data());
  return inputs;
}

std::vector<Calibration> Model::calibrate_predictor(const std::vector<int32_t>& tokens, PredictorKind kind,
                                                    double target_recall, int max_exact_columns) {
  TWELL_REQUIRE(ffn_path_ == FfnPath::predict, "calibrate_predictor: select the predict path first");
  TWELL_REQUIRE(!tokens.empty(), "calibrate_predictor: needs at least one token");
  const std::vector<std::vector<float>> inputs = ffn_inputs(tokens);
  const int64_t rows = static_cast<int64_t>(tokens.size());
  std::vector<Calibration> result;
  for (int32_t layer = 0; layer < config_.n_layers; ++layer) {
    const FfnWeights& ffn = weights_.layers[layer].ffn;
    std::vector<int32_t> exact_columns = choose_exact_columns(
        inputs[layer].data(), rows, ffn.relu_projection().data(), config_.d_hidden, config_.d_model, max_exact_columns);
    if (relu_signs_[layer].exact_columns != exact_columns) relu_signs_[layer] = pack_relu_signs(layer, exact_columns);
    result.push_back(
        twell::calibrate_predictor(inputs[layer].data(), rows, ffn, relu_signs_[layer], kind, target_recall));
    predictors_[layer] = LayerPredictor{result.back().config, std::move(exact_columns)};
  }
  return result;
}

std::vector<std::vector<int64_t>> Model::order_neurons_by_activity(const std::vector<int32_t>& tokens) {
  TWELL_REQUIRE(config_.relu_sparse(), "order_neurons_by_activity: needs a relu-sparse FFN; this model's activation is {}",
                to_string(config_.activation));
  TWELL_REQUIRE(!neurons_ordered_, "order_neurons_by_activity: this model's neurons are already ordered");
  const std::vector<std::vector<float>> inputs = ffn_inputs(tokens);
  const auto rows = static_cast<int64_t>(tokens.size());
  std::vector<std::vector<int64_t>> counts(config_.n_layers);
  for (int32_t layer = 0; layer < config_.n_layers; ++layer) {
    FfnWeights& ffn = weights_.layers[layer].ffn;
    std::vector<int64_t> active = cpu::count_active_neurons(inputs[layer].data(), rows, ffn);
    ffn = sort_neurons_by_activity(ffn, active);
    std::sort(active.begin(), active.end(), std::greater<>());
    counts[layer] = std::move(active);
    if (!relu_signs_.empty()) relu_signs_[layer] = pack_relu_signs(layer, relu_signs_[layer].exact_columns);
  }
  neurons_ordered_ = true;
  return counts;
}

KvCache Model::new_cache(int32_t capacity) const {
  TWELL_REQUIRE(capacity >= 1, "KV cache capacity must be >= 1, got {}", capacity);
  KvCache cache;
  cache.capacity = capacity;
  const size_t per_layer = static_cast<size_t>(capacity) * config_.n_kv_heads * config_.head_dim;
  cache.keys.assign(config_.n_layers, std::vector<float>(per_layer));
  cache.values.assign(config_.n_layers, std::vector<float>(per_layer));
  return cache;
}

void Model::ffn(int32_t layer_index, const float* x, int32_t rows, float* y) {
  const FfnWeights& weights = weights_.layers[layer_index].ffn;
  Workspace& ws = *workspace_;
  if (capture_ffn_inputs_ != nullptr)
    (*capture_ffn_inputs_)[layer_index].assign(x, x + static_cast<int64_t>(rows) * config_.d_model);
  if (ffn_path_ == FfnPath::predict && rows <= kDecodeMaxRows) {
    cpu::decode_ffn(x, rows, weights, relu_signs_[layer_index], predictors_[layer_index].config, y, ws.decode);
    return;
  }
  if (ffn_path_ != FfnPath::dense) {  // twell, and predict for steps longer than the decode kernels take
    cpu::gate_to_twell(x, rows, weights, kTwellTile, kTwellCompression, ws.gate_packed);
    cpu::ffn_from_twell(x, ws.gate_packed, weights, y);
    return;
  }
  // Dense: any activation, and the activations are visible to the observer.
  const int64_t H = config_.d_hidden, D = config_.d_model;
  if (static_cast<int64_t>(ws.gate.size()) < rows * H) {
    ws.gate.resize(rows * H);
    ws.up.resize(rows * H);
  }
  linear(x, rows, weights.gate, D, H, ws.gate.data());
  linear(x, rows, weights.up, D, H, ws.up.data());
  for (int64_t i = 0; i < rows * H; ++i)
    ws.gate[i] = activate(config_.activation, config_.activation_threshold, ws.gate[i]);
  if (observer_) observer_(layer_index, ws.gate.data(), rows);
  for (int64_t i = 0; i < rows * H; ++i) ws.gate[i] *= ws.up[i];
  // y [rows, D] = h [rows, H] · down [H, D]
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, static_cast<int>(D), static_cast<int>(H), 1.0f,
              ws.gate.data(), static_cast<int>(H), weights.down.data(), static_cast<int>(D), 0.0f, y,
              static_cast<int>(D));
}

void Model::forward(const int32_t* tokens, int32_t n, KvCache& cache, float* logits, bool all_logits) {
  const ModelConfig& c = config_;
  TWELL_REQUIRE(n >= 1, "forward: needs at least one token, got {}", n);
  TWELL_REQUIRE(cache.length + n <= cache.capacity, "forward: {} cached + {} new positions exceed the cache capacity {}",
                cache.length, n, cache.capacity);
  TWELL_REQUIRE(static_cast<int32_t>(cache.keys.size()) == c.n_layers, "forward: the cache was made for another model");
  for (int32_t i = 0; i < n; ++i)
    TWELL_REQUIRE(tokens[i] >= 0 && tokens[i] < c.vocab_size, "forward: token {} at index {} is outside [0, {})",
                  tokens[i], i, c.vocab_size);
  Workspace& ws = *workspace_;
  ws.reserve(n, c);
  const int64_t D = c.d_model;
  const int32_t Dh = c.head_dim;
  const int64_t q_dim = int64_t{c.n_heads} * Dh, kv_dim = int64_t{c.n_kv_heads} * Dh;
  const int32_t start = cache.length;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));

  for (int32_t i = 0; i < n; ++i)
    std::copy_n(weights_.embedding.data() + int64_t{tokens[i]} * D, D, ws.hidden.data() + i * D);

  for (int32_t layer_index = 0; layer_index < c.n_layers; ++layer_index) {
    const LayerWeights& layer = weights_.layers[layer_index];
    rms_norm(ws.hidden.data(), n, c.d_model, layer.attn_norm, c.rms_norm_eps, ws.normed.data());
    linear(ws.normed.data(), n, layer.wq, D, q_dim, ws.q.data(), layer.bq);
    linear(ws.normed.data(), n, layer.wk, D, kv_dim, ws.k.data(), layer.bk);
    linear(ws.normed.data(), n, layer.wv, D, kv_dim, ws.v.data(), layer.bv);
    apply_rope(ws.q.data(), n, c.n_heads, Dh, start, c.rope_theta);
    apply_rope(ws.k.data(), n, c.n_kv_heads, Dh, start, c.rope_theta);
    float* keys = cache.keys[layer_index].data();      // [capacity, n_kv_heads, Dh]
    float* values = cache.values[layer_index].data();  // [capacity, n_kv_heads, Dh]
    std::copy_n(ws.k.data(), n * kv_dim, keys + start * kv_dim);
    std::copy_n(ws.v.data(), n * kv_dim, values + start * kv_dim);

    cpu::causal_attention(ws.q.data(), keys, values, {n, c.n_heads, c.n_kv_heads, Dh, start}, scale,
                          ws.attention.data(), ws.attention_scratch);
    linear(ws.attention.data(), n, layer.wo, q_dim, D, ws.projected.data());
    for (int64_t e = 0; e < n * D; ++e) ws.hidden[e] += ws.projected[e];

    rms_norm(ws.hidden.data(), n, c.d_model, layer.ffn_norm, c.rms_norm_eps, ws.normed.data());
    ffn(layer_index, ws.normed.data(), n, ws.projected.data());
    for (int64_t e = 0; e < n * D; ++e) ws.hidden[e] += ws.projected[e];
  }
  cache.length += n;

  const int32_t first_row = all_logits ? 0 : n - 1;
  const int32_t out_rows = n - first_row;
  rms_norm(ws.hidden.data() + first_row * D, out_rows, c.d_model, weights_.final_norm, c.rms_norm_eps,
           ws.normed.data());
  linear(ws.normed.data(), out_rows, weights_.output_matrix(), D, c.vocab_size, logits);
}

}  // namespace twell
