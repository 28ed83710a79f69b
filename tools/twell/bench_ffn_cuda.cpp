// `twell bench ffn --device cuda`: the CUDA implementations the driver (bench_ffn.cpp) times.
//   dense       cuBLASLt bf16 GEMMs (cuda::DenseFfn), the baseline of every ratio
//   dense_fused cuda::DenseFfn as SparseFfn's dense path and split parts run it (twell_options()): the
//               relu gate in the up GEMM's epilogue from kFusedGateMinRows rows on, gate and up in one
//               batched cuBLASLt launch below
//   twell       gate GEMM -> TwELL, then the fused up+down kernel (always sparse); its record also
//               gives each kernel's median time alone (extra gate_ms, ffn_from_twell_ms)
//   twell_split cuda::SparseFfn without its all-dense path: TwELL, or the neurons most often active
//               (a fraction of H in SparseFfnOptions::kSortedNeuronHotFractions) through cuBLASLt
//               and the rest through TwELL, the fastest per call; on weights sorted by activity on calibration rows apart from the
//               timed ones (extra: hot_neurons of the path taken)
//   twell_auto  cuda::SparseFfn: TwELL, a split, or dense per call (its rule in include/twell/cuda.h),
//               on the sorted weights (extra: hot_neurons, dense; both dispatching ones also
//               dispatch_ms, the times per path their dispatch chose from)
// The two dispatching ones get a new dispatch for each (M, density) cell and first run untimed until
// it has timed its paths (extra settle_calls; measured_calls: how many warm-up and timed calls were
// still its measurements).
// Each run is timed with CUDA events around the call on the default stream, after cuda::L2Evictor has
// emptied the L2 (the driver interleaves the implementations: else one would find the weights the
// previous one left there).
#if defined(TWELL_HAVE_CUDA)

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bench_ffn.h"
#include "twell/bench_record.h"
#include "twell/cuda.h"
#include "twell/error.h"

namespace twell::cli {
namespace {

class EventTimer {
 public:
  EventTimer() {
    TWELL_REQUIRE(cudaEventCreate(&start_) == cudaSuccess && cudaEventCreate(&stop_) == cudaSuccess,
                  "cudaEventCreate failed");
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  template <typename Fn>
  double time_ms(Fn&& fn) {
    evictor_.run();
    cudaEventRecord(start_);
    fn();
    cudaEventRecord(stop_);
    const cudaError_t status = cudaEventSynchronize(stop_);
    TWELL_REQUIRE(status == cudaSuccess, "CUDA error during a timed FFN: {}", cudaGetErrorString(status));
    float ms = 0;
    cudaEventElapsedTime(&ms, start_, stop_);
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  cuda::L2Evictor evictor_;
};

// Device copies of the workload: weights, the rotated inputs, y.
class CudaImpl : public FfnBenchImpl {
 public:
  void prepare(const Workload& work, const std::vector<std::vector<float>>& inputs) override {
    rows_ = work.spec.rows;
    weights_ = cuda::upload_weights(sorts_neurons() ? sorted_by_activity(work.weights, work.spec.seed + 4242) : work.weights);
    inputs_.clear();
    for (const std::vector<float>& x : inputs) inputs_.push_back(cuda::upload_bf16(x.data(), x.size()));
    y_count_ = static_cast<size_t>(rows_) * work.spec.d_model;
    y_ = cuda::make_device_array<bf16>(y_count_);
  }
  double run_ms(int input) override { return timer_.time_ms([&] { run(inputs_.at(input).get()); }); }
  // Median ms of `reps` calls of fn(input set), rotating the input sets.
  template <typename Fn>
  double median_ms(int reps, Fn&& fn) {
    std::vector<double> samples;
    for (int i = 0; i < reps; ++i) {
      const bf16* x = inputs_[i % inputs_.size()].get();
      samples.push_back(timer_.time_ms([&] { fn(x); }));
    }
    return summarize_ms(samples).median_ms;
  }
  std::vector<float> output() override { return cuda::download_bf16(y_.get(), y_count_); }

 protected:
  virtual void run(const bf16* x) = 0;
  virtual bool sorts_neurons() const { return false; }
  int64_t rows_ = 0;
  cuda::DeviceFfnWeights weights_;
  std::vector<cuda::DeviceArray<bf16>> inputs_;
  cuda::DeviceArray<bf16> y_;
  size_t y_count_ = 0;
  EventTimer timer_;
};

class CudaDense : public CudaImpl {
 public:
  explicit CudaDense(bool fuse_gate)
      : dense_(fuse_gate ? cuda::DenseFfn::twell_options() : cuda::DenseFfnOptions{}), fuse_gate_(fuse_gate) {}
  std::string name() const override { return fuse_gate_ ? "dense_fused" : "dense"; }
  int64_t peak_bytes() const override { return dense_.scratch_bytes(); }

 private:
  void run(const bf16* x) override { dense_.run(x, rows_, weights_, y_.get()); }
  cuda::DenseFfn dense_;
  bool fuse_gate_;
};

class CudaTwell : public CudaImpl {
 public:
  enum class Kind { twell, split, automatic };
  static constexpr Kind kKinds[] = {Kind::twell, Kind::split, Kind::automatic};
  static std::string name_of(Kind kind) {
    switch (kind) {
      case Kind::twell: return "twell";
      case Kind::split: return "twell_split";
      case Kind::automatic: return "twell_auto";
    }
    return "";
  }
  CudaTwell(const FfnBenchOptions& options, Kind kind)
      : ffn_options_{.tile = options.tile,
                     .compression = options.compression,
                     .allow_dense = kind == Kind::automatic,
                     .hot_fractions = kind == Kind::twell ? std::vector<double>{}
                                      : options.hot_fractions.empty()
                                          ? cuda::SparseFfnOptions::kSortedNeuronHotFractions
                                          : options.hot_fractions,
                     .split_side_stream = options.split_side_stream},
        kind_(kind) {}
  std::string name() const override { return name_of(kind_); }
  // A dispatch of its own per (M, density) cell: what a caller with that workload gets, whatever
  // cells ran before (one dispatch over the grid ran dense at 0.5% after 10%, docs/perf-notes.md).
  void prepare(const Workload& work, const std::vector<std::vector<float>>& inputs) override {
    ffn_.reset();
    CudaImpl::prepare(work, inputs);
    ffn_ = std::make_unique<cuda::SparseFfn>(ffn_options_);
  }
  int64_t peak_bytes() const override { return ffn_->scratch_bytes(); }
  double run_ms(int input) override {
    const double ms = CudaImpl::run_ms(input);
    measured_calls_ += ffn_->last_call_measured() ? 1 : 0;
    return ms;
  }
  // The dispatch times its paths per (M, density) bucket, and the rotated inputs may fall in more
  // than one density bucket: calls until 2 rounds of the input sets run without a measurement.
  int settle(int input_sets) override {
    measured_calls_ = 0;
    if (kind_ == Kind::twell) return 0;
    constexpr int kMaxCalls = 200;
    int calls = 0;
    for (int quiet = 0; quiet < 2 * input_sets && calls < kMaxCalls; ++calls) {
      run(inputs_[static_cast<size_t>(calls % input_sets)].get());
      quiet = ffn_->last_call_measured() ? 0 : quiet + 1;
    }
    TWELL_REQUIRE(cudaDeviceSynchronize() == cudaSuccess, "CUDA error while the dispatch settled");
    return calls;
  }
  // twell: the two kernels of the TwELL path alone. The up+down kernel reads the packing of the input
  // it is given, so each of its calls follows an untimed packing of the same input. The others: the
  // path the last call took.
  nlohmann::json extra_measurements(int reps) override {
    if (kind_ != Kind::twell) {
      nlohmann::json dispatch_ms = nlohmann::json::object();
      for (const auto& [path, ms] : ffn_->last_bucket_times()) dispatch_ms[path] = ms;
      return {{"hot_neurons", ffn_->last_hot_neurons()},
              {"dense", ffn_->last_call_was_dense()},
              {"split_side_stream", ffn_options_.split_side_stream},
              {"measured_calls", measured_calls_},
              {"dispatch_ms", dispatch_ms}};
    }
    cuda::DeviceTwell packed;
    const int32_t tile = ffn_->packed().shape.tile, compression = ffn_->packed().shape.compression;
    cuda::gate_to_twell_complete(inputs_[0].get(), rows_, weights_, tile, compression, packed);
    const double gate_ms =
        median_ms(reps, [&](const bf16* x) { cuda::gate_to_twell(x, rows_, weights_, tile, compression, packed); });
    std::vector<double> samples;
    for (int i = 0; i < reps; ++i) {
      const bf16* x = inputs_[i % inputs_.size()].get();
      cuda::gate_to_twell(x, rows_, weights_, tile, compression, packed);
      samples.push_back(timer_.time_ms([&] { cuda::ffn_from_twell(x, packed, weights_, y_.get()); }));
    }
    return {{"gate_ms", gate_ms}, {"ffn_from_twell_ms", summarize_ms(samples).median_ms}};
  }

 private:
  void run(const bf16* x) override { ffn_->run(x, rows_, weights_, y_.get()); }
  bool sorts_neurons() const override { return kind_ != Kind::twell; }
  cuda::SparseFfnOptions ffn_options_;
  std::unique_ptr<cuda::SparseFfn> ffn_;  // made by prepare, per cell
  int measured_calls_ = 0;  // warm-up and timed calls that were the dispatch's measurements
  Kind kind_;
};

}  // namespace

FfnBenchDevice make_cuda_ffn_bench(const FfnBenchOptions& options) {
  TWELL_REQUIRE(cuda::available(), "--device cuda: no CUDA device is available");
  FfnBenchDevice device;
  device.model = cuda::device_name();
  device.impls.push_back(std::make_unique<CudaDense>(/*fuse_gate=*/false));
  std::vector<std::unique_ptr<FfnBenchImpl>> others;
  others.push_back(std::make_unique<CudaDense>(/*fuse_gate=*/true));
  for (CudaTwell::Kind kind : CudaTwell::kKinds) others.push_back(std::make_unique<CudaTwell>(options, kind));
  for (const std::string& name : options.impls)
    TWELL_REQUIRE(std::any_of(others.begin(), others.end(), [&](const auto& impl) { return impl->name() == name; }),
                  "--impl: unknown implementation '{}' (dense_fused, twell, twell_split or twell_auto)", name);
  for (auto& impl : others) {
    const std::string name = impl->name();
    if (options.impls.empty() || std::find(options.impls.begin(), options.impls.end(), name) != options.impls.end())
      device.impls.push_back(std::move(impl));
  }
  return device;
}

}  // namespace twell::cli

#endif  // TWELL_HAVE_CUDA
