// libFuzzer target: the input is split at the first NUL into a tokenizer.json and a text; the
// tokenizer loads or throws twell::Error, and a loaded one encodes the text and decodes the ids.
// With no NUL, the whole input is the text for the committed byte-level fixture tokenizer.
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
std::unique_ptr<twell::Tokenizer> fixture_tokenizer() {
  return twell::load_hf_tokenizer(TWELL_FUZZ_FIXTURES "/tokenizers/bytelevel/tokenizer.json");
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<twell::Tokenizer> fixture = fixture_tokenizer();
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  try {
    std::unique_ptr<twell::Tokenizer> parsed;
    const twell::Tokenizer* tokenizer = fixture.get();
    std::string text = input;
    if (nul != std::string::npos) {
      parsed = twell::hf_tokenizer_from_json(input.substr(0, nul));
      tokenizer = parsed.get();
      text = input.substr(nul + 1);
    }
    const std::vector<int32_t> ids = tokenizer->encode(text);
    const std::string decoded = tokenizer->decode(ids);
    // Byte-level BPE is lossless on valid UTF-8 without added tokens (invalid bytes read as U+FFFD).
    const bool valid_utf8 = twell::unicode::encode_utf8(twell::unicode::decode_utf8(text)) == text;
    if (tokenizer == fixture.get() && valid_utf8 && text.find("<|") == std::string::npos && decoded != text)
      __builtin_trap();
  } catch (const twell::Error&) {
  }
  return 0;
}
