// tokenizer.json: the Hugging Face `tokenizers` pipeline for BPE models (see include/twell/tokenizer.h
// for what is supported). Encoding: split the text at added tokens; each other segment goes through
// the normalizer, the pre-tokenizer (into words) and the BPE model. Decoding: ids -> token strings ->
// the decoder chain -> bytes.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "model/unicode.h"
#include "twell/error.h"
#include "twell/tokenizer.h"

namespace twell {

namespace {

using nlohmann::json;

std::string type_of(const json& node, const std::string& where) {
  TWELL_REQUIRE(node.is_object() && node.contains("type") && node["type"].is_string(),
                "tokenizer.json: {} must be an object with a string 'type'", where);
  return node["type"].get<std::string>();
}

std::string string_field(const json& node, const char* key, const std::string& where) {
  TWELL_REQUIRE(node.contains(key) && node[key].is_string(), "tokenizer.json: {}.{} must be a string", where, key);
  return node[key].get<std::string>();
}

bool bool_field(const json& node, const char* key, bool fallback, const std::string& where) {
  if (!node.contains(key) || node[key].is_null()) return fallback;
  TWELL_REQUIRE(node[key].is_boolean(), "tokenizer.json: {}.{} must be true or false", where, key);
  return node[key].get<bool>();
}

// Replace-style patterns: {"String": "..."} only (a regex pattern is refused).
std::string string_pattern(const json& node, const std::string& where) {
  TWELL_REQUIRE(node.contains("pattern") && node["pattern"].is_object() && node["pattern"].contains("String") &&
                    node["pattern"]["String"].is_string(),
                "tokenizer.json: {}.pattern: only {{\"String\": ...}} patterns are supported", where);
  return node["pattern"]["String"].get<std::string>();
}

void replace_all(std::string& text, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  size_t start = 0, found;
  while ((found = text.find(from, start)) != std::string::npos) {
    out.append(text, start, found - start);
    out += to;
    start = found + from.size();
  }
  out.append(text, start, std::string::npos);
  text = std::move(out);
}

// GPT-2's byte <-> printable character map: printable Latin-1 bytes map to themselves, the other
// 68 bytes to U+0100.. in byte order, so every byte string becomes visible text.
struct ByteMap {
  char32_t byte_to_char[256];
  std::unordered_map<char32_t, uint8_t> char_to_byte;
  ByteMap() {
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_char[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++);
      char_to_byte[byte_to_char[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

// ---------------------------------------------------------------------------------------------
// Normalizers

struct Normalizer {
  enum class Kind { sequence, prepend, replace, nfc } kind;
  std::string a, b;  // prepend: a; replace: a -> b
  std::vector<Normalizer> children;

  static Normalizer parse(const json& node, const std::string& where) {
    const std::string type = type_of(node, where);
    Normalizer result{};
    if (type == "Sequence") {
      result.kind = Kind::sequence;
      TWELL_REQUIRE(node.contains("normalizers") && node["normalizers"].is_array(),
                    "tokenizer.json: {}.normalizers must be an array", where);
      for (size_t i = 0; i < node["normalizers"].size(); ++i)
        result.children.push_back(parse(node["normalizers"][i], where + ".normalizers[" + std::to_string(i) + "]"));
    } else if (type == "Prepend") {
      result.kind = Kind::prepend;
      result.a = string_field(node, "prepend", where);
    } else if (type == "Replace") {
      result.kind = Kind::replace;
      result.a = string_pattern(node, where);
      result.b = string_field(node, "content", where);
    } else if (type == "NFC") {
      result.kind = Kind::nfc;
    } else {
      fail("tokenizer.json: {} type '{}' is not supported (Sequence, Prepend, Replace, NFC)", where, type);
    }
    return result;
  }

  void apply(std::string& text) const {
    switch (kind) {
      case Kind::sequence:
        for (const Normalizer& child : children) child.apply(text);
        return;
      case Kind::prepend:
        if (!text.empty()) text = a + text;
        return;
      case Kind::replace:
        replace_all(text, a, b);
        return;
      case Kind::nfc:
        text = unicode::to_nfc(text);
        return;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers: text -> words. `first` is true for the segment at the start of the input.

// GPT-2's split regex, by hand:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
std::vector<std::string> split_gpt2(const std::string& text) {
  using namespace unicode;
  const std::vector<char32_t> cs = decode_utf8(text);
  const size_t n = cs.size();
  std::vector<std::string> words;
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    if (cs[i] == '\'' && i + 1 < n) {
      const char32_t a = cs[i + 1], b = i + 2 < n ? cs[i + 2] : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') end = i + 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) end = i + 3;
    }
    if (end == i) {
      const size_t body = cs[i] == ' ' && i + 1 < n ? i + 1 : i;
      for (bool (*cls)(char32_t) : {+[](char32_t c) { return is_letter(c); }, +[](char32_t c) { return is_number(c); },
                                    +[](char32_t c) { return !is_whitespace(c) && !is_letter(c) && !is_number(c); }}) {
        if (body < n && cls(cs[body])) {
          end = body;
          while (end < n && cls(cs[end])) ++end;
          break;
        }
      }
    }
    if (end == i) {  // whitespace: \s+(?!\S) leaves the last space to the next word, else \s+
      size_t run = i;
      while (run < n && is_whitespace(cs[run])) ++run;
      end = (run < n && run - i >= 2) ? run - 1 : run;
    }
    words.push_back(encode_utf8(std::vector<char32_t>(cs.begin() + i, cs.begin() + end)));
    i = end;
  }
  return words;
}

// The Split regex of Qwen2 and Llama 3 (they differ in the digits: one at a time, or runs of up to
// three), by hand, with the leftmost-first, backtracking semantics of the Oniguruma engine HF uses:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// The alternatives cover every character, so the pieces cover the text ("isolated" behaviour).
std::vector<std::string> split_llama3_style(const std::string& text, int max_digits) {
  using namespace unicode;
  const std::vector<char32_t> cs = decode_utf8(text);
  const size_t n = cs.size();
  const auto at = [&](size_t i) { return i < n ? cs[i] : char32_t{0}; };  // for the contractions only
  const auto is_newline = [](char32_t c) { return c == '\r' || c == '\n'; };
  const auto is_other = [](char32_t c) { return !is_whitespace(c) && !is_letter(c) && !is_number(c); };
  // (?i) folds case: ASCII, and U+017F (long s) folds to s.
  const auto folds_to = [](char32_t c, char lower) {
    return c == static_cast<char32_t>(lower) || c == static_cast<char32_t>(lower - 'a' + 'A') ||
           (lower == 's' && c == 0x17F);
  };
  std::vector<std::string> words;
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    if (cs[i] == '\'') {
      const char32_t a = at(i + 1), b = at(i + 2);
      if (folds_to(a, 's') || folds_to(a, 't') || folds_to(a, 'm') || folds_to(a, 'd')) end = i + 2;
      else if ((folds_to(a, 'r') || folds_to(a, 'v')) && folds_to(b, 'e')) end = i + 3;
      else if (folds_to(a, 'l') && folds_to(b, 'l')) end = i + 3;
    }
    if (end == i) {  // [^\r\n\p{L}\p{N}]?\p{L}+
      const bool prefix = !is_newline(cs[i]) && !is_letter(cs[i]) && !is_number(cs[i]);
      const size_t body = prefix && i + 1 < n && is_letter(cs[i + 1]) ? i + 1 : i;
      if (is_letter(cs[body])) {
        end = body;
        while (end < n && is_letter(cs[end])) ++end;
      }
    }
    if (end == i && is_number(cs[i])) {  // \p{N}{1,max_digits}
      end = i;
      while (end < n && end - i < static_cast<size_t>(max_digits) && is_number(cs[end])) ++end;
    }
    if (end == i) {  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
      const size_t body = cs[i] == ' ' && i + 1 < n && is_other(cs[i + 1]) ? i + 1 : i;
      if (is_other(cs[body])) {
        end = body;
        while (end < n && is_other(cs[end])) ++end;
        while (end < n && is_newline(cs[end])) ++end;
      }
    }
    if (end == i) {  // whitespace
      size_t run = i;
      while (run < n && is_whitespace(cs[run])) ++run;
      size_t last_newline = run;
      for (size_t k = i; k < run; ++k)
        if (is_newline(cs[k])) last_newline = k;
      if (last_newline < run) end = last_newline + 1;        // \s*[\r\n]+
      else end = (run < n && run - i >= 2) ? run - 1 : run;  // \s+(?!\S), else \s+
    }
    words.push_back(encode_utf8(std::vector<char32_t>(cs.begin() + i, cs.begin() + end)));
    i = end;
  }
  return words;
}

// Split pre-tokenizer regexes twell implements (by hand above), as tokenizer.json holds them.
constexpr const char* kQwen2SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct PreTokenizer {
  enum class Kind { sequence, byte_level, digits, metaspace, split } kind;
  int max_digits = 1;                               // split: digits per piece (Qwen2 1, Llama 3 3)
  bool add_prefix_space = false, use_regex = true;  // byte_level
  bool individual_digits = false;                   // digits
  std::string replacement;                          // metaspace
  std::string prepend_scheme = "always";            // metaspace
  bool split = true;                                // metaspace
  std::vector<PreTokenizer> children;

  static PreTokenizer parse(const json& node, const std::string& where) {
    const std::string type = type_of(node, where);
    PreTokenizer result{};
    result.kind = Kind::sequence;
    if (type == "Sequence") {
      TWELL_REQUIRE(node.contains("pretokenizers") && node["pretokenizers"].is_array(),
                    "tokenizer.json: {}.pretokenizers must be an array", where);
      for (size_t i = 0; i < node["pretokenizers"].size(); ++i)
        result.children.push_back(parse(node["pretokenizers"][i], where + ".pretokenizers[" + std::to_string(i) + "]"));
    } else if (type == "ByteLevel") {
      result.kind = Kind::byte_level;
      result.add_prefix_space = bool_field(node, "add_prefix_space", true, where);
      result.use_regex = bool_field(node, "use_regex", true, where);
    } else if (type == "Digits") {
      result.kind = Kind::digits;
      result.individual_digits = bool_field(node, "individual_digits", false, where);
    } else if (type == "Metaspace") {
      result.kind = Kind::metaspace;
      result.replacement = string_field(node, "replacement", where);
      if (node.contains("prepend_scheme")) result.prepend_scheme = string_field(node, "prepend_scheme", where);
      else if (!bool_field(node, "add_prefix_space", true, where)) result.prepend_scheme = "never";
      TWELL_REQUIRE(result.prepend_scheme == "always" || result.prepend_scheme == "first" ||
                        result.prepend_scheme == "never",
                    "tokenizer.json: {}.prepend_scheme '{}' is not supported", where, result.prepend_scheme);
      result.split = bool_field(node, "split", true, where);
    } else if (type == "Split") {
      result.kind = Kind::split;
      TWELL_REQUIRE(node.contains("pattern") && node["pattern"].is_object() && node["pattern"].contains("Regex") &&
                        node["pattern"]["Regex"].is_string(),
                    "tokenizer.json: {}.pattern: only the {{\"Regex\": ...}} patterns of Qwen2 and Llama 3 are supported",
                    where);
      const std::string regex = node["pattern"]["Regex"].get<std::string>();
      TWELL_REQUIRE(regex == kQwen2SplitRegex || regex == kLlama3SplitRegex,
                    "tokenizer.json: {}.pattern: regex '{}' is not supported (twell implements the Split regexes of "
                    "Qwen2 and Llama 3)",
                    where, regex);
      result.max_digits = regex == kQwen2SplitRegex ? 1 : 3;
      TWELL_REQUIRE(string_field(node, "behavior", where) == "Isolated",
                    "tokenizer.json: {}.behavior '{}' is not supported (Isolated)", where,
                    string_field(node, "behavior", where));
      TWELL_REQUIRE(!bool_field(node, "invert", false, where), "tokenizer.json: {}.invert = true is not supported",
                    where);
    } else {
      fail("tokenizer.json: {} type '{}' is not supported (Sequence, ByteLevel, Digits, Metaspace, Split)", where,
           type);
    }
    return result;
  }

  void apply(std::vector<std::string>& words, bool first) const {
    std::vector<std::string> out;
    switch (kind) {
      case Kind::sequence:
        for (const PreTokenizer& child : children) child.apply(words, first);
        return;
      case Kind::byte_level:
        for (size_t w = 0; w < words.size(); ++w) {
          std::string word = words[w];
          if (add_prefix_space && w == 0 && !word.empty() && word[0] != ' ') word = " " + word;
          std::vector<std::string> pieces = use_regex ? split_gpt2(word) : std::vector<std::string>{word};
          for (const std::string& piece : pieces) {
            std::string mapped;
            for (unsigned char byte : piece) unicode::append_utf8(byte_map().byte_to_char[byte], mapped);
            out.push_back(std::move(mapped));
          }
        }
        break;
      case Kind::split:
        for (const std::string& word : words)
          for (std::string& piece : split_llama3_style(word, max_digits)) out.push_back(std::move(piece));
        break;
      case Kind::digits:  // ASCII digits isolated, one by one or in runs
        for (const std::string& word : words) {
          size_t i = 0;
          while (i < word.size()) {
            const bool digit = word[i] >= '0' && word[i] <= '9';
            size_t end = i + 1;
            if (!digit || !individual_digits)
              while (end < word.size() && (word[end] >= '0' && word[end] <= '9') == digit) ++end;
            out.push_back(word.substr(i, end - i));
            i = end;
          }
        }
        break;
      case Kind::metaspace:
        for (size_t w = 0; w < words.size(); ++w) {
          std::string word = words[w];
          replace_all(word, " ", replacement);
          const bool prepend = prepend_scheme == "always" || (prepend_scheme == "first" && first && w == 0);
          if (prepend && word.compare(0, replacement.size(), replacement) != 0) word = replacement + word;
          if (!split) {
            out.push_back(std::move(word));
            continue;
          }
          size_t start = 0;  // split before each replacement character (merged with the next word)
          for (size_t found = word.find(replacement, 1); found != std::string::npos;
               found = word.find(replacement, found + 1)) {
            out.push_back(word.substr(start, found - start));
            start = found;
          }
          out.push_back(word.substr(start));
        }
        break;
    }
    out.erase(std::remove(out.begin(), out.end(), std::string()), out.end());
    words = std::move(out);
  }
};

// ---------------------------------------------------------------------------------------------
// Decoders: token strings -> token strings; the result is concatenated.

struct Decoder {
  enum class Kind { sequence, byte_level, byte_fallback, fuse, replace, strip, metaspace } kind;
  std::string a, b;          // replace: a -> b; strip: a = the character; metaspace: a = replacement
  int start = 0, stop = 0;   // strip
  bool prepend = true;       // metaspace: strip the first token's leading space
  std::vector<Decoder> children;

  static Decoder parse(const json& node, const std::string& where) {
    const std::string type = type_of(node, where);
    Decoder result{};
    result.kind = Kind::sequence;
    if (type == "Sequence") {
      TWELL_REQUIRE(node.contains("decoders") && node["decoders"].is_array(),
                    "tokenizer.json: {}.decoders must be an array", where);
      for (size_t i = 0; i < node["decoders"].size(); ++i)
        result.children.push_back(parse(node["decoders"][i], where + ".decoders[" + std::to_string(i) + "]"));
    } else if (type == "ByteLevel") {
      result.kind = Kind::byte_level;
    } else if (type == "ByteFallback") {
      result.kind = Kind::byte_fallback;
    } else if (type == "Fuse") {
      result.kind = Kind::fuse;
    } else if (type == "Replace") {
      result.kind = Kind::replace;
      result.a = string_pattern(node, where);
      result.b = string_field(node, "content", where);
    } else if (type == "Strip") {
      result.kind = Kind::strip;
      result.a = string_field(node, "content", where);
      TWELL_REQUIRE(unicode::decode_utf8(result.a).size() == 1, "tokenizer.json: {}.content must be one character",
                    where);
      TWELL_REQUIRE(node.contains("start") && node["start"].is_number_unsigned() && node.contains("stop") &&
                        node["stop"].is_number_unsigned(),
                    "tokenizer.json: {}.start and .stop must be non-negative integers", where);
      result.start = node["start"].get<int>();
      result.stop = node["stop"].get<int>();
    } else if (type == "Metaspace") {
      result.kind = Kind::metaspace;
      result.a = string_field(node, "replacement", where);
      std::string scheme = node.contains("prepend_scheme") ? string_field(node, "prepend_scheme", where) : "always";
      result.prepend = scheme != "never" && bool_field(node, "add_prefix_space", true, where);
    } else {
      fail("tokenizer.json: {} type '{}' is not supported (Sequence, ByteLevel, ByteFallback, Fuse, Replace, Strip, "
           "Metaspace)", where, type);
    }
    return result;
  }

  static bool byte_token(const std::string& token, uint8_t& byte) {
    if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return false;
    unsigned value = 0;
    for (int k = 3; k < 5; ++k) {
      const char h = token[k];
      const int digit = h >= '0' && h <= '9' ? h - '0' : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (digit < 0) return false;
      value = value * 16 + digit;
    }
    byte = static_cast<uint8_t>(value);
    return true;
  }

  void apply(std::vector<std::string>& tokens) const {
    switch (kind) {
      case Kind::sequence:
        for (const Decoder& child : children) child.apply(tokens);
        return;
      case Kind::byte_level:
        for (std::string& token : tokens) {
          std::string bytes;
          for (char32_t c : unicode::decode_utf8(token)) {
            auto found = byte_map().char_to_byte.find(c);
            if (found != byte_map().char_to_byte.end()) bytes += static_cast<char>(found->second);
            else unicode::append_utf8(c, bytes);
          }
          token = std::move(bytes);
        }
        return;
      case Kind::byte_fallback:  // <0xXX> tokens become their raw byte
        for (std::string& token : tokens) {
          uint8_t byte;
          if (byte_token(token, byte)) token = std::string(1, static_cast<char>(byte));
        }
        return;
      case Kind::fuse: {
        std::string all;
        for (const std::string& token : tokens) all += token;
        tokens.assign(1, std::move(all));
        return;
      }
      case Kind::replace:
        for (std::string& token : tokens) replace_all(token, a, b);
        return;
      case Kind::strip:
        for (std::string& token : tokens) {
          int cut = 0;
          while (cut < start && token.compare(cut * a.size(), a.size(), a) == 0) ++cut;
          token.erase(0, cut * a.size());
          cut = 0;
          while (cut < stop && token.size() >= a.size() && token.compare(token.size() - a.size(), a.size(), a) == 0) {
            token.erase(token.size() - a.size());
            ++cut;
          }
        }
        return;
      case Kind::metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          replace_all(tokens[i], a, " ");
          if (i == 0 && prepend && !tokens[i].empty() && tokens[i][0] == ' ') tokens[i].erase(0, 1);
        }
        return;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The tokenizer

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const json& root) {
    TWELL_REQUIRE(root.is_object(), "tokenizer.json: expected a JSON object");
    TWELL_REQUIRE(root.contains("model"), "tokenizer.json: missing 'model'");
    parse_model(root["model"]);
    if (root.contains("added_tokens") && !root["added_tokens"].is_null()) parse_added(root["added_tokens"]);
    if (root.contains("normalizer") && !root["normalizer"].is_null())
      normalizer_ = std::make_unique<Normalizer>(Normalizer::parse(root["normalizer"], "normalizer"));
    if (root.contains("pre_tokenizer") && !root["pre_tokenizer"].is_null())
      pre_tokenizer_ = std::make_unique<PreTokenizer>(PreTokenizer::parse(root["pre_tokenizer"], "pre_tokenizer"));
    if (root.contains("decoder") && !root["decoder"].is_null())
      decoder_ = std::make_unique<Decoder>(Decoder::parse(root["decoder"], "decoder"));
    if (root.contains("post_processor") && !root["post_processor"].is_null()) parse_bos(root["post_processor"]);
  }

  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_token_.size()); }
  int32_t bos_token() const override { return bos_; }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    size_t segment_start = 0, i = 0;
    while (i <= text.size()) {
      const AddedToken* added = i < text.size() ? added_at(text, i) : nullptr;
      if (added == nullptr && i < text.size()) {
        ++i;
        continue;
      }
      if (i > segment_start) encode_segment(text.substr(segment_start, i - segment_start), segment_start == 0, ids);
      if (added == nullptr) break;
      ids.push_back(added->id);
      i += added->content.size();
      segment_start = i;
    }
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<std::string> tokens;
    for (int32_t id : ids) {
      TWELL_REQUIRE(id >= 0 && id < vocab_size() && !id_to_token_[id].empty(),
                    "decode: token id {} is not in the vocabulary (size {})", id, vocab_size());
      tokens.push_back(id_to_token_[id]);
    }
    if (!decoder_) {
      std::string joined;
      for (size_t k = 0; k < tokens.size(); ++k) joined += (k ? " " : "") + tokens[k];
      return joined;
    }
    decoder_->apply(tokens);
    std::string out;
    for (const std::string& token : tokens) out += token;
    return out;
  }

 private:
  struct AddedToken {
    int32_t id;
    std::string content;
  };

  void parse_model(const json& model) {
    const std::string type = type_of(model, "model");
    TWELL_REQUIRE(type == "BPE", "tokenizer.json: model type '{}' is not supported (BPE)", type);
    TWELL_REQUIRE(!model.contains("dropout") || model["dropout"].is_null() || model["dropout"] == 0.0,
                  "tokenizer.json: model.dropout is not supported");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      TWELL_REQUIRE(!model.contains(key) || model[key].is_null() || model[key] == "",
                    "tokenizer.json: model.{} is not supported", key);
    byte_fallback_ = bool_field(model, "byte_fallback", false, "model");
    fuse_unk_ = bool_field(model, "fuse_unk", false, "model");
    ignore_merges_ = bool_field(model, "ignore_merges", false, "model");
    TWELL_REQUIRE(model.contains("vocab") && model["vocab"].is_object(), "tokenizer.json: model.vocab must be an object");
    for (const auto& [token, id] : model["vocab"].items()) {
      TWELL_REQUIRE(id.is_number_unsigned() && id.get<uint64_t>() < (1u << 24),
                    "tokenizer.json: model.vocab['{}'] must be a token id, got {}", token, id.dump());
      add_token(token, static_cast<int32_t>(id.get<uint64_t>()), "model.vocab");
    }
    if (model.contains("unk_token") && !model["unk_token"].is_null()) {
      const std::string unk = string_field(model, "unk_token", "model");
      auto found = token_to_id_.find(unk);
      TWELL_REQUIRE(found != token_to_id_.end(), "tokenizer.json: model.unk_token '{}' is not in the vocabulary", unk);
      unk_ = found->second;
    }
    TWELL_REQUIRE(model.contains("merges") && model["merges"].is_array(), "tokenizer.json: model.merges must be an array");
    const json& merges = model["merges"];
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      std::string left, right;
      const json& merge = merges[rank];
      if (merge.is_string()) {  // "left right" (older files)
        const std::string text = merge.get<std::string>();
        const size_t space = text.find(' ', 1);
        TWELL_REQUIRE(space != std::string::npos, "tokenizer.json: model.merges[{}] '{}' is not 'left right'", rank, text);
        left = text.substr(0, space);
        right = text.substr(space + 1);
      } else {
        TWELL_REQUIRE(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(),
                      "tokenizer.json: model.merges[{}] must be \"left right\" or [left, right]", rank);
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      }
      auto l = token_to_id_.find(left), r = token_to_id_.find(right), m = token_to_id_.find(left + right);
      TWELL_REQUIRE(l != token_to_id_.end() && r != token_to_id_.end() && m != token_to_id_.end(),
                    "tokenizer.json: model.merges[{}] ('{}', '{}') names a token missing from the vocabulary", rank,
                    left, right);
      merges_.emplace(pair_key(l->second, r->second), Merge{static_cast<int32_t>(rank), m->second});
    }
  }

  void parse_added(const json& added) {
    TWELL_REQUIRE(added.is_array(), "tokenizer.json: added_tokens must be an array");
    for (size_t k = 0; k < added.size(); ++k) {
      const json& token = added[k];
      const std::string where = "added_tokens[" + std::to_string(k) + "]";
      TWELL_REQUIRE(token.is_object() && token.contains("id") && token["id"].is_number_unsigned() &&
                        token["id"].get<uint64_t>() < (1u << 24),
                    "tokenizer.json: {}.id must be a token id", where);
      const std::string content = string_field(token, "content", where);
      TWELL_REQUIRE(!content.empty(), "tokenizer.json: {}.content is empty", where);
      for (const char* flag : {"lstrip", "rstrip", "single_word"})
        TWELL_REQUIRE(!bool_field(token, flag, false, where), "tokenizer.json: {}.{} = true is not supported", where, flag);
      const int32_t id = static_cast<int32_t>(token["id"].get<uint64_t>());
      auto found = token_to_id_.find(content);
      if (found == token_to_id_.end()) add_token(content, id, where);
      else TWELL_REQUIRE(found->second == id, "tokenizer.json: {} '{}' has id {} but the vocabulary says {}", where, content, id, found->second);
      added_.push_back({id, content});
    }
    // Longest first, so that at each position the longest added token wins.
    std::sort(added_.begin(), added_.end(),
              [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  }

  // TemplateProcessing / RobertaProcessing / BertProcessing put a special token first; we only
  // record which, for the caller to prepend.
  void parse_bos(const json& processor) {
    const std::string type = type_of(processor, "post_processor");
    if (type != "TemplateProcessing" || !processor.contains("single") || !processor["single"].is_array() ||
        processor["single"].empty())
      return;
    const json& first = processor["single"][0];
    if (!first.is_object() || !first.contains("SpecialToken")) return;
    const json& special = first["SpecialToken"];
    if (!special.contains("id") || !special["id"].is_string()) return;
    auto found = token_to_id_.find(special["id"].get<std::string>());
    if (found != token_to_id_.end()) bos_ = found->second;
  }

  void add_token(const std::string& token, int32_t id, const std::string& where) {
    if (static_cast<size_t>(id) >= id_to_token_.size()) id_to_token_.resize(id + 1);
    TWELL_REQUIRE(id_to_token_[id].empty(), "tokenizer.json: {}: id {} is used twice", where, id);
    TWELL_REQUIRE(!token.empty(), "tokenizer.json: {}: empty token for id {}", where, id);
    id_to_token_[id] = token;
    TWELL_REQUIRE(token_to_id_.emplace(token, id).second, "tokenizer.json: {}: token '{}' appears twice", where, token);
  }

  const AddedToken* added_at(std::string_view text, size_t i) const {
    for (const AddedToken& token : added_)
      if (text.compare(i, token.content.size(), token.content) == 0) return &token;
    return nullptr;
  }

  void encode_segment(std::string_view segment, bool first, std::vector<int32_t>& ids) const {
    std::string text(segment);
    if (normalizer_) normalizer_->apply(text);
    std::vector<std::string> words{text};
    if (pre_tokenizer_) pre_tokenizer_->apply(words, first);
    for (const std::string& word : words) encode_word(word, ids);
  }

  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  // BPE on one word: characters (or their bytes, with byte fallback) become symbols; the pair of
  // lowest merge rank is merged first, leftmost on ties, until no pair has a merge. A heap of
  // candidate merges keeps this O(n log n) for the long words of pre-tokenizer-less tokenizers.
  void encode_word(const std::string& word, std::vector<int32_t>& ids) const {
    if (word.empty()) return;
    if (ignore_merges_) {
      auto whole = token_to_id_.find(word);
      if (whole != token_to_id_.end()) {
        ids.push_back(whole->second);
        return;
      }
    }
    struct Symbol {
      int32_t id;
      int32_t prev, next;  // neighbours in the linked list; -1 at the ends
      bool alive;
    };
    std::vector<Symbol> symbols;
    const std::vector<char32_t> chars = unicode::decode_utf8(word);
    for (char32_t c : chars) {
      std::string utf8;
      unicode::append_utf8(c, utf8);
      auto found = token_to_id_.find(utf8);
      if (found != token_to_id_.end()) {
        symbols.push_back({found->second, 0, 0, true});
        continue;
      }
      bool all_bytes = byte_fallback_;
      std::vector<int32_t> byte_ids;
      for (unsigned char byte : utf8) {
        auto byte_token = token_to_id_.find(fmt::format("<0x{:02X}>", byte));
        if (byte_token == token_to_id_.end()) all_bytes = false;
        else byte_ids.push_back(byte_token->second);
      }
      if (all_bytes) {
        for (int32_t id : byte_ids) symbols.push_back({id, 0, 0, true});
      } else {
        TWELL_REQUIRE(unk_ >= 0, "tokenizer: character U+{:04X} is not in the vocabulary and there is no unk_token",
                      static_cast<uint32_t>(c));
        if (fuse_unk_ && !symbols.empty() && symbols.back().id == unk_) continue;
        symbols.push_back({unk_, 0, 0, true});
      }
    }
    const int32_t n = static_cast<int32_t>(symbols.size());
    for (int32_t k = 0; k < n; ++k) {
      symbols[k].prev = k - 1;
      symbols[k].next = k + 1 < n ? k + 1 : -1;
    }
    struct Candidate {
      int32_t rank, left, left_id, right_id, merged;  // the pair's ids when queued, to detect staleness
      bool operator>(const Candidate& other) const {
        return rank != other.rank ? rank > other.rank : left > other.left;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    auto push = [&](int32_t left) {
      const int32_t right = symbols[left].next;
      if (right < 0) return;
      auto merge = merges_.find(pair_key(symbols[left].id, symbols[right].id));
      if (merge != merges_.end()) queue.push({merge->second.rank, left, symbols[left].id, symbols[right].id, merge->second.merged});
    };
    for (int32_t k = 0; k + 1 < n; ++k) push(k);
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.left];
      const int32_t right = left.next;
      // Stale when either side has changed since the candidate was queued.
      if (!left.alive || right < 0 || left.id != top.left_id || symbols[right].id != top.right_id) continue;
      left.id = top.merged;
      symbols[right].alive = false;
      left.next = symbols[right].next;
      if (left.next >= 0) symbols[left.next].prev = top.left;
      if (left.prev >= 0) push(left.prev);
      push(top.left);
    }
    for (int32_t k = 0; k >= 0 && k < n; k = symbols[k].next) ids.push_back(symbols[k].id);
  }

  struct Merge {
    int32_t rank;
    int32_t merged;
  };
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int32_t> token_to_id_;
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> rank and merged id
  std::vector<AddedToken> added_;
  int32_t unk_ = -1;
  int32_t bos_ = -1;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Decoder> decoder_;
};

}  // namespace

std::unique_ptr<Tokenizer> hf_tokenizer_from_json(std::string_view json_text) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& error) {
    fail("tokenizer.json: not valid JSON: {}", error.what());
  }
  return std::make_unique<HfTokenizer>(root);
}

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  TWELL_REQUIRE(stream.good(), "cannot read '{}'", path);
  std::stringstream text;
  text << stream.rdbuf();
  try {
    return hf_tokenizer_from_json(text.str());
  } catch (const Error& error) {
    fail("{}: {}", path, error.what());
  }
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(dir) / "tokenizer.json")) return load_hf_tokenizer((fs::path(dir) / "tokenizer.json").string());
  if (fs::exists(fs::path(dir) / "tokenizer.model"))
    return load_sentencepiece_tokenizer((fs::path(dir) / "tokenizer.model").string());
  fail("'{}' has neither tokenizer.json nor tokenizer.model", dir);
}

}  // namespace twell
