// `twell calibrate`: chooses the decode predictor's per-layer setting (alpha for the sign rule,
// margin for the gates) for a target recall on sample tokens (include/twell/decode.h), after choosing
// each layer's exact columns on the same tokens (choose_exact_columns, at most --exact-columns).
//   -m DIR -f TEXT   a checkpoint, on the FFN inputs of a text: the result is stored with the model
//                    as DIR/twell_predictor.json (twell/predictor_store.h), which Model::load reads.
//   otherwise        the one layer of the synthetic workload (speed studies only: its sign agreement
//                    is not a real model's); printed and, with --json, written as {"layers": [{...}]}.
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "twell/cpu.h"
#include "twell/decode.h"
#include "twell/error.h"
#include "twell/model.h"
#include "twell/predictor_store.h"
#include "twell/workload.h"
#include "text_samples.h"

namespace twell::cli {
namespace {

struct CalibrateOptions {
  int32_t d_model = 2048;
  int32_t d_hidden = 5632;
  double density = 0.005;
  int64_t rows = 512;
  double recall = 0.99;
  std::string predictor;  // synthetic: both by default; a model: two-bit-norm (the best measured on a real model)
  uint64_t seed = 1;
  int threads = 0;
  std::string json_path;
  std::string model_dir;
  std::string text_file;
  int32_t max_tokens = 4096;
  int32_t window = 256;
  int exact_columns = kMaxExactColumns;
};

void calibrate_model(const CalibrateOptions& options) {
  TWELL_REQUIRE(!options.text_file.empty(), "-m needs -f TEXT: the text whose FFN inputs calibrate the predictor");
  TWELL_REQUIRE(options.predictor != "both" && options.predictor != "all",
                "--predictor {}: a model stores one predictor kind", options.predictor);
  const PredictorKind kind = parse_predictor_kind(options.predictor.empty() ? "two-bit-norm" : options.predictor);
  cpu::set_num_threads(options.threads);
  Model model = Model::load(options.model_dir);
  const ModelConfig& config = model.config();
  TWELL_REQUIRE(config.activation == FfnActivation::relu, "calibrate: the predictor needs a ReLU FFN; this model's "
                "activation is {}", to_string(config.activation));
  const TextSamples samples = text_ffn_inputs(model, options.model_dir, options.text_file, options.max_tokens,
                                              options.window);
  PredictorRecord record{options.recall, samples.tokens, options.text_file, {}};
  fmt::print("{}: {} layers, D={}, H={}; {} sample tokens of {}; {} for recall {}\n", config.model_type,
             config.n_layers, config.d_model, config.d_hidden, samples.tokens, options.text_file, to_string(kind),
             options.recall);
  for (int32_t l = 0; l < config.n_layers; ++l) {
    const FfnWeights& weights = model.weights().layers[l].ffn;
    const SignBits signs =
        pack_sign_bits_for_samples(samples.ffn_inputs[l].data(), samples.tokens, weights, options.exact_columns);
    record.layers.push_back(calibrate_predictor(samples.ffn_inputs[l].data(), samples.tokens, weights, signs, kind,
                                                options.recall));
    const Calibration& c = record.layers.back();
    fmt::print("  layer {:>3}: {} = {:.6g}, exact columns [{}]: recall {:.4f}, predicted {:.2f}% of neurons ({:.1f}x the "
               "active set)\n",
               l, kind == PredictorKind::sign_rule ? "alpha" : "margin",
               kind == PredictorKind::sign_rule ? c.config.alpha : c.config.margin, fmt::join(c.exact_columns, ", "),
               c.quality.recall(), 100 * c.quality.predicted_fraction(), c.quality.predicted_over_active());
  }
  save_predictor_record(options.model_dir, config, model.weights(), record);
  fmt::print("wrote {}/{}\n", options.model_dir, kPredictorFileName);
}

void run_calibrate(const CalibrateOptions& options) {
  if (!options.model_dir.empty()) return calibrate_model(options);
  TWELL_REQUIRE(options.rows >= 1, "--rows must be >= 1, got {}", options.rows);
  std::vector<PredictorKind> kinds;
  if (options.predictor.empty() || options.predictor == "both")
    kinds = {PredictorKind::one_bit_gate, PredictorKind::sign_rule};
  else if (options.predictor == "all")
    kinds = {PredictorKind::sign_rule, PredictorKind::one_bit_gate, PredictorKind::normalized_one_bit_gate,
             PredictorKind::two_bit_gate};
  else
    kinds = {parse_predictor_kind(options.predictor)};
  cpu::set_num_threads(options.threads);
  WorkloadSpec spec{.rows = 1, .d_model = options.d_model, .d_hidden = options.d_hidden, .density = options.density,
                    .seed = options.seed};
  const FfnWeights weights = make_workload(spec).weights;
  // Sample tokens drawn apart from the workload's own x, as calibration data would be.
  const std::vector<float> samples = make_activations(options.rows, options.d_model, options.seed + 7777);
  const SignBits signs = pack_sign_bits_for_samples(samples.data(), options.rows, weights, options.exact_columns);
  nlohmann::json layer = {{"layer", 0},
                          {"d_model", options.d_model},
                          {"d_hidden", options.d_hidden},
                          {"sample_tokens", options.rows},
                          {"target_recall", options.recall},
                          {"exact_columns", signs.exact_columns}};
  fmt::print("synthetic workload D={} H={} density={}, {} sample tokens, target recall {}, exact columns [{}]\n",
             options.d_model, options.d_hidden, options.density, options.rows, options.recall,
             fmt::join(signs.exact_columns, ", "));
  for (PredictorKind kind : kinds) {
    const Calibration c = calibrate_predictor(samples.data(), options.rows, weights, signs, kind, options.recall);
    fmt::print("  {:<8} {} = {:.6g}: recall {:.4f}, precision {:.4f}, predicted {:.2f}% of neurons ({:.1f}x the {:.1f} "
               "active per token)\n",
               to_string(kind), kind == PredictorKind::sign_rule ? "alpha" : "margin",
               kind == PredictorKind::sign_rule ? c.config.alpha : c.config.margin, c.quality.recall(),
               c.quality.precision(), 100 * c.quality.predicted_fraction(), c.quality.predicted_over_active(),
               static_cast<double>(c.quality.active) / options.rows);
    layer[to_string(kind)] = {{kind == PredictorKind::sign_rule ? "alpha" : "margin",
                               kind == PredictorKind::sign_rule ? c.config.alpha : c.config.margin},
                              {"recall", c.quality.recall()},
                              {"precision", c.quality.precision()},
                              {"predicted_fraction", c.quality.predicted_fraction()},
                              {"predicted_over_active", c.quality.predicted_over_active()}};
  }
  if (!options.json_path.empty()) {
    std::ofstream out(options.json_path);
    TWELL_REQUIRE(out.good(), "--json: cannot open '{}' for writing", options.json_path);
    out << nlohmann::json{{"layers", nlohmann::json::array({layer})}}.dump(2) << "\n";
    fmt::print("wrote {}\n", options.json_path);
  }
}

}  // namespace

void add_calibrate(CLI::App& app) {
  auto options = std::make_shared<CalibrateOptions>();
  CLI::App* command =
      app.add_subcommand("calibrate", "choose the decode predictor's alpha / margin for a target recall");
  command->add_option("--d", options->d_model, "synthetic: model width D")->capture_default_str();
  command->add_option("--h", options->d_hidden, "synthetic: FFN hidden width H")->capture_default_str();
  command->add_option("--density", options->density, "synthetic: target density of the relu projection")->capture_default_str();
  command->add_option("--rows", options->rows, "synthetic: sample tokens")->capture_default_str();
  command->add_option("--recall", options->recall, "target recall of the truly active neurons")->capture_default_str();
  command->add_option("-m,--model", options->model_dir, "checkpoint directory: calibrate its layers and store the "
                      "result as DIR/twell_predictor.json")->check(CLI::ExistingDirectory);
  command->add_option("-f,--file", options->text_file, "with -m: the sample text")->check(CLI::ExistingFile);
  command->add_option("--max-tokens", options->max_tokens, "with -m: tokens of the text to use")->capture_default_str();
  command->add_option("--window", options->window, "with -m: tokens per forward pass (fresh context each)")
      ->capture_default_str();
  command->add_option("--predictor", options->predictor, "sign, one-bit, one-bit-norm, two-bit-norm, both "
                      "(synthetic: one-bit and sign) or all (synthetic); default: both synthetic, two-bit-norm for a "
                      "model");
  command->add_option("--exact-columns", options->exact_columns,
                      "at most this many exact columns per layer, chosen on the sample tokens (0 = none)")
      ->capture_default_str()
      ->check(CLI::Range(0, kMaxExactColumns));
  command->add_option("--seed", options->seed, "workload seed")->capture_default_str();
  command->add_option("--threads", options->threads, "CPU threads, 0 = all cores")->capture_default_str();
  command->add_option("--json", options->json_path, "write the chosen settings to this file");
  command->callback([options] { run_calibrate(*options); });
}

}  // namespace twell::cli
