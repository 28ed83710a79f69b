// The little Unicode the tokenizers need: UTF-8 decoding and encoding, the L / N / White_Space
// classes of the pre-tokenizer regexes, and NFC normalization.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace twell::unicode {

// Code points of UTF-8 text; an invalid byte becomes U+FFFD (as Rust's from_utf8_lossy per byte).
std::vector<char32_t> decode_utf8(std::string_view text);
void append_utf8(char32_t codepoint, std::string& out);
std::string encode_utf8(const std::vector<char32_t>& codepoints);

// Normalization Form C (canonical decomposition, canonical order, canonical composition), with the
// tables of scripts/make_unicode_tables.py.
std::string to_nfc(std::string_view text);

bool is_letter(char32_t c);      // \p{L}
bool is_number(char32_t c);      // \p{N}
bool is_whitespace(char32_t c);  // \s: Unicode White_Space

}  // namespace twell::unicode
