// `twell bench ffn`: driver (workload, rotation, statistics, reference error, table, JSON) and the
// CPU implementations. See bench_ffn.h for how a device plugs in.
#include "bench_ffn.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "commands.h"
#include "timing.h"
#include "twell/bench_record.h"
#include "twell/cpu.h"
#include "twell/error.h"
#include "twell/reference.h"

namespace twell::cli {
namespace {

// ---- CPU implementations ----

// What both CPU implementations hold: the workload and input sets of the current (M, density), y,
// and the clock the options name.
class CpuFfnBench : public FfnBenchImpl {
 public:
  explicit CpuFfnBench(bool thread_cpu_clock) : thread_cpu_clock_(thread_cpu_clock) {}
  void prepare(const Workload& work, const std::vector<std::vector<float>>& inputs) override {
    work_ = &work;
    inputs_ = &inputs;
    y_.assign(work.x.size(), 0.0f);
  }
  std::vector<float> output() override { return y_; }

 protected:
  // Times fn(x) with x = input set `input`, on the clock the options name.
  template <typename Fn>
  double time_ms(int input, Fn&& fn) {
    const float* x = (*inputs_)[input].data();
    return thread_cpu_clock_ ? thread_cpu_ms([&] { fn(x); }) : wall_ms([&] { fn(x); });
  }

  const Workload* work_ = nullptr;
  std::vector<float> y_;  // [M, D]

 private:
  bool thread_cpu_clock_;
  const std::vector<std::vector<float>>* inputs_ = nullptr;
};

// The baseline: three OpenBLAS products (two when non-gated) on every core.
class CpuDense final : public CpuFfnBench {
 public:
  using CpuFfnBench::CpuFfnBench;
  std::string name() const override { return "dense"; }
  double run_ms(int input) override {
    return time_ms(input,
                   [&](const float* x) { cpu::ffn_dense(x, work_->spec.rows, work_->weights, y_.data(), scratch_); });
  }
  int64_t peak_bytes() const override {
    return static_cast<int64_t>((scratch_.gate.capacity() + scratch_.up.capacity()) * sizeof(float));
  }

 private:
  cpu::DenseScratch scratch_;
};

// gate GEMM + relu + TwELL packing, then up and down only at the non-zero gates.
class CpuTwell final : public CpuFfnBench {
 public:
  CpuTwell(int32_t tile, int32_t compression, bool thread_cpu_clock)
      : CpuFfnBench(thread_cpu_clock), tile_(tile), compression_(compression) {}
  std::string name() const override { return "twell"; }
  double run_ms(int input) override {
    return time_ms(input, [&](const float* x) {
      cpu::gate_to_twell(x, work_->spec.rows, work_->weights, tile_, compression_, gate_);
      cpu::ffn_from_twell(x, gate_, work_->weights, y_.data());
    });
  }
  int64_t peak_bytes() const override {
    return static_cast<int64_t>(gate_.slots.capacity() * sizeof(TwellSlot) +
                                gate_.tile_nnz.capacity() * sizeof(int32_t) + gate_.spill.capacity() * sizeof(bf16));
  }

 private:
  int32_t tile_, compression_;
  TwellMatrix gate_;  // reused across calls, as an inference loop would
};

cpu::Isa parse_isa(const std::string& name) {
  for (cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512})
    if (cpu::to_string(isa) == name) return isa;
  fail("--isa must be scalar, avx2 or avx512, got '{}'", name);
}

// ---- Driver ----

// What the workload itself says, from the float64 reference on input set 0, over `rows` spread
// over M (all of M when it has no more rows than that): the full reference is O(M·H·D) in float64,
// hours of CPU at M = 65536.
struct WorkloadFacts {
  std::vector<int64_t> rows;    // the rows checked, ascending
  std::vector<double> y_ref;    // [rows.size(), D]
  double nnz_per_row = 0;       // mean non-zeros per row of the relu projection, over `rows`
  // Neurons non-zero in at least one row (the up/down rows a sparse FFN must read): counted when every
  // row is checked, else bounded from above by min(H, nnz_per_row·M).
  int64_t active_neurons = 0;
  bool active_neurons_exact = true;
};

WorkloadFacts reference_facts(const Workload& work, int reference_rows) {
  const int64_t rows = work.spec.rows;
  const int32_t d = work.spec.d_model, h = work.spec.d_hidden;
  WorkloadFacts facts;
  const int64_t checked = reference_rows <= 0 ? rows : std::min<int64_t>(rows, reference_rows);
  std::vector<float> x(static_cast<size_t>(checked) * d);  // [checked, D]
  for (int64_t i = 0; i < checked; ++i) {
    facts.rows.push_back(i * rows / checked);
    std::copy_n(work.x.data() + facts.rows.back() * d, d, x.data() + i * d);
  }
  const std::vector<double> g = ref::relu_projection(x.data(), checked, work.weights);  // [checked, H]
  int64_t nnz = 0;
  std::vector<bool> active(h, false);
  for (int64_t m = 0; m < checked; ++m)
    for (int32_t j = 0; j < h; ++j)
      if (g[m * h + j] > 0) {
        ++nnz;
        active[j] = true;
      }
  facts.nnz_per_row = static_cast<double>(nnz) / static_cast<double>(checked);
  facts.active_neurons_exact = checked == rows;
  facts.active_neurons = facts.active_neurons_exact
                             ? std::count(active.begin(), active.end(), true)
                             : std::min<int64_t>(h, std::llround(facts.nnz_per_row * static_cast<double>(rows)));
  facts.y_ref = ref::ffn_dense(x.data(), checked, work.weights);
  return facts;
}

// Relative L2 error of y [M, D] on the checked rows.
double reference_error(const WorkloadFacts& facts, const std::vector<float>& y, int32_t d) {
  std::vector<float> checked(facts.rows.size() * d);
  for (size_t i = 0; i < facts.rows.size(); ++i)
    std::copy_n(y.data() + facts.rows[i] * d, d, checked.data() + i * d);
  return relative_l2_error(checked.data(), facts.y_ref.data(), checked.size());
}

// Bytes of weights an implementation has to read at least, and the flops it has to do at least.
struct NapkinMath {
  double weight_bytes;
  double flops;
};

NapkinMath napkin_math(bool sparse, const Workload& work, const WorkloadFacts& facts) {
  const double d = work.spec.d_model, h = work.spec.d_hidden, rows = static_cast<double>(work.spec.rows);
  const double matrices = work.spec.gated ? 3 : 2;
  if (!sparse) return {matrices * h * d * sizeof(float), 2 * matrices * rows * h * d};
  const double sparse_matrices = matrices - 1;  // up and down (down only when non-gated)
  return {(h + sparse_matrices * static_cast<double>(facts.active_neurons)) * d * sizeof(float),
          2 * rows * h * d + 2 * sparse_matrices * facts.nnz_per_row * rows * d};
}

void validate_options(const FfnBenchOptions& options) {
  TWELL_REQUIRE(options.device == "cpu" || options.device == "cuda", "--device must be cpu or cuda, got '{}'",
                options.device);
  TWELL_REQUIRE(!options.rows.empty(), "--m needs at least one value");
  for (int64_t rows : options.rows) TWELL_REQUIRE(rows >= 1, "--m values must be >= 1, got {}", rows);
  TWELL_REQUIRE(!options.densities.empty(), "--density needs at least one value");
  for (double density : options.densities)
    TWELL_REQUIRE(density >= 0 && density <= 1, "--density values must lie in [0, 1], got {}", density);
  TWELL_REQUIRE(options.d_model >= 2, "--d must be >= 2, got {}", options.d_model);
  TWELL_REQUIRE(options.d_hidden >= 1, "--h must be >= 1, got {}", options.d_hidden);
  TWELL_REQUIRE(twell_tile_supported(options.tile), "--tile must be 128 or 256, got {}", options.tile);
  TWELL_REQUIRE(twell_compression_supported(options.compression), "--compression must be 2, 4 or 8, got {}",
                options.compression);
  TWELL_REQUIRE(options.threads >= 0, "--threads must be >= 0 (0 = all cores), got {}", options.threads);
  TWELL_REQUIRE(options.input_sets >= 1, "--inputs must be >= 1, got {}", options.input_sets);
  TWELL_REQUIRE(options.warmup >= 0, "--warmup must be >= 0, got {}", options.warmup);
  TWELL_REQUIRE(options.reps >= 1, "--reps must be >= 1, got {}", options.reps);
  TWELL_REQUIRE(options.reference_rows >= 0, "--reference-rows must be >= 0 (0 = all rows), got {}",
                options.reference_rows);
  TWELL_REQUIRE(options.clock == "wall" || (options.clock == "thread-cpu" && options.device == "cpu" && options.threads == 1),
                "--clock must be wall, or thread-cpu with --device cpu --threads 1 (all work on one thread); got "
                "--clock {} --device {} --threads {}",
                options.clock, options.device, options.threads);
}

FfnBenchDevice make_device(const FfnBenchOptions& options) {
  if (options.device == "cpu") return make_cpu_ffn_bench(options);
#if defined(TWELL_HAVE_CUDA)
  return make_cuda_ffn_bench(options);
#else
  fail("--device cuda: this twell was built without CUDA (configure with nvcc present and TWELL_ENABLE_CUDA=ON)");
#endif
}

void run_ffn_bench(const FfnBenchOptions& options) {
  validate_options(options);
  FfnBenchDevice device = make_device(options);
  TWELL_REQUIRE(!device.impls.empty() && device.impls[0]->name() == "dense",
                "the {} benchmark must list the dense baseline first", options.device);
  fmt::print(
      "twell bench ffn: {} ({}), D={} H={} {}, TwELL T={} C={}, {} input sets, {} warm-up + {} timed reps, {} clock\n",
      options.device, device.model, options.d_model, options.d_hidden, options.gated ? "gated" : "non-gated",
      options.tile, options.compression, options.input_sets, options.warmup, options.reps, options.clock);
  fmt::print("{:>6} {:>8} {:>9} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9} {:>10} {:>8}\n", "M", "density", "nnz/row",
             "impl", "median ms", "p10 ms", "p90 ms", "GB/s", "GFLOP/s", "rel_err", "speedup");

  std::vector<BenchRecord> records;
  for (int64_t rows : options.rows)
    for (double density : options.densities) {
      WorkloadSpec spec;
      spec.rows = rows;
      spec.d_model = options.d_model;
      spec.d_hidden = options.d_hidden;
      spec.density = density;
      spec.gated = options.gated;
      spec.seed = options.seed;
      const Workload work = make_workload(spec);
      const std::vector<std::vector<float>> inputs = rotated_inputs(work, options.input_sets);
      const WorkloadFacts facts = reference_facts(work, options.reference_rows);

      // The implementations take turns call by call, so that drift over the run (clocks, other
      // tenants of a shared CPU) falls on all of them alike, in an order that changes per round.
      const size_t impl_count = device.impls.size();
      for (const auto& impl : device.impls) impl->prepare(work, inputs);
      std::vector<int> settle_calls;
      for (const auto& impl : device.impls) settle_calls.push_back(impl->settle(options.input_sets));
      for (int i = 0; i < options.warmup; ++i)
        for (const auto& impl : device.impls) impl->run_ms(i % options.input_sets);
      std::vector<std::vector<double>> samples(impl_count);
      for (int i = 0; i < options.reps; ++i)
        for (size_t k : round_order(impl_count, i)) samples[k].push_back(device.impls[k]->run_ms(i % options.input_sets));

      double dense_median_ms = 0;
      for (size_t k = 0; k < impl_count; ++k) {
        const auto& impl = device.impls[k];
        impl->run_ms(0);
        const std::vector<float> y = impl->output();
        const size_t outputs = static_cast<size_t>(rows) * options.d_model;
        TWELL_REQUIRE(y.size() == outputs, "impl {} returned {} outputs, expected M*D = {}", impl->name(), y.size(),
                      outputs);

        BenchRecord record = new_bench_record("ffn", options.device, device.model, impl->name(), rows,
                                              options.d_model, options.d_hidden, density);
        record.nnz_per_row = facts.nnz_per_row;
        record.timing = summarize_ms(samples[k]);
        record.rel_err = reference_error(facts, y, options.d_model);
        record.peak_bytes = impl->peak_bytes();
        if (impl->name() == "dense") dense_median_ms = record.timing.median_ms;
        // dense_fused (CUDA) does the dense FFN's products too.
        const NapkinMath napkin = napkin_math(!impl->name().starts_with("dense"), work, facts);
        const double seconds = record.timing.median_ms * 1e-3;
        const double speedup = dense_median_ms / record.timing.median_ms;
        record.extra = {{"speedup_vs_dense", speedup},
                        {"weight_gb_per_s", napkin.weight_bytes / seconds * 1e-9},
                        {"gflop_per_s", napkin.flops / seconds * 1e-9},
                        {"active_neurons", facts.active_neurons},
                        {"active_neurons_exact", facts.active_neurons_exact},
                        {"reference_rows", static_cast<int64_t>(facts.rows.size())},
                        {"tile", options.tile},
                        {"compression", options.compression},
                        {"gated", options.gated},
                        {"input_sets", options.input_sets},
                        {"settle_calls", settle_calls[k]}};
        record.extra.update(impl->extra_measurements(options.reps));
        if (options.device == "cpu") {
          record.extra["threads"] = cpu::num_threads();
          record.extra["isa"] = cpu::to_string(cpu::active_isa());
          record.extra["clock"] = options.clock;
        }
        fmt::print("{:>6} {:>8.4g} {:>9.1f} {:>8} {:>10.3f} {:>10.3f} {:>10.3f} {:>9.1f} {:>9.1f} {:>10.2e} {:>7.2f}x\n",
                   rows, density, facts.nnz_per_row, record.impl, record.timing.median_ms, record.timing.p10_ms,
                   record.timing.p90_ms, napkin.weight_bytes / seconds * 1e-9, napkin.flops / seconds * 1e-9,
                   record.rel_err, speedup);
        if (record.extra.contains("gate_ms") && record.extra.contains("ffn_from_twell_ms"))
          fmt::print("{:>35} gate {:.3f} ms, up+down {:.3f} ms (each alone)\n", "", record.extra["gate_ms"].get<double>(),
                     record.extra["ffn_from_twell_ms"].get<double>());
        if (record.extra.contains("hot_neurons"))
          fmt::print("{:>35} path: {}\n", "",
                     record.extra["dense"].get<bool>() ? std::string("dense")
                     : record.extra["hot_neurons"].get<int>() == 0
                         ? std::string("TwELL")
                         : fmt::format("neurons [0, {}) dense, the rest TwELL", record.extra["hot_neurons"].get<int>()));
        std::fflush(stdout);
        records.push_back(std::move(record));
      }
    }

  fmt::print("\nspeedup over dense (median time):\n");
  for (const auto& impl : device.impls) {
    if (impl->name() == "dense") continue;
    for (const BenchRecord& record : records)
      if (record.impl == impl->name())
        fmt::print("  {:<8} M={:<5} density={:<6.4g} {:6.2f}x\n", record.impl, record.M, record.target_density,
                   record.extra["speedup_vs_dense"].get<double>());
  }
  if (!options.json_path.empty()) {
    write_bench_json(options.json_path, records);
    fmt::print("wrote {} records to {}\n", records.size(), options.json_path);
  }
}

}  // namespace

FfnBenchDevice make_cpu_ffn_bench(const FfnBenchOptions& options) {
  cpu::set_num_threads(options.threads);
  if (!options.isa.empty()) cpu::set_isa(parse_isa(options.isa));
  FfnBenchDevice device;
  device.model = cpu_model_name();
  const bool thread_cpu_clock = options.clock == "thread-cpu";
  device.impls.push_back(std::make_unique<CpuDense>(thread_cpu_clock));
  device.impls.push_back(std::make_unique<CpuTwell>(options.tile, options.compression, thread_cpu_clock));
  return device;
}

void add_bench_ffn(CLI::App& bench) {
  auto options = std::make_shared<FfnBenchOptions>();
  CLI::App* command = bench.add_subcommand("ffn", "dense FFN against the sparse (TwELL) FFN, standard workload");
  command->add_option("--device", options->device, "cpu or cuda")->capture_default_str();
  command->add_option("--m", options->rows, "rows (tokens) per call, comma-separated")->delimiter(',')
      ->capture_default_str();
  command->add_option("--d", options->d_model, "model width D")->capture_default_str();
  command->add_option("--h", options->d_hidden, "FFN hidden width H")->capture_default_str();
  command->add_option("--density", options->densities, "target densities of the relu projection, comma-separated")
      ->delimiter(',')->capture_default_str();
  command->add_flag("!--non-gated", options->gated, "non-gated FFN: y = relu(x·Wu^T)·Wd");
  command->add_option("--tile", options->tile, "TwELL tile width T (128 or 256)")->capture_default_str();
  command->add_option("--compression", options->compression, "TwELL compression C (2, 4 or 8)")->capture_default_str();
  command->add_flag("!--split-one-stream", options->split_side_stream,
                    "cuda: a split's dense and TwELL parts one after the other on one stream (default: side by side)");
  command->add_option("--hot-fractions", options->hot_fractions,
                      "CUDA split paths: hot fractions of H to time, comma-separated (default 0.125,0.25,0.375,0.5)")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 1.0).description("each in (0, 1)"));
  command->add_option("--impl", options->impls,
                      "cuda: implementations timed besides dense (dense_fused, twell, twell_split, twell_auto; "
                      "default all)")
      ->delimiter(',');
  command->add_option("--threads", options->threads, "CPU threads, 0 = all cores")->capture_default_str();
  command->add_option("--isa", options->isa, "CPU kernels: scalar, avx2 or avx512 (default: the best this CPU has)");
  command->add_option("--clock", options->clock,
                      "CPU timing: wall, or thread-cpu (needs --threads 1; robust on a shared machine)")
      ->capture_default_str();
  command->add_option("--reference-rows", options->reference_rows,
                      "rows spread over M checked against the float64 reference (0 = all)")
      ->capture_default_str();
  command->add_option("--inputs", options->input_sets, "activation sets rotated between reps")->capture_default_str();
  command->add_option("--warmup", options->warmup, "untimed runs per implementation and shape")->capture_default_str();
  command->add_option("--reps", options->reps, "timed runs per implementation and shape")->capture_default_str();
  command->add_option("--seed", options->seed, "workload seed")->capture_default_str();
  command->add_option("--json", options->json_path, "write the records (bench_record.h schema) to this file");
  command->callback([options] { run_ffn_bench(*options); });
}

}  // namespace twell::cli
