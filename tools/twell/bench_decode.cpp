// `twell bench decode`: the decode FFN (M = 1..16) on the standard workload: dense, batched TwELL
// and the predictor paths (include/twell/decode.h), per FFN layer; the predictor's recall and
// precision; and its bytes against the floor (sign bits + the three rows of each truly active
// neuron) as a fraction of the measured copy bandwidth.
//
// CPU: wall clock (or with --clock thread-cpu, the thread's CPU time) around each synchronous call.
// CUDA: every impl is timed with events around one call (as `bench ffn` does), and the capturable ones (dense, predictors) also as a CUDA graph of
// kGraphCalls calls replayed (the launch gaps of a decode step that runs in a graph).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>

#include <fmt/format.h>

#include "commands.h"
#include "timing.h"
#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/cpu.h"
#include "twell/decode.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"
#if defined(TWELL_HAVE_CUDA)
#include "twell/cuda.h"
#include "twell/decode_cuda.h"
#endif

namespace twell::cli {
namespace {

struct DecodeBenchOptions {
  std::string device = "cpu";
  std::vector<int64_t> rows = {1, 4, 16};
  int32_t d_model = 2048;
  int32_t d_hidden = 5632;
  double density = 0.005;
  double recall = 0.99;        // calibration target
  int64_t calibration_rows = 512;
  int threads = 0;
  std::string isa;
  std::string clock = "wall";  // or thread-cpu (one thread)
  int input_sets = 4;
  int warmup = 5;
  int reps = 50;
  uint64_t seed = 1;
  std::string json_path;
  int exact_columns = kMaxExactColumns;  // at most, chosen on the calibration tokens
  // CUDA: copies of the layer's weights (and of its decode planes) on the device, taken in turn call
  // by call. One replays a single layer, whose working set stays in the L2 between calls when it fits
  // (a predictor's planes and rows; the streamed kernel's 23 MB of gate rows at the standard shape);
  // copies larger than the L2 together make every call find its weights in DRAM, as a model's layers
  // do. 0: enough copies for four times the L2 (weight_copies_for_dram).
  int weight_copies = 0;
  // The predictor impls' GateSelection (automatic: all gates where the backend's AllGatesRule says so); the
  // all-gates impl is timed beside them either way.
  std::string gates = "automatic";
  GateSelection gate_selection() const { return gates == "predicted" ? GateSelection::predicted : GateSelection::automatic; }
};

constexpr int kGraphCalls = 20;

// One implementation: run(input) does one FFN on inputs[input]; output() is y [M, D] of the last run.
struct Impl {
  std::string name;
  std::function<void(int)> run;
  std::function<std::vector<float>()> output;
  const PredictorConfig* predictor = nullptr;  // predictor impls only
  std::function<DecodeStats(int)> run_counting_misses;  // predictor impls: one run with count_missed
  std::function<double(int)> graph_ms_per_call;          // CUDA capturable impls: ms per call in a graph
};

double median_ms(const std::function<double()>& timed_once, int warmup, int reps, TimingStats* stats) {
  for (int i = 0; i < warmup; ++i) timed_once();
  std::vector<double> samples;
  for (int i = 0; i < reps; ++i) samples.push_back(timed_once());
  *stats = summarize_ms(samples);
  return stats->median_ms;
}

// Read + write bytes per second of a large copy (best of 5), the bandwidth a streaming kernel can hope for.
double cpu_copy_bandwidth() {
  const size_t count = size_t{64} << 20;  // 256 MiB of floats
  std::vector<float> source(count, 1.0f), target(count, 0.0f);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    double ms = wall_ms([&] {
#pragma omp parallel for num_threads(cpu::num_threads()) schedule(static)
      for (int64_t block = 0; block < 64; ++block)
        std::memcpy(target.data() + block * (count / 64), source.data() + block * (count / 64), count / 64 * 4);
    });
    best = std::min(best, ms);
  }
  return 2.0 * count * sizeof(float) / (best * 1e-3);
}

struct Facts {
  std::vector<double> y_ref;  // [M, D] float64 reference on input 0
  double nnz_per_row = 0;
  int64_t union_active = 0;   // neurons active in at least one row of input 0
};

Facts reference_facts(const Workload& work) {
  const int64_t rows = work.spec.rows;
  const int32_t hidden = work.spec.d_hidden;
  const std::vector<double> g = ref::relu_projection(work.x.data(), rows, work.weights);
  Facts facts;
  std::vector<bool> active(hidden, false);
  int64_t nnz = 0;
  for (int64_t m = 0; m < rows; ++m)
    for (int32_t j = 0; j < hidden; ++j)
      if (g[m * hidden + j] > 0) {
        ++nnz;
        active[j] = true;
      }
  facts.nnz_per_row = static_cast<double>(nnz) / rows;
  facts.union_active = std::count(active.begin(), active.end(), true);
  facts.y_ref = ref::ffn_dense(work.x.data(), rows, work.weights);
  return facts;
}

// Neurons predicted active for at least one row of x (the gate rows the predictor path reads).
int64_t union_predicted(const float* x, int64_t rows, const SignBits& signs, const PredictorConfig& config) {
  const int32_t hidden = signs.rows;
  std::vector<bool> any(hidden, false);
  if (config.kind != PredictorKind::sign_rule) {
    std::vector<float> scores(static_cast<size_t>(rows) * hidden);
    if (config.kind == PredictorKind::one_bit_gate) cpu::one_bit_gate(x, rows, signs, scores.data());
    if (config.kind == PredictorKind::normalized_one_bit_gate)
      cpu::normalized_one_bit_gate(x, rows, signs, scores.data());
    if (config.kind == PredictorKind::two_bit_gate) cpu::two_bit_gate(x, rows, signs, scores.data());
    for (size_t i = 0; i < scores.size(); ++i)
      if (scores[i] >= static_cast<float>(-config.margin)) any[i % hidden] = true;
  } else {
    std::vector<int32_t> counts(static_cast<size_t>(rows) * hidden);
    cpu::negative_sign_products(x, rows, signs, counts.data());
    const int32_t max_negatives = sign_rule_max_negatives(config.alpha, signs.cols);
    for (size_t i = 0; i < counts.size(); ++i)
      if (counts[i] <= max_negatives) any[i % hidden] = true;
  }
  return std::count(any.begin(), any.end(), true);
}

// ---- CPU impls ----

struct CpuState {
  const Workload* work;
  const std::vector<std::vector<float>>* inputs;
  const SignBits* signs;
  std::vector<float> y;
  cpu::DenseScratch dense_scratch;
  TwellMatrix packed;
  cpu::DecodeScratch decode_scratch;
};

std::vector<Impl> cpu_impls(CpuState& s, const std::vector<PredictorConfig>& predictors,
                            const DecodeBenchOptions& options) {
  const int64_t rows = s.work->spec.rows;
  s.y.assign(static_cast<size_t>(rows) * options.d_model, 0.0f);
  auto output = [&s] { return s.y; };
  std::vector<Impl> impls;
  impls.push_back({"dense",
                   [&s, rows](int i) { cpu::ffn_dense((*s.inputs)[i].data(), rows, s.work->weights, s.y.data(), s.dense_scratch); },
                   output});
  impls.push_back({"twell",
                   [&s, rows](int i) {
                     cpu::gate_to_twell((*s.inputs)[i].data(), rows, s.work->weights, 128, 4, s.packed);
                     cpu::ffn_from_twell((*s.inputs)[i].data(), s.packed, s.work->weights, s.y.data());
                   },
                   output});
  const GateSelection gates = options.gate_selection();
  for (const PredictorConfig& predictor : predictors) {
    Impl impl{"predict-" + to_string(predictor.kind),
              [&s, rows, &predictor, gates](int i) {
                cpu::decode_ffn((*s.inputs)[i].data(), rows, s.work->weights, *s.signs, predictor, s.y.data(),
                                s.decode_scratch, {.gates = gates});
              },
              output, &predictor};
    impl.run_counting_misses = [&s, rows, &predictor, gates](int i) {
      return cpu::decode_ffn((*s.inputs)[i].data(), rows, s.work->weights, *s.signs, predictor, s.y.data(),
                             s.decode_scratch, {.count_missed = true, .gates = gates});
    };
    impls.push_back(std::move(impl));
  }
  impls.push_back({"all-gates",
                   [&s, rows, &predictors](int i) {
                     cpu::decode_ffn((*s.inputs)[i].data(), rows, s.work->weights, *s.signs, predictors.front(),
                                     s.y.data(), s.decode_scratch, {.gates = GateSelection::all_neurons});
                   },
                   output});
  return impls;
}

#if defined(TWELL_HAVE_CUDA)
#define BENCH_CUDA_CHECK(expression)                                                          \
  do {                                                                                        \
    cudaError_t status_ = (expression);                                                       \
    TWELL_REQUIRE(status_ == cudaSuccess, "{} failed: {}", #expression, cudaGetErrorString(status_)); \
  } while (0)

double cuda_copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  cuda::DeviceArray<char> source = cuda::make_device_array<char>(bytes), target = cuda::make_device_array<char>(bytes);
  BENCH_CUDA_CHECK(cudaMemset(source.get(), 1, bytes));
  cudaEvent_t start, stop;
  BENCH_CUDA_CHECK(cudaEventCreate(&start));
  BENCH_CUDA_CHECK(cudaEventCreate(&stop));
  float best = 1e30f;
  for (int i = 0; i < 6; ++i) {
    BENCH_CUDA_CHECK(cudaEventRecord(start));
    BENCH_CUDA_CHECK(cudaMemcpyAsync(target.get(), source.get(), bytes, cudaMemcpyDeviceToDevice));
    BENCH_CUDA_CHECK(cudaEventRecord(stop));
    BENCH_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i > 0) best = std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 2.0 * bytes / (best * 1e-3);
}

// Milliseconds of fn() on `stream`, by events.
double event_ms(cudaStream_t stream, const std::function<void()>& fn) {
  cudaEvent_t start, stop;
  BENCH_CUDA_CHECK(cudaEventCreate(&start));
  BENCH_CUDA_CHECK(cudaEventCreate(&stop));
  BENCH_CUDA_CHECK(cudaEventRecord(start, stream));
  fn();
  BENCH_CUDA_CHECK(cudaEventRecord(stop, stream));
  BENCH_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms;
}

// ms per call of kGraphCalls calls of run(input set, stream) replayed in a graph, the sets in turn.
std::function<double(int)> graph_timer(std::function<void(int, cudaStream_t)> run, int sets, int reps) {
  return [run, sets, reps](int) {
    return cuda::time_graph([&](int call, cudaStream_t stream) { run(call % sets, stream); }, kGraphCalls, reps).median_ms;
  };
}

// --weight-copies 0: copies of the weights that together are at least four times the L2, so that no
// call finds what the previous calls left there.
int weight_copies_for_dram(int requested, const FfnWeights& weights) {
  if (requested > 0) return requested;
  const double copy_bytes = (weights.gated ? 3.0 : 2.0) * weights.d_hidden * weights.d_model * sizeof(bf16);
  return std::clamp(static_cast<int>(std::ceil(4.0 * static_cast<double>(cuda::l2_bytes()) / copy_bytes)), 1, 64);
}

struct CudaState {
  const Workload* work;
  std::vector<cuda::DeviceFfnWeights> weights;  // weight_copies_for_dram copies, taken in turn
  int next_copy = 0;
  int take_copy() {
    const int copy = next_copy;
    next_copy = (next_copy + 1) % static_cast<int>(weights.size());
    return copy;
  }
  std::vector<cuda::DeviceArray<bf16>> inputs;
  cuda::DeviceArray<bf16> y_bf16;
  cuda::DeviceArray<float> y_float;
  cuda::DenseFfn dense;
  std::unique_ptr<cuda::SparseFfn> twell;
  std::vector<std::unique_ptr<cuda::DecodeLayer>> layers;  // one per copy of the weights
  bool last_float = false;
};

std::vector<Impl> cuda_impls(CudaState& s, const std::vector<std::vector<float>>& host_inputs, const SignBits& signs,
                             const std::vector<PredictorConfig>& predictors, const DecodeBenchOptions& options) {
  const int64_t rows = s.work->spec.rows;
  const size_t count = static_cast<size_t>(rows) * options.d_model;
  s.weights.clear();
  const int copies = weight_copies_for_dram(options.weight_copies, s.work->weights);
  for (int copy = 0; copy < copies; ++copy) s.weights.push_back(cuda::upload_weights(s.work->weights));
  s.inputs.clear();
  for (const auto& x : host_inputs) s.inputs.push_back(cuda::upload_bf16(x.data(), x.size()));
  s.y_bf16 = cuda::make_device_array<bf16>(count);
  s.y_float = cuda::make_device_array<float>(count);
  s.twell = std::make_unique<cuda::SparseFfn>(cuda::SparseFfnOptions{.tile = 128, .compression = 4, .allow_dense = false});
  s.layers.clear();
  for (const cuda::DeviceFfnWeights& copy : s.weights) s.layers.push_back(std::make_unique<cuda::DecodeLayer>(copy, signs));
  auto output = [&s, count] {
    if (!s.last_float) return cuda::download_bf16(s.y_bf16.get(), count);
    std::vector<float> y(count);
    cuda::copy_to_host(y.data(), s.y_float.get(), count * sizeof(float));
    return y;
  };
  const int sets = options.input_sets, reps = options.reps;
  std::vector<Impl> impls;
  {
    auto run = [&s, rows](int i, cudaStream_t stream) {
      s.dense.run(s.inputs[i].get(), rows, s.weights[s.take_copy()], s.y_bf16.get(), stream);
    };
    Impl impl{"dense", [&s, run](int i) { s.last_float = false; run(i, nullptr); }, output};
    impl.graph_ms_per_call = graph_timer(run, sets, reps);
    impls.push_back(std::move(impl));
  }
  impls.push_back({"twell",
                   [&s, rows](int i) {
                     s.last_float = false;
                     s.twell->run(s.inputs[i].get(), rows, s.weights[s.take_copy()], s.y_bf16.get());
                   },
                   output});
  const GateSelection gates = options.gate_selection();
  for (const PredictorConfig& predictor : predictors) {
    auto run = [&s, rows, &predictor, gates](int i, cudaStream_t stream) {
      s.layers[s.take_copy()]->run(s.inputs[i].get(), rows, predictor, s.y_float.get(), stream, {.gates = gates});
    };
    Impl impl{"predict-" + to_string(predictor.kind), [&s, run](int i) { s.last_float = true; run(i, nullptr); }, output,
              &predictor};
    impl.run_counting_misses = [&s, rows, &predictor, gates](int i) {
      for (const auto& layer : s.layers) layer->stats(nullptr);  // drop the counts of the timed runs
      s.layers[0]->run(s.inputs[i].get(), rows, predictor, s.y_float.get(), nullptr,
                       {.count_missed = true, .gates = gates});
      return s.layers[0]->stats(nullptr);
    };
    impl.graph_ms_per_call = graph_timer(run, sets, reps);
    impls.push_back(std::move(impl));
  }
  // Every gate by a product then the pairs ("all-gates"), and in one kernel ("all-gates-streamed", which
  // runs the product where its blocks do not all fit on the GPU at once).
  for (AllGatesKernel kernel : {AllGatesKernel::product, AllGatesKernel::streamed}) {
    auto run = [&s, rows, &predictors, kernel](int i, cudaStream_t stream) {
      s.layers[s.take_copy()]->run(s.inputs[i].get(), rows, predictors.front(), s.y_float.get(), stream,
                                   {.gates = GateSelection::all_neurons, .all_gates_kernel = kernel});
    };
    Impl impl{kernel == AllGatesKernel::product ? "all-gates" : "all-gates-streamed",
              [&s, run](int i) { s.last_float = true; run(i, nullptr); }, output};
    impl.graph_ms_per_call = graph_timer(run, sets, reps);
    impls.push_back(std::move(impl));
  }
  return impls;
}
#endif

void run_decode_bench(const DecodeBenchOptions& options) {
  TWELL_REQUIRE(options.device == "cpu" || options.device == "cuda", "--device must be cpu or cuda, got '{}'",
                options.device);
  for (int64_t rows : options.rows)
    TWELL_REQUIRE(rows >= 1 && rows <= kDecodeMaxRows, "--m values must lie in [1, {}], got {}", kDecodeMaxRows, rows);
  TWELL_REQUIRE(options.input_sets >= 1 && options.reps >= 1 && options.warmup >= 0,
                "--inputs and --reps must be >= 1 and --warmup >= 0");
  const bool on_cuda = options.device == "cuda";
  TWELL_REQUIRE(options.clock == "wall" || (options.clock == "thread-cpu" && !on_cuda && options.threads == 1),
                "--clock must be wall, or thread-cpu with --device cpu --threads 1 (all work on one thread); got "
                "--clock {} --device {} --threads {}",
                options.clock, options.device, options.threads);
#if !defined(TWELL_HAVE_CUDA)
  TWELL_REQUIRE(!on_cuda, "--device cuda: this twell was built without CUDA");
#endif
  cpu::set_num_threads(options.threads);
  if (!options.isa.empty()) {
    bool found = false;
    for (cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512})
      if (cpu::to_string(isa) == options.isa) {
        cpu::set_isa(isa);
        found = true;
      }
    TWELL_REQUIRE(found, "--isa must be scalar, avx2 or avx512, got '{}'", options.isa);
  }

  // The weights depend on the seed, not on M: calibrate once, on sample tokens the timed runs never see.
  WorkloadSpec spec{.rows = 1, .d_model = options.d_model, .d_hidden = options.d_hidden, .density = options.density,
                    .seed = options.seed};
  const FfnWeights weights = make_workload(spec).weights;
  const std::vector<float> samples = make_activations(options.calibration_rows, options.d_model, options.seed + 7777);
  const SignBits signs =
      pack_sign_bits_for_samples(samples.data(), options.calibration_rows, weights, options.exact_columns);
  std::vector<PredictorConfig> predictors;
  fmt::print("twell bench decode: {} D={} H={} density={} ({} calibration tokens, target recall {}, exact columns "
             "[{}])\n",
             options.device, options.d_model, options.d_hidden, options.density, options.calibration_rows,
             options.recall, fmt::join(signs.exact_columns, ", "));
  for (PredictorKind kind : {PredictorKind::one_bit_gate, PredictorKind::sign_rule,
                             PredictorKind::normalized_one_bit_gate, PredictorKind::two_bit_gate}) {
    Calibration c = calibrate_predictor(samples.data(), options.calibration_rows, weights, signs, kind, options.recall);
    fmt::print("  calibrated {:<8} alpha={:.6g} margin={:.6g}: recall {:.4f}, predicted {:.2f}% of neurons = {:.1f}x the active set\n",
               to_string(kind), c.config.alpha, c.config.margin, c.quality.recall(), 100 * c.quality.predicted_fraction(),
               c.quality.predicted_over_active());
    predictors.push_back(c.config);
  }

  const double element_bytes = on_cuda ? 2.0 : 4.0;  // bf16 weights on the GPU, fp32 on the CPU
  std::string model;
  double copy_bandwidth = 0;
#if defined(TWELL_HAVE_CUDA)
  if (on_cuda) {
    TWELL_REQUIRE(cuda::available(), "--device cuda: no CUDA device is available");
    model = cuda::device_name();
    copy_bandwidth = cuda_copy_bandwidth();
  }
#endif
  if (!on_cuda) {
    model = cpu_model_name();
    copy_bandwidth = cpu_copy_bandwidth();
  }
  fmt::print("  {} ({}), copy bandwidth {:.1f} GB/s (read + write)\n", model,
             on_cuda ? "bf16 weights" : fmt::format("fp32 weights, {} threads, {}, {} clock", cpu::num_threads(),
                                                    cpu::to_string(cpu::active_isa()), options.clock),
             copy_bandwidth * 1e-9);
  fmt::print("{:>3} {:>20} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>10} {:>9}\n", "M", "impl", "median us",
             on_cuda ? "graph us" : "p90 us", "speedup", "rel_err", "recall", "precis.", "pred/tok", "floor bw");

  const int64_t sign_bytes = static_cast<int64_t>(signs.bits.size()) * 4 +
                             static_cast<int64_t>(signs.scale.size() + signs.exact_weights.size()) * 4;
  std::vector<BenchRecord> records;
  for (int64_t rows : options.rows) {
    spec.rows = rows;
    const Workload work = make_workload(spec);
    const std::vector<std::vector<float>> inputs = rotated_inputs(work, options.input_sets);
    const Facts facts = reference_facts(work);
    const int matrices = work.weights.gated ? 3 : 2;
    const double floor_bytes = sign_bytes + static_cast<double>(facts.union_active) * matrices * options.d_model * element_bytes;

    CpuState cpu_state{&work, &inputs, &signs};
    std::vector<Impl> impls;
#if defined(TWELL_HAVE_CUDA)
    // Only on the GPU: its dense FFN opens a cuBLASLt handle, which fails where there is no GPU.
    std::unique_ptr<CudaState> cuda_state;
    if (on_cuda) {
      cuda_state = std::make_unique<CudaState>(&work);
      impls = cuda_impls(*cuda_state, inputs, signs, predictors, options);
    }
#endif
    if (!on_cuda) impls = cpu_impls(cpu_state, predictors, options);

    double dense_ms = 0, dense_graph_ms = 0;
    for (Impl& impl : impls) {
      TimingStats timing;
      int next = 0;
      median_ms(
          [&] {
            const int input = next++ % options.input_sets;
#if defined(TWELL_HAVE_CUDA)
            if (on_cuda) return event_ms(nullptr, [&] { impl.run(input); });
#endif
            if (options.clock == "thread-cpu") return thread_cpu_ms([&] { impl.run(input); });
            return wall_ms([&] { impl.run(input); });
          },
          options.warmup, options.reps, &timing);
      double graph_ms = 0.0;
      if (impl.graph_ms_per_call) {
        try {
          graph_ms = impl.graph_ms_per_call(0);
        } catch (const Error& error) {  // not capturable: report the event timing only
          fmt::print("  {}: no graph timing ({})\n", impl.name, error.what());
#if defined(TWELL_HAVE_CUDA)
          cudaGetLastError();
#endif
        }
      }
      impl.run(0);
      const std::vector<float> y = impl.output();

      BenchRecord record = new_bench_record("decode", options.device, model, impl.name, rows, options.d_model,
                                            options.d_hidden, options.density);
      record.nnz_per_row = facts.nnz_per_row;
      record.timing = timing;
      record.rel_err = relative_l2_error(y.data(), facts.y_ref.data(), y.size());
      if (impl.name == "dense") {
        dense_ms = timing.median_ms;
        dense_graph_ms = graph_ms;
      }
      const double speedup = dense_ms / timing.median_ms;
      record.extra = {{"speedup_vs_dense", speedup}, {"union_active_neurons", facts.union_active},
                      {"floor_bytes", floor_bytes}, {"copy_bandwidth_gb_per_s", copy_bandwidth * 1e-9},
                      {"floor_fraction_of_copy_bandwidth", floor_bytes / copy_bandwidth / (timing.median_ms * 1e-3)},
                      {"input_sets", options.input_sets}};
#if defined(TWELL_HAVE_CUDA)
      if (on_cuda) record.extra["weight_copies"] = static_cast<int>(cuda_state->weights.size());
#endif
      if (graph_ms > 0) {
        record.extra["graph_ms_per_call"] = graph_ms;
        if (dense_graph_ms > 0) record.extra["graph_speedup_vs_dense"] = dense_graph_ms / graph_ms;
        record.extra["graph_floor_fraction_of_copy_bandwidth"] = floor_bytes / copy_bandwidth / (graph_ms * 1e-3);
      }
      if (!on_cuda) {
        record.extra["threads"] = cpu::num_threads();
        record.extra["clock"] = options.clock;
        record.extra["isa"] = cpu::to_string(cpu::active_isa());
      }
      double recall = 1, precision = 1, predicted_per_token = 0;
      if (impl.predictor != nullptr) {
        DecodeStats total{0, 0, 0};
        int64_t union_pred = 0;
        for (int i = 0; i < options.input_sets; ++i) {
          DecodeStats stats = impl.run_counting_misses(i);
          total.predicted += stats.predicted;
          total.active += stats.active;
          total.missed += stats.missed;
          union_pred += union_predicted(inputs[i].data(), rows, signs, *impl.predictor);
        }
        recall = total.active + total.missed == 0 ? 1.0 : static_cast<double>(total.active) / (total.active + total.missed);
        precision = total.predicted == 0 ? 1.0 : static_cast<double>(total.active) / total.predicted;
        predicted_per_token = static_cast<double>(total.predicted) / (options.input_sets * rows);
        const double read_bytes = sign_bytes + (static_cast<double>(union_pred) / options.input_sets) * options.d_model *
                                                   element_bytes +
                                  static_cast<double>(total.active) / options.input_sets * (matrices - 1) *
                                      options.d_model * element_bytes;
        record.extra["predictor"] = to_string(impl.predictor->kind);
        record.extra["gates"] =
            computes_all_gates({.gates = options.gate_selection()}, *impl.predictor, rows,
                               on_cuda ? kCudaAllGates : kCpuAllGates) ? "all" : "predicted";
        record.extra["alpha"] = impl.predictor->alpha;
        record.extra["margin"] = impl.predictor->margin;
        record.extra["exact_columns"] = signs.exact_columns;
        record.extra["recall"] = recall;
        record.extra["precision"] = precision;
        record.extra["predicted_per_token"] = predicted_per_token;
        record.extra["active_per_token"] = static_cast<double>(total.active + total.missed) / (options.input_sets * rows);
        record.extra["estimated_bytes_read"] = read_bytes;
        record.extra["achieved_gb_per_s"] = read_bytes / (timing.median_ms * 1e-3) * 1e-9;
      }
      fmt::print("{:>3} {:>20} {:>10.1f} {:>10.1f} {:>8.2f}x {:>9.2e} {:>8.4f} {:>8.4f} {:>10.1f} {:>8.1f}%\n", rows,
                 impl.name, timing.median_ms * 1e3, on_cuda ? graph_ms * 1e3 : timing.p90_ms * 1e3, speedup,
                 record.rel_err, recall, precision, predicted_per_token,
                 100 * floor_bytes / copy_bandwidth / (timing.median_ms * 1e-3));
      if (graph_ms > 0 && impl.name != "dense")
        fmt::print("{:>3} {:>20} graph: {:.2f}x dense graph\n", "", "", dense_graph_ms / graph_ms);
      std::fflush(stdout);
      records.push_back(std::move(record));
    }
  }
  if (!options.json_path.empty()) {
    write_bench_json(options.json_path, records);
    fmt::print("wrote {} records to {}\n", records.size(), options.json_path);
  }
}

}  // namespace

void add_bench_decode(CLI::App& bench) {
  auto options = std::make_shared<DecodeBenchOptions>();
  CLI::App* command = bench.add_subcommand("decode", "decode FFN (M <= 16): dense, TwELL and the sign-bit predictors");
  command->add_option("--device", options->device, "cpu or cuda")->capture_default_str();
  command->add_option("--m", options->rows, "tokens per step, comma-separated (1..16)")->delimiter(',')->capture_default_str();
  command->add_option("--d", options->d_model, "model width D")->capture_default_str();
  command->add_option("--h", options->d_hidden, "FFN hidden width H")->capture_default_str();
  command->add_option("--density", options->density, "target density of the relu projection")->capture_default_str();
  command->add_option("--recall", options->recall, "calibration target recall")->capture_default_str();
  command->add_option("--calibration-rows", options->calibration_rows, "sample tokens for calibration")->capture_default_str();
  command->add_option("--threads", options->threads, "CPU threads, 0 = all cores")->capture_default_str();
  command->add_option("--isa", options->isa, "CPU kernels: scalar, avx2 or avx512 (default: the best)");
  command->add_option("--clock", options->clock,
                      "CPU timing: wall, or thread-cpu (needs --threads 1; robust on a shared machine)")
      ->capture_default_str();
  command->add_option("--inputs", options->input_sets, "activation sets rotated between reps")->capture_default_str();
  command->add_option("--warmup", options->warmup, "untimed runs per impl")->capture_default_str();
  command->add_option("--reps", options->reps, "timed runs per impl")->capture_default_str();
  command->add_option("--seed", options->seed, "workload seed")->capture_default_str();
  command->add_option("--json", options->json_path, "write the records (bench_record.h schema) to this file");
  command->add_option("--exact-columns", options->exact_columns,
                      "at most this many exact columns of the relu projection, chosen on the calibration tokens (0 = "
                      "none)")
      ->capture_default_str()
      ->check(CLI::Range(0, kMaxExactColumns));
  command->add_option("--weight-copies", options->weight_copies,
                      "CUDA: copies of the weights taken in turn call by call; 0 = enough for four times the L2, so "
                      "that every call finds its weights in DRAM, as a model's layers do (1: one layer replayed, "
                      "its working set left in the L2)")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  command->add_option("--gates", options->gates,
                      "the predictor impls' gates: automatic (every gate where the backend's AllGatesRule finds it "
                      "faster: by M, or by how much of H the predicted neurons of the M tokens cover) or predicted "
                      "(always the predictor's)")
      ->capture_default_str()
      ->check(CLI::IsMember({"automatic", "predicted"}));
  command->callback([options] { run_decode_bench(*options); });
}

}  // namespace twell::cli
