// sentencepiece .model files through libsentencepiece, reached through the plugin of
// src/model/sentencepiece_api.h (loaded once, on first use).
#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>
#include <mutex>

#include "model/sentencepiece_api.h"
#include "twell/error.h"
#include "twell/tokenizer.h"

namespace twell {

namespace {

constexpr const char* kPluginFile = "libtwell_sentencepiece.so";

// Candidates: the build's own path (compiled in), then beside the running executable.
const SentencepieceApi& plugin() {
  static const SentencepieceApi* api = nullptr;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
#ifdef TWELL_SENTENCEPIECE_PLUGIN
    candidates.push_back(TWELL_SENTENCEPIECE_PLUGIN);
#endif
    std::error_code ignored;
    const auto exe = std::filesystem::read_symlink("/proc/self/exe", ignored);
    if (!exe.empty()) candidates.push_back((exe.parent_path() / kPluginFile).string());
    for (const std::string& path : candidates) {
      void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        failure += fmt::format(" {}: {};", path, dlerror());
        continue;
      }
      using Entry = const SentencepieceApi* (*)();
      auto entry = reinterpret_cast<Entry>(dlsym(handle, kSentencepieceApiSymbol));
      if (entry != nullptr && entry()->version == kSentencepieceApiVersion) {
        api = entry();
        return;
      }
      failure += fmt::format(" {}: no compatible {} entry;", path, kSentencepieceApiSymbol);
    }
  });
  TWELL_REQUIRE(api != nullptr,
                "sentencepiece tokenizers need {} (built when libsentencepiece-dev is installed); tried:{}",
                kPluginFile, failure.empty() ? " nothing" : failure);
  return *api;
}

class SentencepieceTokenizer final : public Tokenizer {
 public:
  explicit SentencepieceTokenizer(const std::string& path) : api_(plugin()) {
    std::string error;
    processor_ = api_.load(path, error);
    TWELL_REQUIRE(processor_ != nullptr, "{}: sentencepiece cannot load it: {}", path, error);
  }
  ~SentencepieceTokenizer() override { api_.release(processor_); }
  SentencepieceTokenizer(const SentencepieceTokenizer&) = delete;
  SentencepieceTokenizer& operator=(const SentencepieceTokenizer&) = delete;

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    std::string error;
    TWELL_REQUIRE(api_.encode(processor_, std::string(text), ids, error), "sentencepiece encode: {}", error);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    for (int32_t id : ids)
      TWELL_REQUIRE(id >= 0 && id < vocab_size(), "decode: token id {} is outside [0, {})", id, vocab_size());
    std::string text, error;
    TWELL_REQUIRE(api_.decode(processor_, ids, text, error), "sentencepiece decode: {}", error);
    return text;
  }
  int32_t vocab_size() const override { return api_.vocab_size(processor_); }
  int32_t bos_token() const override { return api_.bos_id(processor_); }

 private:
  const SentencepieceApi& api_;
  void* processor_ = nullptr;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::string& model_path) {
  return std::make_unique<SentencepieceTokenizer>(model_path);
}

}  // namespace twell
