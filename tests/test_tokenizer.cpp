// Tokenizers against the reference implementations: ids made by PyPI `tokenizers` and
// `sentencepiece` on held-out text (tests/fixtures/tokenizers/*/expected.json, from
// scripts/make_fixtures.py) must be reproduced exactly, and decoding must give the text back.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "model/unicode.h"
#include "twell/error.h"
#include "twell/tokenizer.h"

namespace twell {
namespace {

std::filesystem::path fixture(const std::string& relative) {
  return std::filesystem::path(__FILE__).parent_path() / "fixtures" / "tokenizers" / relative;
}

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream stream(path);
  return nlohmann::json::parse(stream);
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream stream(path, std::ios::binary);
  std::stringstream text;
  text << stream.rdbuf();
  return text.str();
}

void expect_matches_reference(const Tokenizer& tokenizer, const nlohmann::json& expected, const char* ids_key,
                              const char* decoded_key) {
  const auto texts = expected["texts"].get<std::vector<std::string>>();
  const auto ids = expected[ids_key].get<std::vector<std::vector<int32_t>>>();
  ASSERT_EQ(texts.size(), ids.size());
  ASSERT_GE(texts.size(), 5u);
  for (size_t i = 0; i < texts.size(); ++i) {
    SCOPED_TRACE(texts[i]);
    EXPECT_EQ(tokenizer.encode(texts[i]), ids[i]);
    const std::string decoded = decoded_key ? expected[decoded_key][i].get<std::string>() : texts[i];
    EXPECT_EQ(tokenizer.decode(ids[i]), decoded);
  }
}

TEST(Tokenizer, ByteLevelBpeMatchesTokenizers) {
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(fixture("bytelevel").string());
  EXPECT_EQ(tokenizer->vocab_size(), 384);
  expect_matches_reference(*tokenizer, read_json(fixture("bytelevel/expected.json")), "ids", nullptr);
  // The training text too (longer, every merge exercised), round trip only.
  const std::string train = read_text(std::filesystem::path(__FILE__).parent_path() / "fixtures/text/train.txt");
  EXPECT_EQ(tokenizer->decode(tokenizer->encode(train)), train);
}

// Qwen2's and Llama 3's Split regex pre-tokenizers (then ByteLevel without its own regex): the extra
// lines of expected.json go through every alternative of the regexes (case-folded contractions,
// a non-letter before letters, digit runs, punctuation before newlines, whitespace runs, other scripts).
TEST(Tokenizer, SplitRegexBpeMatchesTokenizers) {
  for (const char* name : {"split_qwen2", "split_llama3"}) {
    SCOPED_TRACE(name);
    std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(fixture(name).string());
    expect_matches_reference(*tokenizer, read_json(fixture(name) / "expected.json"), "ids", nullptr);
  }
}

// NFC against Python's unicodedata on random strings of precomposed letters, combining marks in any
// order (reordering, blocking), Hangul syllables and jamo (tests/fixtures/text/nfc.json, written by
// scripts/make_unicode_tables.py from the same Unicode version as the tables).
TEST(Unicode, NfcMatchesPythonUnicodedata) {
  const nlohmann::json nfc = read_json(std::filesystem::path(__FILE__).parent_path() / "fixtures/text/nfc.json");
  ASSERT_GE(nfc["samples"].size(), 100u);
  int changed = 0;
  for (const auto& sample : nfc["samples"]) {
    const std::string text = sample["text"].get<std::string>(), expected = sample["nfc"].get<std::string>();
    EXPECT_EQ(unicode::to_nfc(text), expected) << "NFC of " << sample["text"].dump();
    changed += text != expected;
  }
  EXPECT_GE(changed, 50) << "too few samples that NFC changes to test anything";
}

TEST(Tokenizer, NfcNormalizerComposesBeforeTheModel) {
  nlohmann::json json = read_json(fixture("bytelevel/tokenizer.json"));
  json["normalizer"] = {{"type", "NFC"}};
  std::unique_ptr<Tokenizer> tokenizer = hf_tokenizer_from_json(json.dump());
  // e + combining acute, A + ring + acute (reordered marks), a Hangul syllable from jamo.
  EXPECT_EQ(tokenizer->encode("cafe\u0301"), tokenizer->encode("caf\u00e9"));
  EXPECT_EQ(tokenizer->encode("A\u0323\u030a"), tokenizer->encode("\u1ea0\u030a"));
  EXPECT_EQ(tokenizer->encode("\u1100\u1161\u11a8"), tokenizer->encode("\uac01"));
}

TEST(Tokenizer, LlamaStyleBpeWithByteFallbackMatchesTokenizers) {
  std::unique_ptr<Tokenizer> tokenizer = load_hf_tokenizer(fixture("spm/tokenizer.json").string());
  EXPECT_EQ(tokenizer->bos_token(), 1);
  expect_matches_reference(*tokenizer, read_json(fixture("spm/expected.json")), "hf_ids", "hf_decoded");
}

TEST(Tokenizer, SentencepieceModelMatchesSentencepiece) {
  std::unique_ptr<Tokenizer> tokenizer = load_sentencepiece_tokenizer(fixture("spm/tokenizer.model").string());
  EXPECT_EQ(tokenizer->vocab_size(), 480);
  EXPECT_EQ(tokenizer->bos_token(), 1);
  expect_matches_reference(*tokenizer, read_json(fixture("spm/expected.json")), "spm_ids", "spm_decoded");
  EXPECT_THROW(load_sentencepiece_tokenizer(fixture("spm/expected.json").string()), Error);
}

TEST(Tokenizer, RefusesUnsupportedOrBrokenFiles) {
  auto expect_refused = [](const std::string& json, const std::string& needle) {
    try {
      hf_tokenizer_from_json(json);
      ADD_FAILURE() << "accepted: " << json;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
    }
  };
  const std::string vocab = R"("vocab":{"a":0,"b":1,"ab":2})";
  expect_refused("{", "not valid JSON");
  expect_refused(R"({"model":{"type":"WordPiece","vocab":{}}})", "model type 'WordPiece'");
  expect_refused(R"({"model":{"type":"BPE",)" + vocab + R"(,"merges":[["a","c"]]}})", "model.merges[0]");
  expect_refused(R"({"model":{"type":"BPE","vocab":{"a":0,"b":0},"merges":[]}})", "id 0 is used twice");
  expect_refused(R"({"model":{"type":"BPE",)" + vocab + R"(,"merges":[]},"normalizer":{"type":"NFKC"}})",
                 "normalizer type 'NFKC'");
  expect_refused(R"({"model":{"type":"BPE",)" + vocab +
                     R"(,"merges":[]},"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split"}]}})",
                 "pre_tokenizer.pretokenizers[0].pattern");
  const auto with_split = [&](const std::string& split) {
    return R"({"model":{"type":"BPE",)" + vocab + R"(,"merges":[]},"pre_tokenizer":{"type":"Split",)" + split + "}}";
  };
  expect_refused(with_split(R"("pattern":{"Regex":"\\s+"},"behavior":"Isolated","invert":false)"),
                 "regex '\\s+' is not supported");
  expect_refused(with_split(R"("pattern":{"String":" "},"behavior":"Isolated","invert":false)"), "pattern: only");
  const std::string qwen2 = read_json(fixture("split_qwen2/tokenizer.json"))["pre_tokenizer"]["pretokenizers"][0]
                                ["pattern"]["Regex"].get<std::string>();
  const std::string qwen2_pattern = R"("pattern":{"Regex":)" + nlohmann::json(qwen2).dump() + "}";
  expect_refused(with_split(qwen2_pattern + R"(,"behavior":"Removed","invert":false)"), "behavior 'Removed'");
  expect_refused(with_split(qwen2_pattern + R"(,"behavior":"Isolated","invert":true)"), "invert = true");
  EXPECT_NO_THROW(hf_tokenizer_from_json(with_split(qwen2_pattern + R"(,"behavior":"Isolated","invert":false)")));
  expect_refused(R"({"model":{"type":"BPE",)" + vocab + R"(,"merges":[],"unk_token":"<unk>"}})", "unk_token '<unk>'");
  // A character outside the vocabulary, with no byte fallback and no unk token, is an error.
  auto tiny = hf_tokenizer_from_json(R"({"model":{"type":"BPE",)" + vocab + R"(,"merges":["a b"]}})");
  EXPECT_EQ(tiny->encode("abba"), (std::vector<int32_t>{2, 1, 0}));
  EXPECT_THROW(tiny->encode("abc"), Error);
  EXPECT_THROW(tiny->decode({7}), Error);
  EXPECT_THROW(load_tokenizer(fixture("").string()), Error);  // neither file
}

// Flipped bytes anywhere in the file: accepted, or refused with twell::Error; never a crash.
TEST(Tokenizer, CorruptedFilesFailCleanly) {
  const std::string valid = read_text(fixture("bytelevel/tokenizer.json"));
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    std::string text = valid;
    for (int flip = 0; flip < 3; ++flip) text[rng() % text.size()] = static_cast<char>(rng() % 128);
    try {
      auto tokenizer = hf_tokenizer_from_json(text);
      const std::vector<int32_t> ids = tokenizer->encode("It was the best of times 1851");
      tokenizer->decode(ids);
    } catch (const Error&) {  // the only acceptable failure
    }
  }
}

TEST(Tokenizer, CompleteUtf8Prefix) {
  const std::string whale = "a\xF0\x9F\x90\x8B";  // 'a' + U+1F40B
  for (size_t cut = 1; cut < whale.size(); ++cut) EXPECT_EQ(complete_utf8_prefix(whale.substr(0, cut)), 1u) << cut;
  EXPECT_EQ(complete_utf8_prefix(whale), whale.size());
  EXPECT_EQ(complete_utf8_prefix("abc"), 3u);
  EXPECT_EQ(complete_utf8_prefix("ab\xFF"), 3u);  // an invalid byte is passed through, not held back
}

}  // namespace
}  // namespace twell
