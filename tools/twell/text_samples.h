// A text as the CLI's measuring commands read it: its first tokens, cut into windows of fresh
// context, and the FFN inputs a model sees on it (the decode predictor's calibration and report).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "twell/model.h"
#include "twell/tokenizer.h"

namespace twell::cli {

struct TextSamples {
  int64_t tokens = 0;                    // rows of every layer's inputs
  int32_t windows = 0;
  int64_t window_rows = 0;               // rows of every window but the last, which may be shorter
  std::vector<std::vector<float>> ffn_inputs;  // per layer [tokens, D]
};

// The first max_tokens tokens of `text_file` (at least one), tokenized with `tokenizer`.
std::vector<int32_t> text_tokens(const Tokenizer& tokenizer, const std::string& text_file, int32_t max_tokens);

// Text tokens per window: at most `window`, and with the BOS in front (when bos >= 0) within the
// model's positions.
int32_t window_span(const ModelConfig& config, int32_t window, int32_t bos);

// The first max_tokens tokens of `text_file` (tokenized with the checkpoint's tokenizer), run on the
// exact dense path in windows of `window` tokens, each a fresh context with the tokenizer's BOS in
// front when it has one (BOS rows are kept: decoding sees them too).
TextSamples text_ffn_inputs(Model& model, const std::string& model_dir, const std::string& text_file,
                            int32_t max_tokens, int32_t window);

// Rows [begin, end) of every layer's inputs, as new samples.
TextSamples slice_rows(const TextSamples& samples, int64_t begin, int64_t end, int32_t d_model);

}  // namespace twell::cli
