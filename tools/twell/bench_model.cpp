// `twell bench model`: prefill and decode throughput of a checkpoint (or of a synthetic model of a
// named shape) for each FFN path, mean ± stddev over repetitions; table plus JSON records
// (include/twell/bench_record.h). Prompts are random token ids (seeded): throughput does not depend
// on the text.
//
// CPU: one sequence; prefill = the prompt through forward() (LM head of the last token included),
// decode = steps of one token with argmax on the host.
// CUDA: prefill = --batch sequences of --prompt-tokens each through one forward() without the LM head
// (the paper's "forward"); decode = --decode-batch sequences after a --decode-context prompt, greedy
// steps with the argmax on the device (CUDA graphs unless --no-graphs). Each phase is timed on the
// wall clock between two synchronizations of the model's stream, so host launch overhead counts;
// joules per token from NVML's energy counter over the same interval. Before timing, a relu model's
// FFN neurons are ordered by activity on --order-tokens random tokens (every path then runs the same
// weights; the twell path can run its most active neurons densely), and prefills warm up until the
// FFN dispatch has timed its paths.
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "commands.h"
#include "progress.h"
#include "timing.h"
#include "twell/bench_record.h"
#include "twell/cpu.h"
#include "twell/error.h"
#include "twell/model.h"
#ifdef TWELL_HAVE_CUDA
#include "twell/cuda.h"
#include "twell/model_cuda.h"
#endif

namespace twell::cli {
namespace {

struct BenchModelOptions {
  std::string model_dir;
  std::string synthetic;  // shape name of synthetic_model_config, instead of a checkpoint
  double density = 0.005;  // synthetic models' FFN density
  std::vector<std::string> paths;  // empty: dense, plus twell and predict for ReLU models
  int32_t prompt_tokens = 128;
  int32_t decode_tokens = 32;
  int32_t batch = 1;            // CUDA: prefill sequences
  int32_t decode_batch = 1;     // CUDA: decode sequences
  int32_t decode_context = 128;  // CUDA: prompt tokens before the timed decode steps
  int32_t calibration_tokens = 64;
  int32_t order_tokens = 256;  // CUDA relu models: random tokens the FFN neurons are ordered on (0: not ordered)
  int reps = 5;
  int threads = 0;
  double recall = 0.99;
  uint64_t seed = 1;
  std::string device = "cpu";
  bool no_graphs = false;
  std::string json_path;
};

struct MeanStd {
  double mean = 0, stddev = 0;
};
MeanStd mean_std(const std::vector<double>& values) {
  MeanStd result;
  for (double v : values) result.mean += v;
  result.mean /= values.size();
  for (double v : values) result.stddev += (v - result.mean) * (v - result.mean);
  result.stddev = values.size() > 1 ? std::sqrt(result.stddev / (values.size() - 1)) : 0.0;
  return result;
}

std::vector<int32_t> random_tokens(size_t count, int32_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> any_token(0, vocab - 1);
  std::vector<int32_t> tokens(count);
  for (int32_t& token : tokens) token = any_token(rng);
  return tokens;
}

// One path's measurements: wall milliseconds per rep and joules per phase (NaN without NVML).
struct PhaseTimes {
  std::vector<double> prefill_ms, decode_ms;
  double prefill_joules = 0, decode_joules = 0;
  double prefill_twell_fraction = NAN;  // CUDA twell path: share of the prefill FFN calls that ran TwELL
  double prefill_split_fraction = NAN;  // ... that ran a split (hot neurons densely beside TwELL)
  double prefill_split_hot_fraction = NAN;  // the splits' hot neurons as a share of H, mean over them
  // ... that were the dispatch's own measurements (timed runs, density rechecks): 0 in a steady state
  double prefill_measured_fraction = NAN;
  int prefill_warmups = 0;
  std::vector<std::pair<std::string, double>> prefill_stage_ms;  // CUDA: one more prefill, by stage
};

PhaseTimes time_cpu(Model& model, const BenchModelOptions& options, const std::vector<int32_t>& prompt) {
  const int32_t capacity = options.prompt_tokens + options.decode_tokens;
  std::vector<float> logits(model.config().vocab_size);
  PhaseTimes times;
  Progress progress("  timing", options.reps + 1, "reps");
  for (int rep = -1; rep < options.reps; ++rep) {  // rep -1 warms up (buffers, page faults)
    KvCache cache = model.new_cache(capacity);
    const double prefill = wall_ms([&] { model.forward(prompt.data(), options.prompt_tokens, cache, logits.data()); });
    int32_t token = prompt.back();
    const double decode = wall_ms([&] {
      for (int32_t step = 0; step < options.decode_tokens; ++step) {
        model.forward(&token, 1, cache, logits.data());
        token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      }
    });
    progress.update(rep + 2);
    if (rep < 0) continue;
    times.prefill_ms.push_back(prefill);
    times.decode_ms.push_back(decode);
  }
  times.prefill_joules = times.decode_joules = NAN;
  return times;
}

#ifdef TWELL_HAVE_CUDA
// Prefills until one ran none of SparseFfn's timing runs (its dispatch has timed every path for
// this shape: with split paths that takes about 36 FFN calls, more than one prefill of a small
// model), at most kMaxPrefillWarmups. Returns how many ran.
int warm_up_prefill(cuda::CudaModel& gpu, const BenchModelOptions& options, const std::vector<int32_t>& prompts) {
  constexpr int kMaxPrefillWarmups = 10;
  for (int warmups = 1;; ++warmups) {
    gpu.reset(options.batch, options.prompt_tokens);
    gpu.forward(prompts.data(), options.prompt_tokens, nullptr);
    gpu.synchronize();
    if (gpu.sparse_ffn_calls().measured == 0) return warmups;
    if (warmups == kMaxPrefillWarmups) {
      fmt::print("  note: the FFN dispatch was still timing its paths after {} warm-up prefills\n", warmups);
      return warmups;
    }
  }
}

PhaseTimes time_cuda(cuda::CudaModel& gpu, const BenchModelOptions& options, const std::vector<int32_t>& prompts,
                     const std::vector<int32_t>& decode_prompts, const cuda::EnergyCounter& energy) {
  std::vector<float> logits(static_cast<size_t>(options.decode_batch) * gpu.config().vocab_size);
  PhaseTimes times;
  times.prefill_warmups = warm_up_prefill(gpu, options, prompts);
  Progress progress("  timing", options.reps + 1, "reps");
  for (int rep = -1; rep < options.reps; ++rep) {  // rep -1 warms up (plans, buffers, dispatch timings, graphs)
    gpu.reset(options.batch, options.prompt_tokens);
    gpu.synchronize();
    const double prefill_start_j = energy.joules();
    const double prefill = wall_ms([&] {
      gpu.forward(prompts.data(), options.prompt_tokens, nullptr);
      gpu.synchronize();
    });
    const double prefill_j = energy.joules() - prefill_start_j;
    const cuda::CudaModel::FfnCalls calls = gpu.sparse_ffn_calls();
    if (calls.twell + calls.dense > 0) {
      const auto all = static_cast<double>(calls.twell + calls.dense);
      times.prefill_twell_fraction = static_cast<double>(calls.twell) / all;
      times.prefill_split_fraction = static_cast<double>(calls.split) / all;
      times.prefill_measured_fraction = static_cast<double>(calls.measured) / all;
      if (calls.split > 0)
        times.prefill_split_hot_fraction =
            static_cast<double>(calls.hot_neurons) / (static_cast<double>(calls.split) * gpu.config().d_hidden);
    }
    gpu.reset(options.decode_batch, options.decode_context + options.decode_tokens);
    gpu.forward(decode_prompts.data(), options.decode_context, logits.data());
    const double decode_start_j = energy.joules();
    const double decode = wall_ms([&] {
      gpu.decode_greedy(options.decode_tokens);
      gpu.synchronize();
    });
    const double decode_j = energy.joules() - decode_start_j;
    progress.update(rep + 2);
    if (rep < 0) continue;
    times.prefill_ms.push_back(prefill);
    times.decode_ms.push_back(decode);
    times.prefill_joules += prefill_j;
    times.decode_joules += decode_j;
  }
  // Where a prefill's time goes: one more, untimed, with events between its stages.
  gpu.set_stage_timing(true);
  gpu.reset(options.batch, options.prompt_tokens);
  gpu.forward(prompts.data(), options.prompt_tokens, nullptr);
  const cuda::CudaModel::StageTimes stages = gpu.stage_times();
  gpu.set_stage_timing(false);
  times.prefill_stage_ms = {{"embed", stages.embed},
                            {"norm_qkv", stages.norm_qkv},
                            {"rope_attention", stages.rope_attention},
                            {"rope", stages.rope},
                            {"o_proj_norm", stages.o_proj_norm},
                            {"ffn", stages.ffn}};
  return times;
}
#endif

void run_bench_model(const BenchModelOptions& options) {
  const bool on_gpu = options.device == "cuda";
  TWELL_REQUIRE(options.device == "cpu" || on_gpu, "--device must be cpu or cuda, got '{}'", options.device);
#ifndef TWELL_HAVE_CUDA
  TWELL_REQUIRE(!on_gpu, "--device cuda: this twell was built without CUDA");
#endif
  TWELL_REQUIRE(options.model_dir.empty() != options.synthetic.empty(), "give either -m DIR or --synthetic SHAPE");
  TWELL_REQUIRE(options.reps >= 1, "--reps must be >= 1, got {}", options.reps);
  TWELL_REQUIRE(options.prompt_tokens >= 1 && options.decode_tokens >= 1, "--prompt-tokens and --decode-tokens must be >= 1");
  TWELL_REQUIRE(options.batch >= 1 && options.decode_batch >= 1 && options.decode_context >= 1,
                "--batch, --decode-batch and --decode-context must be >= 1");
  TWELL_REQUIRE(on_gpu || (options.batch == 1 && options.decode_batch == 1),
                "--batch and --decode-batch need --device cuda (the CPU runtime runs one sequence)");
  cpu::set_num_threads(options.threads);
  Model model = options.synthetic.empty()
                    ? Model::load(options.model_dir)
                    : [&] {
                        const ModelConfig config = synthetic_model_config(options.synthetic);
                        return Model(config, make_synthetic_weights(config, options.density, options.seed));
                      }();
  const ModelConfig& config = model.config();
  const int32_t capacity = std::max(options.prompt_tokens + (on_gpu ? 0 : options.decode_tokens),
                                    on_gpu ? options.decode_context + options.decode_tokens : 0);
  TWELL_REQUIRE(capacity <= config.max_positions, "{} positions exceed max_position_embeddings = {}", capacity,
                config.max_positions);
  std::vector<std::string> paths = options.paths;
  if (paths.empty()) paths = config.activation == FfnActivation::relu ? std::vector<std::string>{"dense", "twell", "predict"}
                                                                       : std::vector<std::string>{"dense"};

  std::mt19937_64 rng(options.seed);
  const std::vector<int32_t> prompts =
      random_tokens(static_cast<size_t>(options.batch) * options.prompt_tokens, config.vocab_size, rng);
  const std::vector<int32_t> decode_prompts =
      random_tokens(static_cast<size_t>(options.decode_batch) * options.decode_context, config.vocab_size, rng);
  const std::vector<int32_t> calibration_tokens = random_tokens(options.calibration_tokens, config.vocab_size, rng);
  // Ordered before the GPU copy is made, so that every path runs the same weights.
  const bool order_neurons = on_gpu && options.order_tokens > 0 && config.activation == FfnActivation::relu;
  if (order_neurons) {
    const std::vector<std::vector<int64_t>> counts =
        model.order_neurons_by_activity(random_tokens(options.order_tokens, config.vocab_size, rng));
    double eighth_share = 0;  // of the activations, held by the most active eighth of the neurons
    for (const std::vector<int64_t>& layer : counts) {
      const auto eighth = static_cast<ptrdiff_t>(layer.size() / 8);
      const int64_t all = std::accumulate(layer.begin(), layer.end(), int64_t{0});
      if (all > 0) eighth_share += static_cast<double>(std::accumulate(layer.begin(), layer.begin() + eighth, int64_t{0})) / all;
    }
    fmt::print("FFN neurons ordered by activity on {} random tokens: the most active eighth holds {:.0f}% of the "
               "activations (mean over layers)\n",
               options.order_tokens, 100 * eighth_share / static_cast<double>(counts.size()));
  }

#ifdef TWELL_HAVE_CUDA
  std::unique_ptr<cuda::CudaModel> gpu;
  std::unique_ptr<cuda::EnergyCounter> energy;
  if (on_gpu) {
    gpu = std::make_unique<cuda::CudaModel>(model, cuda::CudaModelOptions{.decode_graphs = !options.no_graphs});
    energy = std::make_unique<cuda::EnergyCounter>();
  }
#endif
  const std::string device_name =
#ifdef TWELL_HAVE_CUDA
      on_gpu ? std::string(cuda::device_name()) :
#endif
             cpu_model_name();

  std::vector<BenchRecord> records;
  double dense_prefill = 0, dense_decode = 0;
  fmt::print("{}{}: {} layers, D={}, H={}, V={}, heads {}/{}; {}\n", config.model_type,
             options.synthetic.empty() ? "" : fmt::format(" (synthetic {}, FFN density {})", options.synthetic, options.density),
             config.n_layers, config.d_model, config.d_hidden, config.vocab_size, config.n_heads, config.n_kv_heads,
             device_name);
  if (on_gpu)
    fmt::print("prefill {}x{} tokens (no LM head); decode {} steps at batch {} after {} tokens; graphs {}; {} reps\n",
               options.batch, options.prompt_tokens, options.decode_tokens, options.decode_batch, options.decode_context,
               options.no_graphs ? "off" : "on", options.reps);
  else
    fmt::print("{} threads; prompt {} tokens, decode {} tokens, {} reps\n", cpu::num_threads(), options.prompt_tokens,
               options.decode_tokens, options.reps);
  fmt::print("{:>8} {:>22} {:>22} {:>9} {:>9} {:>10} {:>10}\n", "ffn", "prefill tok/s", "decode tok/s", "x dense",
             "x dense", "J/tok pre", "J/tok dec");
  for (const std::string& name : paths) {
    // twell-only: the twell path without SparseFfn's per-call dense fallback (the TwELL kernels' own speed).
    const bool twell_only = name == "twell-only";
    TWELL_REQUIRE(!twell_only || on_gpu, "--ffn twell-only needs --device cuda");
    const FfnPath path = parse_ffn_path(twell_only ? "twell" : name);
    model.set_ffn_path(path);
    nlohmann::json predictor_info;
    if (path == FfnPath::predict) {
      const std::vector<Calibration> calibration =
          model.calibrate_predictor(calibration_tokens, PredictorKind::one_bit_gate, options.recall);
      double active = 0, predicted = 0, recall = 0;
      for (const Calibration& layer : calibration) {
        active += static_cast<double>(layer.quality.active) / layer.quality.pairs;
        predicted += layer.quality.predicted_fraction();
        recall += layer.quality.recall();
      }
      const double layers = static_cast<double>(calibration.size());
      predictor_info = {{"active_fraction", active / layers}, {"predicted_fraction", predicted / layers},
                        {"recall", recall / layers}, {"calibration_tokens", options.calibration_tokens}};
      fmt::print("  predictor (one-bit gate, {} calibration tokens): active {:.3f}%, predicted {:.3f}%, recall {:.4f} "
                 "(means over layers)\n",
                 options.calibration_tokens, 100 * active / layers, 100 * predicted / layers, recall / layers);
#ifdef TWELL_HAVE_CUDA
      if (on_gpu) {
        gpu->set_ffn_path(path);
        gpu->set_predictor(model);
      }
#endif
    }
#ifdef TWELL_HAVE_CUDA
    if (on_gpu && path != FfnPath::predict) gpu->set_ffn_path(path);
    if (on_gpu) gpu->set_ffn_dispatch(!twell_only);
    const PhaseTimes times = on_gpu ? time_cuda(*gpu, options, prompts, decode_prompts, *energy)
                                    : time_cpu(model, options, prompts);
#else
    const PhaseTimes times = time_cpu(model, options, prompts);
#endif
    const double prefill_tokens = static_cast<double>(options.batch) * options.prompt_tokens;
    const double decode_tokens = static_cast<double>(options.decode_batch) * options.decode_tokens;
    std::vector<double> prefill_rate, decode_rate;
    for (double ms : times.prefill_ms) prefill_rate.push_back(prefill_tokens / (ms / 1e3));
    for (double ms : times.decode_ms) decode_rate.push_back(decode_tokens / (ms / 1e3));
    const MeanStd prefill = mean_std(prefill_rate), decode = mean_std(decode_rate);
    if (path == FfnPath::dense) {
      dense_prefill = prefill.mean;
      dense_decode = decode.mean;
    }
    const double prefill_speedup = dense_prefill > 0 ? prefill.mean / dense_prefill : NAN;
    const double decode_speedup = dense_decode > 0 ? decode.mean / dense_decode : NAN;
    // A counter that did not move (intervals shorter than its update period) measured nothing.
    auto per_token = [&](double joules, double tokens) { return joules > 0 ? joules / (tokens * options.reps) : NAN; };
    const double prefill_j = per_token(times.prefill_joules, prefill_tokens);
    const double decode_j = per_token(times.decode_joules, decode_tokens);
    auto joules = [](double value) { return std::isnan(value) ? std::string("n/a") : fmt::format("{:.3g}", value); };
    fmt::print("{:>8} {:>12.1f} ± {:>7.1f} {:>12.1f} ± {:>7.1f} {:>8.2f}x {:>8.2f}x {:>10} {:>10}\n", name, prefill.mean,
               prefill.stddev, decode.mean, decode.stddev, prefill_speedup, decode_speedup, joules(prefill_j),
               joules(decode_j));
    if (!times.prefill_stage_ms.empty()) {
      std::string line;
      for (const auto& [stage, ms] : times.prefill_stage_ms) line += fmt::format(" {} {:.1f}", stage, ms);
      fmt::print("{:>8} prefill stages, ms (one more prefill, events between stages):{}\n", "", line);
    }
    if (!std::isnan(times.prefill_twell_fraction))
      fmt::print("{:>8} prefill FFN calls that ran TwELL (the rest dense): {:.0f}%, a split among them: {:.0f}%{}{}\n",
                 "", 100 * times.prefill_twell_fraction, 100 * times.prefill_split_fraction,
                 std::isnan(times.prefill_split_hot_fraction)
                     ? std::string()
                     : fmt::format(" (hot neurons {:.1f}% of H)", 100 * times.prefill_split_hot_fraction),
                 times.prefill_measured_fraction > 0
                     ? fmt::format("; the dispatch's own measurements: {:.0f}%", 100 * times.prefill_measured_fraction)
                     : std::string());
    for (const bool is_prefill : {true, false}) {
      BenchRecord record =
          new_bench_record("model", options.device, device_name, name,
                           is_prefill ? options.batch * options.prompt_tokens : options.decode_batch, config.d_model,
                           config.d_hidden);
      record.timing = summarize_ms(is_prefill ? times.prefill_ms : times.decode_ms);
      const MeanStd& rate = is_prefill ? prefill : decode;
      const double joules_per_token = is_prefill ? prefill_j : decode_j;
      record.extra = {{"phase", is_prefill ? "prefill" : "decode"},
                      {"sequences", is_prefill ? options.batch : options.decode_batch},
                      {"tokens", is_prefill ? options.prompt_tokens : options.decode_tokens},
                      {"tokens_per_s_mean", rate.mean},
                      {"tokens_per_s_stddev", rate.stddev},
                      {"speedup_vs_dense", is_prefill ? prefill_speedup : decode_speedup},
                      {"joules_per_token", std::isnan(joules_per_token) ? nlohmann::json() : nlohmann::json(joules_per_token)},
                      {"layers", config.n_layers},
                      {"vocab", config.vocab_size},
                      {"model_type", config.model_type},
                      {"synthetic", options.synthetic},
                      {"threads", cpu::num_threads()}};
      if (on_gpu) {
        record.extra["lm_head"] = !is_prefill;
        record.extra["graphs"] = !options.no_graphs;
        record.extra["ffn_dispatch"] = !twell_only;
        if (is_prefill && !std::isnan(times.prefill_twell_fraction)) {
          record.extra["ffn_calls_twell_fraction"] = times.prefill_twell_fraction;
          record.extra["ffn_calls_split_fraction"] = times.prefill_split_fraction;
          record.extra["ffn_calls_measured_fraction"] = times.prefill_measured_fraction;
          if (!std::isnan(times.prefill_split_hot_fraction))
            record.extra["ffn_split_hot_fraction"] = times.prefill_split_hot_fraction;
        }
        if (is_prefill) {
          record.extra["prefill_warmups"] = times.prefill_warmups;
          for (const auto& [stage, ms] : times.prefill_stage_ms) record.extra["stage_ms"][stage] = ms;
        }
        record.extra["neuron_order_tokens"] = order_neurons ? options.order_tokens : 0;
        if (!is_prefill) record.extra["decode_context"] = options.decode_context;
      }
      if (!predictor_info.is_null()) record.extra["predictor"] = predictor_info;
      records.push_back(record);
    }
  }
#ifdef TWELL_HAVE_CUDA
  if (on_gpu && !energy->available()) fmt::print("joules per token: n/a ({})\n", energy->why_unavailable());
#endif
  if (!options.json_path.empty()) {
    write_bench_json(options.json_path, records);
    fmt::print("wrote {}\n", options.json_path);
  }
}

}  // namespace

void add_bench_model(CLI::App& bench) {
  auto options = std::make_shared<BenchModelOptions>();
  CLI::App* command = bench.add_subcommand("model", "prefill and decode tokens/s of a model, dense vs sparse FFN");
  command->add_option("-m,--model", options->model_dir, "checkpoint directory")->check(CLI::ExistingDirectory);
  command->add_option("--synthetic", options->synthetic, "instead of -m: random weights of a named shape (2b, tiny)");
  command->add_option("--density", options->density, "synthetic models: FFN density of the standard workload")
      ->capture_default_str();
  command->add_option("--ffn", options->paths,
                      "FFN paths to time: dense, twell, predict, and on cuda twell-only (TwELL without the dense "
                      "fallback); default dense, and twell, predict for ReLU models")
      ->delimiter(',');
  command->add_option("--prompt-tokens", options->prompt_tokens, "prefill length")->capture_default_str();
  command->add_option("--decode-tokens", options->decode_tokens, "decode steps after the prefill")->capture_default_str();
  command->add_option("--batch", options->batch, "cuda: sequences in the prefill")->capture_default_str();
  command->add_option("--decode-batch", options->decode_batch, "cuda: sequences decoded together")->capture_default_str();
  command->add_option("--decode-context", options->decode_context, "cuda: prompt tokens before the timed decode steps")
      ->capture_default_str();
  command->add_option("--calibration-tokens", options->calibration_tokens, "predict path: random calibration tokens")
      ->capture_default_str();
  command->add_option("--order-tokens", options->order_tokens,
                      "cuda, relu models: order each layer's FFN neurons by how many of this many random tokens "
                      "activate them, so the twell path can run the most active densely beside TwELL (0: keep the "
                      "checkpoint's order)")
      ->capture_default_str();
  command->add_option("--reps", options->reps, "repetitions (after one warm-up)")->capture_default_str();
  command->add_option("--threads", options->threads, "CPU threads (0 = all cores)")->capture_default_str();
  command->add_option("--recall", options->recall, "predict path: calibration recall")->capture_default_str();
  command->add_option("--seed", options->seed, "seed of the prompts and of synthetic weights")->capture_default_str();
  command->add_option("--device", options->device, "cpu or cuda")->capture_default_str();
  command->add_flag("--no-graphs", options->no_graphs, "cuda: launch decode steps one kernel at a time");
  command->add_option("--json", options->json_path, "write the records to this JSON file");
  command->callback([options] { run_bench_model(*options); });
}

}  // namespace twell::cli
