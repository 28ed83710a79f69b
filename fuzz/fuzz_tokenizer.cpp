// libFuzzer target: the input is split at the first NUL into a tokenizer.json and a text; the
// tokenizer loads or throws twell::Error, and a loaded one encodes the text and decodes the ids.
// With no NUL, the whole input is the text for two committed byte-level fixture tokenizers (GPT-2's
// regex; Qwen2's Split regex), which must give valid UTF-8 back unchanged, and NFC must be idempotent.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "model/unicode.h"
#include "twell/error.h"
#include "twell/tokenizer.h"

namespace {
std::unique_ptr<twell::Tokenizer> fixture_tokenizer(const char* name) {
  return twell::load_hf_tokenizer(std::string(TWELL_FUZZ_FIXTURES "/tokenizers/") + name + "/tokenizer.json");
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<twell::Tokenizer> fixtures[] = {fixture_tokenizer("bytelevel"),
                                                                fixture_tokenizer("split_qwen2")};
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  try {
    if (nul != std::string::npos) {
      const std::unique_ptr<twell::Tokenizer> parsed = twell::hf_tokenizer_from_json(input.substr(0, nul));
      const std::string text = input.substr(nul + 1);
      parsed->decode(parsed->encode(text));
      return 0;
    }
    // Byte-level BPE is lossless on valid UTF-8 without added tokens (invalid bytes read as U+FFFD).
    const bool valid_utf8 = twell::unicode::encode_utf8(twell::unicode::decode_utf8(input)) == input;
    for (const auto& tokenizer : fixtures) {
      const std::string decoded = tokenizer->decode(tokenizer->encode(input));
      if (valid_utf8 && input.find("<|") == std::string::npos && decoded != input) __builtin_trap();
    }
    const std::string nfc = twell::unicode::to_nfc(input);
    if (valid_utf8 && twell::unicode::to_nfc(nfc) != nfc) __builtin_trap();
  } catch (const twell::Error&) {
  }
  return 0;
}
