// `twell bench model`: prefill and decode throughput of a checkpoint on the CPU, for each FFN path,
// mean ± stddev over repetitions; table plus JSON records (include/twell/bench_record.h).
// Prompts are random token ids (seeded): throughput does not depend on the text.
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "commands.h"
#include "timing.h"
#include "twell/bench_record.h"
#include "twell/cpu.h"
#include "twell/error.h"
#include "twell/model.h"

namespace twell::cli {
namespace {

struct BenchModelOptions {
  std::string model_dir;
  std::vector<std::string> paths;  // empty: dense, plus twell and predict for ReLU models
  int32_t prompt_tokens = 128;
  int32_t decode_tokens = 32;
  int reps = 5;
  int threads = 0;
  double recall = 0.99;
  uint64_t seed = 1;
  std::string device = "cpu";
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

void run_bench_model(const BenchModelOptions& options) {
  TWELL_REQUIRE(options.device == "cpu", "--device {}: the model runtime has only the CPU backend so far", options.device);
  TWELL_REQUIRE(options.reps >= 1, "--reps must be >= 1, got {}", options.reps);
  TWELL_REQUIRE(options.prompt_tokens >= 1 && options.decode_tokens >= 1, "--prompt-tokens and --decode-tokens must be >= 1");
  cpu::set_num_threads(options.threads);
  Model model = Model::load(options.model_dir);
  const ModelConfig& config = model.config();
  const int32_t capacity = options.prompt_tokens + options.decode_tokens;
  TWELL_REQUIRE(capacity <= config.max_positions, "{} prompt + {} decode tokens exceed max_position_embeddings = {}",
                options.prompt_tokens, options.decode_tokens, config.max_positions);
  std::vector<std::string> paths = options.paths;
  if (paths.empty()) paths = config.activation == FfnActivation::relu ? std::vector<std::string>{"dense", "twell", "predict"}
                                                                       : std::vector<std::string>{"dense"};

  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<int32_t> any_token(0, config.vocab_size - 1);
  std::vector<int32_t> prompt(options.prompt_tokens);
  for (int32_t& token : prompt) token = any_token(rng);
  std::vector<float> logits(config.vocab_size);

  std::vector<BenchRecord> records;
  double dense_prefill = 0, dense_decode = 0;
  fmt::print("{}: {} layers, D={}, H={}, V={}, {} threads; prompt {} tokens, decode {} tokens, {} reps\n",
             config.model_type, config.n_layers, config.d_model, config.d_hidden, config.vocab_size, cpu::num_threads(),
             options.prompt_tokens, options.decode_tokens, options.reps);
  fmt::print("{:>8} {:>22} {:>22} {:>9} {:>9}\n", "ffn", "prefill tok/s", "decode tok/s", "x dense", "x dense");
  for (const std::string& name : paths) {
    const FfnPath path = parse_ffn_path(name);
    model.set_ffn_path(path);
    if (path == FfnPath::predict) model.calibrate_predictor(prompt, PredictorKind::one_bit_gate, options.recall);
    std::vector<double> prefill_ms, decode_ms, prefill_rate, decode_rate;
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
      if (rep < 0) continue;
      prefill_ms.push_back(prefill);
      decode_ms.push_back(decode);
      prefill_rate.push_back(options.prompt_tokens / (prefill / 1e3));
      decode_rate.push_back(options.decode_tokens / (decode / 1e3));
    }
    const MeanStd prefill = mean_std(prefill_rate), decode = mean_std(decode_rate);
    if (path == FfnPath::dense) {
      dense_prefill = prefill.mean;
      dense_decode = decode.mean;
    }
    const double prefill_speedup = dense_prefill > 0 ? prefill.mean / dense_prefill : NAN;
    const double decode_speedup = dense_decode > 0 ? decode.mean / dense_decode : NAN;
    fmt::print("{:>8} {:>12.1f} ± {:>7.1f} {:>12.1f} ± {:>7.1f} {:>8.2f}x {:>8.2f}x\n", name, prefill.mean, prefill.stddev,
               decode.mean, decode.stddev, prefill_speedup, decode_speedup);
    for (const bool is_prefill : {true, false}) {
      BenchRecord record;
      record.bench = "model";
      record.device = "cpu";
      record.gpu_name = cpu_model_name();
      record.impl = name;
      record.M = is_prefill ? options.prompt_tokens : 1;
      record.D = config.d_model;
      record.H = config.d_hidden;
      record.timing = summarize_ms(is_prefill ? prefill_ms : decode_ms);
      record.commit = build_commit();
      record.date = today_utc();
      const MeanStd& rate = is_prefill ? prefill : decode;
      record.extra = {{"phase", is_prefill ? "prefill" : "decode"},
                      {"tokens", is_prefill ? options.prompt_tokens : options.decode_tokens},
                      {"tokens_per_s_mean", rate.mean},
                      {"tokens_per_s_stddev", rate.stddev},
                      {"speedup_vs_dense", is_prefill ? prefill_speedup : decode_speedup},
                      {"layers", config.n_layers},
                      {"vocab", config.vocab_size},
                      {"model_type", config.model_type},
                      {"threads", cpu::num_threads()}};
      records.push_back(record);
    }
  }
  if (!options.json_path.empty()) {
    write_bench_json(options.json_path, records);
    fmt::print("wrote {}\n", options.json_path);
  }
}

}  // namespace

void add_bench_model(CLI::App& bench) {
  auto options = std::make_shared<BenchModelOptions>();
  CLI::App* command = bench.add_subcommand("model", "prefill and decode tokens/s of a checkpoint, dense vs sparse FFN");
  command->add_option("-m,--model", options->model_dir, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  command->add_option("--ffn", options->paths, "FFN paths to time (default: dense, and twell, predict for ReLU models)")
      ->delimiter(',');
  command->add_option("--prompt-tokens", options->prompt_tokens, "prefill length")->capture_default_str();
  command->add_option("--decode-tokens", options->decode_tokens, "decode steps after the prefill")->capture_default_str();
  command->add_option("--reps", options->reps, "repetitions (after one warm-up)")->capture_default_str();
  command->add_option("--threads", options->threads, "CPU threads (0 = all cores)")->capture_default_str();
  command->add_option("--recall", options->recall, "predict path: calibration recall on the prompt")->capture_default_str();
  command->add_option("--seed", options->seed, "seed of the random prompt")->capture_default_str();
  command->add_option("--device", options->device, "cpu (the CUDA runtime is not written yet)")->capture_default_str();
  command->add_option("--json", options->json_path, "write the records to this JSON file");
  command->callback([options] { run_bench_model(*options); });
}

}  // namespace twell::cli
