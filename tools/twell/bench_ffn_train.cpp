// `twell bench ffn-train --device cuda`: one training step of the gated FFN (forward + backward)
// on the GPU: the sparse path (TwELL gate kernel -> hybrid -> sparse products), the dense cuBLASLt
// path, the automatic dispatch (the op's timed choice among dense, sparse and splits, after the
// steps it takes to choose) and the split steps (FfnTrainOptions::hot_fraction: the most often
// active neurons dense, the rest sparse); auto and split run on the weights sorted by activity on
// calibration rows apart from the timed ones. Timed in the same run on the standard workload. Reports the
// speed-up over dense, the memory each holds, and the relative errors of y, dx and the three
// weight gradients against the float64 reference on sampled rows (y, dx) and neurons (weights).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "commands.h"
#include "twell/bench_record.h"
#include "twell/convert.h"
#include "twell/error.h"
#include "twell/reference.h"
#include "twell/workload.h"
#if defined(TWELL_HAVE_CUDA)
#include "twell/cuda.h"
#include "twell/train.h"
#endif

namespace twell::cli {
namespace {

constexpr int kMaxDispatchSteps = 100;

struct TrainBenchOptions {
  std::string device = "cuda";
  std::vector<int64_t> rows = {16384, 65536};
  int32_t d_model = 2048;
  int32_t d_hidden = 5632;
  std::vector<double> densities = {0.005, 0.02, 0.1};
  std::vector<std::string> impls = {"dense", "sparse", "auto", "split"};
  std::vector<double> hot_fractions = {0.25, 0.375, 0.5};  // split: one run each
  bool split_side_stream = true;                          // FfnTrainOptions::split_side_stream
  double l1_coeff = 0.01;
  int warmup = 3;
  int reps = 10;
  int check_rows = 16;
  int check_neurons = 8;
  std::string json;
};

// The float64 reference on samples. Rows of y and dx depend only on their own row of x and dy;
// a weight gradient row depends only on its own neuron's three weight rows. So both are exact
// reference values computed on a slice of the problem (the L1 coefficient rescaled to keep coeff/M).
struct SampledReference {
  std::vector<int64_t> rows;     // [R]
  std::vector<int32_t> neurons;  // [J]
  std::vector<double> y, dx;     // [R, D]
  std::vector<double> d_gate, d_up, d_down;  // [J, D]
};

SampledReference sampled_reference(const std::vector<float>& x, const std::vector<float>& dy, int64_t m,
                                   const FfnWeights& weights, double l1_coeff, int check_rows, int check_neurons) {
  const int32_t d = weights.d_model, h = weights.d_hidden;
  SampledReference out;
  const int64_t r_count = std::min<int64_t>(check_rows, m);
  for (int64_t i = 0; i < r_count; ++i) out.rows.push_back(i * m / r_count);
  const int32_t j_count = std::min(check_neurons, h);
  for (int32_t i = 0; i < j_count; ++i) out.neurons.push_back(static_cast<int32_t>((int64_t{i} * h / j_count + 7) % h));

  std::vector<float> x_rows, dy_rows;  // [R, D]
  for (int64_t r : out.rows) {
    x_rows.insert(x_rows.end(), x.begin() + r * d, x.begin() + (r + 1) * d);
    dy_rows.insert(dy_rows.end(), dy.begin() + r * d, dy.begin() + (r + 1) * d);
  }
  const double row_l1 = l1_coeff * static_cast<double>(r_count) / static_cast<double>(m);
  const HybridMatrix row_gate = hybrid_from_twell(ref::gate_to_twell(x_rows.data(), r_count, weights, 128, 4), 1);
  out.y = ref::hybrid_ffn_forward(x_rows.data(), row_gate, weights, row_l1).y;
  out.dx = ref::hybrid_ffn_backward(x_rows.data(), row_gate, weights, dy_rows.data(), row_l1).dx;

  FfnWeights slice;
  slice.d_model = d;
  slice.d_hidden = j_count;
  slice.gated = true;
  for (int32_t j : out.neurons) {
    const auto row = [&](const std::vector<float>& w) { return w.begin() + int64_t{j} * d; };
    slice.gate.insert(slice.gate.end(), row(weights.gate), row(weights.gate) + d);
    slice.up.insert(slice.up.end(), row(weights.up), row(weights.up) + d);
    slice.down.insert(slice.down.end(), row(weights.down), row(weights.down) + d);
  }
  const HybridMatrix neuron_gate = hybrid_from_twell(ref::gate_to_twell(x.data(), m, slice, 128, 4), 1);
  ref::FfnGrads grads = ref::hybrid_ffn_backward(x.data(), neuron_gate, slice, dy.data(), l1_coeff);
  out.d_gate = std::move(grads.d_gate);
  out.d_up = std::move(grads.d_up);
  out.d_down = std::move(grads.d_down);
  return out;
}

void validate_options(const TrainBenchOptions& o) {
  TWELL_REQUIRE(o.device == "cuda", "bench ffn-train runs on --device cuda only, got '{}'", o.device);
  TWELL_REQUIRE(!o.rows.empty() && !o.densities.empty() && !o.impls.empty(), "--m, --density and --impl need values");
  for (int64_t rows : o.rows) TWELL_REQUIRE(rows >= 1, "--m values must be >= 1, got {}", rows);
  for (double density : o.densities)
    TWELL_REQUIRE(density >= 0 && density <= 1, "--density values must lie in [0, 1], got {}", density);
  for (const std::string& impl : o.impls)
    TWELL_REQUIRE(impl == "dense" || impl == "sparse" || impl == "auto" || impl == "split",
                  "--impl must be dense, sparse, auto or split, got '{}'", impl);
  TWELL_REQUIRE(!o.hot_fractions.empty(), "--hot-fraction needs values");
  for (double f : o.hot_fractions) TWELL_REQUIRE(f > 0 && f < 1, "--hot-fraction values must lie in (0, 1), got {}", f);
  TWELL_REQUIRE(o.d_model >= 64 && o.d_model % 64 == 0, "--d must be a positive multiple of 64, got {}", o.d_model);
  TWELL_REQUIRE(o.d_hidden >= 1, "--h must be >= 1, got {}", o.d_hidden);
  TWELL_REQUIRE(o.l1_coeff >= 0, "--l1 must be >= 0, got {}", o.l1_coeff);
  TWELL_REQUIRE(o.warmup >= 1 && o.reps >= 1, "--warmup and --reps must be >= 1, got {} and {}", o.warmup, o.reps);
  TWELL_REQUIRE(o.check_rows >= 1 && o.check_neurons >= 1, "--check-rows and --check-neurons must be >= 1");
}

#if defined(TWELL_HAVE_CUDA)

struct Errors {
  double y = 0, dx = 0, d_gate = 0, d_up = 0, d_down = 0;
  double worst() const { return std::max({y, dx, d_gate, d_up, d_down}); }
};

// The device outputs at the sampled rows and neurons against the reference.
Errors sampled_errors(const SampledReference& ref, const bf16* y, const cuda::DeviceFfnGrads& grads, int32_t d) {
  std::vector<float> y_rows, dx_rows;
  for (int64_t r : ref.rows) {
    const std::vector<float> y_row = cuda::download_bf16(y + r * d, d);
    const std::vector<float> dx_row = cuda::download_bf16(grads.dx + r * d, d);
    y_rows.insert(y_rows.end(), y_row.begin(), y_row.end());
    dx_rows.insert(dx_rows.end(), dx_row.begin(), dx_row.end());
  }
  const auto neuron_rows = [&](const float* device) {
    std::vector<float> rows(ref.neurons.size() * d);
    for (size_t i = 0; i < ref.neurons.size(); ++i)
      cuda::copy_to_host(rows.data() + i * d, device + int64_t{ref.neurons[i]} * d, d * sizeof(float));
    return rows;
  };
  Errors e;
  e.y = relative_l2_error(y_rows.data(), ref.y.data(), y_rows.size());
  e.dx = relative_l2_error(dx_rows.data(), ref.dx.data(), dx_rows.size());
  e.d_gate = relative_l2_error(neuron_rows(grads.d_gate).data(), ref.d_gate.data(), ref.d_gate.size());
  e.d_up = relative_l2_error(neuron_rows(grads.d_up).data(), ref.d_up.data(), ref.d_up.size());
  e.d_down = relative_l2_error(neuron_rows(grads.d_down).data(), ref.d_down.data(), ref.d_down.size());
  return e;
}

void check_cuda(cudaError_t status, const char* what) {
  TWELL_REQUIRE(status == cudaSuccess, "CUDA error '{}' in {}", cudaGetErrorString(status), what);
}

void run_cuda(const TrainBenchOptions& o) {
  TWELL_REQUIRE(cuda::available(), "--device cuda: no CUDA device is available");
  std::vector<BenchRecord> records;
  cudaStream_t stream = nullptr;
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  fmt::print("{:>6} {:>6} {:>10} {:>7} {:>5} {:>9} {:>8} {:>8} {:>9} {:>6} {:>7} {:>9}\n", "M", "dens%", "impl", "path",
             "hot", "nnz/row", "ms", "xdense", "held MiB", "mem%", "backup", "max err");
  for (int64_t m : o.rows) {
    const int32_t d = o.d_model, h = o.d_hidden;
    const std::vector<float> x = make_activations(m, d, 1);
    const std::vector<float> dy = make_activations(m, d, 2);  // any fixed upstream gradient
    const cuda::DeviceArray<bf16> x_device = cuda::upload_bf16(x.data(), x.size());
    const cuda::DeviceArray<bf16> dy_device = cuda::upload_bf16(dy.data(), dy.size());
    const cuda::DeviceArray<bf16> y = cuda::make_device_array<bf16>(m * d);
    const cuda::DeviceArray<bf16> dx = cuda::make_device_array<bf16>(m * d);
    const cuda::DeviceArray<float> d_gate = cuda::make_device_array<float>(int64_t{h} * d);
    const cuda::DeviceArray<float> d_up = cuda::make_device_array<float>(int64_t{h} * d);
    const cuda::DeviceArray<float> d_down = cuda::make_device_array<float>(int64_t{h} * d);
    const cuda::DeviceFfnGrads grads{dx.get(), d_gate.get(), d_up.get(), d_down.get()};
    for (double density : o.densities) {
      const FfnWeights weights =
          make_workload({.rows = 1, .d_model = d, .d_hidden = h, .density = density, .seed = 1}).weights;
      const cuda::DeviceFfnWeights device_weights = cuda::upload_weights(weights);
      const SampledReference ref = sampled_reference(x, dy, m, weights, o.l1_coeff, o.check_rows, o.check_neurons);
      // The auto and split runs' weights: sorted by activity (loaded lazily; the sampled reference follows).
      std::unique_ptr<cuda::DeviceFfnWeights> sorted_device;
      std::unique_ptr<SampledReference> sorted_ref;
      // One run per impl, split once per fraction. All stay alive and take turns step by step, so
      // that drift of the clocks over the run falls on all alike (dense steps were seen 7% apart
      // between runs timed one after the other).
      struct Run {
        std::string impl;
        double hot_fraction = 0;
        const cuda::DeviceFfnWeights* weights = nullptr;
        const SampledReference* ref = nullptr;
        std::unique_ptr<cuda::FfnTrainOp> op;
        int dispatch_steps = 0;
        std::vector<double> samples;
      };
      std::vector<Run> runs;
      for (const std::string& impl : o.impls) {
        if (impl == "split")
          for (double f : o.hot_fractions) runs.push_back({.impl = impl, .hot_fraction = f});
        else
          runs.push_back({.impl = impl});
      }
      for (Run& run : runs) {
        const bool sorted_weights = run.hot_fraction > 0 || run.impl == "auto";
        if (sorted_weights && !sorted_device) {
          const FfnWeights sorted = sorted_by_activity(weights, 4243);
          sorted_device = std::make_unique<cuda::DeviceFfnWeights>(cuda::upload_weights(sorted));
          sorted_ref = std::make_unique<SampledReference>(
              sampled_reference(x, dy, m, sorted, o.l1_coeff, o.check_rows, o.check_neurons));
        }
        run.weights = sorted_weights ? sorted_device.get() : &device_weights;
        run.ref = sorted_weights ? sorted_ref.get() : &ref;
        run.op = std::make_unique<cuda::FfnTrainOp>(
            cuda::FfnTrainOptions{.l1_coeff = o.l1_coeff,
                                  .path = run.impl == "split" ? cuda::TrainPath::sparse : cuda::parse_train_path(run.impl),
                                  .expected_density = density,
                                  .hot_fraction = run.hot_fraction,
                                  .split_side_stream = o.split_side_stream});
      }
      const auto train_step = [&](Run& run) {
        run.op->forward(x_device.get(), m, *run.weights, y.get(), stream);
        run.op->backward(dy_device.get(), grads, stream);
      };
      // The automatic dispatch first times its candidates (a one-time cost per size and density).
      for (Run& run : runs) {
        for (; !run.op->dispatch_settled() && run.dispatch_steps < kMaxDispatchSteps; ++run.dispatch_steps) {
          train_step(run);
          check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        }
        TWELL_REQUIRE(run.op->dispatch_settled(), "{}: the dispatch did not settle in {} steps", run.impl,
                      kMaxDispatchSteps);
      }
      for (int i = 0; i < o.warmup; ++i)
        for (Run& run : runs) train_step(run);
      // Each round in its own order (round_order): no run always follows the same one.
      for (int i = 0; i < o.reps; ++i)
        for (size_t k : round_order(runs.size(), i)) {
          Run& run = runs[k];
          check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
          train_step(run);
          check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
          check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
          float ms = 0;
          check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
          run.samples.push_back(ms);
        }
      double dense_ms = 0, dense_bytes = 0;
      for (Run& run : runs) {
        train_step(run);  // y and the gradients are shared: this run's, for its error check
        const cuda::FfnTrainStats stats = run.op->stats(stream);
        const Errors errors = sampled_errors(*run.ref, y.get(), grads, d);

        BenchRecord r = new_bench_record("ffn-train", "cuda", cuda::device_name(), run.impl, m, d, h, density);
        r.nnz_per_row = stats.l0;
        r.timing = summarize_ms(run.samples);
        r.rel_err = errors.worst();
        r.peak_bytes = run.op->held_bytes();
        if (run.impl == "dense") {
          dense_ms = r.timing.median_ms;
          dense_bytes = static_cast<double>(r.peak_bytes);
        }
        const double speedup = dense_ms > 0 ? dense_ms / r.timing.median_ms : 0;
        const double memory_fraction = dense_bytes > 0 ? r.peak_bytes / dense_bytes : 0;
        r.extra = {{"path", cuda::to_string(stats.path)},
                   {"hot_fraction", run.hot_fraction},
                   {"dispatch_steps", run.dispatch_steps},
                   {"hot_neurons", stats.hot_neurons},
                   {"split_side_stream", o.split_side_stream},
                   {"speedup_vs_dense", speedup},
                   {"held_fraction_of_dense", memory_fraction},
                   {"ell_width", stats.ell_width},
                   {"backup_rows", stats.backup_rows},
                   {"l1", stats.l1},
                   {"l1_coeff", o.l1_coeff},
                   {"err_y", errors.y},
                   {"err_dx", errors.dx},
                   {"err_d_gate", errors.d_gate},
                   {"err_d_up", errors.d_up},
                   {"err_d_down", errors.d_down},
                   {"checked_rows", run.ref->rows.size()},
                   {"checked_neurons", run.ref->neurons.size()}};
        records.push_back(r);
        fmt::print("{:>6} {:>6.2f} {:>10} {:>7} {:>5} {:>9.1f} {:>8.3f} {:>8.2f} {:>9.1f} {:>6.1f} {:>7} {:>9.2e}\n", m,
                   100 * density, run.impl, cuda::to_string(stats.path), stats.hot_neurons, stats.l0, r.timing.median_ms,
                   speedup,
                   r.peak_bytes / 1048576.0, 100 * memory_fraction, stats.backup_rows, errors.worst());
        std::fflush(stdout);
      }
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!o.json.empty()) write_bench_json(o.json, records);
}

#endif

}  // namespace

void add_bench_ffn_train(CLI::App& bench) {
  auto options = std::make_shared<TrainBenchOptions>();
  CLI::App* command = bench.add_subcommand("ffn-train", "training FFN forward+backward: sparse hybrid vs dense cuBLASLt");
  command->add_option("--device", options->device, "cuda (the only device this benchmark runs on)");
  command->add_option("--m", options->rows, "rows (tokens) per step")->delimiter(',');
  command->add_option("--d", options->d_model, "model width D");
  command->add_option("--h", options->d_hidden, "hidden width H");
  command->add_option("--density", options->densities, "target densities of the gate")->delimiter(',');
  command->add_option("--impl", options->impls,
                      "dense, sparse, auto, split (once per --hot-fraction) (dense first: ratios use it)")
      ->delimiter(',');
  command->add_option("--hot-fraction", options->hot_fractions,
                      "split: fractions of H run densely (the most active neurons)")
      ->delimiter(',');
  command->add_flag("!--split-one-stream", options->split_side_stream,
                    "split: the dense and sparse parts one after the other on one stream (default: side by side)");
  command->add_option("--l1", options->l1_coeff, "L1 coefficient on h");
  command->add_option("--warmup", options->warmup, "untimed steps first");
  command->add_option("--reps", options->reps, "timed steps");
  command->add_option("--check-rows", options->check_rows, "rows of y and dx checked against float64");
  command->add_option("--check-neurons", options->check_neurons, "weight-gradient rows checked against float64");
  command->add_option("--json", options->json, "write the records here");
  command->callback([options] {
    validate_options(*options);
#if defined(TWELL_HAVE_CUDA)
    run_cuda(*options);
#else
    fail("bench ffn-train needs a CUDA build (TWELL_ENABLE_CUDA=ON with nvcc present)");
#endif
  });
}

}  // namespace twell::cli
