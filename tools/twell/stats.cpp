// `twell stats`: how sparse a model's FFN activations are on a text. Runs the text through the
// dense path in windows and counts, per layer, the active neurons (activation > 0) of every token
// and the neurons never active at all. Writes a per-layer summary CSV, a per-token CSV and an SVG.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "commands.h"
#include "progress.h"
#include "text_samples.h"
#include "twell/cpu.h"
#include "twell/error.h"
#include "twell/model.h"
#include "twell/tokenizer.h"

namespace twell::cli {
namespace {

struct StatsOptions {
  std::string model_dir;
  std::string text_file;
  std::string out_prefix = "twell-stats";
  int32_t max_tokens = 4096;
  int32_t window = 256;
  int threads = 0;
};

struct LayerCounts {
  std::vector<int32_t> active_per_token;  // [tokens]
  std::vector<int64_t> active_per_neuron; // [H] tokens on which the neuron was active
};

double percentile(std::vector<int32_t> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(std::min<double>(values.size() - 1, std::floor(q * values.size())))];
}

// Per-layer bars of the mean active fraction, with a p10..p90 whisker over tokens.
std::string svg_plot(const std::vector<LayerCounts>& layers, int32_t d_hidden, const std::string& title) {
  const int width = 720, height = 360, left = 60, bottom = 40, top = 40;
  const double plot_w = width - left - 20, plot_h = height - top - bottom;
  double max_fraction = 1e-6;
  for (const LayerCounts& layer : layers) max_fraction = std::max(max_fraction, percentile(layer.active_per_token, 0.9) / d_hidden);
  max_fraction *= 1.1;
  std::ostringstream svg;
  svg << fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">)", width, height)
      << "\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << fmt::format(R"(<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>)", width / 2, title) << "\n";
  for (int tick = 0; tick <= 4; ++tick) {
    const double value = max_fraction * tick / 4, y = top + plot_h * (1 - tick / 4.0);
    svg << fmt::format(R"(<line x1="{}" x2="{}" y1="{:.1f}" y2="{:.1f}" stroke="#ddd"/>)", left, width - 20, y, y)
        << fmt::format(R"(<text x="{}" y="{:.1f}" text-anchor="end">{:.2f}%</text>)", left - 5, y + 4, 100 * value) << "\n";
  }
  const double bar = plot_w / layers.size();
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<int32_t>& tokens = layers[i].active_per_token;
    double mean = 0;
    for (int32_t count : tokens) mean += count;
    mean /= std::max<size_t>(1, tokens.size()) * static_cast<double>(d_hidden);
    const double x = left + i * bar, y = top + plot_h * (1 - mean / max_fraction);
    svg << fmt::format(R"(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="#4477aa"/>)", x + bar * 0.1, y,
                       bar * 0.8, top + plot_h - y);
    const double p10 = top + plot_h * (1 - percentile(tokens, 0.1) / d_hidden / max_fraction);
    const double p90 = top + plot_h * (1 - percentile(tokens, 0.9) / d_hidden / max_fraction);
    svg << fmt::format(R"(<line x1="{:.1f}" x2="{:.1f}" y1="{:.1f}" y2="{:.1f}" stroke="black"/>)", x + bar / 2, x + bar / 2, p10, p90)
        << "\n";
    if (layers.size() <= 40 || i % 5 == 0)
      svg << fmt::format(R"(<text x="{:.1f}" y="{}" text-anchor="middle">{}</text>)", x + bar / 2, height - bottom + 15, i) << "\n";
  }
  svg << fmt::format(R"(<text x="{}" y="{}" text-anchor="middle">layer (bar: mean active fraction per token; line: p10..p90)</text>)",
                     width / 2, height - 8)
      << "\n</svg>\n";
  return svg.str();
}

void run_stats(const StatsOptions& options) {
  cpu::set_num_threads(options.threads);
  Model model = Model::load(options.model_dir);
  const std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(options.model_dir);
  const ModelConfig& config = model.config();
  const std::vector<int32_t> tokens = text_tokens(*tokenizer, options.text_file, options.max_tokens);
  const int32_t bos = tokenizer->bos_token();
  const int32_t window = window_span(config, options.window, bos);

  std::vector<LayerCounts> layers(config.n_layers);
  for (LayerCounts& layer : layers) layer.active_per_neuron.assign(config.d_hidden, 0);
  model.set_activation_observer([&](int32_t layer, const float* activations, int64_t rows) {
    LayerCounts& counts = layers[layer];
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = activations + r * config.d_hidden;  // [H]
      int32_t active = 0;
      for (int32_t j = 0; j < config.d_hidden; ++j) {
        if (row[j] > 0.0f) {
          ++active;
          ++counts.active_per_neuron[j];
        }
      }
      counts.active_per_token.push_back(active);
    }
  });

  // Windows of `window` tokens, each with a fresh context (BOS in front when the tokenizer has one).
  std::vector<float> logits(config.vocab_size);
  {
    Progress progress("twell stats", static_cast<int64_t>(tokens.size()), "tokens");
    for (size_t start = 0; start < tokens.size(); start += window) {
      std::vector<int32_t> chunk(tokens.begin() + start, tokens.begin() + std::min(tokens.size(), start + window));
      if (bos >= 0) chunk.insert(chunk.begin(), bos);
      KvCache cache = model.new_cache(static_cast<int32_t>(chunk.size()));
      model.forward(chunk.data(), static_cast<int32_t>(chunk.size()), cache, logits.data());
      progress.update(static_cast<int64_t>(std::min(tokens.size(), start + window)));
    }
  }

  const std::string summary_path = options.out_prefix + "-layers.csv";
  const std::string tokens_path = options.out_prefix + "-tokens.csv";
  const std::string svg_path = options.out_prefix + ".svg";
  std::ofstream summary(summary_path), per_token(tokens_path), svg(svg_path);
  TWELL_REQUIRE(summary.good() && per_token.good() && svg.good(), "cannot write the outputs with prefix '{}'",
                options.out_prefix);
  summary << "layer,tokens,d_hidden,mean_active,mean_fraction,p10_active,p50_active,p90_active,max_active,dead_neurons\n";
  per_token << "layer,token_index,token_id,active\n";
  fmt::print("{:>5} {:>12} {:>10} {:>8} {:>8} {:>12}\n", "layer", "mean active", "fraction", "p90", "max", "dead neurons");
  for (int32_t l = 0; l < config.n_layers; ++l) {
    const LayerCounts& counts = layers[l];
    double mean = 0;
    for (int32_t active : counts.active_per_token) mean += active;
    mean /= counts.active_per_token.size();
    const int64_t dead = std::count(counts.active_per_neuron.begin(), counts.active_per_neuron.end(), 0);
    const int32_t max_active = *std::max_element(counts.active_per_token.begin(), counts.active_per_token.end());
    summary << fmt::format("{},{},{},{:.3f},{:.6f},{},{},{},{},{}\n", l, counts.active_per_token.size(), config.d_hidden,
                           mean, mean / config.d_hidden, percentile(counts.active_per_token, 0.1),
                           percentile(counts.active_per_token, 0.5), percentile(counts.active_per_token, 0.9),
                           max_active, dead);
    // The observer saw the windows' tokens in order, BOS included when there is one.
    size_t index = 0;
    for (size_t start = 0; start < tokens.size(); start += window) {
      const size_t end = std::min(tokens.size(), start + window);
      if (bos >= 0) ++index;  // skip the BOS row of the window
      for (size_t t = start; t < end; ++t, ++index)
        per_token << fmt::format("{},{},{},{}\n", l, t, tokens[t], counts.active_per_token[index]);
    }
    fmt::print("{:>5} {:>12.1f} {:>9.3f}% {:>8} {:>8} {:>12}\n", l, mean, 100 * mean / config.d_hidden,
               percentile(counts.active_per_token, 0.9), max_active, dead);
  }
  svg << svg_plot(layers, config.d_hidden,
                  fmt::format("{}: active FFN neurons ({}, {} tokens)", config.model_type, to_string(config.activation),
                              tokens.size()));
  fmt::print("wrote {}, {}, {}\n", summary_path, tokens_path, svg_path);
}

}  // namespace

void add_stats(CLI::App& app) {
  auto options = std::make_shared<StatsOptions>();
  CLI::App* command = app.add_subcommand("stats", "FFN activation sparsity of a model on a text: CSV and SVG");
  command->add_option("-m,--model", options->model_dir, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  command->add_option("-f,--file", options->text_file, "text file")->required()->check(CLI::ExistingFile);
  command->add_option("-o,--out", options->out_prefix, "output prefix: PREFIX-layers.csv, PREFIX-tokens.csv, PREFIX.svg")
      ->capture_default_str();
  command->add_option("--max-tokens", options->max_tokens, "tokens of the file to use")->capture_default_str();
  command->add_option("--window", options->window, "tokens per forward pass (fresh context each)")->capture_default_str();
  command->add_option("--threads", options->threads, "CPU threads (0 = all cores)")->capture_default_str();
  command->callback([options] { run_stats(*options); });
}

}  // namespace twell::cli
