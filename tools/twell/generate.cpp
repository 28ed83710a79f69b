// `twell generate`: load a checkpoint directory, tokenize the prompt, stream the continuation.
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>

#include <fmt/format.h>

#include "commands.h"
#include "twell/cpu.h"
#include "twell/error.h"
#include "twell/model.h"
#include "twell/tokenizer.h"
#ifdef TWELL_HAVE_CUDA
#include "twell/cuda.h"
#include "twell/model_cuda.h"
#endif

namespace twell::cli {
namespace {

struct GenerateOptions {
  std::string model_dir;
  std::string prompt;
  int32_t new_tokens = 64;
  std::string ffn = "dense";
  std::string device = "cpu";
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  bool ignore_eos = false;
  int threads = 0;
  double recall = 0.99;
  std::string predictor = "one-bit";
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void run_generate(const GenerateOptions& options) {
  TWELL_REQUIRE(options.device == "cpu" || options.device == "cuda", "--device must be cpu or cuda, got '{}'",
                options.device);
#ifndef TWELL_HAVE_CUDA
  TWELL_REQUIRE(options.device == "cpu", "--device cuda: this twell was built without CUDA");
#endif
  TWELL_REQUIRE(options.new_tokens >= 0, "-n must be >= 0, got {}", options.new_tokens);
  cpu::set_num_threads(options.threads);
  const FfnPath path = parse_ffn_path(options.ffn);
  Sampler sampler(SamplerConfig{options.temperature, options.top_k, options.top_p, options.seed});  // checks them

  const auto load_start = std::chrono::steady_clock::now();
  Model model = Model::load(options.model_dir);
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(options.model_dir);
  const bool stored_predictor = !model.predictor().empty();  // the checkpoint's twell_predictor.json
  model.set_ffn_path(path);
  const ModelConfig& config = model.config();
  TWELL_REQUIRE(tokenizer->vocab_size() <= config.vocab_size,
                "the tokenizer has {} tokens but the model's vocabulary only {}", tokenizer->vocab_size(),
                config.vocab_size);
  std::fprintf(stderr, "twell: %s, %d layers, D=%d, H=%d, %s FFN; loaded in %.2f s\n", config.model_type.c_str(),
               config.n_layers, config.d_model, config.d_hidden, to_string(config.activation).c_str(),
               seconds_since(load_start));

  std::vector<int32_t> prompt;
  if (tokenizer->bos_token() >= 0) prompt.push_back(tokenizer->bos_token());
  for (int32_t id : tokenizer->encode(options.prompt)) prompt.push_back(id);
  TWELL_REQUIRE(!prompt.empty(), "the prompt is empty and the tokenizer adds no BOS token: nothing to condition on");
  const int32_t capacity = static_cast<int32_t>(prompt.size()) + options.new_tokens;
  TWELL_REQUIRE(capacity <= config.max_positions, "{} prompt + {} new tokens exceed max_position_embeddings = {}",
                prompt.size(), options.new_tokens, config.max_positions);

  if (path == FfnPath::predict && stored_predictor) {
    std::fprintf(stderr, "twell: predictor settings from %s/twell_predictor.json\n", options.model_dir.c_str());
  } else if (path == FfnPath::predict) {
    const auto calibration = model.calibrate_predictor(prompt, parse_predictor_kind(options.predictor), options.recall);
    double predicted = 0;
    for (const Calibration& layer : calibration) predicted += layer.quality.predicted_fraction();
    std::fprintf(stderr, "twell: predictor calibrated on the prompt for recall %.3f: %.2f%% of neurons predicted active\n",
                 options.recall, 100.0 * predicted / calibration.size());
  }

  // forward(tokens, n, logits of the last token): the chosen backend with its cache.
  std::function<void(const int32_t*, int32_t, float*)> forward;
  KvCache cache;
#ifdef TWELL_HAVE_CUDA
  std::unique_ptr<cuda::CudaModel> gpu;
  if (options.device == "cuda") {
    gpu = std::make_unique<cuda::CudaModel>(model);
    gpu->set_ffn_path(path);
    if (path == FfnPath::predict) gpu->set_predictor(model);
    gpu->reset(1, std::max(capacity, 1));
    std::fprintf(stderr, "twell: weights on %s (bf16)\n", cuda::device_name());
    forward = [&](const int32_t* tokens, int32_t n, float* logits) { gpu->forward(tokens, n, logits); };
  }
#endif
  if (!forward) {
    cache = model.new_cache(std::max(capacity, 1));
    forward = [&](const int32_t* tokens, int32_t n, float* logits) { model.forward(tokens, n, cache, logits); };
  }

  std::fputs(options.prompt.c_str(), stdout);
  std::fflush(stdout);
  std::vector<float> logits(config.vocab_size);

  const auto prefill_start = std::chrono::steady_clock::now();
  forward(prompt.data(), static_cast<int32_t>(prompt.size()), logits.data());
  const double prefill_s = seconds_since(prefill_start);

  // Stream: decode everything generated so far and print what is new, holding back an incomplete
  // UTF-8 character until its last byte arrives. A decoder may still rewrite text already decoded
  // (a stripped leading space, say); then printing waits until the output again extends it.
  std::vector<int32_t> generated;
  std::string shown;
  const auto decode_start = std::chrono::steady_clock::now();
  for (int32_t step = 0; step < options.new_tokens; ++step) {
    const int32_t token = sampler.sample(logits.data(), config.vocab_size);
    const bool stop = !options.ignore_eos && std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(),
                                                       token) != config.eos_token_ids.end();
    if (stop) break;
    generated.push_back(token);
    const std::string text = tokenizer->decode(generated);
    const size_t ready = complete_utf8_prefix(text);
    if (ready > shown.size() && text.compare(0, shown.size(), shown) == 0) {
      std::fwrite(text.data() + shown.size(), 1, ready - shown.size(), stdout);
      std::fflush(stdout);
      shown.assign(text, 0, ready);
    }
    if (step + 1 < options.new_tokens) forward(&token, 1, logits.data());
  }
  const double decode_s = seconds_since(decode_start);
  const std::string text = tokenizer->decode(generated);
  if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0)
    std::fwrite(text.data() + shown.size(), 1, text.size() - shown.size(), stdout);
  std::fputs("\n", stdout);
  std::fprintf(stderr, "twell: prompt %zu tokens in %.3f s (%.1f tok/s); generated %zu tokens in %.3f s (%.1f tok/s), "
               "--ffn %s, --device %s\n", prompt.size(), prefill_s, prompt.size() / prefill_s, generated.size(), decode_s,
               generated.empty() ? 0.0 : generated.size() / decode_s, options.ffn.c_str(), options.device.c_str());
}

}  // namespace

void add_generate(CLI::App& app) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* command = app.add_subcommand("generate", "generate text from a Hugging Face checkpoint directory");
  command->add_option("-m,--model", options->model_dir, "checkpoint directory (config.json, safetensors, tokenizer)")
      ->required()
      ->check(CLI::ExistingDirectory);
  command->add_option("-p,--prompt", options->prompt, "prompt text")->required();
  command->add_option("-n,--new-tokens", options->new_tokens, "tokens to generate")->capture_default_str();
  command->add_option("--ffn", options->ffn, "FFN path: dense, twell (ReLU models) or predict (ReLU models)")
      ->capture_default_str();
  command->add_option("--device", options->device, "cpu or cuda (bf16 weights on the GPU)")->capture_default_str();
  command->add_option("--temperature", options->temperature, "0 = greedy")->capture_default_str();
  command->add_option("--top-k", options->top_k, "keep the k most likely tokens (0 = off)")->capture_default_str();
  command->add_option("--top-p", options->top_p, "nucleus sampling mass (1 = off)")->capture_default_str();
  command->add_option("--seed", options->seed, "sampling seed")->capture_default_str();
  command->add_flag("--ignore-eos", options->ignore_eos, "do not stop at the model's end-of-sequence tokens");
  command->add_option("--threads", options->threads, "CPU threads (0 = all cores)")->capture_default_str();
  command->add_option("--predictor", options->predictor, "predict path without a stored twell_predictor.json: sign, one-bit, one-bit-norm or two-bit-norm")->capture_default_str();
  command->add_option("--recall", options->recall, "predict path without a stored twell_predictor.json: recall the predictor is calibrated for on the prompt")
      ->capture_default_str();
  command->callback([options] { run_generate(*options); });
}

}  // namespace twell::cli
