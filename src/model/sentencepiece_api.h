// The interface between twell_core and the sentencepiece plugin (libtwell_sentencepiece.so, built
// from src/model/sentencepiece_plugin/ and linked to libsentencepiece). twell_core loads the plugin
// with dlopen only when a tokenizer.model is opened, so the twell binary itself does not need
// libsentencepiece (GPU machines run it without Debian's shared libraries). Both sides are built
// by the same compiler in the same build, so the table may use std types.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace twell {

struct SentencepieceApi {
  int32_t version;  // kSentencepieceApiVersion
  // Returns a processor handle, or null with `error` set.
  void* (*load)(const std::string& path, std::string& error);
  void (*release)(void* processor);
  bool (*encode)(void* processor, const std::string& text, std::vector<int32_t>& ids, std::string& error);
  bool (*decode)(void* processor, const std::vector<int32_t>& ids, std::string& text, std::string& error);
  int32_t (*vocab_size)(void* processor);
  int32_t (*bos_id)(void* processor);  // -1 when the model has none
};

inline constexpr int32_t kSentencepieceApiVersion = 1;
inline constexpr const char* kSentencepieceApiSymbol = "twell_sentencepiece_api";

}  // namespace twell
