// Wall-clock timing of host code for the CPU benchmarks (device code times itself with events).
#pragma once

#include <chrono>

namespace twell::cli {

// Milliseconds that fn() took, on the monotonic clock.
template <typename Fn>
double wall_ms(Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace twell::cli
