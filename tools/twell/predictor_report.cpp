// `twell predictor-report`: how well the decode predictors do on a real checkpoint and text. The
// text's tokens go through the exact dense path; each layer's FFN inputs are split into a
// calibration part (the first --calibrate-fraction of the windows) and an evaluation part. Each
// predictor is calibrated for --recall on the first and measured on the second, so the recall shown
// is what a calibration achieves on text it has not seen. Per layer and predictor: recall,
// precision, truly active and predicted neurons per token, the predicted set as a multiple of the
// active set, and the decode FFN's relative L2 error against the exact FFN (everything predicted).
// Each layer's exact columns (choose_exact_columns, at most --exact-columns; 0 = none) are chosen on
// the calibration part too. --stored measures instead the calibration stored with the model
// (twell_predictor.json, with its exact columns) on the whole text: how a calibration made on one
// text holds on another.
#include <algorithm>
#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "text_samples.h"
#include "twell/convert.h"
#include "twell/cpu.h"
#include "twell/decode.h"
#include "twell/error.h"
#include "twell/model.h"

namespace twell::cli {
namespace {

struct ReportOptions {
  std::string model_dir;
  std::string text_file;
  std::string kind = "all";
  double recall = 0.99;
  double calibrate_fraction = 0.5;
  int32_t max_tokens = 4096;
  int32_t window = 256;
  std::string out_prefix = "twell-predictor";
  int threads = 0;
  bool stored = false;
  int exact_columns = kMaxExactColumns;
};

// Relative L2 error of the decode FFN with `predictor` against the same FFN with every neuron
// predicted active (the exact result of the same fp32 kernels), over all rows of x [rows, D].
double decode_ffn_error(const float* x, int64_t rows, const FfnWeights& weights, const SignBits& signs,
                        const PredictorConfig& predictor) {
  const PredictorConfig keep_all = keeps_every_neuron();
  const int32_t cols = weights.d_model;
  std::vector<float> y(static_cast<size_t>(kDecodeMaxRows) * cols), y_exact(y.size());
  cpu::DecodeScratch scratch;
  double error = 0, norm = 0;
  for (int64_t begin = 0; begin < rows; begin += kDecodeMaxRows) {
    const int64_t count = std::min<int64_t>(kDecodeMaxRows, rows - begin);
    cpu::decode_ffn(x + begin * cols, count, weights, signs, predictor, y.data(), scratch,
                    {.gates = GateSelection::predicted});  // the predictor's error, at any M
    cpu::decode_ffn(x + begin * cols, count, weights, signs, keep_all, y_exact.data(), scratch);
    for (int64_t i = 0; i < count * cols; ++i) {
      error += std::pow(static_cast<double>(y[i]) - y_exact[i], 2);
      norm += std::pow(static_cast<double>(y_exact[i]), 2);
    }
  }
  return norm == 0 ? std::sqrt(error) : std::sqrt(error / norm);
}

struct Row {
  int32_t layer;
  PredictorKind kind;
  int32_t exact_columns;  // how many the layer's sign bits keep exact
  double setting;  // alpha or margin
  double calibration_recall;
  PredictorQuality quality;  // on the evaluation part
  double ffn_error;
};

void run_report(const ReportOptions& options) {
  TWELL_REQUIRE(options.calibrate_fraction > 0 && options.calibrate_fraction < 1,
                "--calibrate-fraction must lie in (0, 1), got {}", options.calibrate_fraction);
  std::vector<PredictorKind> kinds;
  if (options.kind == "all")
    kinds = {PredictorKind::sign_rule, PredictorKind::one_bit_gate, PredictorKind::normalized_one_bit_gate,
             PredictorKind::two_bit_gate};
  else
    kinds = {parse_predictor_kind(options.kind)};
  cpu::set_num_threads(options.threads);
  Model model = Model::load(options.model_dir);
  const ModelConfig& config = model.config();
  TWELL_REQUIRE(config.activation == FfnActivation::relu,
                "predictor-report needs a ReLU FFN; this model's activation is {}", to_string(config.activation));
  const std::vector<LayerPredictor> stored = model.predictor();
  TWELL_REQUIRE(!options.stored || !stored.empty(), "--stored: {} has no twell_predictor.json (run `twell calibrate -m "
                "{} -f TEXT` first)", options.model_dir, options.model_dir);
  const TextSamples all = text_ffn_inputs(model, options.model_dir, options.text_file, options.max_tokens, options.window);
  TWELL_REQUIRE(options.stored || all.windows >= 2, "the text gives {} window(s) of {} tokens; it takes two, one to "
                "calibrate and one to measure (a longer text or a smaller --window)", all.windows, options.window);
  // Split on a window boundary so no context is shared between the two parts; --stored measures all.
  const int32_t calibration_windows =
      options.stored ? 0
                     : std::clamp(static_cast<int32_t>(std::lround(options.calibrate_fraction * all.windows)), 1,
                                  all.windows - 1);
  const int64_t boundary = all.window_rows * calibration_windows;
  const TextSamples calibration = slice_rows(all, 0, boundary, config.d_model);
  const TextSamples evaluation = slice_rows(all, boundary, all.tokens, config.d_model);
  if (options.stored) {
    kinds.clear();
    for (const LayerPredictor& layer : stored)
      if (std::find(kinds.begin(), kinds.end(), layer.config.kind) == kinds.end()) kinds.push_back(layer.config.kind);
  }

  std::vector<Row> rows;
  for (int32_t l = 0; l < config.n_layers; ++l) {
    const FfnWeights& weights = model.weights().layers[l].ffn;
    const float* projection = weights.relu_projection().data();
    const std::vector<int32_t> exact_columns =
        options.stored ? stored[l].exact_columns
                       : choose_exact_columns(calibration.ffn_inputs[l].data(), calibration.tokens, projection,
                                              config.d_hidden, config.d_model, options.exact_columns);
    const SignBits signs = pack_sign_bits(projection, config.d_hidden, config.d_model, exact_columns);
    const int32_t exact_count = static_cast<int32_t>(exact_columns.size());
    if (options.stored) {
      const PredictorConfig& c = stored[l].config;
      const PredictorQuality q = measure_predictor(evaluation.ffn_inputs[l].data(), evaluation.tokens, weights, signs, c);
      const double error = decode_ffn_error(evaluation.ffn_inputs[l].data(), evaluation.tokens, weights, signs, c);
      rows.push_back({l, c.kind, exact_count, c.kind == PredictorKind::sign_rule ? c.alpha : c.margin, NAN, q, error});
      continue;
    }
    for (PredictorKind kind : kinds) {
      const Calibration c = calibrate_predictor(calibration.ffn_inputs[l].data(), calibration.tokens, weights, signs,
                                                kind, options.recall);
      const PredictorQuality q =
          measure_predictor(evaluation.ffn_inputs[l].data(), evaluation.tokens, weights, signs, c.config);
      const double error = decode_ffn_error(evaluation.ffn_inputs[l].data(), evaluation.tokens, weights, signs, c.config);
      rows.push_back({l, kind, exact_count, kind == PredictorKind::sign_rule ? c.config.alpha : c.config.margin,
                      c.quality.recall(), q, error});
    }
  }

  if (options.stored)
    fmt::print("{}: {} layers, D={}, H={}; {} tokens of {}, all measured with {}/twell_predictor.json\n",
               config.model_type, config.n_layers, config.d_model, config.d_hidden, all.tokens, options.text_file,
               options.model_dir);
  else
    fmt::print("{}: {} layers, D={}, H={}; {} tokens of {}: {} calibrate, {} measure; target recall {}\n",
               config.model_type, config.n_layers, config.d_model, config.d_hidden, all.tokens, options.text_file,
               calibration.tokens, evaluation.tokens, options.recall);
  fmt::print("{:>5} {:>12} {:>5} {:>11} {:>8} {:>9} {:>9} {:>10} {:>12} {:>10} {:>10}\n", "layer", "kind", "exact",
             "alpha/margin", "recall", "precision", "active/t", "predicted/t", "pred/active", "pred %", "FFN rel err");
  std::ofstream csv(options.out_prefix + ".csv");
  TWELL_REQUIRE(csv.good(), "cannot write '{}.csv'", options.out_prefix);
  csv << "layer,kind,exact_columns,setting,calibration_recall,recall,precision,active_per_token,predicted_per_token,"
         "predicted_over_active,predicted_fraction,ffn_rel_err\n";
  nlohmann::json json_rows = nlohmann::json::array();
  const auto print = [&](const std::string& layer, PredictorKind kind, const std::string& exact,
                         const std::string& setting, double recall, double precision, double active, double predicted,
                         double ratio, double fraction, double error) {
    fmt::print("{:>5} {:>12} {:>5} {:>11} {:>8.4f} {:>9.4f} {:>9.1f} {:>10.1f} {:>11.2f}x {:>9.2f}% {:>10.2e}\n", layer,
               to_string(kind), exact, setting, recall, precision, active, predicted, ratio, 100 * fraction, error);
  };
  const double per_token = 1.0 / static_cast<double>(evaluation.tokens);
  for (const Row& r : rows) {
    const PredictorQuality& q = r.quality;
    print(std::to_string(r.layer), r.kind, std::to_string(r.exact_columns), fmt::format("{:.4g}", r.setting), q.recall(),
          q.precision(), q.active * per_token, q.predicted * per_token, q.predicted_over_active(), q.predicted_fraction(),
          r.ffn_error);
    csv << fmt::format("{},{},{},{:.9g},{:.6f},{:.6f},{:.6f},{:.3f},{:.3f},{:.4f},{:.6f},{:.6e}\n", r.layer,
                       to_string(r.kind), r.exact_columns, r.setting, r.calibration_recall, q.recall(), q.precision(),
                       q.active * per_token, q.predicted * per_token, q.predicted_over_active(), q.predicted_fraction(),
                       r.ffn_error);
    json_rows.push_back({{"layer", r.layer}, {"kind", to_string(r.kind)}, {"exact_columns", r.exact_columns},
                         {"setting", r.setting},
                         {"calibration_recall", r.calibration_recall}, {"recall", q.recall()},
                         {"precision", q.precision()}, {"active_per_token", q.active * per_token},
                         {"predicted_per_token", q.predicted * per_token},
                         {"predicted_over_active", q.predicted_over_active()},
                         {"predicted_fraction", q.predicted_fraction()}, {"ffn_rel_err", r.ffn_error}});
  }
  // The yardstick: averages over layers (each layer weighs the same).
  nlohmann::json means = nlohmann::json::object();
  for (PredictorKind kind : kinds) {
    double recall = 0, precision = 0, active = 0, predicted = 0, ratio = 0, fraction = 0, error = 0;
    int32_t n = 0;
    for (const Row& r : rows) {
      if (r.kind != kind) continue;
      recall += r.quality.recall();
      precision += r.quality.precision();
      active += r.quality.active * per_token;
      predicted += r.quality.predicted * per_token;
      ratio += r.quality.predicted_over_active();
      fraction += r.quality.predicted_fraction();
      error += r.ffn_error;
      ++n;
    }
    print("mean", kind, "", "", recall / n, precision / n, active / n, predicted / n, ratio / n, fraction / n, error / n);
    means[to_string(kind)] = {{"recall", recall / n},          {"precision", precision / n},
                              {"active_per_token", active / n}, {"predicted_per_token", predicted / n},
                              {"predicted_over_active", ratio / n}, {"predicted_fraction", fraction / n},
                              {"ffn_rel_err", error / n}};
  }
  std::ofstream json(options.out_prefix + ".json");
  TWELL_REQUIRE(json.good(), "cannot write '{}.json'", options.out_prefix);
  json << nlohmann::json{{"model", options.model_dir},
                         {"text", options.text_file},
                         {"d_model", config.d_model},
                         {"d_hidden", config.d_hidden},
                         {"stored_calibration", options.stored},
                         {"max_exact_columns", options.stored ? -1 : options.exact_columns},
                         {"target_recall", options.recall},
                         {"calibration_tokens", calibration.tokens},
                         {"evaluation_tokens", evaluation.tokens},
                         {"layers", json_rows},
                         {"mean_over_layers", means}}
              .dump(1)
       << "\n";
  fmt::print("wrote {}.csv, {}.json\n", options.out_prefix, options.out_prefix);
}

}  // namespace

void add_predictor_report(CLI::App& app) {
  auto options = std::make_shared<ReportOptions>();
  CLI::App* command = app.add_subcommand(
      "predictor-report", "decode predictor quality per layer on a checkpoint and a text: table, CSV and JSON");
  command->add_option("-m,--model", options->model_dir, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  command->add_option("-f,--file", options->text_file, "text file")->required()->check(CLI::ExistingFile);
  command->add_option("--kind", options->kind, "predictor: sign, one-bit, one-bit-norm, two-bit-norm or all")->capture_default_str();
  command->add_option("--recall", options->recall, "target recall each predictor is calibrated for")
      ->capture_default_str();
  command->add_option("--calibrate-fraction", options->calibrate_fraction,
                      "fraction of the text's windows used to calibrate (the rest measures)")
      ->capture_default_str();
  command->add_option("--max-tokens", options->max_tokens, "tokens of the file to use")->capture_default_str();
  command->add_option("--window", options->window, "tokens per forward pass (fresh context each)")->capture_default_str();
  command->add_option("-o,--out", options->out_prefix, "output prefix: PREFIX.csv, PREFIX.json")->capture_default_str();
  command->add_option("--threads", options->threads, "CPU threads (0 = all cores)")->capture_default_str();
  command->add_option("--exact-columns", options->exact_columns,
                      "at most this many exact columns per layer, chosen on the calibration part (0 = none)")
      ->capture_default_str()
      ->check(CLI::Range(0, kMaxExactColumns));
  command->add_flag("--stored", options->stored,
                    "measure the model's stored twell_predictor.json on the whole text instead of calibrating");
  command->callback([options] { run_report(*options); });
}

}  // namespace twell::cli
