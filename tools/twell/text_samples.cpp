#include "text_samples.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "progress.h"
#include "twell/error.h"

namespace twell::cli {

std::vector<int32_t> text_tokens(const Tokenizer& tokenizer, const std::string& text_file, int32_t max_tokens) {
  TWELL_REQUIRE(max_tokens >= 1, "--max-tokens must be >= 1, got {}", max_tokens);
  std::ifstream stream(text_file, std::ios::binary);
  TWELL_REQUIRE(stream.good(), "cannot read '{}'", text_file);
  std::stringstream text;
  text << stream.rdbuf();
  std::vector<int32_t> tokens = tokenizer.encode(text.str());
  if (static_cast<int32_t>(tokens.size()) > max_tokens) tokens.resize(max_tokens);
  TWELL_REQUIRE(!tokens.empty(), "'{}' has no tokens", text_file);
  return tokens;
}

int32_t window_span(const ModelConfig& config, int32_t window, int32_t bos) {
  TWELL_REQUIRE(window >= 1, "--window must be >= 1, got {}", window);
  const int32_t span = std::min(window, config.max_positions - (bos >= 0 ? 1 : 0));
  TWELL_REQUIRE(span >= 1, "max_position_embeddings = {} leaves no room for a window", config.max_positions);
  return span;
}

TextSamples text_ffn_inputs(Model& model, const std::string& model_dir, const std::string& text_file,
                            int32_t max_tokens, int32_t window) {
  const std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(model_dir);
  const std::vector<int32_t> tokens = text_tokens(*tokenizer, text_file, max_tokens);
  const int32_t bos = tokenizer->bos_token();
  const int32_t span = window_span(model.config(), window, bos);

  TextSamples samples;
  samples.ffn_inputs.resize(model.config().n_layers);
  Progress progress("twell: through the model", static_cast<int64_t>(tokens.size()), "tokens");
  for (size_t start = 0; start < tokens.size(); start += span) {
    std::vector<int32_t> chunk(tokens.begin() + start, tokens.begin() + std::min(tokens.size(), start + span));
    if (bos >= 0) chunk.insert(chunk.begin(), bos);
    const std::vector<std::vector<float>> inputs = model.ffn_inputs(chunk);
    for (size_t l = 0; l < inputs.size(); ++l)
      samples.ffn_inputs[l].insert(samples.ffn_inputs[l].end(), inputs[l].begin(), inputs[l].end());
    if (samples.windows == 0) samples.window_rows = static_cast<int64_t>(chunk.size());
    samples.tokens += static_cast<int64_t>(chunk.size());
    ++samples.windows;
    progress.update(static_cast<int64_t>(std::min(tokens.size(), start + span)));
  }
  return samples;
}

TextSamples slice_rows(const TextSamples& samples, int64_t begin, int64_t end, int32_t d_model) {
  TWELL_REQUIRE(0 <= begin && begin <= end && end <= samples.tokens, "slice_rows: [{}, {}) outside [0, {})", begin, end,
                samples.tokens);
  TextSamples slice;
  slice.tokens = end - begin;
  for (const std::vector<float>& layer : samples.ffn_inputs)
    slice.ffn_inputs.emplace_back(layer.begin() + begin * d_model, layer.begin() + end * d_model);
  return slice;
}

}  // namespace twell::cli
