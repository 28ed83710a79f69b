// CudaModel (include/twell/model_cuda.h): weights on the device, the KV cache, one forward step as a
// sequence of launches on the model's stream, and CUDA graphs of decode steps.
#include <cmath>
#include <cstddef>
#include <map>
#include <set>
#include <utility>

#include "cuda/cuda_utils.h"
#include "cuda/decode_gemv.h"
#include "cuda/gemm.h"
#include "cuda/model_kernels.h"
#include "cuda/prefill_attention.h"
#include "twell/convert.h"
#include "twell/cuda.h"
#include "twell/decode_cuda.h"
#include "twell/error.h"
#include "twell/model_cuda.h"

namespace twell::cuda {
namespace {

namespace mk = model_kernels;

DeviceArray<float> upload_f32(const std::vector<float>& host) {
  DeviceArray<float> device = make_device_array<float>(host.size());
  copy_to_device(device.get(), host.data(), host.size() * sizeof(float));
  return device;
}

int32_t round_up(int32_t value, int32_t multiple) { return (value + multiple - 1) / multiple * multiple; }

struct DeviceLayer {
  DeviceArray<float> attn_norm;  // [D]
  DeviceArray<float> ffn_norm;   // [D]
  DeviceArray<bf16> wqkv;        // [H_q·Dh + 2·H_kv·Dh, D]: q_proj, k_proj, v_proj stacked
  DeviceArray<float> bqkv;       // [H_q·Dh + 2·H_kv·Dh], null without qkv_bias
  DeviceArray<bf16> wo;          // [D, H_q·Dh]
  DeviceFfnWeights ffn;          // canonical neuron-major [H, D]
  SignBits signs;                // host copy, relu models only: the predictor's input
  std::unique_ptr<DecodeLayer> decode;  // built when the predict path is chosen
};

}  // namespace

struct CudaModel::Impl {
  ModelConfig config;
  CudaModelOptions options;
  FfnPath path = FfnPath::dense;
  std::vector<PredictorConfig> predictors;
  bool neurons_ordered = false;  // the host's FFN neurons were ordered by activity: SparseFfn times splits

  DeviceArray<bf16> embedding;  // [V, D]
  DeviceArray<bf16> lm_head;    // [V, D], null when tied
  DeviceArray<float> final_norm;
  std::vector<DeviceLayer> layers;

  cudaStream_t stream = nullptr;
  RowMajorGemm gemm;
  DenseFfn dense_batch;   // steps of n > 1 tokens
  DenseFfn dense_decode;  // steps of n = 1 (its buffers stay put once a graph holds them)
  std::unique_ptr<SparseFfn> sparse;
  GemmPrefillAttention gemm_attention;  // used for head dims the fused kernel lacks

  // KV cache and step state
  int32_t batch = 0, capacity = 0, cache_stride = 0, length = 0;
  bool next_tokens_ready = false;   // tokens[0 .. B) hold the argmax of the last step's logits
  DeviceBuffer<bf16> k_cache;       // [layers, B, H_kv, cache_stride, Dh]
  DeviceBuffer<bf16> v_cache;       // [layers, B, H_kv, cache_stride, Dh]
  DeviceBuffer<int32_t> length_device;  // [1] positions cached, read by the kernels
  DeviceBuffer<int32_t> tokens;     // [B·n] this step's input
  DeviceBuffer<int32_t> history;    // [B, cache_stride] argmax token after each position

  // workspace, grown to the largest step
  DeviceBuffer<float> hidden;     // [rows, D] residual stream
  DeviceBuffer<bf16> normed;      // [rows, D]
  DeviceBuffer<bf16> qkv;         // [rows, H_q·Dh + 2·H_kv·Dh]
  DeviceBuffer<bf16> q;           // [B, H_q, n, Dh], steps of n > 1 tokens
  DeviceBuffer<bf16> attention;   // [rows, H_q·Dh]
  DeviceBuffer<bf16> ffn_out;     // [rows, D]
  DeviceBuffer<float> logits;     // [out rows, V]
  DeviceBuffer<std::byte> decode_attention_workspace;  // mk::decode_attention_workspace_bytes, zeroed at reset
  DeviceBuffer<unsigned int> gemv_arrivals;            // [1] the O GEMV's RMSNorm tail counter, zeroed at reset

  std::map<std::pair<int32_t, bool>, cudaGraphExec_t> graphs;  // (B, LM head) -> decode step
  std::set<std::pair<int32_t, bool>> warmed;                   // ran once eagerly at that shape
  int64_t dense_decode_bytes = 0;
  int64_t replays = 0;
  FfnCalls sparse_calls;

  // Stage timing (set_stage_timing): an event after each stage of an eager step, never inside a
  // graph capture; mark_stage[i] is the stage that ends at events[i] (kNoStage: a step's start).
  static constexpr int kNoStage = -1;
  static constexpr size_t kMaxMarks = 4096;
  // kRopeStage ends at qkv_rope (prefill only): its time counts in rope_attention too.
  enum { kEmbedStage, kNormQkvStage, kRopeStage, kRopeAttentionStage, kOProjNormStage, kFfnStage, kLmHeadStage };
  bool stage_timing = false;
  bool capturing = false;
  std::vector<cudaEvent_t> events;
  std::vector<int> mark_stage;
  StageTimes stage_ms;

  void mark(int stage) {
    if (!stage_timing || capturing) return;
    // Fold long runs of marks (steps nobody reads) so the pool stays bounded.
    if (mark_stage.size() >= kMaxMarks && stage == kNoStage) fold_stages();
    if (mark_stage.size() == events.size()) {
      cudaEvent_t event = nullptr;
      TWELL_CUDA_CHECK(cudaEventCreate(&event));
      events.push_back(event);
    }
    TWELL_CUDA_CHECK(cudaEventRecord(events[mark_stage.size()], stream));
    mark_stage.push_back(stage);
  }

  // Adds the time between consecutive marks to the later mark's stage.
  void fold_stages() {
    TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));
    double* by_stage[] = {&stage_ms.embed, &stage_ms.norm_qkv, &stage_ms.rope, &stage_ms.rope_attention,
                          &stage_ms.o_proj_norm, &stage_ms.ffn, &stage_ms.lm_head};
    for (size_t i = 1; i < mark_stage.size(); ++i) {
      if (mark_stage[i] == kNoStage) continue;
      float ms = 0;
      TWELL_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i - 1], events[i]));
      *by_stage[mark_stage[i]] += ms;
      if (mark_stage[i] == kRopeStage) stage_ms.rope_attention += ms;
    }
    mark_stage.clear();
  }

  std::unique_ptr<SparseFfn> make_sparse() const {
    return std::make_unique<SparseFfn>(SparseFfnOptions{
        .allow_dense = options.ffn_dispatch,
        .hot_fractions = neurons_ordered && options.ffn_dispatch ? SparseFfnOptions::kSortedNeuronHotFractions
                                                                 : std::vector<double>{}});
  }

  int64_t q_dim() const { return int64_t{config.n_heads} * config.head_dim; }
  int64_t kv_dim() const { return int64_t{config.n_kv_heads} * config.head_dim; }
  int64_t qkv_width() const { return q_dim() + 2 * kv_dim(); }
  int64_t cache_layer_elements() const { return int64_t{batch} * config.n_kv_heads * cache_stride * config.head_dim; }

  void drop_graphs() {
    for (auto& [key, exec] : graphs) cudaGraphExecDestroy(exec);
    graphs.clear();
    warmed.clear();
  }

  // A captured graph holds the buffers' addresses: growing one invalidates every graph.
  template <typename T>
  void grow(DeviceBuffer<T>& buffer, int64_t count) {
    if (static_cast<size_t>(count) <= buffer.size()) return;
    drop_graphs();
    TWELL_CUDA_CHECK(cudaStreamSynchronize(stream));
    buffer.resize(static_cast<size_t>(count));
  }

  void reserve(int32_t n, bool with_lm_head, bool all_logits) {
    const int64_t rows = int64_t{batch} * n, d = config.d_model;
    grow(hidden, rows * d);
    grow(normed, rows * d);
    grow(qkv, rows * qkv_width());
    if (n > 1) grow(q, rows * q_dim());  // a decode step rotates q inside its attention kernel
    grow(attention, rows * q_dim());
    grow(ffn_out, rows * d);
    if (with_lm_head) grow(logits, (all_logits ? rows : batch) * int64_t{config.vocab_size});
  }

  bool graph_capturable(int32_t n, bool all_logits) const {
    if (n != 1 || all_logits || !options.decode_graphs) return false;
    return path == FfnPath::dense || (path == FfnPath::predict && batch <= kDecodeMaxRows);
  }

  // The layer's FFN of normed into the residual stream. Returns true when its output waits in
  // ffn_out for the caller to add (the decode FFN adds into hidden itself).
  bool ffn(int32_t layer_index, int32_t n) {
    DeviceLayer& layer = layers[layer_index];
    const int64_t rows = int64_t{batch} * n;
    if (path == FfnPath::predict && rows <= kDecodeMaxRows) {
      layer.decode->run(normed.data(), rows, predictors[layer_index], hidden.data(), stream, {.accumulate = true});
      return false;
    }
    if (path == FfnPath::dense)
      (n == 1 ? dense_decode : dense_batch)
          .run(normed.data(), rows, layer.ffn, ffn_out.data(), stream,
               GateActivation{config.activation, config.activation_threshold});
    else {
      sparse->run(normed.data(), rows, layer.ffn, ffn_out.data(), stream);
      ++(sparse->last_call_was_dense() ? sparse_calls.dense : sparse_calls.twell);
      if (const int32_t hot = sparse->last_hot_neurons(); hot > 0) {
        ++sparse_calls.split;
        sparse_calls.hot_neurons += hot;
      }
      if (sparse->last_call_measured()) ++sparse_calls.measured;
    }
    return true;
  }

  // Enqueues one step of n tokens per sequence from tokens[]; no host synchronization.
  void enqueue(int32_t n, bool with_lm_head, bool all_logits) {
    const ModelConfig& c = config;
    const int64_t rows = int64_t{batch} * n, d = c.d_model;
    const mk::AttentionShape shape{batch, n, c.n_heads, c.n_kv_heads, c.head_dim, cache_stride};
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    const float rope_theta = static_cast<float>(c.rope_theta);
    const float eps = static_cast<float>(c.rms_norm_eps);
    mark(kNoStage);
    mk::embed(tokens.data(), rows, embedding.get(), c.d_model, hidden.data(), stream);
    mark(kEmbedStage);
    // A batch-1 decode step's projections are GEMVs (the QKV one normalizes its input itself). On the
    // H200 they beat cuBLASLt at one row (QKV 1.15x, O 1.63x) but not at four (0.6-1.0x):
    // docs/perf-notes.md, lab_decode_gemv.
    const bool gemv = rows == 1 && decode_gemv_supports(1, c.d_model) &&
                      decode_gemv_supports(1, static_cast<int32_t>(q_dim()));
    bool ffn_out_pending = false;  // the previous layer's FFN output, not yet in hidden
    for (int32_t index = 0; index < c.n_layers; ++index) {
      DeviceLayer& layer = layers[index];
      bf16* k_layer = k_cache.data() + index * cache_layer_elements();
      bf16* v_layer = v_cache.data() + index * cache_layer_elements();
      if (gemv) {
        decode_gemv(1, static_cast<int32_t>(qkv_width()), c.d_model,
                    GemvInput::rms_norm(hidden.data(), layer.attn_norm.get(), eps), layer.wqkv.get(), qkv.data(),
                    GemvOutput::bf16, stream);
      } else {
        if (ffn_out_pending)
          mk::add_rms_norm(hidden.data(), ffn_out.data(), rows, c.d_model, layer.attn_norm.get(), eps, normed.data(),
                           stream);
        else
          mk::rms_norm(hidden.data(), rows, 0, 1, c.d_model, layer.attn_norm.get(), eps, normed.data(), stream);
        gemm.run(rows, qkv_width(), d, {normed.data(), d, false}, {layer.wqkv.get(), d, true}, qkv.data(),
                 qkv_width(), GemmOutput::bf16, 0.0f, stream);
      }
      mark(kNormQkvStage);
      if (n == 1) {
        mk::decode_attention_rope(qkv.data(), layer.bqkv.get(), shape, length_device.data(), rope_theta, k_layer,
                                  v_layer, scale, attention.data(), decode_attention_workspace.data(),
                                  decode_attention_workspace.size(), stream);
      } else {
        mk::qkv_rope(qkv.data(), layer.bqkv.get(), shape, length_device.data(), rope_theta, q.data(), k_layer, v_layer,
                     stream);
        mark(kRopeStage);
        if (fused_prefill_attention_supports(c.head_dim))
          fused_prefill_attention(q.data(), k_layer, v_layer, shape, length, scale, attention.data(), stream);
        else
          gemm_attention.run(gemm, q.data(), k_layer, v_layer, shape, length, scale, attention.data(), stream);
      }
      mark(kRopeAttentionStage);
      // h [rows, D] += attention [rows, H_q·Dh] · Wo^T, accumulated in fp32; then the FFN's RMSNorm
      // (at one row the GEMV's last block does it: one launch fewer per layer).
      if (gemv) {
        decode_gemv(1, c.d_model, static_cast<int32_t>(q_dim()), GemvInput::rows(attention.data()), layer.wo.get(),
                    hidden.data(), GemvOutput::f32_add, stream,
                    {layer.ffn_norm.get(), eps, normed.data(), gemv_arrivals.data()});
      } else {
        gemm.run(rows, d, q_dim(), {attention.data(), q_dim(), false}, {layer.wo.get(), q_dim(), true}, hidden.data(),
                 d, GemmOutput::f32, 1.0f, stream);
        mk::rms_norm(hidden.data(), rows, 0, 1, c.d_model, layer.ffn_norm.get(), eps, normed.data(), stream);
      }
      mark(kOProjNormStage);
      // The FFN's output joins the stream in the next layer's attention RMSNorm (one pass over the
      // fp32 stream fewer), except where that norm is the QKV GEMV's own or there is no next layer.
      ffn_out_pending = ffn(index, n);
      if (ffn_out_pending && (gemv || index + 1 == c.n_layers)) {
        mk::add_residual(hidden.data(), ffn_out.data(), rows * d, stream);
        ffn_out_pending = false;
      }
      mark(kFfnStage);
    }
    mk::advance_length(length_device.data(), n, stream);
    if (!with_lm_head) return;
    const int64_t out_rows = all_logits ? rows : batch;
    mk::rms_norm(hidden.data(), out_rows, all_logits ? 0 : n - 1, all_logits ? 1 : n, c.d_model, final_norm.get(), eps,
                 normed.data(), stream);
    const bf16* output = lm_head ? lm_head.get() : embedding.get();
    gemm.run(out_rows, c.vocab_size, d, {normed.data(), d, false}, {output, d, true}, logits.data(), c.vocab_size,
             GemmOutput::f32, 0.0f, stream);
    if (!all_logits)
      mk::argmax_tokens(logits.data(), batch, c.vocab_size, length_device.data(), tokens.data(), history.data(),
                        cache_stride, stream);
    mark(kLmHeadStage);
  }

  // One step, through a CUDA graph where possible: the first step of a shape runs eagerly (plans,
  // buffers), the second is captured, every later one replays.
  void step(int32_t n, bool with_lm_head, bool all_logits) {
    reserve(n, with_lm_head, all_logits);
    if (!graph_capturable(n, all_logits)) {
      enqueue(n, with_lm_head, all_logits);
      after_eager_step();
      return;
    }
    const std::pair<int32_t, bool> key{batch, with_lm_head};
    if (auto found = graphs.find(key); found != graphs.end()) {
      TWELL_CUDA_CHECK(cudaGraphLaunch(found->second, stream));
      ++replays;
      return;
    }
    if (!warmed.count(key)) {
      enqueue(n, with_lm_head, all_logits);
      after_eager_step();
      warmed.insert(key);
      return;
    }
    cudaGraph_t graph = nullptr;
    TWELL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    capturing = true;
    try {
      enqueue(n, with_lm_head, all_logits);
      capturing = false;
    } catch (...) {
      capturing = false;
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    TWELL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    TWELL_CUDA_CHECK(status);
    graphs.emplace(key, exec);
    TWELL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    ++replays;
  }

  void after_eager_step() {
    if (dense_decode.scratch_bytes() != dense_decode_bytes) {  // it grew: graphs may hold its old buffers
      drop_graphs();
      dense_decode_bytes = dense_decode.scratch_bytes();
    }
  }

  void require_reset() const { TWELL_REQUIRE(batch > 0, "CudaModel: call reset(batch, capacity) before running it"); }
};

namespace {

// Checked before Impl's members (cuBLASLt handles among them) would fail with a less useful message.
void require_gpu() { TWELL_REQUIRE(available(), "--device cuda: no usable CUDA device (the CUDA runtime found none)"); }

}  // namespace

CudaModel::CudaModel(const Model& host, CudaModelOptions options) : impl_((require_gpu(), std::make_unique<Impl>())) {
  Impl& m = *impl_;
  m.config = host.config();
  m.options = options;
  m.neurons_ordered = host.neurons_ordered_by_activity();
  const ModelConfig& c = m.config;
  TWELL_REQUIRE(mk::decode_attention_supports(c.head_dim),
                "CUDA runtime: head_dim must be 8, 16, 32, 64, 128 or 256, got {}", c.head_dim);
  TWELL_REQUIRE(c.n_heads % c.n_kv_heads == 0, "CUDA runtime: n_heads ({}) must be a multiple of n_kv_heads ({})",
                c.n_heads, c.n_kv_heads);
  const ModelWeights& w = host.weights();
  m.embedding = upload_bf16(w.embedding.data(), w.embedding.size());
  if (!w.lm_head.empty()) m.lm_head = upload_bf16(w.lm_head.data(), w.lm_head.size());
  m.final_norm = upload_f32(w.final_norm);
  m.layers.resize(c.n_layers);  // never resized again: DecodeLayer keeps pointers to the FFN weights
  for (int32_t i = 0; i < c.n_layers; ++i) {
    const LayerWeights& from = w.layers[i];
    DeviceLayer& to = m.layers[i];
    to.attn_norm = upload_f32(from.attn_norm);
    to.ffn_norm = upload_f32(from.ffn_norm);
    std::vector<float> stacked(from.wq);
    stacked.insert(stacked.end(), from.wk.begin(), from.wk.end());
    stacked.insert(stacked.end(), from.wv.begin(), from.wv.end());
    to.wqkv = upload_bf16(stacked.data(), stacked.size());
    if (c.qkv_bias) {
      std::vector<float> bias(from.bq);
      bias.insert(bias.end(), from.bk.begin(), from.bk.end());
      bias.insert(bias.end(), from.bv.begin(), from.bv.end());
      to.bqkv = upload_f32(bias);
    }
    to.wo = upload_bf16(from.wo.data(), from.wo.size());
    to.ffn = upload_weights(from.ffn);
    if (c.activation == FfnActivation::relu)
      to.signs = pack_sign_bits(from.ffn.relu_projection().data(), c.d_hidden, c.d_model);
  }
  TWELL_CUDA_CHECK(cudaDeviceSynchronize());
  TWELL_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  m.length_device.resize(1);
}

CudaModel::~CudaModel() {
  if (!impl_) return;
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  impl_->drop_graphs();
  for (cudaEvent_t event : impl_->events) cudaEventDestroy(event);
  impl_->sparse.reset();
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

const ModelConfig& CudaModel::config() const { return impl_->config; }
FfnPath CudaModel::ffn_path() const { return impl_->path; }
int32_t CudaModel::batch() const { return impl_->batch; }
int32_t CudaModel::length() const { return impl_->length; }
int64_t CudaModel::graph_replays() const { return impl_->replays; }

void CudaModel::set_ffn_path(FfnPath path) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  if (path != FfnPath::dense)
    TWELL_REQUIRE(c.activation == FfnActivation::relu, "--ffn {} needs a ReLU FFN; this model's activation is {}{}",
                  to_string(path), to_string(c.activation),
                  c.activation == FfnActivation::fatrelu ? " (threshold > 0: the sparse kernels implement plain relu)" : "");
  if (path != FfnPath::dense && !m.sparse) m.sparse = m.make_sparse();
  if (path == FfnPath::predict && !m.layers.empty() && !m.layers[0].decode) {
    for (DeviceLayer& layer : m.layers) layer.decode = std::make_unique<DecodeLayer>(layer.ffn, layer.signs);
    m.predictors.assign(c.n_layers, keeps_every_neuron());
  }
  m.drop_graphs();
  m.path = path;
}

void CudaModel::set_predictor(const Model& host) {
  Impl& m = *impl_;
  TWELL_REQUIRE(m.path == FfnPath::predict, "set_predictor: select the predict path first");
  const std::vector<LayerPredictor>& per_layer = host.predictor();
  TWELL_REQUIRE(host.neurons_ordered_by_activity() == m.neurons_ordered,
                "set_predictor: the host model's FFN neurons are in another order than when this model was built "
                "from it (order_neurons_by_activity in between), so its sign bits do not match these weights");
  TWELL_REQUIRE(static_cast<int32_t>(per_layer.size()) == m.config.n_layers &&
                    host.config().d_model == m.config.d_model && host.config().d_hidden == m.config.d_hidden,
                "set_predictor: the host model has {} layer settings for D = {}, H = {}; this model has {} layers, "
                "D = {}, H = {}",
                per_layer.size(), host.config().d_model, host.config().d_hidden, m.config.n_layers, m.config.d_model,
                m.config.d_hidden);
  // The graphs hold the old settings as kernel arguments, and a layer packed again frees the device
  // arrays queued work may still read.
  m.drop_graphs();
  TWELL_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.predictors.clear();
  for (int32_t l = 0; l < m.config.n_layers; ++l) {
    // The margin holds for the sign bits packed with the host's exact columns: take those bits.
    DeviceLayer& layer = m.layers[l];
    const SignBits& signs = host.relu_signs(l);
    if (layer.signs.exact_columns != signs.exact_columns) {
      layer.signs = signs;
      layer.decode = std::make_unique<DecodeLayer>(layer.ffn, layer.signs);
    }
    m.predictors.push_back(per_layer[l].config);
  }
}

void CudaModel::set_decode_graphs(bool enabled) {
  impl_->options.decode_graphs = enabled;
  impl_->drop_graphs();
}

void CudaModel::set_ffn_dispatch(bool enabled) {
  Impl& m = *impl_;
  m.options.ffn_dispatch = enabled;
  if (m.sparse) m.sparse = m.make_sparse();
}

CudaModel::FfnCalls CudaModel::sparse_ffn_calls() const { return impl_->sparse_calls; }

void CudaModel::set_stage_timing(bool enabled) {
  Impl& m = *impl_;
  if (!enabled) m.fold_stages();
  m.stage_timing = enabled;
}

CudaModel::StageTimes CudaModel::stage_times() {
  Impl& m = *impl_;
  m.fold_stages();
  return std::exchange(m.stage_ms, StageTimes{});
}

void CudaModel::reset(int32_t batch, int32_t capacity) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  TWELL_REQUIRE(batch >= 1, "batch must be >= 1, got {}", batch);
  TWELL_REQUIRE(capacity >= 1, "KV cache capacity must be >= 1, got {}", capacity);
  const int32_t stride = round_up(capacity, kGemmAttentionPositionAlign);
  if (batch != m.batch || stride != m.cache_stride) m.drop_graphs();
  m.batch = batch;
  m.capacity = capacity;
  m.cache_stride = stride;
  const int64_t cache_elements = int64_t{c.n_layers} * m.cache_layer_elements();
  m.grow(m.k_cache, cache_elements);
  m.grow(m.v_cache, cache_elements);
  m.grow(m.tokens, int64_t{batch} * capacity);
  m.grow(m.history, int64_t{batch} * stride);
  // Zeros, so the padded positions the GEMM prefill attention reads past the sequence are finite
  // (their probabilities are 0, and 0·NaN would not be).
  TWELL_CUDA_CHECK(cudaMemsetAsync(m.k_cache.data(), 0, cache_elements * sizeof(bf16), m.stream));
  TWELL_CUDA_CHECK(cudaMemsetAsync(m.v_cache.data(), 0, cache_elements * sizeof(bf16), m.stream));
  TWELL_CUDA_CHECK(cudaMemsetAsync(m.length_device.data(), 0, sizeof(int32_t), m.stream));
  const size_t attention_bytes =
      mk::decode_attention_workspace_bytes({batch, 1, c.n_heads, c.n_kv_heads, c.head_dim, stride});
  m.grow(m.decode_attention_workspace, static_cast<int64_t>(attention_bytes));
  TWELL_CUDA_CHECK(cudaMemsetAsync(m.decode_attention_workspace.data(), 0, attention_bytes, m.stream));
  m.grow(m.gemv_arrivals, 1);
  TWELL_CUDA_CHECK(cudaMemsetAsync(m.gemv_arrivals.data(), 0, sizeof(unsigned int), m.stream));
  m.length = 0;
  m.next_tokens_ready = false;
  m.replays = 0;
  m.sparse_calls = {};
}

void CudaModel::forward(const int32_t* tokens, int32_t n, float* logits, bool all_logits) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  m.require_reset();
  TWELL_REQUIRE(n >= 1, "forward: needs at least one token, got {}", n);
  TWELL_REQUIRE(m.length + n <= m.capacity, "forward: {} cached + {} new positions exceed the cache capacity {}",
                m.length, n, m.capacity);
  const int64_t rows = int64_t{m.batch} * n;
  for (int64_t i = 0; i < rows; ++i)
    TWELL_REQUIRE(tokens[i] >= 0 && tokens[i] < c.vocab_size, "forward: token {} at index {} is outside [0, {})",
                  tokens[i], i, c.vocab_size);
  TWELL_CUDA_CHECK(cudaMemcpyAsync(m.tokens.data(), tokens, rows * sizeof(int32_t), cudaMemcpyHostToDevice, m.stream));
  m.step(n, logits != nullptr, all_logits);
  m.length += n;
  m.next_tokens_ready = logits != nullptr && !all_logits;
  if (logits == nullptr) return;
  const int64_t out_rows = all_logits ? rows : m.batch;
  m.logits.download(logits, out_rows * c.vocab_size, m.stream);
}

void CudaModel::decode_greedy(int32_t steps, int32_t* tokens) {
  Impl& m = *impl_;
  m.require_reset();
  TWELL_REQUIRE(steps >= 0, "decode_greedy: steps must be >= 0, got {}", steps);
  TWELL_REQUIRE(m.next_tokens_ready, "decode_greedy: run forward() with logits (last positions) first");
  TWELL_REQUIRE(m.length + steps <= m.capacity, "decode_greedy: {} cached + {} steps exceed the cache capacity {}",
                m.length, steps, m.capacity);
  const int32_t first = m.length - 1;  // history index of the first fed token
  for (int32_t s = 0; s < steps; ++s) {
    m.step(1, true, false);
    ++m.length;
  }
  if (tokens == nullptr || steps == 0) return;
  TWELL_CUDA_CHECK(cudaMemcpy2DAsync(tokens, steps * sizeof(int32_t), m.history.data() + first,
                                     m.cache_stride * sizeof(int32_t), steps * sizeof(int32_t), m.batch,
                                     cudaMemcpyDeviceToHost, m.stream));
  synchronize();
}

void CudaModel::synchronize() { TWELL_CUDA_CHECK(cudaStreamSynchronize(impl_->stream)); }

}  // namespace twell::cuda
