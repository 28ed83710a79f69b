// The model runtime on the GPU (sm_90a): the forward pass of twell/model.h with bf16 weights and
// activations, fp32 accumulation and an fp32 residual stream, for B sequences decoded in lockstep.
//
//   h = embed[token]                                   (fp32 [B·n, D])
//   per layer:  x = rms(h) -> one QKV GEMM (+bias) -> RoPE -> K, V into the device cache
//               attention: n > 1 (prefill): one fused flash-style kernel (head dims 16, 32, 64, 128;
//                          others: batched cuBLASLt Q·K^T, causal softmax, P·V);
//                          n = 1 (decode): one kernel over the cache
//               h += O-proj GEMM (accumulated into h in fp32)
//               x = rms(h) -> FFN (--ffn dense: cuda::DenseFfn; twell: cuda::SparseFfn; predict:
//               cuda::DecodeLayer for steps of <= 16 rows, SparseFfn otherwise) -> h += y
//   logits = lm_head(rms(h)) (fp32), greedy next token by argmax on the device
//
// A decode step (n = 1) of the dense or predict path can be captured in a CUDA graph, one per
// batch size: the step reads its position and its tokens from device memory, so the graph is
// replayed for every later step. Calibration of the predictor runs on the host Model
// (Model::calibrate_predictor); its per-layer settings and sign bits are handed over with set_predictor.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "twell/model.h"

namespace twell::cuda {

struct CudaModelOptions {
  bool decode_graphs = true;  // capture decode steps (n = 1) in CUDA graphs where the FFN path allows
  // twell path: SparseFfn may run dense (or, on ordered neurons, a split) where that is faster;
  // false: always plain TwELL.
  bool ffn_dispatch = true;
};

class CudaModel {
 public:
  // Uploads the weights of `host` as bf16 (norms and biases fp32). Synchronous. Throws a
  // twell::Error without a GPU, or when a shape is one the kernels do not take (named). When the
  // host's neurons are ordered by activity (Model::order_neurons_by_activity), the twell path's
  // SparseFfn also times split paths (SparseFfnOptions::kSortedNeuronHotFractions).
  explicit CudaModel(const Model& host, CudaModelOptions options = {});
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const;
  // Same refusals as Model::set_ffn_path; the predict path starts exact (nothing predicted zero).
  void set_ffn_path(FfnPath path);
  FfnPath ffn_path() const;
  // The host model's per-layer predictor settings (Model::predictor) with the sign bits it packed
  // for them (Model::relu_signs, so its exact columns too). `host` is the Model this one was built
  // from, on its predict path.
  void set_predictor(const Model& host);
  void set_decode_graphs(bool enabled);
  // twell path: let SparseFfn run dense or a split where that is faster (true), or always plain TwELL (false).
  void set_ffn_dispatch(bool enabled);
  // FFN calls of the twell path (and of predict steps over 16 rows) since reset(), by what they ran:
  // TwELL (split among them: its hot neurons densely beside it) or dense; measured: how many were
  // SparseFfn's own timing runs rather than its choice (a benchmark warms up until none are);
  // hot_neurons: the splits' dense neurons, summed over the split calls.
  struct FfnCalls {
    int64_t twell = 0, dense = 0, split = 0, measured = 0, hot_neurons = 0;
  };
  FfnCalls sparse_ffn_calls() const;
  // GPU time per stage of the steps that run eagerly (a prefill; decode steps outside a graph) while
  // enabled: CUDA events between the stages on the model's stream, summed by stage. The FFN's
  // residual add counts in the next layer's norm_qkv where it is fused into that norm; a split's
  // side stream is joined before the FFN stage ends; rope is the part of rope_attention that
  // qkv_rope takes (prefill: a decode step's RoPE runs inside its attention kernel). For where a
  // forward's time goes (bench model); events between every stage cost a little, so timed runs
  // leave it off.
  struct StageTimes {
    double embed = 0, norm_qkv = 0, rope = 0, rope_attention = 0, o_proj_norm = 0, ffn = 0, lm_head = 0;  // ms
  };
  void set_stage_timing(bool enabled);
  // The sums since stage timing was enabled or the last call (synchronizes the model's stream).
  StageTimes stage_times();

  // Empties the KV cache and shapes it for `batch` sequences of up to `capacity` positions each.
  void reset(int32_t batch, int32_t capacity);
  int32_t batch() const;
  int32_t length() const;  // positions cached per sequence

  // Runs tokens [B, n] (sequence b's n tokens at b·n) at positions length() .. of every sequence.
  // logits (host): [B, V] for each sequence's last token, [B, n, V] when all_logits, none when null
  // (no LM head: the benchmarks' "forward"). Synchronous when logits is given.
  void forward(const int32_t* tokens, int32_t n, float* logits, bool all_logits = false);
  // `steps` greedy decode steps with no host round trip: each step feeds every sequence the argmax
  // of its previous logits (the first step: of the last forward() or decode call). tokens (host,
  // optional): [B, steps], the token each step fed. Asynchronous unless tokens is given.
  void decode_greedy(int32_t steps, int32_t* tokens = nullptr);
  // Waits for the GPU work of the model's stream.
  void synchronize();
  // Decode steps replayed from a captured graph since reset() (for tests and benchmarks).
  int64_t graph_replays() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Energy of the GPU this process uses, from NVML's total-energy counter (nvmlDeviceGetTotalEnergyConsumption,
// millijoules since the driver loaded). libnvidia-ml.so.1 is opened with dlopen, so programs run
// where it is absent; then available() is false and joules() returns NaN.
class EnergyCounter {
 public:
  EnergyCounter();
  ~EnergyCounter();
  EnergyCounter(const EnergyCounter&) = delete;
  EnergyCounter& operator=(const EnergyCounter&) = delete;
  bool available() const;
  double joules() const;  // counter value now
  const std::string& why_unavailable() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace twell::cuda
