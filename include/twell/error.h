// Errors: every bad input becomes a twell::Error whose message names the argument,
// the expected and the actual value. The CLI prints what() and exits non-zero.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace twell {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace twell

// TWELL_REQUIRE(n > 0, "m must be positive, got {}", m);
#define TWELL_REQUIRE(condition, ...)        \
  do {                                       \
    if (!(condition)) ::twell::fail(__VA_ARGS__); \
  } while (0)
