// The sentencepiece plugin: libsentencepiece behind the table of src/model/sentencepiece_api.h.
#include <sentencepiece_processor.h>

#include "model/sentencepiece_api.h"

namespace {

using sentencepiece::SentencePieceProcessor;

void* load(const std::string& path, std::string& error) {
  auto* processor = new SentencePieceProcessor();
  const auto status = processor->Load(path);
  if (status.ok()) return processor;
  error = status.ToString();
  delete processor;
  return nullptr;
}

void release(void* processor) { delete static_cast<SentencePieceProcessor*>(processor); }

bool encode(void* processor, const std::string& text, std::vector<int32_t>& ids, std::string& error) {
  std::vector<int> pieces;
  const auto status = static_cast<SentencePieceProcessor*>(processor)->Encode(text, &pieces);
  if (!status.ok()) {
    error = status.ToString();
    return false;
  }
  ids.assign(pieces.begin(), pieces.end());
  return true;
}

bool decode(void* processor, const std::vector<int32_t>& ids, std::string& text, std::string& error) {
  const std::vector<int> pieces(ids.begin(), ids.end());
  const auto status = static_cast<SentencePieceProcessor*>(processor)->Decode(pieces, &text);
  if (status.ok()) return true;
  error = status.ToString();
  return false;
}

int32_t vocab_size(void* processor) { return static_cast<SentencePieceProcessor*>(processor)->GetPieceSize(); }
int32_t bos_id(void* processor) { return static_cast<SentencePieceProcessor*>(processor)->bos_id(); }

const twell::SentencepieceApi kApi = {twell::kSentencepieceApiVersion, load, release, encode, decode, vocab_size, bos_id};

}  // namespace

extern "C" const twell::SentencepieceApi* twell_sentencepiece_api() { return &kApi; }
