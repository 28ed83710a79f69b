// Tokenizers of Hugging Face checkpoint directories.
//   tokenizer.json  (src/model/tokenizer_hf.cpp) the `tokenizers` pipeline: added tokens, then
//                   normalizer -> pre-tokenizer -> BPE model; decoder for the way back. Supported:
//                   normalizers Sequence, Prepend, Replace (string pattern), NFC (text below U+0300);
//                   pre-tokenizers Sequence, ByteLevel (GPT-2 regex), Digits, Metaspace;
//                   BPE with merges, byte_fallback, fuse_unk, ignore_merges;
//                   decoders Sequence, ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace.
//                   Byte-level BPE as GPT-2 and SmolLM2, and Llama-2-style BPE with byte fallback.
//                   Anything else is refused at load with the JSON path of the unsupported part.
//   tokenizer.model (src/model/tokenizer_sentencepiece.cpp) sentencepiece, through libsentencepiece,
//                   which is loaded at run time (see there), so twell runs where it is absent.
// encode() adds no special tokens and reads invalid UTF-8 bytes as U+FFFD (the reference
// implementations take only valid text); bos_token() says what a model expects in front.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace twell {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The bytes the ids stand for (not necessarily valid UTF-8 for a partial sequence).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int32_t vocab_size() const = 0;
  // The token the tokenizer puts in front of a text (its post-processor or sentencepiece's
  // add_bos); -1 when none.
  virtual int32_t bos_token() const = 0;
};

// tokenizer.json when present, else tokenizer.model; throws when the directory has neither.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir);
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& tokenizer_json_path);
// From the text of a tokenizer.json (tests and the fuzzer).
std::unique_ptr<Tokenizer> hf_tokenizer_from_json(std::string_view json_text);
std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::string& model_path);

// The longest prefix of `text` that ends on a complete UTF-8 character (for streaming output).
size_t complete_utf8_prefix(std::string_view text);

}  // namespace twell
