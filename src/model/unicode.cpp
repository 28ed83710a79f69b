#include "model/unicode.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "twell/tokenizer.h"

namespace twell::unicode {

namespace {

struct CodepointRange {
  char32_t first, last;
};
struct CombiningClassRange {
  char32_t first, last, combining_class;
};
struct Decomposition {
  char32_t codepoint, first, second;
};
struct Composition {
  char32_t first, second, composite;
};
#include "model/unicode_tables.inc"

// Hangul syllables decompose and compose arithmetically (Unicode 3.12).
constexpr char32_t kSyllableBase = 0xAC00, kLeadBase = 0x1100, kVowelBase = 0x1161, kTrailBase = 0x11A7;
constexpr char32_t kLeadCount = 19, kVowelCount = 21, kTrailCount = 28;
constexpr char32_t kSyllableCount = kLeadCount * kVowelCount * kTrailCount;

char32_t combining_class(char32_t c) {
  auto after = std::upper_bound(std::begin(kCombiningClasses), std::end(kCombiningClasses), c,
                                [](char32_t value, const CombiningClassRange& range) { return value < range.first; });
  return after != std::begin(kCombiningClasses) && c <= (after - 1)->last ? (after - 1)->combining_class : 0;
}

void decompose(char32_t c, std::vector<char32_t>& out) {
  if (c >= kSyllableBase && c < kSyllableBase + kSyllableCount) {
    const char32_t index = c - kSyllableBase;
    out.push_back(kLeadBase + index / (kVowelCount * kTrailCount));
    out.push_back(kVowelBase + index % (kVowelCount * kTrailCount) / kTrailCount);
    if (index % kTrailCount != 0) out.push_back(kTrailBase + index % kTrailCount);
    return;
  }
  auto found = std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), c,
                                [](const Decomposition& d, char32_t value) { return d.codepoint < value; });
  if (found == std::end(kDecompositions) || found->codepoint != c) {
    out.push_back(c);
    return;
  }
  decompose(found->first, out);
  if (found->second != 0) decompose(found->second, out);
}

// The primary composite of a + b, or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLeadBase && a < kLeadBase + kLeadCount && b >= kVowelBase && b < kVowelBase + kVowelCount)
    return kSyllableBase + ((a - kLeadBase) * kVowelCount + (b - kVowelBase)) * kTrailCount;
  if (a >= kSyllableBase && a < kSyllableBase + kSyllableCount && (a - kSyllableBase) % kTrailCount == 0 &&
      b > kTrailBase && b < kTrailBase + kTrailCount)
    return a + (b - kTrailBase);
  auto found = std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::pair{a, b},
                                [](const Composition& c, std::pair<char32_t, char32_t> key) {
                                  return std::pair{c.first, c.second} < key;
                                });
  return found != std::end(kCompositions) && found->first == a && found->second == b ? found->composite : 0;
}

template <size_t N>
bool in_ranges(const CodepointRange (&ranges)[N], char32_t c) {
  auto after = std::upper_bound(std::begin(ranges), std::end(ranges), c,
                                [](char32_t value, const CodepointRange& range) { return value < range.first; });
  return after != std::begin(ranges) && c <= (after - 1)->last;
}

// Length of the UTF-8 sequence a lead byte starts; 0 for a byte that cannot lead.
int sequence_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

}  // namespace

std::vector<char32_t> decode_utf8(std::string_view text) {
  std::vector<char32_t> out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const uint8_t lead = static_cast<uint8_t>(text[i]);
    const int length = sequence_length(lead);
    char32_t c = length == 1 ? lead : length == 2 ? (lead & 0x1F) : length == 3 ? (lead & 0x0F) : (lead & 0x07);
    bool valid = length > 0 && i + length <= text.size();
    for (int k = 1; valid && k < length; ++k) {
      const uint8_t next = static_cast<uint8_t>(text[i + k]);
      valid = (next & 0xC0) == 0x80;
      c = (c << 6) | (next & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are invalid too.
    if (valid && ((length == 3 && (c < 0x800 || (c >= 0xD800 && c <= 0xDFFF))) ||
                  (length == 4 && (c < 0x10000 || c > 0x10FFFF))))
      valid = false;
    if (valid) {
      out.push_back(c);
      i += length;
    } else {
      out.push_back(0xFFFD);
      i += 1;
    }
  }
  return out;
}

void append_utf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

std::string encode_utf8(const std::vector<char32_t>& codepoints) {
  std::string out;
  for (char32_t c : codepoints) append_utf8(c, out);
  return out;
}

std::string to_nfc(std::string_view text) {
  const std::vector<char32_t> codepoints = decode_utf8(text);
  // Nothing below U+0300 decomposes or combines.
  if (std::all_of(codepoints.begin(), codepoints.end(), [](char32_t c) { return c < 0x300; }))
    return std::string(text);
  std::vector<char32_t> decomposed;
  for (char32_t c : codepoints) decompose(c, decomposed);
  // Canonical order: each run of non-starters sorted by combining class, stably.
  for (size_t i = 1; i < decomposed.size(); ++i) {
    const char32_t c = decomposed[i], cc = combining_class(c);
    if (cc == 0) continue;
    size_t j = i;
    for (; j > 0 && combining_class(decomposed[j - 1]) > cc; --j) decomposed[j] = decomposed[j - 1];
    decomposed[j] = c;
  }
  // Canonical composition: a character joins the last starter unless a character between them has
  // class 0 or a class >= its own (it is blocked).
  std::vector<char32_t> composed;
  size_t starter = SIZE_MAX;
  char32_t last_class = 0;
  for (char32_t c : decomposed) {
    const char32_t cc = combining_class(c);
    const bool adjacent = starter != SIZE_MAX && starter == composed.size() - 1;
    if (starter != SIZE_MAX && (adjacent || (last_class != 0 && last_class < cc))) {
      if (const char32_t composite = compose(composed[starter], c); composite != 0) {
        composed[starter] = composite;
        continue;
      }
    }
    if (cc == 0) starter = composed.size();
    last_class = cc;
    composed.push_back(c);
  }
  return encode_utf8(composed);
}

bool is_letter(char32_t c) { return in_ranges(kLetterRanges, c); }
bool is_number(char32_t c) { return in_ranges(kNumberRanges, c); }

bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

}  // namespace twell::unicode

namespace twell {

size_t complete_utf8_prefix(std::string_view text) {
  // Walk back over at most 3 continuation bytes to the last lead byte; keep it only if its sequence is whole.
  size_t end = text.size();
  for (size_t back = 1; back <= 4 && back <= end; ++back) {
    const uint8_t byte = static_cast<uint8_t>(text[end - back]);
    if ((byte & 0xC0) == 0x80) continue;  // continuation
    const int length = unicode::sequence_length(byte);
    return length != 0 && static_cast<size_t>(length) > back ? end - back : end;
  }
  return end;
}

}  // namespace twell
